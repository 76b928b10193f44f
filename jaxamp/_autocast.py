"""``autocast``: run any JAX function in mixed precision without editing it.

``autocast(f, dtype=jnp.float16)`` traces ``f`` to a jaxpr with
``jax.make_jaxpr`` and evaluates that jaxpr again, equation by equation,
casting each equation's floating inputs to the dtype its op class calls for
(``DEFAULT_RULES``, like ``torch.autocast``'s op lists) and binding the
primitive on the cast values. Because the re-evaluation only binds primitives,
it runs under whatever transformation is active: ``jax.grad(autocast(f))``
differentiates the cast program, so a backward op runs in the dtype of its
forward op, and ``jit`` / ``vmap`` compose as usual.

Each value carries one of three marks while the jaxpr is evaluated:

* an *activation*: a value autocast put in the lower-precision dtype (a
  matmul's output, and everything computed from it by ``"follow"`` ops);
* *pinned*: the user wrote ``x.astype(jnp.float32)`` (or
  ``lax.convert_element_type``) and so asked for float32;
* neither: parameters, inputs, constants and float32-list results, in the
  dtype ``f`` gives them.

The op classes (the values of ``DEFAULT_RULES``; unlisted primitives are
``"follow"``):

* ``"lower"``: run in the autocast dtype (``dot_general``, convolutions). The
  result is an activation.
* ``"float32"``: run in float32, or wider if an input is wider (exp, log,
  division, pow, sums, softmax, norm statistics, losses).
* ``"elementwise"``: as ``"follow"``, and in float32 when everything it
  produces only feeds ``"float32"`` ops (the ``sub`` / ``square`` of a norm's
  variance, the ``sub`` / ``abs`` of a loss): float32-list reductions see the
  values ``f`` would have computed, not float16-rounded or overflowed ones.
* ``"follow"``: pinned input -> float32; else an activation input -> the
  autocast dtype, casting float32 parameters and constants *down* (a Dense
  bias, a LayerNorm scale, a gated product stay in float16, as PyTorch's
  ``Linear`` and ``GELU`` do); else the widest input dtype.
* ``"widest"``: the widest floating input dtype, never cast down.
* ``"as_written"``: the dtypes ``f`` used without autocast (bit casts,
  callbacks, scatters, reductions with a combiner).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import functools
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxamp import _jax_compat
from jaxamp._policy import Policy

__all__ = ["DEFAULT_RULES", "autocast", "full_precision"]

# --------------------------------------------------------------------------
# The op table: plain data. Read it as `jaxamp.DEFAULT_RULES`; override
# entries per call with `autocast(f, rules={"dot_general": "float32"})`.
# --------------------------------------------------------------------------

LOWER = "lower"
FLOAT32 = "float32"
ELEMENTWISE = "elementwise"
FOLLOW = "follow"
WIDEST = "widest"
AS_WRITTEN = "as_written"
OP_CLASSES = (LOWER, FLOAT32, ELEMENTWISE, FOLLOW, WIDEST, AS_WRITTEN)

#: Matrix products and convolutions, and so everything built on them (``@``,
#: ``einsum``, ``Dense``, ``Conv``, attention projections, RNN cells).
LOWER_PRECISION_OPS: frozenset[str] = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)

#: Numerically sensitive ops, run in float32 even when fed float16/bfloat16.
#: Sums, products and cumulative sums/products cover mean, variance, norms and
#: losses; ``reduce_max`` makes softmax / log-softmax / logsumexp subtract their
#: maximum in float32. ``square`` is ``pow(x, 2)`` (float32 in torch.autocast).
FLOAT32_OPS: frozenset[str] = frozenset(
    {
        # elementwise
        "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
        "rsqrt", "div", "erf_inv", "tan", "sinh", "cosh", "asin", "acos",
        "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a",
        "random_gamma_grad", "zeta", "bessel_i0e", "bessel_i1e",
        # reductions
        "reduce_sum", "reduce_prod", "reduce_max", "cumsum", "cumprod",
        "cumlogsumexp",
    }
)  # fmt: skip

#: Elementwise and data-movement ops that run in float32 when all their
#: results feed float32-list ops (see the module docstring).
ELEMENTWISE_OPS: frozenset[str] = frozenset(
    {
        "add", "sub", "mul", "neg", "abs", "sign", "max", "min", "select_n",
        "clamp", "sqrt", "cbrt", "tanh", "logistic", "sin", "cos", "atan2", "erf",
        "erfc", "floor", "ceil", "round", "rem", "nextafter", "copy", "copy_p",
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
        "slice", "dynamic_slice", "gather", "concatenate", "pad", "rev",
        "reduce_precision", "convert_element_type",
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
        "shard_map",
    }
)  # fmt: skip

#: Primitive name -> op class. Primitives not listed are ``"follow"``.
DEFAULT_RULES: Mapping[str, str] = MappingProxyType(
    {
        **{name: ELEMENTWISE for name in sorted(ELEMENTWISE_OPS)},
        **{name: LOWER for name in sorted(LOWER_PRECISION_OPS)},
        **{name: FLOAT32 for name in sorted(FLOAT32_OPS)},
        **{name: AS_WRITTEN for name in sorted(AS_WRITTEN_OPS)},
    }
)

# `jax.named_scope` markers. Equations traced under either run as written when
# an enclosing autocast re-evaluates them: a full_precision region by
# definition, and a nested autocast because it already applied its own rules.
_FULL_PRECISION_SCOPE = "jaxamp_full_precision"
_AUTOCAST_SCOPE = "jaxamp_autocast"

_FLOAT32 = np.dtype(np.float32)

# Value marks (see the module docstring).
_NONE, _ACT, _PIN = 0, 1, 2


@functools.cache
def _is_float(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


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
    modules: tuple[tuple[str, Any], ...] = ()
    axis_env: tuple[tuple[Any, int], ...] = ()
    # Inner jaxprs already autocast during this trace, keyed by id with the
    # jaxpr kept alive (the same nested jit is often called many times).
    cache: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Casts already made during this trace: (id(value), dtype) -> (value, cast).
    casts: dict[tuple[int, Any], tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Float32-demand analysis per jaxpr (id -> (jaxpr, demanded equations)).
    demand: dict[int, tuple[Any, frozenset[int]]] = dataclasses.field(default_factory=dict)
    # Resolved per-module rules per name stack.
    scoped: dict[str, tuple[bool, Mapping[str, str]]] = dataclasses.field(default_factory=dict)

    def cast(self, x: Any, dtype: np.dtype) -> Any:
        """``convert_element_type`` once per (value, dtype) in this trace."""
        key = (id(x), dtype)
        hit = self.casts.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        y = _cast_jit(np.dtype(dtype))(x)
        self.casts[key] = (x, y)
        if np.dtype(dtype).itemsize > np.dtype(x.dtype).itemsize:
            # An exact upcast: casting the result back down gives `x` again.
            self.casts[(id(y), np.dtype(x.dtype))] = (y, x)
        return y


def _saturate_cast(x: Any, dtype: np.dtype, literal: bool) -> Any:
    # Finite constants beyond the lower dtype's range (finfo(float32).min as
    # an attention mask) keep their meaning as "very large", not inf.
    info = jnp.finfo(dtype)
    if literal:
        v = np.asarray(x)
        if np.isfinite(v).all():
            v = np.clip(v, float(info.min), float(info.max))
        return np.asarray(v, dtype=dtype)[()]
    clipped = jnp.where(jnp.isfinite(x), jnp.clip(x, float(info.min), float(info.max)), x)
    return lax.convert_element_type(clipped, dtype)


def _demanded_eqns(jaxpr: Jaxpr, ctx: _Context) -> frozenset[int]:
    """Indices of ``"elementwise"`` equations whose results only feed float32 ops.

    A backward pass over the jaxpr: a value is demanded when every use of it
    is a ``"float32"`` op or a demanded equation (and it is not an output); an
    ``"elementwise"`` equation is demanded when all its results are.
    """
    hit = ctx.demand.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    uses: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                uses.setdefault(v, []).append(i)
    outs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    sinks: set[int] = set()  # float32 ops and demanded equations
    demanded: set[int] = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        rule = ctx.rules.get(eqn.primitive.name, FOLLOW)
        if rule == FLOAT32:
            sinks.add(i)
        elif (
            rule == ELEMENTWISE
            and eqn.outvars
            and all(
                v not in outs and v in uses and all(u in sinks for u in uses[v])
                for v in eqn.outvars
            )
        ):
            sinks.add(i)
            demanded.add(i)
    result = frozenset(demanded)
    ctx.demand[id(jaxpr)] = (jaxpr, result)
    return result


def _eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Iterable[Any],
    args: Iterable[Any],
    ctx: _Context,
    marks: Sequence[int] | None = None,
    stack: str = "",
    as_written: bool = False,
) -> tuple[list[Any], list[int]]:
    """Evaluates `jaxpr` with autocast rules; returns the outputs and their marks."""
    env: dict[Any, Any] = {}
    mark: dict[Any, int] = {}
    const_only: set[Any] = set()  # values computed from literals alone
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    args = list(args)
    marks = list(marks) if marks is not None else [_NONE] * len(args)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v] = x
        mark[v] = m
    demanded = _demanded_eqns(jaxpr, ctx) if not as_written else frozenset()

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        inmarks = [_NONE if isinstance(v, Literal) else mark.get(v, _NONE) for v in eqn.invars]
        consts_in = [isinstance(v, Literal) or v in const_only for v in eqn.invars]
        outs, outmarks = _eval_eqn(
            eqn, invals, inmarks, consts_in, ctx, i in demanded, stack, as_written
        )
        all_const = bool(eqn.invars) and all(consts_in) and not eqn.effects
        for v, x, m in zip(eqn.outvars, outs, outmarks, strict=True):
            env[v] = x
            mark[v] = m
            if all_const:
                const_only.add(v)
    outvals = [read(v) for v in jaxpr.outvars]
    outmarks = [_NONE if isinstance(v, Literal) else mark.get(v, _NONE) for v in jaxpr.outvars]
    return outvals, outmarks


def _dtype_of(x: Any, v: Any) -> Any:
    # Not np.dtype(...): extended dtypes (PRNG keys) have no numpy equivalent.
    return v.aval.dtype if isinstance(v, Literal) else x.dtype


def _is_weak(v: Any) -> bool:
    # Python scalars (weakly typed) follow the other inputs, as in JAX and PyTorch.
    return bool(v.aval.weak_type)


def _to_original(vals: list[Any], dtypes: list[Any], invars: list[Any], ctx: _Context) -> list[Any]:
    """Casts floating values back to the dtypes the un-autocast program had."""
    out = []
    for x, cur, v in zip(vals, dtypes, invars, strict=True):
        want = v.aval.dtype
        if cur != want and _is_float(cur) and _is_float(want):
            x = np.asarray(x, dtype=want)[()] if isinstance(v, Literal) else ctx.cast(x, want)
        out.append(x)
    return out


# Primitives bound through `_op_jit`: pure, context-free ops (no effects, no
# axis names, no sharding), i.e. those the op table classifies plus a few
# common "follow" ones.
_JITTED_OPS: frozenset[str] = (
    LOWER_PRECISION_OPS
    | FLOAT32_OPS
    | ELEMENTWISE_OPS
    | frozenset(
        {
            "split", "stop_gradient", "iota", "eq", "ne", "lt", "le", "gt", "ge",
            "and", "or", "not", "xor", "is_finite", "argmax", "argmin", "reduce_min",
            "reduce_and", "reduce_or", "sort",
        }
    )
)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _op_jit(prim: Any, items: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    """One inlined ``jit`` per (primitive, params).

    Why: autocast binds the ops of an already-traced program one by one, and
    under ``grad`` JAX linearizes each bind afresh, while a model written with
    ``jnp`` calls small inlined jits whose linearization JAX caches per program.
    Binding through one jit per (primitive, params) gets the same cache: the
    ops of 48 identical layers are linearized once, not 48 times. ``inline``
    leaves the traced program exactly as a direct bind would.
    """
    params = dict(items)
    return jax.jit(lambda *args: prim.bind(*args, **params), inline=True)


@functools.lru_cache(maxsize=64)
def _cast_jit(dtype: np.dtype) -> Callable[[Any], Any]:
    return jax.jit(lambda x: lax.convert_element_type(x, dtype), inline=True)


def _bind(eqn: Any, args: list[Any], params: Any = None) -> list[Any]:
    prim = eqn.primitive
    params = eqn.params if params is None else params
    if prim.name in _JITTED_OPS and not eqn.effects:
        try:
            fn = _op_jit(prim, tuple(sorted(params.items())))
        except TypeError:  # an unhashable param
            pass
        else:
            return _jax_compat.outputs_as_list(prim, fn(*args))
    out = _jax_compat.bind(prim, args, params)
    return _jax_compat.outputs_as_list(prim, out)


def _scope_rules(ctx: _Context, stack: str) -> tuple[bool, Mapping[str, str]]:
    """(run as written?, rules) for equations traced under name stack `stack`."""
    hit = ctx.scoped.get(stack)
    if hit is not None:
        return hit
    parts = [p for p in stack.split("/") if p]
    full = any(p.startswith(_FULL_PRECISION_SCOPE) or p.startswith(_AUTOCAST_SCOPE) for p in parts)
    rules = ctx.rules
    if ctx.modules and not full:
        for pattern, value in ctx.modules:
            if _module_match(pattern, parts):
                if value == FLOAT32:
                    full = True
                    break
                rules = {**rules, **value}
    ctx.scoped[stack] = (full, rules)
    return full, rules


def _module_match(pattern: str, parts: list[str]) -> bool:
    # A pattern matches a module path ("Block_0/LayerNorm_1", nnx "blocks/0/ln"),
    # a module name, or a class name (linen auto-names are `Class_N`; nnx
    # scopes are written `name[Class]`; `_linen_class_scopes` adds a `[Class]`
    # scope inside each linen module's own `name` scope).
    names = []
    for p in parts:
        name, _, cls = p.partition("[")
        if name:
            names.append(name)
        if cls:
            names.append(cls.rstrip("]"))
        head, _, tail = name.rpartition("_")
        if head and tail.isdigit():
            names.append(head)
    if "/" in pattern:
        # A path names a module: its rule covers the ops of its submodules too.
        path = [n for n in (p.partition("[")[0] for p in parts) if n]
        for i in range(len(path), 0, -1):
            prefix = "/".join(path[:i])
            if fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, "*/" + pattern):
                return True
        return False
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def _eval_eqn(
    eqn: Any,
    invals: list[Any],
    inmarks: list[int],
    consts_in: list[bool],
    ctx: _Context,
    demanded: bool,
    outer_stack: str,
    as_written: bool,
) -> tuple[list[Any], list[int]]:
    name = eqn.primitive.name
    dtypes = [_dtype_of(x, v) for x, v in zip(invals, eqn.invars, strict=True)]
    stack = _jax_compat.name_stack(eqn)
    if outer_stack:
        stack = f"{outer_stack}/{stack}" if stack else outer_stack
    rules = ctx.rules
    if not as_written:
        as_written, rules = _scope_rules(ctx, stack)
    nout = len(eqn.outvars)

    if as_written:
        return _bind(eqn, _to_original(invals, dtypes, eqn.invars, ctx)), [_NONE] * nout

    rule = rules.get(name, FOLLOW)
    if rule != AS_WRITTEN and _has_subjaxprs(eqn.params):
        if name in HIGHER_ORDER_OPS and (name != "shard_map" or _jax_compat.HAS_SHARD_MAP):
            return _eval_higher_order(eqn, invals, inmarks, dtypes, ctx, stack)
        if ctx.unknown_higher_order == "error":
            raise NotImplementedError(
                f"jaxamp.autocast does not know the higher-order primitive {name!r}. "
                "Pass unknown_higher_order='as_written' to run it in its original "
                f"dtypes, or rules={{{name!r}: 'as_written'}}."
            )
        if ctx.unknown_higher_order == "warn":
            why = ""
            if name == "custom_vjp_call_jaxpr":
                why = (
                    f" On JAX {jax.__version__} a jax.custom_vjp function appears in "
                    "jaxprs in a form autocast does not enter; newer JAX (tested: "
                    "0.10) writes it as custom_vjp_call, which autocast enters."
                )
            warnings.warn(
                f"jaxamp.autocast: higher-order primitive {name!r} is not entered; it "
                f"runs in the dtypes of the original function.{why}",
                stacklevel=2,
            )
        rule = AS_WRITTEN

    if rule == AS_WRITTEN:
        return _bind(eqn, _to_original(invals, dtypes, eqn.invars, ctx)), [_NONE] * nout

    floats = [i for i, d in enumerate(dtypes) if _is_float(d)]
    if name == "convert_element_type":
        return _eval_convert(eqn, invals, inmarks, dtypes, floats, ctx, demanded)
    if name == "copy" and floats and _jax_compat.EXPLICIT_CAST_SCOPE in stack:
        # `x.astype(jnp.float32)` of a value float32 in `f`: an explicit cast.
        want = np.dtype(eqn.outvars[0].aval.dtype)
        x = invals[0] if dtypes[0] == want else ctx.cast(invals[0], want)
        return [x], [_PIN if want.itemsize >= 4 and not demanded else inmarks[0]]
    if not floats:  # integer / bool / key ops are never touched
        return _bind(eqn, invals), [_NONE] * nout

    strong = [i for i in floats if not _is_weak(eqn.invars[i])] or floats
    widest = dtypes[strong[0]]
    for i in strong[1:]:
        widest = _promote(widest, dtypes[i])
    out_mark = _NONE
    if rule == LOWER:
        big = widest.itemsize > ctx.dtype.itemsize and widest.itemsize > 4
        target = widest if big else ctx.dtype
        out_mark = _NONE if big else _ACT
    elif rule == FLOAT32 or (rule == ELEMENTWISE and demanded):
        target = _promote(widest, _FLOAT32)
    elif rule in (ELEMENTWISE, FOLLOW):
        if any(inmarks[i] == _PIN for i in floats):
            target, out_mark = _promote(widest, _FLOAT32), _PIN
        elif widest.itemsize <= 4 and any(inmarks[i] == _ACT for i in floats):
            target, out_mark = ctx.dtype, _ACT
        else:
            target = widest
    elif rule == WIDEST:
        target = widest
    else:  # validated by _resolve_rules
        raise AssertionError(rule)

    args = list(invals)
    for i in floats:
        if dtypes[i] == target:
            continue
        literal = isinstance(eqn.invars[i], Literal)
        down = np.dtype(target).itemsize < np.dtype(dtypes[i]).itemsize
        if down and consts_in[i] and not _is_weak(eqn.invars[i]):
            args[i] = _saturate_cast(invals[i], target, literal)
        elif literal:  # a Python scalar: cast on the host, it stays a literal
            args[i] = np.asarray(invals[i], dtype=target)[()]
        else:
            args[i] = ctx.cast(invals[i], target)
    params = eqn.params
    pref = params.get("preferred_element_type")
    if pref is not None and _is_float(pref) and np.dtype(pref) != target:
        # jnp sets preferred_element_type to its inputs' dtype: follow the cast,
        # unless the user asked for a wider accumulation type explicitly.
        orig = np.dtype(eqn.invars[floats[0]].aval.dtype)
        for i in floats[1:]:
            orig = _promote(orig, np.dtype(eqn.invars[i].aval.dtype))
        explicit = np.dtype(pref) != orig or _jax_compat.KEEP_ACCUMULATION_SCOPE in stack
        if not explicit:
            params = dict(params, preferred_element_type=target)
        elif rule == LOWER:
            out_mark = _NONE
    return _bind(eqn, args, params), [out_mark] * nout


def _eval_convert(
    eqn: Any,
    invals: list[Any],
    inmarks: list[int],
    dtypes: list[Any],
    floats: list[int],
    ctx: _Context,
    demanded: bool,
) -> tuple[list[Any], list[int]]:
    new = eqn.params["new_dtype"]
    x = invals[0]
    src_float = bool(floats)
    if not _is_float(new):
        if src_float:  # float -> int / bool: from the value `f` had
            x = _to_original([x], dtypes, eqn.invars, ctx)[0]
        return _bind(eqn, [x]), [_NONE]
    if not src_float:
        return _bind(eqn, [x]), [_NONE]
    new = np.dtype(new)
    # An explicit cast to float32 or wider (`x.astype(jnp.float32)`, kept in
    # the jaxpr by _jax_compat.user_intent_hooks) pins the value to float32
    # for the "follow" ops after it. A weak -> strong retyping is not a cast.
    src = eqn.invars[0].aval
    retype = bool(src.weak_type) != bool(eqn.params.get("weak_type", False))
    pinned = new.itemsize >= 4 and not demanded and not retype
    if dtypes[0] == new:
        return [x], [_PIN if pinned else inmarks[0]]
    return [ctx.cast(x, new)], [_PIN if pinned else _NONE]


def _has_subjaxprs(params: Mapping[str, Any]) -> bool:
    for value in params.values():
        if isinstance(value, (ClosedJaxpr, Jaxpr)):
            return True
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value
        ):
            return True
    return False


def _cast_all(xs: Sequence[Any], dtypes: Sequence[Any], ctx: _Context) -> list[Any]:
    return [
        ctx.cast(x, d) if _is_float(d) and _is_float(x.dtype) and x.dtype != d else x
        for x, d in zip(xs, dtypes, strict=True)
    ]


def _eval_higher_order(
    eqn: Any, invals: list[Any], inmarks: list[int], dtypes: list[Any], ctx: _Context, stack: str
) -> tuple[list[Any], list[int]]:
    name = eqn.primitive.name
    params = eqn.params
    nout = len(eqn.outvars)
    if name in ("jit", "pjit", "closed_call", "core_call", "call"):
        inner = params.get("jaxpr", params.get("call_jaxpr"))
        shardings = list(params.get("in_shardings", ())) + list(params.get("out_shardings", ()))
        if not params.get("donated_invars", ()) or not any(params["donated_invars"]):
            if all(_jax_compat.is_unspecified(s) for s in shardings):
                # Activations keep their dtype across the boundary (jax.nn.relu,
                # silu, jnp.cross, jnp.tril are nested jits).
                closed = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())
                if name in ("jit", "pjit"):
                    hit = _eval_nested_jit(eqn, closed, invals, inmarks, ctx, stack)
                    if hit is not None:
                        return hit
                return _eval_jaxpr(closed.jaxpr, closed.consts, invals, ctx, inmarks, stack)
    if name in ("remat", "remat2", "checkpoint"):
        return _eval_remat(eqn, invals, inmarks, ctx, stack)
    if name == "custom_jvp_call":
        return _eval_custom_jvp(eqn, invals, inmarks, ctx, stack)
    if name == "custom_vjp_call":
        return _eval_custom_vjp(eqn, invals, inmarks, ctx, stack)

    if name in ("scan", "while", "cond"):
        return _eval_control_flow(eqn, invals, inmarks, dtypes, ctx, stack)

    # The primitive keeps its original signature: inputs go back to their
    # original dtypes and every inner jaxpr is replaced by an autocast jaxpr
    # with exactly the same input and output types. Everything else in the
    # params (shardings, carry counts) stays valid untouched.
    args = _to_original(invals, dtypes, eqn.invars, ctx)
    if name == "shard_map":
        mesh = params["mesh"]
        sub_ctx = dataclasses.replace(
            ctx, axis_env=ctx.axis_env + tuple(mesh.shape.items()), casts={}
        )
        body = params["jaxpr"]
        outs = _jax_compat.shard_map_call(
            lambda *xs: _eval_to_original(body, (), xs, sub_ctx, stack), args, params
        )
        return outs, [_NONE] * nout
    new_params = {}
    for key, value in params.items():
        if isinstance(value, (ClosedJaxpr, Jaxpr)):
            value = _autocast_subjaxpr(value, ctx, stack)
        elif isinstance(value, (tuple, list)) and any(
            isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value
        ):
            value = type(value)(
                _autocast_subjaxpr(v, ctx, stack) if isinstance(v, (ClosedJaxpr, Jaxpr)) else v
                for v in value
            )
        new_params[key] = value
    return _bind(eqn, args, new_params), [_NONE] * nout


_Form = tuple[Any, int]  # (dtype, mark) of a value entering or leaving a region
_FREE = "free"  # an output form: whatever the region gives


@dataclasses.dataclass(frozen=True)
class _Region:
    jaxpr: ClosedJaxpr  # the autocast region
    got: list[_Form]  # each output's form before the exit cast
    cast_only: list[bool]  # each input: is it only ever read cast to the compute dtype?


def _trace_region(
    closed: ClosedJaxpr,
    in_forms: Sequence[_Form | None],
    out_forms: Sequence[_Form | str | None],
    ctx: _Context,
    stack: str,
) -> _Region:
    """Autocasts `closed` (a loop body, a branch) for given entry and exit forms.

    An input whose form is None enters in its original dtype, unmarked. An
    output whose form is None leaves in its original dtype, ``_FREE`` as the
    region gives it, and a form in that form's dtype.
    """
    key = ("region", id(closed), stack, ctx.axis_env, tuple(in_forms), tuple(out_forms))
    hit = ctx.cache.get(key)
    if hit is not None and hit[0] is closed:
        return hit[1]
    jaxpr = closed.jaxpr
    avals = [
        v.aval if f is None else v.aval.update(dtype=f[0], weak_type=False)
        for v, f in zip(jaxpr.invars, in_forms, strict=True)
    ]
    marks = [_NONE if f is None else f[1] for f in in_forms]
    got: list[_Form] = []
    sub_ctx = dataclasses.replace(ctx, casts={})

    def body(*xs: Any) -> list[Any]:
        outs, out_marks = _eval_jaxpr(jaxpr, closed.consts, xs, sub_ctx, marks, stack)
        got[:] = [(o.dtype, m) for o, m in zip(outs, out_marks, strict=True)]
        final = []
        for o, f, v in zip(outs, out_forms, jaxpr.outvars, strict=True):
            want = o.dtype if f == _FREE else v.aval.dtype if f is None else f[0]
            if o.dtype != want and _is_float(o.dtype) and _is_float(want):
                o = sub_ctx.cast(o, want)
            final.append(o)
        return final

    traced = jax.make_jaxpr(body, axis_env=list(ctx.axis_env) or None)(*avals)
    # Which inputs the autocast region reads only through a cast down to the
    # compute dtype (the casts are inlined `convert_element_type`s).
    cast_only = [True] * len(traced.jaxpr.invars)
    index = {v: k for k, v in enumerate(traced.jaxpr.invars)}
    for v in traced.jaxpr.outvars:
        if not isinstance(v, Literal) and v in index:
            cast_only[index[v]] = False
    for e in traced.jaxpr.eqns:
        down = e.primitive.name == "convert_element_type" and e.params["new_dtype"] == ctx.dtype
        for v in e.invars:
            if not down and not isinstance(v, Literal) and v in index:
                cast_only[index[v]] = False
    result = _Region(traced, list(got), cast_only)
    ctx.cache[key] = (closed, result)
    return result


def _eval_control_flow(
    eqn: Any, invals: list[Any], inmarks: list[int], dtypes: list[Any], ctx: _Context, stack: str
) -> tuple[list[Any], list[int]]:
    """``scan``, ``while`` and ``cond`` with activations kept in the autocast dtype.

    Loop-invariant inputs (constants, scanned ``xs``, branch operands) enter
    in the form they have. A scan carry must leave each iteration in the form
    it entered, so its form is a fixed point, and it may differ from the
    unrolled loop's only towards more precision: an activation carry stays one
    if the body returns it as one; a float32 carry that the body returns as an
    activation and reads only through casts down to the compute dtype (an
    RNN's hidden state) enters cast down, which changes nothing the body
    computes; any other carry runs in its original dtype. A ``while`` loop's
    carry enters pinned to its original dtype: its trip count depends on it
    (``t += 1e-4`` never reaches 1 in float16). Scanned outputs leave in the
    form the body gives them, branch outputs too when all branches agree; a
    carry the body returns pinned to float32 leaves pinned.
    """
    name = eqn.primitive.name
    params = eqn.params
    orig = [np.dtype(v.aval.dtype) if _is_float(v.aval.dtype) else None for v in eqn.invars]
    forms: list[_Form | None] = [
        (dtypes[i], m) if m != _NONE and _is_float(dtypes[i]) else None
        for i, m in enumerate(inmarks)
    ]

    def entry() -> list[Any]:
        args = []
        for x, d, o, f in zip(invals, dtypes, orig, forms, strict=True):
            want = o if f is None else f[0]
            args.append(ctx.cast(x, want) if want is not None and d != want else x)
        return args

    if name == "cond":
        branches = params["branches"]
        ops = forms[1:]
        nout = len(branches[0].out_avals)
        free = [_trace_region(b, ops, [_FREE] * nout, ctx, stack) for b in branches]
        decided: list[_Form | None] = []
        for j in range(nout):
            seen = {r.got[j] for r in free}
            one = next(iter(seen))
            decided.append(one if len(seen) == 1 and one[1] != _NONE else None)
        avals = branches[0].out_avals
        out_dtypes = [a.dtype if d is None else d[0] for a, d in zip(avals, decided, strict=True)]
        traced = tuple(
            r.jaxpr if all(d == g[0] for d, g in zip(out_dtypes, r.got, strict=True))
            else _trace_region(b, ops, decided, ctx, stack).jaxpr
            for b, r in zip(branches, free, strict=True)
        )  # fmt: skip
        marks = [_NONE if d is None else d[1] for d in decided]
        return _bind(eqn, entry(), dict(params, branches=traced)), marks

    if name == "scan":
        body, first = params["jaxpr"], 0  # body inputs: consts, carry, xs
        carry0, ncarry = params["num_consts"], params["num_carry"]
    else:  # while: body inputs are the body consts and the carry
        body, first = params["body_jaxpr"], params["cond_nconsts"]
        carry0 = first + params["body_nconsts"]
        ncarry = len(invals) - carry0
    carry = range(carry0, carry0 + ncarry)
    if name == "while":
        # The carry decides the trip count: it enters pinned to its dtype, so
        # `t + dt` with an activation `dt` runs in float32 (in float16 it would
        # stall at 0.25 for dt = 1e-4 and the loop would never end), and
        # leaves in its original dtype.
        for i in carry:
            pinned = orig[i] is not None and orig[i].itemsize >= 4
            forms[i] = (orig[i], _PIN) if pinned else None
        exits = [forms[i] for i in carry]
        region = _trace_region(body, forms[first:], exits, ctx, stack)
        cond_in = forms[: params["cond_nconsts"]] + forms[carry0:]
        cond = _trace_region(params["cond_jaxpr"], cond_in, [None], ctx, stack)
        new_params = dict(params, body_jaxpr=region.jaxpr, cond_jaxpr=cond.jaxpr)
        got = zip(carry, region.got, strict=True)
        marks = [_PIN if g == (orig[i], _PIN) else _NONE for i, g in got]
        return _bind(eqn, entry(), new_params), marks
    nys = len(body.out_avals) - ncarry
    # Each carry changes form at most twice (promoted, then demoted for good),
    # so this ends after at most 2 * ncarry + 1 traces of the body.
    demoted: set[int] = set()
    while True:
        exits = [forms[i] for i in carry] + [_FREE] * nys
        region = _trace_region(body, forms[first:], exits, ctx, stack)
        changed = False
        for j, i in enumerate(carry):
            if forms[i] is not None and region.got[j] != forms[i]:
                forms[i], changed = None, True
                demoted.add(i)
            elif (
                forms[i] is None
                and i not in demoted
                and region.got[j] == (ctx.dtype, _ACT)
                and region.cast_only[i - first]
                and orig[i] is not None
                and orig[i].itemsize > ctx.dtype.itemsize
            ):
                forms[i], changed = region.got[j], True
        if not changed:
            break
    marks = [
        f[1] if f is not None else _PIN if g == (orig[i], _PIN) else _NONE
        for i, f, g in zip(carry, (forms[i] for i in carry), region.got, strict=False)
    ] + [m for _, m in region.got[ncarry:]]
    return _bind(eqn, entry(), dict(params, jaxpr=region.jaxpr)), marks


def _inner_stacks(jaxpr: Jaxpr, ctx: _Context) -> tuple[str, ...]:
    """The distinct name stacks of `jaxpr`'s equations, sub-jaxprs included."""
    key = ("stacks", id(jaxpr))
    hit = ctx.cache.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    found: dict[str, None] = {}
    for eqn in jaxpr.eqns:
        here = _jax_compat.name_stack(eqn)
        found[here] = None
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    for inner in _inner_stacks(getattr(sub, "jaxpr", sub), ctx):
                        found[f"{here}/{inner}" if here and inner else here or inner] = None
    result = tuple(found)
    ctx.cache[key] = (jaxpr, result)
    return result


def _eval_nested_jit(
    eqn: Any, closed: ClosedJaxpr, invals: list[Any], inmarks: list[int], ctx: _Context, stack: str
) -> tuple[list[Any], list[int]] | None:
    """A nested ``jit`` re-issued as a ``jit`` of its autocast jaxpr, or None to inline.

    The autocast jaxpr takes and returns values in their autocast dtypes, so
    activations cross the boundary unchanged, as when inlined. It is built
    once per (jaxpr, input types, input marks, rules in force) in a trace and
    the same object is bound at every call site: JAX then differentiates,
    partially evaluates and lowers it once (a ``jnp.tril`` or ``jnp.where`` in
    each of 48 layers costs one trace, not 48).
    """
    if closed.effects:
        return None
    try:
        avals = [_jax_compat.aval_of(x) for x in invals]
    except TypeError:
        return None
    if any(not hasattr(a, "shape") or not hasattr(a, "dtype") for a in avals):
        return None
    # The rules that the inner equations will see (module rules match on the
    # name stack): identical rules, identical program.
    scopes = tuple(
        (full, id(rules))
        for full, rules in (
            _scope_rules(ctx, f"{stack}/{s}" if stack and s else stack or s)
            for s in _inner_stacks(closed.jaxpr, ctx)
        )
    )
    key = (
        "jit",
        id(closed),
        tuple((a.dtype, bool(getattr(a, "weak_type", False))) for a in avals),
        tuple(inmarks),
        scopes,
        ctx.axis_env,
    )
    hit = ctx.cache.get(key)
    if hit is None or hit[0] is not closed:
        out_marks: list[int] = []
        sub_ctx = dataclasses.replace(ctx, casts={})

        def body(*xs: Any) -> list[Any]:
            outs, marks = _eval_jaxpr(closed.jaxpr, closed.consts, xs, sub_ctx, inmarks, stack)
            out_marks[:] = marks
            return outs

        try:
            traced = jax.make_jaxpr(body, axis_env=list(ctx.axis_env) or None)(*avals)
        except Exception:  # e.g. an axis name bound outside: inline instead
            return None
        if traced.consts or traced.effects:
            return None
        hit = ctx.cache[key] = (closed, (traced, list(out_marks)))
    traced, out_marks = hit[1]
    params = dict(eqn.params, jaxpr=traced)
    return _bind(eqn, list(invals), params), list(out_marks)


def _eval_remat(
    eqn: Any, invals: list[Any], inmarks: list[int], ctx: _Context, stack: str
) -> tuple[list[Any], list[int]]:
    # Re-issued through the public jax.checkpoint so the rematerialised region
    # takes and returns activations in their autocast dtypes.
    params = eqn.params
    inner = params["jaxpr"]
    closed = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())
    out_marks: list[int] = []
    sub_ctx = dataclasses.replace(ctx, casts={})

    def body(*xs: Any) -> list[Any]:
        outs, marks = _eval_jaxpr(closed.jaxpr, closed.consts, xs, sub_ctx, inmarks, stack)
        out_marks[:] = marks
        return outs

    outs = jax.checkpoint(
        body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )(*invals)
    return list(outs), out_marks


