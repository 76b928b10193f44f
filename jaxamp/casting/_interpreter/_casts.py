"""How autocast casts a value and binds an op.

A cast is a plain ``convert_element_type``: a finite value beyond the target's
range becomes inf, as float16 arithmetic makes it, so the loss scale and
``find_overflow`` see it. Only trace-time constants (sentinels such as
``finfo(float32).min``) are cast saturating (see ``cast_jit``). Pure ops are
bound through one cached, inlined ``jit`` per (primitive, params) (see
``_op_jit``); a pointwise region through one cached ``jax.checkpoint`` per
structure (see ``region_fn``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Jaxpr, Literal

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float_dtype, narrows
from jaxamp.casting._rules import _rules
from jaxamp.casting._rules._rules import FLOAT32_DTYPE

if TYPE_CHECKING:
    from jaxamp.casting._interpreter._analysis import Region
    from jaxamp.casting._interpreter._context import Context


SATURATING_CAST_NAME = "jaxamp_saturating_cast"
#: The primitives of a saturating cast's body, in order (how a traced region
#: recognises one: ``_loops``).
SATURATING_CAST_OPS = ["clamp", "abs", "eq", "select_n", "convert_element_type"]


@functools.lru_cache(maxsize=64)
def cast_jit(src: np.dtype, dst: np.dtype, saturate: bool = False) -> Callable[[Any], Any]:
    """``x -> x.astype(dst)``; with `saturate`, finite values beyond `dst`'s
    range become its largest finite value instead of inf.

    Why saturate a constant: a sentinel that float32 keeps finite (a mask
    fill of ``finfo(float32).min``, ``-1e9``) must not become inf in float16 or
    bfloat16 (a fully masked softmax row would then give NaN). Infinities and
    NaN pass unchanged. A run-time value is never clipped: clipped, it would
    be a wrong finite number that no overflow check sees. The derivative is
    the plain cast (a straight-through clip), so the backward pass keeps no
    mask. Bound as one inlined jit per dtype pair so grad linearizes it once.
    """
    if not (saturate and narrows(src, dst)):
        return jax.jit(lambda x: lax.convert_element_type(x, dst), inline=True)
    hi = float(jnp.finfo(dst).max)

    def saturate(x: Any) -> Any:
        clipped = lax.clamp(np.asarray(-hi, src), x, np.asarray(hi, src))
        inf = lax.eq(lax.abs(x), np.asarray(np.inf, src))
        return lax.convert_element_type(lax.select(inf, x, clipped), dst)

    saturate.__name__ = SATURATING_CAST_NAME
    cast = jax.custom_jvp(saturate)
    cast.defjvp(lambda p, t: (cast(p[0]), lax.convert_element_type(t[0], dst)))
    return jax.jit(cast, inline=True)


def cast(ctx: Context, x: Any, dtype: Any, const: bool = False) -> Any:
    """`x` cast to `dtype`, once per (value, dtype) at `ctx`'s tracing level; saturating
    for a trace-time constant (`const`), plain (inf beyond the range) otherwise."""
    dtype = np.dtype(dtype)
    saturate = const and ctx.position.saturate
    key = (id(x), dtype, saturate)
    hit = ctx.casts.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    src = np.dtype(x.dtype)
    y = cast_jit(src, dtype, saturate)(x)
    ctx.casts[key] = (x, y)
    if dtype.itemsize > src.itemsize:
        # An exact upcast: casting the result back down gives `x` again.
        for s in (False, True):
            ctx.casts[(id(y), src, s)] = (y, x)
    return y


def host_cast(value: Any, dtype: Any) -> Any:
    """A literal's cast on the host: a constant, so it saturates (``cast_jit``)."""
    v = np.asarray(value)
    if narrows(v.dtype, np.dtype(dtype)) and np.isfinite(v).all():
        hi = float(jnp.finfo(dtype).max)
        v = np.clip(v, -hi, hi)
    return np.asarray(v, dtype=dtype)[()]


def to_original(vals: list[Any], dtypes: list[Any], invars: list[Any], ctx: Context) -> list[Any]:
    """Casts floating values back to the dtypes the un-autocast program had."""
    out = []
    for x, cur, v in zip(vals, dtypes, invars, strict=True):
        want = v.aval.dtype
        if cur != want and is_float_dtype(cur) and is_float_dtype(want):
            x = host_cast(x, want) if isinstance(v, Literal) else cast(ctx, x, want)
        out.append(x)
    return out


def cast_all(xs: Sequence[Any], dtypes: Sequence[Any], ctx: Context) -> list[Any]:
    return [
        cast(ctx, x, d) if is_float_dtype(d) and is_float_dtype(x.dtype) and x.dtype != d else x
        for x, d in zip(xs, dtypes, strict=True)
    ]


