"""``jaxamp.find_overflow``: which op made the inf, on request, outside the train step.

The loss function is traced once, as training runs it (``autocast``, the loss
times the loss scale, its gradient), into one jaxpr whose equations keep the
user's tracebacks and module scopes (``_api.debugging_autocast``). The
evaluator (``_overflow_eval``) then runs that jaxpr eagerly, one equation at a
time, and stops at the first one that overflowed. This module turns that
equation into a report: forward or backward, module path, source line, how
large the value would have been in float32, and what to do about it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import _jax_compat, _overflow_eval, _overflow_where
from jaxamp._autocast._api import debugging_autocast
from jaxamp._autocast._interpret import AUTOCAST_SCOPE
from jaxamp._autocast._rules import _known_primitives
from jaxamp._metrics import get_loss_scale
from jaxamp._tree import wide_dtype

__all__ = ["OverflowReport", "find_overflow"]

_LOW_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# How many smaller loss scales find_overflow tries before it suggests one.
_MAX_RETRIES = 8


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """What :func:`jaxamp.find_overflow` found: the first op that overflowed, if any.

    Attributes:
      found: whether some op made an inf or NaN from finite inputs.
      primitive: that op's primitive name (``"dot_general"``, ``"exp"``, ...).
      pass_: ``"forward"`` or ``"backward"`` (the gradient computation).
      dtype: the dtype of the non-finite result (``"float16"``, ``"float32"``, ...).
      low_precision: False when no float16 / bfloat16 op overflowed and the
        report names a float32 op instead.
      nonfinite: ``"inf"`` or ``"nan"``.
      module_path: the Flax module path the op ran in (linen
        ``Block_1/Mlp_0/Dense_0``, nnx ``blocks/0/mlp``), or None outside modules.
      module_class: the class of that module where known (nnx), else None.
      name_stack: the op's full ``jax.named_scope`` stack, for reference.
      file, line, function: the innermost source frame outside JAX, Flax,
        optax, chex and jaxamp (the user's or the model package's code).
      scan_iterations: the iteration index of each ``scan`` / ``while`` loop
        around the op, outermost first (``()`` outside loops).
      magnitude: the largest finite absolute value of the op's result computed
        in float32 (for a float32 op, or where that fails, the largest finite
        absolute input).
      magnitude_source: ``"float32"`` or ``"inputs"``: how `magnitude` was found.
      dtype_max: the largest finite value of `dtype` (65504 for float16).
      ratio: ``magnitude / dtype_max`` where that means something, else None.
      loss_scale: the loss scale the run used.
      compute_dtype: autocast's lower-precision dtype for the run.
      suggested_loss_scale: for a backward overflow caused by the loss scale, a
        scale small enough for this op (``loss_scale / 2**ceil(log2(ratio))``).
      advice: what to do, in words.
    """

    found: bool
    compute_dtype: str
    loss_scale: float
    primitive: str | None = None
    pass_: str | None = None
    dtype: str | None = None
    low_precision: bool = False
    nonfinite: str | None = None
    module_path: str | None = None
    module_class: str | None = None
    name_stack: str = ""
    file: str | None = None
    line: int | None = None
    function: str | None = None
    scan_iterations: tuple[int, ...] = ()
    magnitude: float | None = None
    magnitude_source: str | None = None
    dtype_max: float | None = None
    ratio: float | None = None
    suggested_loss_scale: float | None = None
    advice: str = ""

    @property
    def scan_iteration(self) -> int | None:
        """The innermost loop iteration the op ran in, or None outside loops."""
        return self.scan_iterations[-1] if self.scan_iterations else None

    def __str__(self) -> str:
        if not self.found:
            return (
                f"find_overflow: nothing overflowed. Every {self.compute_dtype} and float32 "
                f"result of the forward and backward pass (loss scale {self.loss_scale:g}) "
                "is finite or only passes on a non-finite input."
            )
        what = "" if self.low_precision else " (no float16 / bfloat16 op overflowed)"
        lines = [
            f"find_overflow: the first op to overflow is {self.primitive} in the "
            f"{self.pass_} pass: its {self.dtype} result holds {self.nonfinite} "
            f"from finite inputs{what}.",
        ]
        if self.module_path is not None:
            cls = f" ({self.module_class})" if self.module_class else ""
            lines.append(f"  module:    {self.module_path}{cls}")
        if self.file is not None:
            lines.append(f"  source:    {self.file}:{self.line}, in {self.function}")
        if self.scan_iterations:
            its = ", ".join(str(i) for i in self.scan_iterations)
            lines.append(f"  loop:      iteration {its} (outermost first)")
        if self.magnitude is not None:
            how = "in float32" if self.magnitude_source == "float32" else "(largest input)"
            size = f"  magnitude: {self.magnitude:.4g} {how}"
            if self.ratio is not None:
                size += f" = {self.ratio:.3g}x {self.dtype}'s max ({self.dtype_max:g})"
            lines.append(size)
        lines.append(f"  advice:    {self.advice}")
        return "\n".join(lines)


def find_overflow(
    loss_fn: Callable[..., Any],
    *args: Any,
    loss_scale: float = 2.0**15,
    dtype: Any = jnp.float16,
    argnums: int | Sequence[int] = 0,
    rules: Mapping[Any, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    autocast: bool = True,
    **kwargs: Any,
) -> OverflowReport:
    """Finds the first op whose float16 / bfloat16 result overflowed, forward or backward.

    Runs ``loss_fn(*args, **kwargs)`` once more as mixed-precision training
    does: under ``jaxamp.autocast(loss_fn, dtype=dtype, rules=rules,
    modules=modules)``, the loss multiplied by `loss_scale`, and its gradient
    with respect to ``args[argnums]``. It evaluates that program eagerly, one
    op at a time (entering ``jit``, ``scan``, ``while``, ``cond``, ``remat``
    and custom derivatives), and reports the first op, in execution order
    (forward before backward), whose lower-precision result holds an inf or
    NaN while all its floating inputs were finite. If no lower-precision op
    overflowed but a float32 op made a non-finite value from finite inputs,
    that one is reported instead. Call it outside ``jit`` on concrete values,
    e.g. when the loss scale keeps dropping; it is slow (every op is dispatched
    on its own) and meant for debugging, not for the train step.

    Args:
      loss_fn: the loss function as the train step calls it (returns a scalar
        floating loss).
      *args: its positional arguments (parameters, batch, ...).
      loss_scale: the loss scale to test: a number, a :class:`jaxamp.LossScaleState`,
        or the optimizer state holding one (its current scale).
      dtype: autocast's lower-precision dtype, ``jnp.float16`` or ``jnp.bfloat16``.
      argnums: which positional arguments the gradient is taken with respect
        to (an int or a sequence of ints, negative ones counted from the end).
      rules: autocast's per-primitive rules (as in :func:`jaxamp.autocast`).
      modules: autocast's per-module rules (as in :func:`jaxamp.autocast`).
      autocast: False runs `loss_fn` as written, without ``jaxamp.autocast``:
        for a loss that casts itself (a model built with ``dtype=jnp.float16``,
        ``x.astype(jnp.float16)`` by hand), whose overflows autocast would move
        (it runs sums, ``exp`` and norms in float32). `dtype`, `rules` and
        `modules` then only name the report's compute dtype.
      **kwargs: keyword arguments of `loss_fn` (not differentiated).

    Returns:
      An :class:`OverflowReport`; ``report.found`` is False when nothing
      overflowed, and ``print(report)`` explains the finding.

    Raises:
      TypeError: if `loss_fn` is not callable, returns something other than a
        scalar floating loss, `argnums` is not an int or a sequence of ints, or
        an argument is a tracer (``find_overflow`` called inside ``jit``).
      ValueError: if `dtype` is not float16 or bfloat16, `argnums` is out of
        range, `loss_scale` is not a positive finite number, or `rules` /
        `modules` are invalid (as in ``autocast``).

    Example:
      >>> def loss_fn(w, x):
      ...   return jnp.mean(x @ w)
      >>> w = jnp.full((4, 4), 300.0)
      >>> report = jaxamp.find_overflow(loss_fn, w, jnp.full((2, 4), 100.0))
      >>> report.found, report.primitive, report.pass_, report.dtype
      (True, 'dot_general', 'forward', 'float16')
      >>> jaxamp.find_overflow(loss_fn, w / 1000, jnp.ones((2, 4)), loss_scale=1.0).found
      False
    """
    if not callable(loss_fn):
        raise TypeError(f"find_overflow: loss_fn must be callable, got {type(loss_fn).__name__}")
    low = _check_dtype(dtype)
    loss_scale = _check_loss_scale(loss_scale)
    diff = _check_argnums(argnums, len(args))
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arg_of = _leaf_owners(args, kwargs)
    for x in leaves:
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                "find_overflow: the arguments must be concrete arrays; call it outside "
                "jax.jit / jax.grad (it evaluates the program eagerly, op by op)"
            )
    dynamic = [
        i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray | np.generic)
    ]
    wrt = [i for i in dynamic if arg_of[i] in diff and _overflow_eval.is_float(leaves[i])]
    rest = [i for i in dynamic if i not in set(wrt)]
    if not isinstance(autocast, bool):
        raise TypeError(f"find_overflow: autocast must be a bool, got {autocast!r}")
    target = loss_fn
    if not autocast:
        # Equations traced under autocast's own scope run as written (that is how
        # an autocast nested in another is left alone); the debugging wrapper
        # still keeps their source lines and names nnx modules.
        def target(*a: Any, **k: Any) -> Any:
            with jax.named_scope(AUTOCAST_SCOPE):
                return loss_fn(*a, **k)

    amp = debugging_autocast(target, low, rules, modules)

    def scaled(wrt_vals: list[Any], rest_vals: list[Any], scale: Any) -> Any:
        full = list(leaves)
        for i, x in zip(wrt, wrt_vals, strict=True):
            full[i] = x
        for i, x in zip(rest, rest_vals, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        loss = amp(*a, **k)
        if not isinstance(loss, jax.Array) or loss.shape != () or not _overflow_eval.is_float(loss):
            got = (
                f"{loss.dtype}{list(loss.shape)}"
                if isinstance(loss, jax.Array)
                else (type(loss).__name__)
            )
            raise TypeError(f"find_overflow: loss_fn must return a scalar floating loss, got {got}")
        # What jaxamp.scale does, with the scale an input of the program, so
        # that a smaller scale can be checked without tracing again.
        wide = wide_dtype(loss.dtype)
        return (loss.astype(wide) * scale.astype(wide)).astype(loss.dtype)

    wrt_vals = [leaves[i] for i in wrt]
    rest_vals = [leaves[i] for i in rest]
    scale0 = jnp.asarray(loss_scale, jnp.float32)
    closed = jax.make_jaxpr(jax.value_and_grad(scaled))(wrt_vals, rest_vals, scale0)
    inputs = jax.tree_util.tree_leaves((wrt_vals, rest_vals))

    def run(scale: float) -> OverflowReport:
        args = [*inputs, jnp.asarray(scale, jnp.float32)]
        return _report(_overflow_eval.find(closed, args), low, scale)

    report = run(loss_scale)
    if report.suggested_loss_scale is None:
        return report
    # The suggestion fits this op; a later gradient op may need a smaller one.
    for _ in range(_MAX_RETRIES):
        check = run(report.suggested_loss_scale)
        if not _scale_bound(check):
            break
        smaller = check.suggested_loss_scale
        report = dataclasses.replace(report, suggested_loss_scale=smaller)
        if smaller is None:
            break
    return dataclasses.replace(report, advice=_advice(report))


def _scale_bound(r: OverflowReport) -> bool:
    """Whether `r` is a lower-precision gradient overflow that the loss scale causes."""
    return r.found and r.low_precision and r.pass_ == "backward" and r.loss_scale > 1


# --------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        resolved = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise ValueError(f"find_overflow: dtype={dtype!r} is not a dtype") from e
    if resolved not in _LOW_DTYPES:
        raise ValueError(
            f"find_overflow: dtype must be jnp.float16 or jnp.bfloat16, got {resolved.name}"
        )
    return resolved


def _check_loss_scale(loss_scale: Any) -> float:
    if not isinstance(loss_scale, int | float | np.number | jax.Array | np.ndarray):
        # A LossScaleState, or an optimizer state holding one (as metrics takes).
        try:
            scale = get_loss_scale(loss_scale).scale
        except (TypeError, ValueError):
            raise TypeError(
                "find_overflow: loss_scale must be a number, a jaxamp.LossScaleState or an "
                f"optimizer state holding one, got a {type(loss_scale).__name__}"
            ) from None
        # A pmap-replicated state holds one equal copy per device.
        loss_scale = np.max(jax.device_get(scale))
    if np.size(loss_scale) != 1:
        raise ValueError(
            f"find_overflow: loss_scale must be one number, got shape {np.shape(loss_scale)}"
        )
    try:
        value = float(np.asarray(jax.device_get(loss_scale)).reshape(()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"find_overflow: loss_scale must be a number, got {loss_scale!r}") from e
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"find_overflow: loss_scale must be positive and finite, got {value}")
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
                f"argument{'s' if nargs != 1 else ''} of loss_fn"
            )
        out.add(n % nargs)
    return out


def _leaf_owners(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The positional argument each leaf of ``(args, kwargs)`` belongs to (-1: kwargs)."""
    owners: list[int] = []
    for i, a in enumerate(args):
        owners += [i] * len(jax.tree_util.tree_leaves(a))
    return owners + [-1] * len(jax.tree_util.tree_leaves(kwargs))


