"""One FP8 matrix product with current scaling, forward and backward: ``fp8_dot_general``.

Forward: both operands scaled by ``fp8 max / amax`` of this call's values and
rounded to float8_e4m3fn; backward: the incoming gradient scaled the same way
and rounded to float8_e5m2 (two more exponent bits, one less mantissa bit:
gradients span a wider range); dgrad and wgrad are each one FP8 product.

Each product is emitted in the form XLA's GPU GEMM rewriter
(``xla/service/gpu/transforms/gemm_rewriter.cc``) folds into one cuBLASLt FP8
call. Tensorwise, every operand of the ``dot`` is ``convert(q) *
broadcast(inv)``, the f8 array dequantized to the product's dtype
(``MatchFp8Param`` takes the f8 array as the call's operand and the scalar
``inv`` as its scale), and the ``dot`` produces the output dtype directly: no
pass after the call. Rowwise scales are vectors, which the rewriter does not
fold (``CreateF8CustomCall`` accepts scalar scales only), so there the f8
operands enter the ``dot`` themselves and the per-row and per-column factors
multiply its float32 result. docs/fp8.md gives the rewriter's conditions.

Tensorwise, the f8 operands and their scales are the residuals: the weight is
quantized once per step for the forward product and the dgrad. Rowwise, the
dgrad contracts the weight's other axis, so it needs scales along that axis:
the weight is quantized again.

Nothing here is stateful: the scales are recomputed from each call's operands
(current scaling), so there is nothing to checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils import jax_compat

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32 = np.dtype(np.float32)

DotDims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class Gemm:
    """The static part of one FP8 product: a ``dot_general``'s dimension numbers,
    precision and output sharding, the scaling, and the operand / output dtypes."""

    dims: DotDims
    rowwise: bool
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    precision: Any = None
    out_sharding: Any = None


def _floor(dtype: np.dtype) -> float:
    # The smallest amax given its own scale: fmax / floor stays a finite float32
    # (2**126), so an all-zero operand gets a finite scale and quantizes to zeros.
    return float(jnp.finfo(dtype).max) * 2.0**-126


def manual_axes() -> tuple[str, ...]:
    """The mesh axes a ``shard_map`` body being traced is manual over (else none)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    types = getattr(mesh, "axis_types", None)
    if not types:
        return ()
    manual = getattr(jax.sharding.AxisType, "Manual", None)
    return tuple(n for n, t in zip(mesh.axis_names, types, strict=True) if t == manual)


def quantize(
    x: Any, dtype: np.dtype, reduce_axes: Sequence[int] | None, inv_dtype: np.dtype = F32
) -> tuple[Any, Any]:
    """``(q, inv)``: `x` scaled into `dtype`'s range and rounded, and the factor
    that undoes the scale (``x ~ q * inv``), in `inv_dtype`.

    `x` is divided by `inv` as it is rounded to `inv_dtype`, so dequantizing
    with it (``dequantize``) undoes exactly the scale that was applied.

    `reduce_axes` None is tensorwise (one scale); otherwise the amax is taken
    over those axes (kept as size 1), one scale per remaining index. A
    tensorwise amax inside ``shard_map`` is the maximum over every device
    (``pmax`` over the manual axes: one scalar collective), so every device
    scales with the amax of the whole array, as one device would. Under
    ``jit`` on a mesh the reduction is over the global array already: XLA's
    partitioner inserts the all-reduce. An inf or NaN in `x` makes the amax
    inf or NaN and the product NaN: the overflow stays visible.
    """
    fmax = float(jnp.finfo(dtype).max)
    x32 = x.astype(F32)
    axes = tuple(range(x.ndim)) if reduce_axes is None else tuple(reduce_axes)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=reduce_axes is not None)
    if reduce_axes is None:
        names = manual_axes()
        if names:
            amax = lax.pmax(amax, names)
    amax = jnp.maximum(amax, _floor(dtype))
    inv = (amax / fmax).astype(inv_dtype)
    scaled = x32 / inv.astype(F32)
    # |scaled| <= fmax up to the rounding of `inv` (a bfloat16 one: 2**-8, less
    # than half an e4m3 / e5m2 step at fmax, so the clamp changes no rounded
    # value); e4m3fn has no inf and converts anything past fmax + half an ulp
    # to NaN, so clamp first.
    q = _to_fp8(lax.clamp(np.float32(-fmax), scaled, np.float32(fmax)), dtype)
    return q, inv


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _to_fp8(x: Any, dtype: np.dtype) -> Any:
    """``x.astype(dtype)``, refusing forward-mode differentiation.

    Forward mode reaches an FP8 cast only through the backward rule (``jax.jvp``
    of ``jax.grad``, ``jax.hessian``, grad of grad): JAX's own jvp of the cast
    rounds the tangent to e4m3fn unscaled, and e4m3fn, which has no inf, turns
    every tangent past 448 into NaN; a Hessian of all NaN, silently."""
    return x.astype(dtype)


