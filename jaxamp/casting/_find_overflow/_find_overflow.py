"""``jaxamp.find_overflow``: which op made the inf, on request, outside the train step.

The loss function is traced once, as training runs it (``autocast``, the loss
times the loss scale, its gradient), into one jaxpr whose equations keep the
user's tracebacks and module scopes (``_api.debugging_autocast``). The
evaluator (``_overflow_eval``) then runs that jaxpr eagerly, one equation at a
time, and stops at the first one that overflowed; ``_overflow_report`` turns
that equation into a report (forward or backward, module path, source line,
how large the value would have been in float32), and ``_overflow_advice`` checks
each piece of advice by tracing and running the loss again with it.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.conversion_checks import _stacklevel
from jaxamp._utils.deprecation import add_note
from jaxamp._utils.dtypes import HALF_DTYPES, is_float, times_wide
from jaxamp._utils.errors import unnamed, with_article
from jaxamp._utils.tree import holds_tracer, is_tracer
from jaxamp.casting._autocast._api import debugging_autocast
from jaxamp.casting._find_overflow import _overflow_eval, _overflow_report
from jaxamp.casting._find_overflow._overflow_advice import advise
from jaxamp.casting._find_overflow._overflow_report import OverflowReport
from jaxamp.casting._rules._scopes import AUTOCAST_SCOPE
from jaxamp.loss_scale import LossScaleNotFound, LossScaleState, get_loss_scale

__all__ = ["OverflowReport", "find_overflow"]


# find_overflow's own options; in jaxamp 0.3's call form every other keyword was the loss's.
_OPTIONS = ("scale", "dtype", "argnums", "rules", "modules", "autocast")
_OPTIONS_0_3 = ("loss_scale", *_OPTIONS[1:])


def _call_form_of_0_3(f: Callable[..., Any]) -> Callable[..., Any]:
    """Takes jaxamp 0.3's ``find_overflow(loss_fn, *args, loss_scale=..., **kwargs)`` too,
    with a ``DeprecationWarning``, until jaxamp 0.5: told apart by arguments of the loss
    given with the options (positional ones after the function, or keywords that are no
    option), or 0.3's keywords ``loss_fn=`` and ``loss_scale=``."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "loss_fn" in kwargs:
            if args:
                raise TypeError("jaxamp.find_overflow() got both loss_fn= and fun; pass fun only.")
            args = (kwargs.pop("loss_fn"),)
            old = True
        else:
            if "fun" in kwargs and not args:  # fun= by keyword, as its signature allows
                args = (kwargs.pop("fun"),)
            old = len(args) > 1 or any(k not in (*_OPTIONS, "loss_scale") for k in kwargs)
        if not old:
            if "loss_scale" in kwargs:
                if "scale" in kwargs:
                    raise TypeError("jaxamp.find_overflow() got both loss_scale= and scale=.")
                kwargs["scale"] = kwargs.pop("loss_scale")
                warnings.warn(
                    "jaxamp.find_overflow: the argument loss_scale= is now called scale=; "
                    "loss_scale= is deprecated and will be an error in jaxamp 0.5.",
                    DeprecationWarning,
                    stacklevel=_stacklevel(),
                )
            return f(*args, **kwargs)
        warnings.warn(
            "jaxamp.find_overflow(loss_fn, *args, loss_scale=..., **kwargs) is deprecated and "
            "will be an error in jaxamp 0.5: the options come first and the loss's arguments "
            "in a second call, as in jax.make_jaxpr: "
            "jaxamp.find_overflow(fun, scale=...)(*args, **kwargs).",
            DeprecationWarning,
            stacklevel=_stacklevel(),
        )
        # 0.3's options: its loss scale was loss_scale=, so a scale= is the loss's own.
        options = {k: kwargs.pop(k) for k in _OPTIONS_0_3 if k in kwargs}
        if "loss_scale" in options:
            options["scale"] = options.pop("loss_scale")
        return f(args[0], **options)(*args[1:], **kwargs)

    add_note(
        wrapper,
        "Until jaxamp 0.5 the call form of jaxamp 0.3, ``find_overflow(loss_fn, *args, "
        "loss_scale=..., **kwargs)``, also works (returning the report), with a "
        "``DeprecationWarning``.",
    )
    return wrapper


