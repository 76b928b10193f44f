"""The public face of autocast: ``autocast``, ``full_precision``, ``keep_float32``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._autocast._config import build_config
from jaxamp.casting._autocast._wrapper import make_wrapper
from jaxamp.casting._fp8._fp8_config import Fp8Config
from jaxamp.casting._rules._policy import Policy
from jaxamp.casting._rules._scopes import FULL_PRECISION_SCOPE, KEEP_FLOAT32_SCOPE

__all__ = ["autocast", "debugging_autocast", "full_precision", "keep_float32"]


@renamed_parameter("f", "fun", removed_in="0.5")
def autocast(
    fun: Callable[..., Any] | None = None,
    dtype: Any = None,
    *,
    policy: Policy | str | None = None,
    enabled: bool = True,
    rules: Mapping[Any, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    unknown_higher_order: str = "warn",
    fp8: Fp8Config | bool | None = None,
    device_type: None = None,
) -> Callable[..., Any]:
    """Runs `fun` in mixed precision, choosing each operation's dtype by op class.

    Like ``torch.autocast``: matrix products and convolutions run in `dtype`;
    numerically sensitive ops (exp, log, division, sums, softmax, norm
    statistics, losses, linear algebra, FFTs, and the elementwise steps that
    feed them) in float32; everything else follows torch's type promotion: a
    float32 value meeting an activation promotes the op to float32, unless it is
    a scalar or vector broadcast into it (a Dense bias, a norm scale, a fill),
    which is cast down, so the activations between two matmuls stay in `dtype`.
    An explicit ``x.astype(jnp.float32)`` of a lower-precision value, or
    ``jaxamp.keep_float32(x)``, is kept: the ops after it run in float32 until
    a matmul. Only trace-time constants saturate when cast down
    (``finfo(float32).min`` masks stay finite); a run-time value beyond the
    dtype's range overflows to inf, where the loss scale and
    [`jaxamp.find_overflow`][jaxamp.find_overflow] see it. The result depends only on `fun`'s
    program and these arguments; nothing in JAX or in `fun` is patched.
    Parameters stay in their own dtype and outputs come back in the dtypes `fun`
    returns without autocast (or the policy's ``output_dtype``), so
    ``autocast(fun)`` is a drop-in for `fun`. It
    composes with ``jit``, ``grad`` (backward ops run in the dtype of their
    forward ops), ``vmap``, control flow, ``remat``, custom derivatives, Flax
    linen (also as a decorator on a ``@nn.compact`` method) and nnx modules
    (state updates are written back). Eager calls are compiled once per
    input signature.

    Arrays among the arguments are traced; every other argument (Python
    scalars, strings, modules) is fixed at trace time, like a static argument.
    With `fun` a plain Python object (or one of its methods), its attributes are
    read at each call the same way: ``model.w = new`` is seen by the next call.
    What `fun` reads from a closure or a global is fixed when `fun` is traced, as
    for ``jax.jit``: an array rebound there later is not seen by an eager call
    already cached; pass it as an argument instead. ``autocast(nnx_module)``
    is the module's forward, bound to it (attribute reads go to the module);
    give the module itself to ``jaxamp.nnx.Optimizer`` and the nnx transforms.

    Args:
      fun: the function to transform, e.g. a Flax ``model.apply``, an nnx module
        or a linen method. Without it, returns a decorator.
      dtype: the lower-precision dtype (``jnp.float16`` or ``jnp.bfloat16``).
        Defaults to float16 (bfloat16 on TPU).
      policy: a [`jaxamp.Policy`][jaxamp.Policy] (or policy string) instead of `dtype`:
        its ``compute_dtype`` is the lower-precision dtype and floating
        outputs are cast to its ``output_dtype``.
      enabled: if False, return `fun` itself.
      rules: per-call overrides of ``jaxamp.DEFAULT_RULES``: primitive name
        (or primitive) -> ``"lower"``, ``"float32"``, ``"elementwise"``,
        ``"follow"``, ``"widest"`` or ``"as_written"``. E.g.
        ``{"dot_general": "float32"}`` keeps matmuls in float32. An unknown
        name raises ``ValueError`` naming the closest known ones.
      modules: per-module rules by Flax module path: pattern -> ``"float32"``
        (the module runs in full precision, like ``full_precision``) or a
        mapping of primitive rules for the ops of that module. A pattern is
        matched (``fnmatch``) against each module's name and class name (linen
        ``LayerNorm_0`` and ``nn.LayerNorm(name="ln")`` both match
        ``"LayerNorm"``), or, with a ``/``, against its path, e.g.
        ``{"LayerNorm": "float32", "head": "float32"}``; a module's rule
        covers its submodules. A stack of nnx layers that ``nnx.scan`` runs
        is one module (``layers``): a rule covers all its layers.
      unknown_higher_order: what to do with a primitive that carries a jaxpr
        but is not in the table: ``"warn"`` (default) or ``"as_written"`` run
        it in its original dtypes, ``"error"`` raises.
      fp8: [`jaxamp.fp8`][jaxamp.fp8]``(...)`` (or True for its defaults): the
        matrix products that run in `dtype` run as FP8 GEMMs with current
        scaling instead (float8_e4m3fn operands, float8_e5m2 gradients,
        float32 accumulation, results in `dtype`). Default None: no FP8.
      device_type: not taken (``torch.autocast``'s ``"cuda"`` / ``"cpu"``): JAX runs on
        its default device. Given, it raises a ``TypeError`` saying what to write.

    Returns:
      A function with the signature of `fun`.

    Raises:
      TypeError: if `fun` is not callable.
      ValueError: if `dtype` is not floating, both `dtype` and `policy` are
        given, or a rule names an unknown primitive or op class.

    Examples:
      >>> model = flax.linen.Dense(16)
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> y = jaxamp.autocast(model.apply, dtype=jnp.float16)(params, jnp.ones((2, 8)))
      >>> y.dtype  # the matmul ran in float16; the output keeps f's dtype
      dtype('float32')
    """
    write = "jaxamp.autocast(f, dtype=jnp.float16) (or @jaxamp.autocast(dtype=...) on f)."
    if device_type is not None:
        raise TypeError(
            f"autocast: got device_type={device_type!r}, but jaxamp.autocast takes no device "
            "type (torch.autocast's 'cuda' / 'cpu'): JAX runs on its default device. It wraps "
            f"the function to run in mixed precision: write {write}"
        )
    if fun is None:
        return _Decorator(functools.partial(
            autocast, dtype=dtype, policy=policy, enabled=enabled, rules=rules,
            modules=modules, unknown_higher_order=unknown_higher_order, fp8=fp8,
        ))  # fmt: skip
    named = _dtype_named(fun)  # torch.autocast(torch.float16)'s spelling: a dtype first
    if named is not None:
        raise TypeError(
            f"autocast: the first argument is the function to run in mixed precision, got "
            f"the dtype {named}. autocast wraps a function and takes the dtype by keyword: "
            f"write jaxamp.autocast(f, dtype=jnp.{named}) (or @jaxamp.autocast(dtype=jnp."
            f"{named}) on f)."
        )
    if isinstance(fun, str):
        raise TypeError(
            f"autocast: the first argument is the function to run in mixed precision, got "
            f"the string {fun!r}. jaxamp.autocast takes no device type (torch.autocast's "
            f"'cuda' / 'cpu'): JAX runs on its default device. Write {write}"
        )
    if not callable(fun):
        raise TypeError(f"autocast: fun must be callable, got {type(fun).__name__}")
    cfg = build_config(dtype, policy, rules, modules, unknown_higher_order, fp8=fp8)
    if not enabled:
        return fun
    return make_wrapper(fun, cfg)


def _dtype_named(x: Any) -> str | None:
    """The name of ``x`` if it is a dtype (``jnp.float16``, ``np.float16``, a dtype
    object or a dtype's name), else None: never a function to wrap."""
    is_dtype = (
        isinstance(x, np.dtype | str | type(jnp.float16))
        or isinstance(x, type)
        and issubclass(x, np.generic)
    )
    if not is_dtype:
        return None
    try:
        return np.dtype(jnp.dtype(x)).name
    except TypeError:
        return None


class _Decorator:
    """``autocast(dtype=...)`` without a function: a decorator, and not a context manager."""

    def __init__(self, bind: Callable[..., Any]) -> None:
        self._bind = bind

    def __call__(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return self._bind(f)

    def __enter__(self) -> None:
        # torch.autocast is a context manager; a JAX program is a traced function.
        raise TypeError(
            "jaxamp.autocast is a function transformation, not a context manager: JAX "
            "traces functions, so autocast wraps the function to run in mixed precision. "
            "Write f_amp = jaxamp.autocast(f, dtype=jnp.float16) and call f_amp(...), or "
            "put @jaxamp.autocast(dtype=jnp.float16) on f. Inside it, "
            "jaxamp.full_precision(g) is torch's autocast(enabled=False)."
        )

    def __exit__(self, *exc: Any) -> None:
        return None


def debugging_autocast(
    f: Callable[..., Any],
    dtype: Any,
    rules: Mapping[Any, str] | None,
    modules: Mapping[str, Any] | None,
) -> Callable[..., Any]:
    """``autocast(f, dtype=dtype, rules=rules, modules=modules)`` for ``find_overflow``.

    The same casts; in addition every equation it evaluates keeps the
    traceback and name stack it had in `f` (so a jaxpr of the result points at
    the user's source lines and module scopes), and nnx module calls are named
    by their path in the graph even without ``modules=``.
    """
    return make_wrapper(f, build_config(dtype, None, rules, modules, "warn", debug=True))


@renamed_parameter("g", "fun", removed_in="0.5")
def full_precision(fun: Callable[..., Any]) -> Callable[..., Any]:
    """Marks `fun` as a region that runs in full precision inside autocast.

    PyTorch's ``custom_fwd(cast_inputs=torch.float32)`` and
    ``autocast(enabled=False)``: `fun` gets its inputs in the dtypes it has
    without autocast (float32 for a float32 model) and every operation of `fun`,
    forward and backward, runs as written. An ``autocast`` nested inside `fun`
    switches lower precision back on for its own function. Outside autocast,
    ``full_precision(fun)`` behaves exactly like `fun`.

    Args:
      fun: the function to protect.

    Returns:
      A function with the signature of `fun`.

    Raises:
      TypeError: if `fun` is not callable.

    Examples:
      >>> @jaxamp.full_precision
      ... def loss_fn(logits, labels):
      ...   return optax.softmax_cross_entropy(logits, labels).mean()
    """
    if not callable(fun):
        raise TypeError(f"full_precision: fun must be callable, got {type(fun).__name__}")

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return fun(*args, **kwargs)

    return wrapper


def keep_float32(tree: Any) -> Any:
    """Marks the floating leaves of `tree` as float32 on purpose for ``autocast``.

    Inside ``autocast``, the marked values are float32 and so are the ops that
    use them, until a matrix product or convolution consumes them (what
    ``x.astype(jnp.float32)`` does to a float16 value). Use it where the
    float32 request is not visible in the program: ``x.astype(jnp.float32)``
    of a value that is already float32 in `f` (logits before a loss) leaves no
    trace in a jaxpr, so autocast cannot tell it from no cast at all. Outside
    ``autocast`` it is ``x.astype(jnp.float32)`` for each floating leaf (and
    XLA removes the marker).

    Args:
      tree: an array or a pytree of arrays.

    Returns:
      `tree` with every floating leaf in float32.

    Examples:
      >>> def loss_fn(params, x, y):
      ...   logits = jaxamp.keep_float32(model.apply(params, x))
      ...   return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    """

    def mark(x: Any) -> Any:
        if not is_float_dtype(jnp.result_type(x)):
            return x
        with jax.named_scope(KEEP_FLOAT32_SCOPE):
            # reduce_precision to float32's own format: an identity equation
            # that stays in the jaxpr (a same-dtype astype would be dropped).
            return lax.reduce_precision(jnp.asarray(x, jnp.float32), 8, 23)

    return jax.tree_util.tree_map(mark, tree)