def _custom_primal(
    eqn: Any, invals: list[Any], inmarks: list[int], ctx: _Context, stack: str
) -> tuple[Any, list[Any], list[int], list[int], list[Any]]:
    """A custom derivative's primal, run under autocast: ``(primal, xs, xmarks,
    out_marks, out_dtypes)``; the last two are filled in when ``primal`` runs."""
    params = eqn.params
    call = params["call_jaxpr"]
    nconst = params["num_consts"]
    consts, xs = invals[:nconst], invals[nconst:]
    cmarks, xmarks = inmarks[:nconst], inmarks[nconst:]
    out_marks: list[int] = []
    out_dtypes: list[Any] = []

    def primal(*ys: Any) -> list[Any]:
        sub = dataclasses.replace(ctx, casts={})
        outs, marks = _eval_jaxpr(
            call.jaxpr, call.consts, [*consts, *ys], sub, [*cmarks, *xmarks], stack
        )
        out_marks[:] = marks
        out_dtypes[:] = [o.dtype for o in outs]
        return outs

    return primal, xs, xmarks, out_marks, out_dtypes


def _eval_custom_jvp(
    eqn: Any, invals: list[Any], inmarks: list[int], ctx: _Context, stack: str
) -> tuple[list[Any], list[int]]:
    # A new jax.custom_jvp whose primal and jvp rule are both the autocast
    # evaluations of the user's: the primal has the same dtypes whether or not
    # it is differentiated (PyTorch's custom_fwd / custom_bwd).
    params = eqn.params
    primal, xs, xmarks, out_marks, out_dtypes = _custom_primal(eqn, invals, inmarks, ctx, stack)
    fn = jax.custom_jvp(primal)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        rule, rconsts, out_zeros = _jax_compat.custom_jvp_rule(params, len(primals))
        sub = dataclasses.replace(ctx, casts={})
        outs, _ = _eval_jaxpr(
            rule.jaxpr if isinstance(rule, ClosedJaxpr) else rule,
            rconsts,
            [*primals, *tangents],
            sub,
            [*xmarks, *xmarks],
            stack,
        )
        if not out_dtypes:
            primal(*primals)  # the primal's dtypes decide the rule's output dtypes
        p_out = _cast_all(outs[: len(out_zeros)], out_dtypes, sub)
        nz = iter(outs[len(out_zeros) :])
        t_out = [
            jnp.zeros(p.shape, p.dtype) if z else next(nz)
            for p, z in zip(p_out, out_zeros, strict=True)
        ]
        return p_out, _cast_all(t_out, out_dtypes, sub)

    fn.defjvp(jvp)
    outs = fn(*xs)
    return list(outs), list(out_marks) or [_NONE] * len(outs)