# --------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------


def _report(
    finding: _overflow_eval.Finding | None, low: np.dtype, loss_scale: float
) -> OverflowReport:
    if finding is None:
        return OverflowReport(found=False, compute_dtype=low.name, loss_scale=loss_scale)
    eqn, stack = finding.eqn, finding.frame.stack
    backward = ("transform", "transpose") in stack
    path, cls = _overflow_where.module_path(stack)
    file, line, function = _overflow_where.source(eqn) or (None, None, None)
    dtype_max = float(jnp.finfo(finding.dtype).max)
    magnitude, source = _magnitude(finding)
    ratio = magnitude / dtype_max if magnitude is not None and source == "float32" else None
    if ratio is not None and not finding.low_precision:
        ratio = None
    report = OverflowReport(
        found=True,
        compute_dtype=low.name,
        loss_scale=loss_scale,
        primitive=eqn.primitive.name,
        pass_="backward" if backward else "forward",
        dtype=finding.dtype.name,
        low_precision=finding.low_precision,
        nonfinite=finding.kind,
        module_path=path,
        module_class=cls,
        name_stack=_overflow_where.stack_str(stack),
        file=file,
        line=line,
        function=function,
        scan_iterations=finding.frame.iterations,
        magnitude=magnitude,
        magnitude_source=source,
        dtype_max=dtype_max,
        ratio=ratio,
    )
    suggested = _suggest_scale(report)
    report = dataclasses.replace(report, suggested_loss_scale=suggested)
    return dataclasses.replace(report, advice=_advice(report))


