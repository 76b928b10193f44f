"""``autocast``: run any JAX function in mixed precision without editing it.

``autocast(f, dtype=jnp.float16)`` traces ``f`` to a jaxpr with
``jax.make_jaxpr`` and evaluates that jaxpr again, equation by equation,
casting each equation's floating inputs to the dtype its op class calls for
(the table below, like ``torch.autocast``'s op lists) and binding the
primitive on the cast values. Because the re-evaluation only binds primitives,
it runs under whatever transformation is active: ``jax.grad(autocast(f))``
differentiates the cast program, so a backward matmul runs in the dtype of its
forward matmul, and ``jit`` / ``vmap`` compose as usual.

Op classes (``DEFAULT_RULES`` maps primitive names to them):

* ``"lower"`` (``LOWER_PRECISION_OPS``): run in the autocast dtype.
* ``"float32"`` (``FLOAT32_OPS``): run in float32, or wider if an input is
  wider (float64 is never downcast).
* ``"widest"`` (every primitive not in the table): run in the widest floating
  dtype among the inputs, so mixed inputs never raise. Weakly typed inputs
  (Python scalars) do not take part, so ``x * 2.0`` stays float16.
* ``"as_written"`` (``AS_WRITTEN_OPS``): run in the dtypes ``f`` used without
  autocast (bit casts, callbacks, scatters and reductions with a combiner).

Higher-order primitives (``HIGHER_ORDER_OPS``: nested ``jit``, ``scan``,
``while``, ``cond``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``,
``shard_map``, ...) are entered: their inner jaxprs are autocast the same way,
while their inputs and outputs keep the dtypes ``f`` gave them, so loop carries
and branch outputs keep matching types. A custom derivative's own rule (the
``jvp`` of a ``custom_jvp``, the ``fwd``/``bwd`` of a ``custom_vjp``) runs as
the user wrote it, which is what PyTorch's ``custom_fwd`` / ``custom_bwd``
guarantee. Any other primitive that carries a jaxpr runs as written, with a
warning (or an error, with ``unknown_higher_order="error"``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxamp import _jax_compat
from jaxamp.policy import Policy

__all__ = [
    "AS_WRITTEN",
    "AS_WRITTEN_OPS",
    "DEFAULT_RULES",
    "FLOAT32",
    "FLOAT32_OPS",
    "HIGHER_ORDER_OPS",
    "LOWER",
    "LOWER_PRECISION_OPS",
    "WIDEST",
    "autocast",
    "full_precision",
]

# --------------------------------------------------------------------------
# The op table. Plain data: read it, or override entries per call with
# `autocast(f, rules={"dot_general": "float32"})`.
# --------------------------------------------------------------------------

LOWER = "lower"
FLOAT32 = "float32"
WIDEST = "widest"
AS_WRITTEN = "as_written"
_OP_CLASSES = (LOWER, FLOAT32, WIDEST, AS_WRITTEN)

#: Matrix products and convolutions, and so everything built on them (``@``,
#: ``einsum``, ``Dense``, ``Conv``, attention projections, RNN cells).
LOWER_PRECISION_OPS: frozenset[str] = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)

#: Numerically sensitive ops, run in float32 even when fed float16/bfloat16.
#: Sums, products and cumulative sums/products cover mean, variance, norms and
#: losses; ``reduce_max`` makes softmax / log-softmax / logsumexp subtract their
#: maximum in float32, so the whole max / exp / sum chain is float32.
FLOAT32_OPS: frozenset[str] = frozenset(
    {
        # elementwise
        "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "rsqrt",
        "div", "erf_inv", "tan", "sinh", "cosh", "asin", "acos",
        "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a",
        "random_gamma_grad", "zeta", "bessel_i0e", "bessel_i1e",
        # reductions
        "reduce_sum", "reduce_prod", "reduce_max", "cumsum", "cumprod",
        "cumlogsumexp",
    }
)  # fmt: skip

#: Ops that run in the dtypes the un-autocast function gave them: their
#: semantics or their params (a combiner jaxpr, a callback's result types, a
#: bit width) are tied to the original dtype.
AS_WRITTEN_OPS: frozenset[str] = frozenset(
    {
        "bitcast_convert_type", "pure_callback", "io_callback", "debug_callback",
        "scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub",
        "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
        "scatter_max", "scatter-apply", "scatter_apply", "reduce", "reduce_window",
        "select_and_scatter", "select_and_scatter_add", "select_and_gather_add",
    }
)  # fmt: skip

#: Higher-order primitives whose inner jaxprs autocast enters.
HIGHER_ORDER_OPS: frozenset[str] = frozenset(
    {
        "jit", "pjit", "closed_call", "core_call", "call", "scan", "while", "cond",
        "remat", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call",
        "custom_vjp_call_jaxpr", "shard_map",
    }
)  # fmt: skip

#: Primitive name -> op class. Primitives not listed are ``"widest"``.
DEFAULT_RULES: Mapping[str, str] = MappingProxyType(
    {
        **{name: LOWER for name in LOWER_PRECISION_OPS},
        **{name: FLOAT32 for name in FLOAT32_OPS},
        **{name: AS_WRITTEN for name in AS_WRITTEN_OPS},
    }
)

# `jax.named_scope` markers. Equations traced under either run as written when
# an enclosing autocast re-evaluates them: a full_precision region by
# definition, and a nested autocast because it already applied its own rules.
_FULL_PRECISION_SCOPE = "jaxamp_full_precision"
_AUTOCAST_SCOPE = "jaxamp_autocast"

_FLOAT32 = np.dtype(np.float32)


@functools.cache
def _is_float(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


@functools.cache
def _promote(a: np.dtype, b: np.dtype) -> np.dtype:
    return np.dtype(jnp.promote_types(a, b))


def _default_dtype() -> np.dtype:
    # float16 mirrors torch.autocast on CUDA; TPUs have no fast float16.
    return np.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


# --------------------------------------------------------------------------
# The interpreter.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Context:
    dtype: np.dtype
    rules: Mapping[str, str]
    unknown_higher_order: str
    axis_env: tuple[tuple[Any, int], ...] = ()
    # Inner jaxprs already autocast during this trace (the same nested jit is
    # often called many times), keyed by id with the jaxpr kept alive.
    cache: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)


def _cast(x: Any, dtype: np.dtype, literal: bool) -> Any:
    if literal:
        # Cast Python / numpy scalars on the host, so they stay jaxpr literals.
        return np.asarray(x, dtype=dtype)[()]
    return lax.convert_element_type(x, dtype)


def _to_original(vals: list[Any], dtypes: list[np.dtype], invars: list[Any]) -> list[Any]:
    """Casts floating values back to the dtypes the un-autocast program had."""
    out = []
    for x, cur, v in zip(vals, dtypes, invars, strict=True):
        want = v.aval.dtype
        if cur != want and _is_float(cur) and _is_float(want):
            x = _cast(x, want, isinstance(v, Literal))
        out.append(x)
    return out


def _eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Iterable[Any],
    args: Iterable[Any],
    ctx: _Context,
    as_written: bool = False,
) -> list[Any]:
    """Evaluates `jaxpr` with autocast rules; outputs keep whatever dtype they get."""
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = _eval_eqn(eqn, invals, ctx, as_written)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _dtype_of(x: Any, v: Any) -> Any:
    # Not np.dtype(...): extended dtypes (PRNG keys) have no numpy equivalent.
    return v.aval.dtype if isinstance(v, Literal) else x.dtype


_F16_MAX = float(np.finfo(np.float16).max)


def _is_weak(v: Any) -> bool:
    if isinstance(v, Literal):
        # A constant too large for float16 (e.g. finfo(float32).min used as an
        # attention mask) would become inf, so it keeps the op wide.
        val = float(np.asarray(v.val, dtype=np.float64))
        return not np.isfinite(val) or abs(val) <= _F16_MAX
    return bool(v.aval.weak_type)


def _eval_eqn(eqn: Any, invals: list[Any], ctx: _Context, as_written: bool) -> list[Any]:
    prim = eqn.primitive
    name = prim.name
    dtypes = [_dtype_of(x, v) for x, v in zip(invals, eqn.invars, strict=True)]
    if not as_written:
        stack = _jax_compat.name_stack(eqn)
        as_written = _FULL_PRECISION_SCOPE in stack or _AUTOCAST_SCOPE in stack

    if as_written:
        args = _to_original(invals, dtypes, eqn.invars)
        return _jax_compat.outputs_as_list(prim, _jax_compat.bind(prim, args, eqn.params))

    rule = ctx.rules.get(name, WIDEST)
    if rule != AS_WRITTEN and _has_subjaxprs(eqn.params):
        if name in HIGHER_ORDER_OPS and (name != "shard_map" or _jax_compat.HAS_SHARD_MAP):
            return _eval_higher_order(eqn, invals, dtypes, ctx)
        if rule == WIDEST:  # not declared by the table: an unknown higher-order primitive
            if ctx.unknown_higher_order == "error":
                raise NotImplementedError(
                    f"jaxamp.autocast does not know the higher-order primitive {name!r}. "
                    "Pass unknown_higher_order='as_written' to run it in its original "
                    f"dtypes, or rules={{{name!r}: 'as_written'}}."
                )
            if ctx.unknown_higher_order == "warn":
                warnings.warn(
                    f"jaxamp.autocast: higher-order primitive {name!r} is not entered; it "
                    "runs in the dtypes of the original function.",
                    stacklevel=2,
                )
        rule = AS_WRITTEN

    if rule == AS_WRITTEN:
        args = _to_original(invals, dtypes, eqn.invars)
        return _jax_compat.outputs_as_list(prim, _jax_compat.bind(prim, args, eqn.params))

    floats = [i for i, d in enumerate(dtypes) if _is_float(d)]
    if not floats:  # integer / bool / key ops are never touched
        return _jax_compat.outputs_as_list(prim, _jax_compat.bind(prim, invals, eqn.params))

    # Weakly typed inputs and scalar literals (Python scalars, which jnp has
    # already promoted to float32 in the jaxpr) follow the other inputs, as in
    # JAX's and PyTorch's promotion, unless every floating input is one.
    strong = [i for i in floats if not _is_weak(eqn.invars[i])] or floats
    widest = dtypes[strong[0]]
    for i in strong[1:]:
        widest = _promote(widest, dtypes[i])
    if rule == LOWER:
        target = (
            widest if widest.itemsize > ctx.dtype.itemsize and widest.itemsize > 4 else ctx.dtype
        )
    elif rule == FLOAT32:
        target = _promote(widest, _FLOAT32)
    elif rule == WIDEST:
        target = widest
    else:
        raise ValueError(f"unknown op class {rule!r} for primitive {name!r}")

    args = list(invals)
    for i in floats:
        if dtypes[i] != target:
            args[i] = _cast(invals[i], target, isinstance(eqn.invars[i], Literal))
    params = eqn.params
    pref = params.get("preferred_element_type")
    if pref is not None and _is_float(np.dtype(pref)):
        # jnp sets preferred_element_type to the input dtype; follow the cast
        # (an explicit wider accumulation type asked for by the user is kept).
        orig_widest = np.dtype(eqn.invars[floats[0]].aval.dtype)
        for i in floats[1:]:
            orig_widest = _promote(orig_widest, np.dtype(eqn.invars[i].aval.dtype))
        if np.dtype(pref) == orig_widest and np.dtype(pref) != target:
            params = dict(params, preferred_element_type=target)
    return _jax_compat.outputs_as_list(prim, _jax_compat.bind(prim, args, params))


def _has_subjaxprs(params: Mapping[str, Any]) -> bool:
    for value in params.values():
        if isinstance(value, (ClosedJaxpr, Jaxpr)):
            return True
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value
        ):
            return True
    return False


def _eval_higher_order(
    eqn: Any, invals: list[Any], dtypes: list[np.dtype], ctx: _Context
) -> list[Any]:
    # The primitive keeps its original signature: inputs go back to their
    # original dtypes and every inner jaxpr is replaced by an autocast jaxpr
    # with exactly the same input and output types. Everything else in the
    # params (shardings, carry counts, custom rules) stays valid untouched.
    sub_ctx = ctx
    args = _to_original(invals, dtypes, eqn.invars)
    if eqn.primitive.name == "shard_map":
        mesh = eqn.params["mesh"]
        sub_ctx = dataclasses.replace(ctx, axis_env=ctx.axis_env + tuple(mesh.shape.items()))
        body = eqn.params["jaxpr"]
        return _jax_compat.shard_map_call(
            lambda *xs: _eval_to_original(body, (), xs, sub_ctx), args, eqn.params
        )
    params = {}
    for key, value in eqn.params.items():
        if isinstance(value, (ClosedJaxpr, Jaxpr)):
            value = _autocast_subjaxpr(value, sub_ctx)
        elif isinstance(value, (tuple, list)) and any(
            isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value
        ):
            value = type(value)(
                _autocast_subjaxpr(v, sub_ctx) if isinstance(v, (ClosedJaxpr, Jaxpr)) else v
                for v in value
            )
        params[key] = value
    return _jax_compat.outputs_as_list(eqn.primitive, _jax_compat.bind(eqn.primitive, args, params))


def _eval_to_original(
    jaxpr: Jaxpr, consts: Iterable[Any], args: Iterable[Any], ctx: _Context
) -> list[Any]:
    """Like `_eval_jaxpr`, with outputs cast back to the jaxpr's output dtypes."""
    outs = _eval_jaxpr(jaxpr, consts, args, ctx)
    return [
        lax.convert_element_type(x, v.aval.dtype)
        if _is_float(x.dtype) and x.dtype != v.aval.dtype
        else x
        for x, v in zip(outs, jaxpr.outvars, strict=True)
    ]