@_call_form_of_0_3
def find_overflow(
    fun: Callable[..., Any],
    *,
    scale: float | LossScaleState | Any = 2.0**15,
    dtype: Any = jnp.float16,
    argnums: int | Sequence[int] = 0,
    rules: Mapping[Any, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    autocast: bool = True,
) -> Callable[..., OverflowReport]:
    """Finds the first op whose float16 / bfloat16 result overflowed, forward or backward.

    ``jaxamp.find_overflow(fun, ...)(*args, **kwargs)`` runs ``fun(*args, **kwargs)``
    once more as mixed-precision training does: under ``jaxamp.autocast(fun,
    dtype=dtype, rules=rules, modules=modules)``, the loss multiplied by the loss
    scale, and its gradient with respect to ``args[argnums]``. Its options come first
    and the loss's arguments in a second call, as in ``jax.make_jaxpr(fun)(*args)``, so
    that no argument of the loss is taken for an option. It evaluates that program eagerly, one
    op at a time (entering ``jit``, ``scan``, ``while``, ``cond``, ``remat``,
    custom derivatives and ``shard_map`` bodies, each op of a body on every
    device's block), and reports the first op, in execution order (forward
    before backward), whose lower-precision result holds an inf or NaN while
    all its floating inputs were finite. If no lower-precision op overflowed
    but a float32 op made a non-finite value from finite inputs, that one is
    reported instead. Call it outside ``jit`` on concrete values, e.g. when the
    loss scale keeps dropping; it is slow (every op is dispatched on its own)
    and meant for debugging, not for the train step.

    The advice is checked before it is given: the loss is run again with each
    suggestion (a smaller loss scale; a ``modules=`` or ``rules=`` entry
    running the module, the op, or the op a cast feeds in float32; bfloat16),
    and only those after which this op no longer overflows are suggested
    (``report.suggested_loss_scale``, ``suggested_modules``,
    ``suggested_rules``, ``suggested_dtype``). When none does, the advice says
    so and gives the op and its magnitude. A float32 op is called the
    program's own overflow only if the program without autocast makes it too.

    Args:
      fun: the loss function as the train step calls it (returns a scalar
        floating loss).
      scale: the loss scale the step uses, in any form the step holds it: the
        [`jaxamp.LossScaleState`][jaxamp.LossScaleState] given to
        [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite], the optimizer state holding one (or a
        [`jaxamp.TrainState`][jaxamp.TrainState] or [`jaxamp.nnx.Optimizer`][jaxamp.nnx.Optimizer]),
        whose current scale is tested, or a positive number (a normal float32, as the
        step multiplies by it in float32). After a skipped step, pass the scale from
        *before* that step: the state after it has already backed off (to half, by
        default), and an overflow the old scale caused may not happen at the new one.
        Keep ``jnp.copy(jaxamp.get_loss_scale(opt_state).scale)`` before the step (the
        copy survives a step that donates ``opt_state``) and pass that.
      dtype: autocast's lower-precision dtype, ``jnp.float16`` or ``jnp.bfloat16``.
      argnums: which positional arguments the gradient is taken with respect
        to (an int or a sequence of ints, negative ones counted from the end).
      rules: autocast's per-primitive rules (as in [`jaxamp.autocast`][jaxamp.autocast]).
      modules: autocast's per-module rules (as in [`jaxamp.autocast`][jaxamp.autocast]).
      autocast: False runs `fun` as written, without ``jaxamp.autocast``:
        for a loss that casts itself (a model built with ``dtype=jnp.float16``,
        ``x.astype(jnp.float16)`` by hand), whose overflows autocast would move
        (it runs sums, ``exp`` and norms in float32). `dtype`, `rules` and
        `modules` then only name the report's compute dtype.

    Returns:
      A function of ``fun``'s arguments (positional: parameters, batch, ...; keyword:
      not differentiated) returning an
      [`OverflowReport`][jaxamp.types.OverflowReport]; ``report.found`` is False when
      nothing overflowed, and ``print(report)`` explains the finding.

    Raises:
      TypeError: if `fun` is not callable, returns something other than a
        scalar floating loss, `argnums` is not an int or a sequence of ints,
        `scale` is none of the forms above, or an argument or `scale` is a
        tracer (``find_overflow`` called inside ``jit``).
      ValueError: if `dtype` is not float16 or bfloat16, `argnums` is out of
        range, `scale` is not a positive normal float32 number (or holds several
        loss-scale states), or `rules` / `modules` are invalid (as in ``autocast``).

    Examples:
      >>> def loss_fn(w, x):
      ...   return jnp.mean(x @ w)
      >>> w = jnp.full((4, 4), 300.0)
      >>> report = jaxamp.find_overflow(loss_fn)(w, jnp.full((2, 4), 100.0))
      >>> report.found, report.primitive, report.pass_, report.dtype
      (True, 'dot_general', 'forward', 'float16')
      >>> jaxamp.find_overflow(loss_fn, scale=1.0)(w / 1000, jnp.ones((2, 4))).found
      False
    """
    if not callable(fun):
        raise TypeError(f"find_overflow: fun must be callable, got {type(fun).__name__}")
    low = _check_dtype(dtype)
    if not isinstance(autocast, bool):
        raise TypeError(f"find_overflow: autocast must be a bool, got {autocast!r}")

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> OverflowReport:
        _check_concrete(args, kwargs)  # first: a traced scale usually comes with traced args
        loss_scale = _check_loss_scale(scale)
        loss = _Loss.of(fun, args, kwargs, _check_argnums(argnums, len(args)))
        settings = _Settings(low, rules, modules, autocast)
        closed, cache = loss.trace(settings, loss_scale), {}

        def probe(at: float, **overrides: Any) -> OverflowReport:
            """The loss run again at scale `at`, with `overrides` (dtype=, rules=, modules=,
            autocast=) in place of the caller's: the report, without advice."""
            if not overrides:
                return loss.report(closed, settings, at, cache)
            again = settings._replace(**overrides)
            again = again._replace(dtype=np.dtype(again.dtype))
            return loss.report(loss.trace(again, loss_scale), again, at, {})

        finding = loss.find(closed, loss_scale, cache)
        report = _overflow_report.build(finding, low, loss_scale)
        return advise(report, finding, probe, rules, modules, autocast)

    return run


class _Settings(NamedTuple):
    """What a run of the loss is traced with (the caller's, or a probe's overrides)."""

    dtype: np.dtype
    rules: Any
    modules: Any
    autocast: bool


class _Loss:
    """The loss function and its arguments: what is differentiated, what is not."""

    def __init__(
        self, loss_fn: Callable[..., Any], leaves: list[Any], treedef: Any, wrt: list[int]
    ) -> None:
        self.loss_fn, self.leaves, self.treedef = loss_fn, leaves, treedef
        dynamic = [
            i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray | np.generic)
        ]
        self.wrt = wrt
        self.rest = [i for i in dynamic if i not in set(wrt)]
        self.inputs = jax.tree_util.tree_leaves(
            ([leaves[i] for i in self.wrt], [leaves[i] for i in self.rest])
        )

    @classmethod
    def of(cls, loss_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], diff: set[int]):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        arg_of = _leaf_owners(args, kwargs)
        wrt = [
            i
            for i, x in enumerate(leaves)
            if isinstance(x, jax.Array | np.ndarray | np.generic)
            and arg_of[i] in diff
            and is_float(x)
        ]
        return cls(loss_fn, leaves, treedef, wrt)

    def trace(self, settings: _Settings, loss_scale: float) -> Any:
        """The jaxpr of the scaled loss's value and gradient, the scale an input,
        so that a smaller scale is checked without tracing again."""
        target = self.loss_fn
        if not settings.autocast:
            # Equations traced under autocast's own scope run as written (that is how
            # an autocast nested in another is left alone); the debugging wrapper
            # still keeps their source lines and names nnx modules.
            def target(*a: Any, **k: Any) -> Any:
                with jax.named_scope(AUTOCAST_SCOPE):
                    return self.loss_fn(*a, **k)

        amp = debugging_autocast(target, settings.dtype, settings.rules, settings.modules)

        def scaled(wrt_vals: list[Any], rest_vals: list[Any], scale: Any) -> Any:
            full = list(self.leaves)
            for i, x in zip([*self.wrt, *self.rest], [*wrt_vals, *rest_vals], strict=True):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(self.treedef, full)
            return times_wide(_scalar_loss(amp(*a, **k)), scale)  # as jaxamp.scale multiplies

        wrt_vals = [self.leaves[i] for i in self.wrt]
        rest_vals = [self.leaves[i] for i in self.rest]
        scale0 = jnp.asarray(loss_scale, jnp.float32)
        return jax.make_jaxpr(jax.value_and_grad(scaled))(wrt_vals, rest_vals, scale0)

    def find(self, program: Any, scale: float, cache: dict) -> Any:
        args = [*self.inputs, jnp.asarray(scale, jnp.float32)]
        return _overflow_eval.find(program, args, cache)

    def report(self, program: Any, settings: _Settings, scale: float, cache: dict) -> Any:
        finding = self.find(program, scale, cache)
        return _overflow_report.build(finding, np.dtype(settings.dtype), scale)