@_to_fp8.defjvp
def _to_fp8_jvp(dtype: np.dtype, primals: Any, tangents: Any) -> Any:
    raise TypeError(FORWARD_MODE)


FORWARD_MODE = (
    "jaxamp.autocast(..., fp8=...): an FP8 product cannot be differentiated in forward "
    "mode or twice (jax.jvp, jax.linearize, jax.hessian, jax.jacfwd, grad of grad): "
    "its scales and e4m3/e5m2 roundings have no useful derivative. Differentiate an "
    "autocast of the same function without fp8= (dtype=jnp.bfloat16) for Hessians "
    "and forward-mode derivatives."
)


def _free(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    return [i for i in range(ndim) if i not in contract and i not in batch]


def _out_factors(
    inv_l: Any, inv_r: Any, nl: int, nr: int, dims: DotDims, rowwise: bool
) -> tuple[Any, Any]:
    """The dequantization factors of a product's float32 result (rank ``nb + fl +
    fr``), the lhs's and the rhs's, each broadcastable to it.

    They are applied one after the other, never multiplied together first: their
    product underflows float32 for operands whose amaxes multiply to below
    ~1e-33 (tiny cotangents), and overflows (inf times a zero sum: NaN) for
    amaxes near 1e25, where the result itself is a normal number."""
    if not rowwise:
        return inv_l, inv_r  # scalars: a multiply by a broadcast scalar each
    (lc, rc), (lb, rb) = dims
    lf, rf = _free(nl, lc, lb), _free(nr, rc, rb)
    # Per-row factors of the lhs in the result's order (batch, lhs free), then a
    # 1 for each rhs free dim; per-column factors of the rhs likewise.
    l2 = jnp.transpose(jnp.squeeze(inv_l, axis=tuple(lc)), _order(nl, lc, list(lb) + lf))
    r2 = jnp.transpose(jnp.squeeze(inv_r, axis=tuple(rc)), _order(nr, rc, list(rb) + rf))
    l2 = l2.reshape(l2.shape + (1,) * len(rf))
    r2 = r2.reshape(r2.shape[: len(rb)] + (1,) * len(lf) + r2.shape[len(rb) :])
    return l2, r2


def _order(ndim: int, dropped: Sequence[int], want: Sequence[int]) -> list[int]:
    """The permutation of an array whose axes `dropped` were squeezed away that
    puts its axes in the order `want` (original axis numbers)."""
    kept = [i for i in range(ndim) if i not in dropped]
    return [kept.index(a) for a in want]


def _dequantized_dtype(out_dtype: np.dtype) -> np.dtype:
    """The dtype a tensorwise product's operands are dequantized to: the product's
    own where it has float32's exponent range (bfloat16, float32), else float32.
    A float16 scale ``amax / fmax`` of a small gradient is below float16's
    smallest subnormal: the operand would dequantize to zeros."""
    out_dtype = np.dtype(out_dtype)
    return out_dtype if out_dtype in (np.dtype(jnp.bfloat16), F32) else F32


def dequantize(q: Any, inv: Any, dtype: np.dtype) -> Any:
    """``convert(q) * broadcast(inv)`` in `dtype`: the operand form XLA's GPU GEMM
    rewriter folds into a cuBLASLt FP8 call, `inv` becoming its scale operand."""
    return q.astype(dtype) * inv.astype(dtype)


def scaled_dot(
    ql: Any,
    inv_l: Any,
    qr: Any,
    inv_r: Any,
    dims: DotDims,
    gemm: Gemm,
    out_sharding: Any,
    out_dtype: np.dtype,
) -> Any:
    """The FP8 product of two quantized operands, dequantized, in `out_dtype`.

    Tensorwise, each operand is dequantized before the ``dot`` (``dequantize``):
    its value is the operand's own, so the product has the range of the
    unquantized one. Rowwise, the f8 operands enter the ``dot`` themselves and
    the per-row and per-column factors multiply its float32 result
    (``_out_factors``): XLA folds only scalar scales into the call.
    """
    kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
    if not gemm.rowwise:
        dtype = _dequantized_dtype(out_dtype)
        out = lax.dot_general(
            dequantize(ql, inv_l, dtype),
            dequantize(qr, inv_r, dtype),
            dims,
            precision=gemm.precision,
            preferred_element_type=dtype,
            **kwargs,
        )
        return out.astype(out_dtype)
    acc = lax.dot_general(
        ql, qr, dims, precision=gemm.precision, preferred_element_type=F32, **kwargs
    )
    fl, fr = _out_factors(inv_l, inv_r, ql.ndim, qr.ndim, dims, gemm.rowwise)
    return ((acc * fl) * fr).astype(out_dtype)


def scale_dtype(gemm: Gemm) -> np.dtype:
    """The dtype of a product's ``inv`` factors: tensorwise, its dequantization
    dtype (the operands are dequantized in it); rowwise, float32 (the factors
    multiply the float32 result)."""
    return F32 if gemm.rowwise else _dequantized_dtype(gemm.out_dtype)


def _quantize_for(x: Any, dtype: np.dtype, contract: Sequence[int], gemm: Gemm) -> Any:
    return quantize(x, dtype, contract if gemm.rowwise else None, scale_dtype(gemm))


# --------------------------------------------------------------------------
# The transposed products of the backward pass.
# --------------------------------------------------------------------------


def dgrad_dims(dims: DotDims, nl: int, nr: int) -> tuple[DotDims, list[int]]:
    """``(dims, perm)``: d lhs = ``transpose(dot_general(g, rhs, dims), perm)``.

    The result ``g`` has axes (batch, lhs free, rhs free). Contracting ``g``'s
    rhs-free axes with the rhs's free axes, batched as in the forward, leaves
    (batch, lhs free, rhs contracting in ascending order); each lhs contracting
    axis is paired with its rhs contracting axis, hence ``perm``.
    """
    (lc, rc), (lb, rb) = dims
    lf, rf = _free(nl, lc, lb), _free(nr, rc, rb)
    nb = len(lb)
    g_rf = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
    new = ((g_rf, tuple(rf)), (tuple(range(nb)), tuple(rb)))
    ranked = sorted(rc)
    perm = [0] * nl
    for i, a in enumerate(lb):
        perm[a] = i
    for j, a in enumerate(lf):
        perm[a] = nb + j
    for a, b in zip(lc, rc, strict=True):
        perm[a] = nb + len(lf) + ranked.index(b)
    return new, perm


def wgrad_dims(dims: DotDims, nl: int, nr: int) -> tuple[DotDims, list[int]]:
    """``(dims, perm)``: d rhs = ``transpose(dot_general(lhs, g, dims), perm)``.

    Contracting the lhs's free axes with ``g``'s lhs-free axes, batched as in
    the forward, leaves (batch, lhs contracting ascending, rhs free).
    """
    (lc, rc), (lb, rb) = dims
    lf, rf = _free(nl, lc, lb), _free(nr, rc, rb)
    nb = len(lb)
    g_lf = tuple(range(nb, nb + len(lf)))
    new = ((tuple(lf), g_lf), (tuple(lb), tuple(range(nb))))
    ranked = sorted(lc)
    perm = [0] * nr
    for i, b in enumerate(rb):
        perm[b] = i
    for a, b in zip(lc, rc, strict=True):
        perm[b] = nb + ranked.index(a)
    for j, b in enumerate(rf):
        perm[b] = nb + len(lc) + j
    return new, perm


def _explicit_mesh(x: Any) -> Any:
    sharding = getattr(jax_compat.aval_of(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if mesh is None or not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return mesh


def _sharding_before(target: Any, perm: list[int], *operands: Any) -> Any:
    """The out_sharding that makes ``transpose(result, perm)`` sharded as `target`
    on an Explicit mesh (None elsewhere: there XLA's partitioner chooses).

    Even a replicated target needs one: JAX refuses a product whose contracted
    dimensions are sharded (a wgrad over the batch) without it. A target with
    no mesh in its type (an array passed in unsharded) is replicated over the
    operands' mesh.
    """
    mesh = _explicit_mesh(target)
    if mesh is None:
        mesh = next((m for m in map(_explicit_mesh, operands) if m is not None), None)
        if mesh is None:
            return None
        spec: tuple[Any, ...] = (None,) * len(perm)
    else:
        spec = tuple(jax_compat.aval_of(target).sharding.spec)
    spec = spec + (None,) * (len(perm) - len(spec))
    before = [None] * len(perm)
    for a, p in enumerate(perm):
        before[p] = spec[a]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*before))


# --------------------------------------------------------------------------
# The custom VJP.
# --------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_dot_general(lhs: Any, rhs: Any, gemm: Gemm) -> Any:
    """``lax.dot_general(lhs, rhs, gemm.dims)`` as FP8 products, forward and backward."""
    return _fwd(lhs, rhs, gemm)[0]


def _fwd(lhs: Any, rhs: Any, gemm: Gemm) -> tuple[Any, tuple[Any, ...]]:
    (lc, rc), _ = gemm.dims
    ql, il = _quantize_for(lhs, E4M3, lc, gemm)
    qr, ir = _quantize_for(rhs, E4M3, rc, gemm)
    out = scaled_dot(ql, il, qr, ir, gemm.dims, gemm, gemm.out_sharding, gemm.out_dtype)
    # Tensorwise, the backward products reuse the FP8 operands and their scales
    # (one byte per element kept, not two). Rowwise, each backward product
    # contracts other axes, so its scales differ: keep the operands themselves.
    res = (lhs, rhs) if gemm.rowwise else (ql, il, qr, ir)
    return out, res


def _bwd(gemm: Gemm, res: tuple[Any, ...], g: Any) -> tuple[Any, Any]:
    if gemm.rowwise:
        lhs, rhs = res
        nl, nr = lhs.ndim, rhs.ndim
    else:
        ql, il, qr, ir = res
        nl, nr = ql.ndim, qr.ndim
        lhs, rhs = ql, qr  # for their shardings
        qg, ig = _quantize_for(g, E5M2, (), gemm)
    d_dims, d_perm = dgrad_dims(gemm.dims, nl, nr)
    w_dims, w_perm = wgrad_dims(gemm.dims, nl, nr)
    if gemm.rowwise:
        qg, ig = quantize(g, E5M2, d_dims[0][0])
        qr, ir = quantize(rhs, E4M3, d_dims[0][1])
    dl = scaled_dot(
        qg, ig, qr, ir, d_dims, gemm, _sharding_before(lhs, d_perm, qg, qr), gemm.lhs_dtype
    )
    if gemm.rowwise:
        ql, il = quantize(lhs, E4M3, w_dims[0][0])
        qg, ig = quantize(g, E5M2, w_dims[0][1])
    dr = scaled_dot(
        ql, il, qg, ig, w_dims, gemm, _sharding_before(rhs, w_perm, ql, qg), gemm.rhs_dtype
    )
    dl = lax.transpose(dl, d_perm)
    dr = lax.transpose(dr, w_perm)
    return dl, dr


fp8_dot_general.defvjp(_fwd, _bwd)


def mnk(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dims: DotDims) -> tuple[int, ...]:
    """The product's M, N and K: the products of the lhs free, rhs free and
    contracting dimensions."""
    (lc, rc), (lb, rb) = dims
    m = int(np.prod([lhs_shape[i] for i in _free(len(lhs_shape), lc, lb)]))
    n = int(np.prod([rhs_shape[i] for i in _free(len(rhs_shape), rc, rb)]))
    k = int(np.prod([lhs_shape[i] for i in lc]))
    return m, n, k


def eligible(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dims: DotDims) -> bool:
    """Whether the product's M, N and K are all multiples of 16 (see ``_fp8``: XLA
    pads them to 16 for the cuBLASLt FP8 kernel, a copy that eats the gain)."""
    return all(d > 0 and d % 16 == 0 for d in mnk(lhs_shape, rhs_shape, dims))