def _eval_custom_vjp(
    eqn: Any, invals: list[Any], inmarks: list[int], ctx: _Context, stack: str
) -> tuple[list[Any], list[int]]:
    params = eqn.params
    in_avals = params["call_jaxpr"].in_avals[params["num_consts"] :]
    primal, xs, xmarks, out_marks, out_dtypes = _custom_primal(eqn, invals, inmarks, ctx, stack)
    fn = jax.custom_vjp(primal)
    res_types: list[Any] = []  # the original fwd's residual types (static)

    def fwd(*ys: Any) -> tuple[list[Any], tuple[Any, ...]]:
        nonzeros = [_is_float(a.dtype) for a in in_avals]
        fwd_jaxpr, fconsts, out_trees = _jax_compat.custom_vjp_fwd(params, nonzeros)
        sub = dataclasses.replace(ctx, casts={})
        jaxpr = fwd_jaxpr.jaxpr if isinstance(fwd_jaxpr, ClosedJaxpr) else fwd_jaxpr
        outs, _ = _eval_jaxpr(jaxpr, fconsts, list(ys), sub, xmarks, stack)
        out_tree, res_tree, forwards = out_trees()
        nres = len(outs) - out_tree.num_leaves
        pruned, p_out = outs[:nres], outs[nres:]
        if not out_dtypes:
            primal(*ys)
        p_out = _cast_all(p_out, out_dtypes, sub)
        it = iter(pruned)
        res = [ys[f] if f is not None else next(it) for f in forwards]
        # Residuals as the user's fwd produced them under autocast; bwd is
        # traced at the residual types of the original fwd, then autocast.
        orig_res = [v.aval for v in jaxpr.outvars[:nres]]
        orig_res_it = iter(orig_res)
        res_avals = [in_avals[f] if f is not None else next(orig_res_it) for f in forwards]
        res_types[:] = res_avals
        return p_out, tuple(res)

    def bwd(saved: tuple[Any, ...], cts: Sequence[Any]) -> tuple[Any, ...]:
        res, res_avals = saved, res_types
        ct_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in params["call_jaxpr"].out_avals]
        rule = _jax_compat.custom_vjp_bwd(params)
        with _jax_compat.hooks_paused():
            closed = jax.make_jaxpr(rule)(
                *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res_avals], *ct_avals
            )
        sub = dataclasses.replace(ctx, casts={})
        outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, [*res, *cts], sub, None, stack)
        return tuple(_cast_all(outs, [y.dtype for y in xs], sub))

    fn.defvjp(fwd, bwd)
    outs = fn(*xs)
    return list(outs), list(out_marks) or [_NONE] * len(outs)