def _magnitude(finding: _overflow_eval.Finding) -> tuple[float | None, str | None]:
    """The largest finite |result| of the op computed in float32, or of its inputs."""
    if finding.low_precision:
        try:
            outs = _in_float32(finding.eqn, list(finding.invals))
        except Exception:  # noqa: BLE001 - any failure falls back to the inputs
            outs = []
        top = _largest_finite([x for x in outs if _overflow_eval.is_float(x)])
        if top is not None:
            return top, "float32"
    top = _largest_finite([x for x in finding.invals if _overflow_eval.is_float(x)])
    return (top, "inputs") if top is not None else (None, None)


def _in_float32(eqn: Any, invals: list[Any]) -> list[Any]:
    """`eqn` again with its lower-precision inputs and dtype params in float32."""
    f32 = np.dtype(jnp.float32)

    def up(x: Any) -> Any:
        if _overflow_eval.is_float(x) and np.dtype(jnp.result_type(x)).itemsize < 4:
            return jnp.asarray(x, f32)
        return x

    params = dict(eqn.params)
    for key in ("preferred_element_type", "new_dtype"):
        value = params.get(key)
        if value is not None and jnp.issubdtype(value, jnp.floating):
            params[key] = f32 if np.dtype(value).itemsize < 4 else value
    with _jax_compat.eqn_context(eqn):
        out = _jax_compat.bind(eqn.primitive, [up(x) for x in invals], params)
    return _jax_compat.outputs_as_list(eqn.primitive, out)