# Primitives bound through `_op_jit`: pure, context-free ops (no effects, no
# axis names, no sharding), i.e. those the op table classifies plus a few
# common "follow" ones.
_JITTED_OPS: frozenset[str] = (
    _rules.LOWER_PRECISION_OPS
    | _rules.FLOAT32_OPS
    | _rules.ELEMENTWISE_OPS
    | _rules.WIDEST_OPS
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
    ops of identical layers are linearized once, not once per layer. ``inline``
    leaves the traced program exactly as a direct bind would.
    """
    params = dict(items)
    return jax.jit(lambda *args: prim.bind(*args, **params), inline=True)


def bind(eqn: Any, args: list[Any], params: Any = None, cached: bool = True) -> list[Any]:
    """Binds `eqn`'s primitive on `args`; pure ops through one cached jit each,
    unless not `cached` (a cached trace keeps the source info of its first use)."""
    prim = eqn.primitive
    params = eqn.params if params is None else params
    if cached and prim.name in _JITTED_OPS and not eqn.effects:
        try:
            fn = _op_jit(prim, tuple(sorted(params.items())))
        except TypeError:  # an unhashable param
            pass
        else:
            return jax_compat.outputs_as_list(prim, fn(*args))
    out = jax_compat.bind(prim, args, params)
    return jax_compat.outputs_as_list(prim, out)


def region_fn(
    steps: tuple[tuple[Any, tuple[tuple[str, Any], ...], tuple[tuple[Any, ...], ...]], ...],
    outputs: tuple[tuple[int, int], ...],
    target: np.dtype,
    prevent_cse: bool,
) -> Callable[..., list[Any]]:
    """A pointwise region as one ``jax.checkpoint``: ``(x, *extra) -> outputs``.

    `steps` are ``(primitive, params, inputs)``; an input is ``("x",)`` (the
    activation, cast up to `target`), ``("lit", value, dtype, bytes)``, ``("v", k, o)``
    (output `o` of step `k`) or ``("e", n)`` (the `n`-th extra, non-floating
    argument: a mask). `outputs` name the steps' outputs returned.

    Why checkpointed: every step runs in float32 (torch's type promotion after
    a float32-list op), and the backward pass would keep float32 copies of its
    intermediates (gelu's tanh and its product: two per MLP). Rematerialised
    from the float16 / bfloat16 activation instead, the region keeps that one
    input, as a fused activation kernel does. The forward values are the same.
    """
    try:
        return _region_fn(steps, outputs, target, prevent_cse)
    except TypeError:  # an unhashable param or literal: traced afresh
        return _make_region_fn(steps, outputs, target, prevent_cse)


@functools.lru_cache(maxsize=512)
def _region_fn(steps: Any, outputs: Any, target: np.dtype, prevent_cse: bool) -> Any:
    """One function per region structure: JAX caches the trace of a function
    object, so identical layers trace their gelu once (trace + compile)."""
    return _make_region_fn(steps, outputs, target, prevent_cse)


def _make_region_fn(steps: Any, outputs: Any, target: np.dtype, prevent_cse: bool) -> Any:
    def body(x: Any, *extra: Any) -> list[Any]:
        up = lax.convert_element_type(x, target)
        vals: list[list[Any]] = []

        def get(ref: tuple[Any, ...]) -> Any:
            if ref[0] == "x":
                return up
            if ref[0] == "lit":
                dtype = np.dtype(ref[2])
                return np.asarray(ref[1], target if is_float_dtype(dtype) else dtype)
            if ref[0] == "v":
                return vals[ref[1]][ref[2]]
            return extra[ref[1]]

        for prim, params, refs in steps:
            out = prim.bind(*[get(r) for r in refs], **dict(params))
            vals.append(list(out) if prim.multiple_results else [out])
        return [vals[k][o] for k, o in outputs]

    return jax.checkpoint(body, prevent_cse=prevent_cse)


def bind_region(
    jaxpr: Jaxpr, region: Region, read: Callable[[Any], Any], prevent_cse: bool
) -> list[Any]:
    """Binds `region` (``_analysis.pointwise_region``) as one checkpointed function
    of its activation (``region_fn``); `read` gives a variable's current value."""
    eqns = [jaxpr.eqns[j] for j in region.eqns]
    (x,) = [v for v in eqns[0].invars if not isinstance(v, Literal)]
    where = {v: (k, o) for k, e in enumerate(eqns) for o, v in enumerate(e.outvars)}
    extra: list[Any] = []
    steps = []
    for e in eqns:
        refs: list[tuple[Any, ...]] = []
        for v in e.invars:
            if isinstance(v, Literal):
                # Its bytes key the cache too: 0.0 == -0.0 (and 1 == 1.0) as
                # Python values, so the value alone would share a region.
                lit = np.asarray(v.val)
                refs.append(("lit", lit.tolist(), np.dtype(v.aval.dtype).str, lit.tobytes()))
            elif v is x:
                refs.append(("x",))
            elif v in where:
                refs.append(("v", *where[v]))
            else:
                if v not in extra:
                    extra.append(v)
                refs.append(("e", extra.index(v)))
        steps.append((e.primitive, tuple(sorted(e.params.items())), tuple(refs)))
    outputs = tuple(where[v] for v in region.outputs)
    low = read(x)
    target = _rules.promote(np.dtype(low.dtype), FLOAT32_DTYPE)
    return region_fn(tuple(steps), outputs, target, prevent_cse)(low, *map(read, extra))


def bind_opmath(eqn: Any, x: Any, low: np.dtype, ctx: Context, cached: bool) -> list[Any]:
    """`eqn` (one input) in float32 on the low-precision `x`, rounded once to `low`.

    Checkpointed from `x` (``region_fn``): the backward pass keeps `x`, not a
    float32 copy of the result. Not `cached` (``find_overflow``, which reads
    each op where it was written) the op is bound plainly: the same values.
    """
    x = x if x.dtype == low else cast(ctx, x, low)
    if not cached:
        up = cast(ctx, x, FLOAT32_DTYPE)
        return [cast(ctx, o, low) for o in bind(eqn, [up], cached=False)]
    step = (eqn.primitive, tuple(sorted(eqn.params.items())), (("x",),))
    outs = region_fn((step,), ((0, 0),), FLOAT32_DTYPE, not ctx.position.in_region)(x)
    return [cast(ctx, o, low) for o in outs]