def _eval_to_original(
    jaxpr: Jaxpr, consts: Iterable[Any], args: Iterable[Any], ctx: _Context, stack: str = ""
) -> list[Any]:
    """Like `_eval_jaxpr`, with outputs cast back to the jaxpr's output dtypes."""
    outs, _ = _eval_jaxpr(jaxpr, consts, args, ctx, None, stack)
    return [
        lax.convert_element_type(x, v.aval.dtype)
        if _is_float(x.dtype) and x.dtype != v.aval.dtype
        else x
        for x, v in zip(outs, jaxpr.outvars, strict=True)
    ]


def _autocast_subjaxpr(sub: ClosedJaxpr | Jaxpr, ctx: _Context, stack: str) -> ClosedJaxpr | Jaxpr:
    """An autocast version of `sub` with the same input and output types."""
    key = (id(sub), stack)
    hit = ctx.cache.get(key)
    if hit is not None and hit[0] is sub:
        return hit[1]
    if isinstance(sub, ClosedJaxpr):
        jaxpr, consts = sub.jaxpr, sub.consts
    else:
        jaxpr, consts = sub, ()
        if jaxpr.constvars:
            raise NotImplementedError("open inner jaxpr with constvars")
    in_avals = [v.aval for v in jaxpr.invars]
    sub_ctx = dataclasses.replace(ctx, casts={})
    traced = jax.make_jaxpr(
        lambda *args: _eval_to_original(jaxpr, consts, args, sub_ctx, stack),
        axis_env=list(ctx.axis_env) or None,
    )(*in_avals)
    if isinstance(sub, ClosedJaxpr):
        new: ClosedJaxpr | Jaxpr = traced
    else:
        if traced.consts:
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