def _scalar_loss(loss: Any) -> jax.Array:
    if not isinstance(loss, jax.Array) or loss.shape != () or not is_float(loss):
        got = (
            f"{loss.dtype}{list(loss.shape)}"
            if isinstance(loss, jax.Array)
            else type(loss).__name__
        )
        raise TypeError(f"find_overflow: fun must return a scalar floating loss, got {got}")
    return loss


# --------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        resolved = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise ValueError(f"find_overflow: dtype={dtype!r} is not a dtype") from e
    if resolved not in HALF_DTYPES:
        raise ValueError(
            f"find_overflow: dtype must be jnp.float16 or jnp.bfloat16, got {resolved.name}"
        )
    return resolved


_LOSS_SCALE_FORMS = (
    "find_overflow: scale must be the loss scale the step uses: a jaxamp.LossScaleState, "
    "the optimizer state holding one (as tx.init / the step returns it, a TrainState, a "
    "jaxamp.nnx.Optimizer) or a positive number"
)
_EAGER = "call it outside jax.jit / jax.grad (it evaluates the program eagerly, op by op)"
# The normal float32 range, as Python floats (compared with a Python float, numpy's
# float32 bounds would cast it to float32 first).
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def _check_concrete(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if holds_tracer((args, kwargs)):
        raise TypeError(f"find_overflow: the arguments must be concrete arrays; {_EAGER}")


def _check_loss_scale(loss_scale: Any) -> float:
    """The scale to test, as a float, from any form the step's loss scale takes."""
    if loss_scale is None or isinstance(loss_scale, bool | str | bytes):
        raise TypeError(f"{_LOSS_SCALE_FORMS}, got {loss_scale!r}")
    if not isinstance(loss_scale, int | float | np.number | jax.Array | np.ndarray):
        try:
            state = get_loss_scale(loss_scale)
        except LossScaleNotFound:
            raise TypeError(
                f"{_LOSS_SCALE_FORMS}, got {with_article(type(loss_scale).__name__)} with no "
                "LossScaleState in it"
            ) from None
        except ValueError as e:  # several, or an unsafe structure: name them, as metrics does
            raise ValueError(f"find_overflow: scale: {unnamed(e)}") from None
        loss_scale = state.scale
        if not is_tracer(loss_scale):
            # A state that does not scale holds a scale of 1; a pmap-replicated state
            # holds one equal copy per device.
            loss_scale = np.max(jax.device_get(loss_scale))
    if is_tracer(loss_scale):
        raise TypeError(f"find_overflow: scale is a traced value; {_EAGER}")
    if np.size(loss_scale) != 1:
        raise ValueError(
            f"find_overflow: scale must be one number, got shape {np.shape(loss_scale)}"
        )
    if not isinstance(loss_scale, int | float):  # a Python int may be too large for numpy
        loss_scale = np.asarray(jax.device_get(loss_scale)).reshape(())
        kind = loss_scale.dtype
        if not (jnp.issubdtype(kind, jnp.integer) or jnp.issubdtype(kind, jnp.floating)):
            raise TypeError(f"{_LOSS_SCALE_FORMS}, got an array of {kind}")
    try:
        value = float(loss_scale)
    except OverflowError:
        value = math.inf
    # The step multiplies by the scale in float32: 1e39 is inf there and 1e-45 subnormal
    # (flushed to 0 on most accelerators), neither a scale a state can hold.
    if not (math.isfinite(value) and _F32_TINY <= value <= _F32_MAX):
        raise ValueError(
            "find_overflow: scale must be positive and finite as a normal float32 "
            f"(2**-126 ~ {_F32_TINY:.3g} to {_F32_MAX:.3g}: the step multiplies by it in "
            f"float32), got {value:g}"
        )
    return value


def _check_argnums(argnums: Any, nargs: int) -> set[int]:
    many = isinstance(argnums, Sequence) and not isinstance(argnums, str)
    nums = list(argnums) if many else [argnums]
    if not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
        raise TypeError(
            f"find_overflow: argnums must be an int or a sequence of ints, got {argnums!r}"
        )
    out = set()
    for n in nums:
        if not -nargs <= n < nargs:
            raise ValueError(
                f"find_overflow: argnums={argnums!r} is out of range for {nargs} positional "
                f"argument{'s' if nargs != 1 else ''} of fun"
            )
        out.add(n % nargs)
    return out


def _leaf_owners(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The positional argument each leaf of ``(args, kwargs)`` belongs to (-1: kwargs)."""
    owners: list[int] = []
    for i, a in enumerate(args):
        owners += [i] * len(jax.tree_util.tree_leaves(a))
    return owners + [-1] * len(jax.tree_util.tree_leaves(kwargs))