def _largest_finite(xs: list[Any]) -> float | None:
    best = None
    for x in xs:
        a = np.abs(np.asarray(jnp.asarray(x, jnp.float32)))
        a = a[np.isfinite(a)]
        if a.size:
            best = max(best or 0.0, float(a.max()))
    return best


def _suggest_scale(r: OverflowReport) -> float | None:
    """A loss scale under which this backward op's result fits its dtype."""
    if r.pass_ != "backward" or not r.low_precision or r.loss_scale <= 1:
        return None
    if r.ratio is None:
        return r.loss_scale / 2 if r.loss_scale >= 2 else None
    steps = max(1, math.ceil(math.log2(r.ratio)))
    scale = r.loss_scale / 2.0**steps
    return scale if scale >= 1 else None


def _advice(r: OverflowReport) -> str:
    if not r.low_precision:
        scale = ""
        if r.pass_ == "backward" and r.loss_scale > 1:
            scale = (
                f" In the backward pass the loss scale ({r.loss_scale:g}) multiplies every "
                "gradient: try a smaller one as well."
            )
        return (
            f"No {r.compute_dtype} op overflowed; a {r.dtype} {r.primitive} made {r.nonfinite} "
            "from finite inputs, which the program does without mixed precision too (exp of a "
            "large value, log of 0, 0/0, a value past float32's range): fix the computation "
            "there (subtract the max before exp, add an epsilon, clip)." + scale
        )
    if r.pass_ == "backward" and r.suggested_loss_scale is not None:
        s = f"{r.suggested_loss_scale:g}"
        return (
            f"The loss scale is too large: with loss_scale={r.loss_scale:.9g} this gradient "
            f"op exceeds {r.dtype}'s range. Start from a smaller scale, at most {s}: "
            f"jaxamp.dynamic_scale(init_scale={s}) (a dynamic scale also gets there by "
            f"halving, skipping one step each time); find_overflow(..., loss_scale={s}) "
            "checks it."
        )
    where = []
    if r.module_path is not None:
        where.append(f'jaxamp.autocast(f, modules={{"{r.module_path}": "float32"}})')
    if r.primitive in _known_primitives():
        where.append(f'rules={{"{r.primitive}": "float32"}}')
    where.append("wrap that computation in jaxamp.full_precision")
    what = f"Module {r.module_path}" if r.module_path is not None else "This op"
    pass_ = "" if r.pass_ == "forward" else " (its gradient, even without loss scaling)"
    hint = ""
    if r.compute_dtype == "float16":
        hint = " Or use dtype=jnp.bfloat16, which has float32's range."
    return (
        f"{what} produces values beyond {r.dtype}'s range{pass_}: run it in float32 with "
        + ", or ".join(where)
        + "."
        + hint
    )