def _resolve_dtype(dtype: Any, policy: Policy | str | None) -> tuple[np.dtype, np.dtype | None]:
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


@functools.cache
def _known_primitives() -> frozenset[str]:
    names = set(DEFAULT_RULES) | HIGHER_ORDER_OPS
    try:
        from jax.extend.core import primitives

        for value in vars(primitives).values():
            name = getattr(value, "name", None)
            if isinstance(name, str) and hasattr(value, "bind"):
                names.add(name)
    except ImportError:  # pragma: no cover - older jax.extend
        pass
    for value in vars(lax).values():
        name = getattr(value, "name", None)
        if isinstance(name, str) and hasattr(value, "bind"):
            names.add(name)
    return frozenset(names)


def _check_class(where: str, value: Any) -> None:
    if value not in OP_CLASSES:
        raise ValueError(f"autocast: {where}={value!r}; expected one of {OP_CLASSES}")


def _resolve_rules(rules: Mapping[Any, str] | None, where: str = "rules") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (rules or {}).items():
        if isinstance(key, str):
            name = key
            if name not in _known_primitives():
                known = sorted(_known_primitives())
                close = sorted((k for k in known if k.startswith(name)), key=len)[:3]
                close += [k for k in difflib.get_close_matches(name, known, n=3) if k not in close]
                hint = f" Closest known names: {', '.join(close)}." if close else ""
                raise ValueError(
                    f"autocast: {where} names an unknown primitive {name!r}.{hint} Keys are "
                    "primitive names as in jax.make_jaxpr output (see jaxamp.DEFAULT_RULES), "
                    "or the primitive objects themselves."
                )
        else:
            name = getattr(key, "name", None)
            if not isinstance(name, str):
                raise TypeError(f"autocast: {where} keys must be primitive names, got {key!r}")
        _check_class(f"{where}[{name!r}]", value)
        out[name] = value
    return out