def _autocast_subjaxpr(sub: ClosedJaxpr | Jaxpr, ctx: _Context) -> ClosedJaxpr | Jaxpr:
    """An autocast version of `sub` with the same input and output types."""
    key = id(sub)
    if key in ctx.cache:
        return ctx.cache[key][1]
    if isinstance(sub, ClosedJaxpr):
        jaxpr, consts = sub.jaxpr, sub.consts
    else:
        jaxpr, consts = sub, ()
        if jaxpr.constvars:
            raise NotImplementedError("open inner jaxpr with constvars")
    in_avals = [v.aval for v in jaxpr.invars]
    traced = jax.make_jaxpr(
        lambda *args: _eval_to_original(jaxpr, consts, args, ctx),
        axis_env=list(ctx.axis_env) or None,
    )(*in_avals)
    if isinstance(sub, ClosedJaxpr):
        new: ClosedJaxpr | Jaxpr = traced
    else:
        if traced.consts:
            # An open inner jaxpr (remat, shard_map) cannot take new constants;
            # fold them in as a closed call, which every JAX version accepts.
            raise NotImplementedError("autocast introduced constants in an open inner jaxpr")
        new = traced.jaxpr
    ctx.cache[key] = (sub, new)
    return new


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


def _is_dynamic(x: Any) -> bool:
    # Arrays (and tracers) are traced; Python scalars, strings, modules, ...
    # are fixed at trace time like static arguments, so flags such as
    # `train=False` keep working in Python control flow.
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _resolve_dtype(dtype: Any, policy: Policy | None) -> tuple[np.dtype, np.dtype | None]:
    if policy is not None and dtype is not None:
        raise ValueError("autocast: pass either dtype= or policy=, not both")
    if policy is not None:
        if isinstance(policy, str):
            policy = Policy.from_string(policy)
        if not isinstance(policy, Policy):
            raise TypeError(
                f"autocast: policy must be a jaxamp.Policy or a policy string, got "
                f"{type(policy).__name__}"
            )
        return np.dtype(policy.compute_dtype), np.dtype(policy.output_dtype)
    if dtype is None:
        return _default_dtype(), None
    try:
        resolved = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(f"autocast: dtype={dtype!r} is not a dtype") from e
    if not _is_float(resolved):
        raise ValueError(
            f"autocast: dtype must be a floating dtype such as jnp.float16 or "
            f"jnp.bfloat16, got {resolved.name}"
        )
    return resolved, None