def _resolve_modules(modules: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    resolved = []
    for pattern, value in (modules or {}).items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"autocast: modules keys must be module name patterns, got {pattern!r}")
        if isinstance(value, str):
            if value != FLOAT32:
                raise ValueError(
                    f"autocast: modules[{pattern!r}]={value!r}; expected 'float32' (run the "
                    "module in full precision) or a mapping of primitive rules"
                )
            resolved.append((pattern, FLOAT32))
        elif isinstance(value, Mapping):
            resolved.append((pattern, _resolve_rules(value, f"modules[{pattern!r}]")))
        else:
            raise TypeError(
                f"autocast: modules[{pattern!r}] must be 'float32' or a mapping of primitive "
                f"rules, got {type(value).__name__}"
            )
    return tuple(resolved)


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional
        return None
    return nnx


def _is_bound_linen(x: Any) -> bool:
    try:
        from flax import linen as nn
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, nn.Module) and x.scope is not None


@dataclasses.dataclass(frozen=True)
class _Config:
    compute_dtype: np.dtype
    output_dtype: np.dtype | None
    rules: Mapping[str, str]
    modules: tuple[tuple[str, Any], ...]
    unknown_higher_order: str


def _run(
    f: Callable[..., Any],
    cfg: _Config,
    leaves: list[Any],
    treedef: Any,
    dynamic: list[int],
    dyn: Sequence[Any],
    scopes: Callable[[], Any] | None = None,
) -> Any:
    """Traces `f` on the dynamic leaves and evaluates it with autocast rules."""

    def flat_f(*vals: Any) -> Any:
        full = list(leaves)
        for i, x in zip(dynamic, vals, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        with contextlib.ExitStack() as stack:
            if scopes is not None:
                stack.enter_context(scopes())
            linen_scopes = _linen_class_scopes() if cfg.modules else None
            if linen_scopes is not None:
                stack.enter_context(linen_scopes)
            return f(*a, **k)

    with _jax_compat.user_intent_hooks():
        closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(*dyn)
    ctx = _Context(cfg.compute_dtype, cfg.rules, cfg.unknown_higher_order, cfg.modules)
    with jax.named_scope(_AUTOCAST_SCOPE):
        outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, dyn, ctx)
        final = []
        for x, shape in zip(outs, jax.tree_util.tree_leaves(out_shape), strict=True):
            want = shape.dtype
            if _is_float(want) and cfg.output_dtype is not None:
                want = cfg.output_dtype
            if _is_float(x.dtype) and x.dtype != want:
                x = ctx.cast(x, want)
            final.append(x)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), final)


def _linen_class_scopes() -> Any:
    """A context naming every linen module method call `[Class]` (for `modules=`).

    Linen puts each module call under a ``jax.named_scope`` of the module's
    name only, so an explicitly named module (``nn.LayerNorm(name="ln")``)
    would not show its class; this interceptor adds it inside that scope. None
    when flax.linen is not imported (then there are no linen modules).
    """
    linen = sys.modules.get("flax.linen")
    if linen is None or not hasattr(linen, "intercept_methods"):
        return None

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        with jax.named_scope(f"[{type(context.module).__name__}]"):
            return next_fun(*args, **kwargs)

    return linen.intercept_methods(interceptor)


def _nnx_scopes(nnx: Any, roots: Sequence[Any]) -> Callable[[], Any]:
    """A context that names every nnx submodule call `path[Class]` (for `modules=`)."""

    @contextlib.contextmanager
    def scopes() -> Any:
        names: dict[int, str] = {}
        classes: dict[type, Any] = {}
        for root in roots:
            for path, node in nnx.iter_graph(root):
                if isinstance(node, nnx.Module) and id(node) not in names:
                    names[id(node)] = "/".join(str(p) for p in path)
                    classes.setdefault(type(node), None)
        for cls in list(classes):
            original = cls.__dict__.get("__call__")
            if original is None:
                del classes[cls]
                continue
            classes[cls] = original

            def call(self: Any, *a: Any, __original: Any = original, **k: Any) -> Any:
                # A module rebuilt inside an nnx transform (nnx.scan, nnx.vmap)
                # is a new object: named by its class only.
                path = names.get(id(self), "")
                with jax.named_scope(f"{path}[{type(self).__name__}]"):
                    return __original(self, *a, **k)

            cls.__call__ = call
        try:
            yield
        finally:
            for cls, original in classes.items():
                cls.__call__ = original

    return scopes