def _resolve_rules(rules: Mapping[Any, str] | None) -> Mapping[str, str]:
    if not rules:
        return DEFAULT_RULES
    merged = dict(DEFAULT_RULES)
    for key, value in rules.items():
        name = key if isinstance(key, str) else getattr(key, "name", None)
        if not isinstance(name, str):
            raise TypeError(f"autocast: rules keys must be primitive names, got {key!r}")
        if value not in _OP_CLASSES:
            raise ValueError(f"autocast: rules[{name!r}]={value!r}; expected one of {_OP_CLASSES}")
        merged[name] = value
    return merged


def autocast(
    f: Callable[..., Any],
    dtype: Any = None,
    *,
    policy: Policy | str | None = None,
    enabled: bool = True,
    rules: Mapping[Any, str] | None = None,
    unknown_higher_order: str = "warn",
) -> Callable[..., Any]:
    """Runs `f` in mixed precision, choosing each operation's dtype by op class.

    Like ``torch.autocast``: matrix products and convolutions run in `dtype`,
    numerically sensitive ops (exp, log, division, sums, softmax, norms,
    losses, ...) in float32, everything else in the widest dtype among its
    inputs. Parameters stay in their own dtype (usually float32) and outputs
    come back in the dtypes `f` returns without autocast (or the policy's
    ``output_dtype``), so ``autocast(f)`` is a drop-in for `f`. It composes
    with ``jit``, ``grad`` (backward ops run in the dtype of their forward
    ops), ``vmap``, control flow, ``remat``, custom derivatives and Flax.

    Arrays among the arguments are traced; every other argument (Python
    scalars, strings, modules) is fixed at trace time, like a static argument.

    Args:
      f: the function to transform, e.g. a Flax ``model.apply`` or an nnx
        module.
      dtype: the lower-precision dtype (``jnp.float16`` or ``jnp.bfloat16``).
        Defaults to float16 (bfloat16 on TPU).
      policy: a :class:`jaxamp.Policy` (or policy string) instead of `dtype`:
        its ``compute_dtype`` is the lower-precision dtype and floating
        outputs are cast to its ``output_dtype``.
      enabled: if False, return `f` itself.
      rules: per-call overrides of ``DEFAULT_RULES``: primitive name (or
        primitive) -> ``"lower"``, ``"float32"``, ``"widest"`` or
        ``"as_written"``. E.g. ``{"dot_general": "float32"}`` keeps matmuls
        in float32.
      unknown_higher_order: what to do with a primitive that carries a jaxpr
        but is not in ``HIGHER_ORDER_OPS``: ``"warn"`` (default) or
        ``"as_written"`` run it in its original dtypes, ``"error"`` raises.

    Returns:
      A function with the signature of `f`.

    Raises:
      TypeError: if `f` is not callable.
      ValueError: if `dtype` is not floating, both `dtype` and `policy` are
        given, or an override names an unknown op class.

    Example:
      >>> model = flax.linen.Dense(16)
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> y = jaxamp.autocast(model.apply, dtype=jnp.float16)(params, jnp.ones((2, 8)))
      >>> y.dtype  # the matmul ran in float16; the output keeps f's dtype
      dtype('float32')
    """
    if not callable(f):
        raise TypeError(f"autocast: f must be callable, got {type(f).__name__}")
    compute_dtype, output_dtype = _resolve_dtype(dtype, policy)
    resolved_rules = _resolve_rules(rules)
    if unknown_higher_order not in ("warn", "as_written", "error"):
        raise ValueError(
            "autocast: unknown_higher_order must be 'warn', 'as_written' or 'error', "
            f"got {unknown_higher_order!r}"
        )
    if not enabled:
        return f

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]

        def flat_f(*dyn: Any) -> Any:
            full = list(leaves)
            for i, x in zip(dynamic, dyn, strict=True):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return f(*a, **k)

        dyn_args = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(*dyn_args)
        ctx = _Context(compute_dtype, resolved_rules, unknown_higher_order)
        with jax.named_scope(_AUTOCAST_SCOPE):
            outs = _eval_jaxpr(closed.jaxpr, closed.consts, dyn_args, ctx)
            final = []
            for x, shape in zip(outs, jax.tree_util.tree_leaves(out_shape), strict=True):
                want = np.dtype(shape.dtype)
                if _is_float(want) and output_dtype is not None:
                    want = output_dtype
                if _is_float(x.dtype) and x.dtype != want:
                    x = lax.convert_element_type(x, want)
                final.append(x)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), final)

    return wrapper


def full_precision(g: Callable[..., Any]) -> Callable[..., Any]:
    """Marks `g` as a region that runs as written (float32) inside autocast.

    The equivalent of ``with torch.autocast(..., enabled=False)``: every
    operation of `g` runs in the dtypes `g` uses without autocast (float32 for
    a float32 model), and its inputs arrive in those dtypes. An ``autocast``
    nested inside `g` switches lower precision back on for its own function.
    Outside autocast, ``full_precision(g)`` behaves exactly like `g`.

    Args:
      g: the function to protect.

    Returns:
      A function with the signature of `g`.

    Raises:
      TypeError: if `g` is not callable.

    Example:
      >>> @jaxamp.full_precision
      ... def loss_fn(logits, labels):
      ...   return optax.softmax_cross_entropy(logits, labels).mean()
    """
    if not callable(g):
        raise TypeError(f"full_precision: g must be callable, got {type(g).__name__}")

    @functools.wraps(g)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(_FULL_PRECISION_SCOPE):
            return g(*args, **kwargs)

    return wrapper