def _make_wrapper(f: Callable[..., Any], cfg: _Config) -> Callable[..., Any]:
    cache: dict[Any, Callable[..., Any]] = {}
    linen_lifted: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        nnx = _nnx()
        is_node = nnx.graph.is_graph_node if nnx is not None else (lambda x: False)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
        node_idx = [i for i, x in enumerate(leaves) if is_node(x)]
        fn = f
        self_node = None
        if is_node(f):
            self_node = f
        elif getattr(f, "__self__", None) is not None and is_node(f.__self__):
            self_node = f.__self__
        if not node_idx and self_node is None:
            dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
            dyn = [leaves[i] for i in dynamic]
            return _dispatch(fn, leaves, treedef, dynamic, dyn)
        return _call_nnx(nnx, leaves, treedef, node_idx, self_node)

    def _dispatch(
        fn: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[int], dyn: list[Any]
    ) -> Any:
        if any(isinstance(x, jax.core.Tracer) for x in dyn):
            return _run(fn, cfg, leaves, treedef, dynamic, dyn)
        # Eager call: one jitted program per call signature (jit caches per
        # shapes and dtypes), instead of re-tracing `f` op by op every call.
        static = tuple(x for i, x in enumerate(leaves) if i not in set(dynamic))
        try:
            key = (treedef, tuple(dynamic), static)
            hash(key)
        except TypeError:
            return _run(fn, cfg, leaves, treedef, dynamic, dyn)
        jitted = cache.get(key)
        if jitted is None:
            template = list(leaves)
            for i in dynamic:
                template[i] = None

            def flat(*vals: Any) -> Any:
                return _run(fn, cfg, template, treedef, dynamic, vals)

            jitted = cache[key] = jax.jit(flat)
            if len(cache) > 64:
                cache.pop(next(iter(cache)))
        return jitted(*dyn)

    def _call_nnx(
        nnx: Any, leaves: list[Any], treedef: Any, node_idx: list[int], self_node: Any
    ) -> Any:
        # nnx modules are split into a graph definition and a state pytree;
        # the state is traced like any other input and the updated state
        # (BatchStat, RNG counts, ...) is written back after the call, as
        # nnx.jit does.
        nodes = tuple(leaves[i] for i in node_idx) + ((self_node,) if self_node is not None else ())
        graphdef, state = nnx.split(nodes)
        state_leaves, state_def = jax.tree_util.tree_flatten(state)
        if len(state_leaves) != len(
            jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        ):
            raise NotImplementedError("autocast: nnx Variables with several array leaves")
        rest = [i for i, x in enumerate(leaves) if i not in set(node_idx) and _is_dynamic(x)]
        static_leaves = list(leaves)
        for i in node_idx:
            static_leaves[i] = None
        nstate = len(state_leaves)
        method = f.__func__ if self_node is not None and self_node is not f else None

        def pure(*vals: Any) -> Any:
            merged = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, vals[:nstate]))
            full = list(static_leaves)
            for i, x in zip(node_idx, merged, strict=False):
                full[i] = x
            for i, x in zip(rest, vals[nstate:], strict=True):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            target = f
            if self_node is not None:
                target = merged[-1] if method is None else functools.partial(method, merged[-1])
            names = _nnx_scopes(nnx, merged) if cfg.modules else contextlib.nullcontext
            with names():
                out = target(*a, **k)
            new_leaves = jax.tree_util.tree_leaves(nnx.state(merged))
            # Only the state the call changed comes back (and is written back):
            # unchanged parameters must not be written from inside a trace.
            changed = {
                i: y for i, (x, y) in enumerate(zip(vals[:nstate], new_leaves, strict=True))
                if y is not x
            }  # fmt: skip
            return out, changed

        flat_args = [*state_leaves, *(leaves[i] for i in rest)]
        p_leaves, p_def = jax.tree_util.tree_flatten((tuple(flat_args), {}))
        out, changed = _dispatch(pure, p_leaves, p_def, list(range(len(p_leaves))), p_leaves)
        if not changed:
            return out
        variables = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if all(hasattr(v, "set_value") for v in variables):
            for i, value in changed.items():
                variables[i].set_value(value)
        else:  # flax < 0.11: the split state holds copies (VariableState), not Variables
            new_leaves = [changed.get(i, x) for i, x in enumerate(state_leaves)]
            nnx.update(nodes, jax.tree_util.tree_unflatten(state_def, new_leaves))
        return out

    def linen_call(*args: Any, **kwargs: Any) -> Any:
        if not linen_lifted:
            from flax.core import lift
            from flax.linen import transforms as nn_transforms

            def core(fn: Callable[..., Any]) -> Callable[..., Any]:
                def inner(
                    scope_fn: Any,
                    repack_fn: Any,
                    variable_groups: Any,
                    rng_groups: Any,
                    *a: Any,
                    **k: Any,
                ) -> Any:
                    def pure(variable_groups: Any, rng_groups: Any, a: Any, k: Any) -> Any:
                        scope = scope_fn(variable_groups, rng_groups)
                        y = fn(scope, *a, **k)
                        return y, repack_fn(scope)

                    return _make_wrapper(pure, cfg)(variable_groups, rng_groups, a, k)

                return lift.pack(
                    inner, (True,), (True,), (True,), name="autocast", enable_kwargs=True
                )

            linen_lifted.append(nn_transforms.lift_transform(core, f))
        return linen_lifted[0](*args, **kwargs)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args and _is_bound_linen(args[0]) and not _is_bound_linen(f):
            # The decorator form on a linen method: lift through flax so that
            # parameters, collections and RNGs cross the trace (init and apply).
            return linen_call(*args, **kwargs)
        return call(*args, **kwargs)

    return wrapper


def autocast(
    f: Callable[..., Any] | None = None,
    dtype: Any = None,
    *,
    policy: Policy | str | None = None,
    enabled: bool = True,
    rules: Mapping[Any, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    unknown_higher_order: str = "warn",
) -> Callable[..., Any]:
    """Runs `f` in mixed precision, choosing each operation's dtype by op class.

    Like ``torch.autocast``: matrix products and convolutions run in `dtype`;
    numerically sensitive ops (exp, log, division, sums, softmax, norm
    statistics, losses, and the elementwise steps that feed them) in float32;
    everything else follows its inputs, so the activations between two matmuls
    stay in `dtype` (a float32 parameter meeting one, like a Dense bias, is cast
    down). An explicit ``x.astype(jnp.float32)`` in `f` is kept: the ops after
    it run in float32 until a matmul. Parameters stay in their own dtype and
    outputs come back in the dtypes `f` returns without autocast (or the
    policy's ``output_dtype``), so ``autocast(f)`` is a drop-in for `f`. It
    composes with ``jit``, ``grad`` (backward ops run in the dtype of their
    forward ops), ``vmap``, control flow, ``remat``, custom derivatives, Flax
    linen (also as a decorator on a ``@nn.compact`` method) and nnx modules
    (state updates are written back). Eager calls are compiled once per
    input signature.

    Arrays among the arguments are traced; every other argument (Python
    scalars, strings, modules) is fixed at trace time, like a static argument.

    Args:
      f: the function to transform, e.g. a Flax ``model.apply``, an nnx module
        or a linen method. Without it, returns a decorator.
      dtype: the lower-precision dtype (``jnp.float16`` or ``jnp.bfloat16``).
        Defaults to float16 (bfloat16 on TPU).
      policy: a :class:`jaxamp.Policy` (or policy string) instead of `dtype`:
        its ``compute_dtype`` is the lower-precision dtype and floating
        outputs are cast to its ``output_dtype``.
      enabled: if False, return `f` itself.
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
        covers its submodules. Modules that ``nnx.scan`` / ``nnx.vmap``
        rebuild are matched by class only.
      unknown_higher_order: what to do with a primitive that carries a jaxpr
        but is not in the table: ``"warn"`` (default) or ``"as_written"`` run
        it in its original dtypes, ``"error"`` raises.

    Returns:
      A function with the signature of `f`.

    Raises:
      TypeError: if `f` is not callable.
      ValueError: if `dtype` is not floating, both `dtype` and `policy` are
        given, or a rule names an unknown primitive or op class.

    Example:
      >>> model = flax.linen.Dense(16)
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> y = jaxamp.autocast(model.apply, dtype=jnp.float16)(params, jnp.ones((2, 8)))
      >>> y.dtype  # the matmul ran in float16; the output keeps f's dtype
      dtype('float32')
    """
    if f is None:
        return functools.partial(
            autocast, dtype=dtype, policy=policy, enabled=enabled, rules=rules,
            modules=modules, unknown_higher_order=unknown_higher_order,
        )  # fmt: skip
    if not callable(f):
        raise TypeError(f"autocast: f must be callable, got {type(f).__name__}")
    compute_dtype, output_dtype = _resolve_dtype(dtype, policy)
    resolved_rules = {**DEFAULT_RULES, **_resolve_rules(rules)}
    resolved_modules = _resolve_modules(modules)
    if unknown_higher_order not in ("warn", "as_written", "error"):
        raise ValueError(
            "autocast: unknown_higher_order must be 'warn', 'as_written' or 'error', "
            f"got {unknown_higher_order!r}"
        )
    if not enabled:
        return f
    cfg = _Config(
        compute_dtype,
        output_dtype,
        MappingProxyType(resolved_rules),
        resolved_modules,
        unknown_higher_order,
    )
    return _make_wrapper(f, cfg)


def full_precision(g: Callable[..., Any]) -> Callable[..., Any]:
    """Marks `g` as a region that runs in full precision inside autocast.

    PyTorch's ``custom_fwd(cast_inputs=torch.float32)`` and
    ``autocast(enabled=False)``: `g` gets its inputs in the dtypes it has
    without autocast (float32 for a float32 model) and every operation of `g`,
    forward and backward, runs as written. An ``autocast`` nested inside `g`
    switches lower precision back on for its own function. Outside autocast,
    ``full_precision(g)`` behaves exactly like `g`.

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
