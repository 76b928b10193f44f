"""The measured FP8 product: ``fp8_dot_general`` that also returns the statistics of its
FP8 casts, forward as an output and backward as the cotangent of a zero "probe" input
(``_fp8_health`` says why they leave that way)."""

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
from jaxamp.casting._fp8 import _fp8_gemm

#: The statistics of one cast, in the order of its row.
STATS = ("amax", "saturated", "flushed")
_F32 = np.dtype(np.float32)


def cast_stats(
    x: Any, dtype: np.dtype, reduce_axes: Sequence[int] | None, inv_dtype: np.dtype
) -> Any:
    """``[amax, saturated, flushed]`` (float32) of `x`'s cast to `dtype` as
    ``_fp8_gemm.quantize`` makes it with `reduce_axes` and `inv_dtype`.

    ``flushed`` compares the FP8 values themselves with the float32 ones: the
    elements that are finite and nonzero before the cast and zero after it.
    ``saturated`` counts the inf and NaN elements: under current scaling a
    finite element never exceeds the FP8 maximum (the scale maps the amax to
    it), so non-finite input is the only way a cast overflows. The
    quantization repeats the product's own, operand for operand, its scale
    rounded to the same `inv_dtype` (the rounding moves the flush threshold):
    XLA computes it once (CSE)."""
    x32 = x.astype(_F32)
    q, _ = _fp8_gemm.quantize(x, dtype, reduce_axes, inv_dtype)
    finite = jnp.isfinite(x32)
    flushed = finite & (x32 != 0) & (q.astype(_F32) == 0)
    # One variadic reduction reads the operand once for all its statistics
    # (separate reductions would read it once each; benchmarks/fp8_health_cost.py),
    # except a tensorwise amax: quantize's own reduction, which XLA computes once.
    counts = ((~finite).astype(jnp.int32), flushed.astype(jnp.int32))
    zero = np.int32(0)
    if reduce_axes is None:
        amax = jnp.max(jnp.abs(x32))
        saturated, flushed = lax.reduce(
            counts, (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim))
        )
    else:
        amax, saturated, flushed = lax.reduce(
            (jnp.abs(x32), *counts),
            (np.float32(-np.inf), zero, zero),
            lambda a, b: (lax.max(a[0], b[0]), a[1] + b[1], a[2] + b[2]),
            tuple(range(x.ndim)),
        )
    n = np.float32(max(x.size, 1))
    return jnp.stack([amax, saturated.astype(_F32) / n, flushed.astype(_F32) / n])


@dataclasses.dataclass(frozen=True)
class Static:
    """A product's static part with its operands' ranks (the backward's axes)."""

    gemm: _fp8_gemm.Gemm
    nl: int
    nr: int

    def reduce_axes(self) -> tuple[Any, ...]:
        """The amax axes of the forward's lhs and rhs, the gradient's casts for the
        dgrad and the wgrad, and (rowwise) the rhs cast again for the dgrad and the
        lhs for the wgrad (None: tensorwise, which casts each once)."""
        if not self.gemm.rowwise:
            return None, None, None, None, None, None
        (lc, rc), _ = self.gemm.dims
        d_dims, _ = _fp8_gemm.dgrad_dims(self.gemm.dims, self.nl, self.nr)
        w_dims, _ = _fp8_gemm.wgrad_dims(self.gemm.dims, self.nl, self.nr)
        return lc, rc, d_dims[0][0], w_dims[0][1], d_dims[0][1], w_dims[0][0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def measured_dot(lhs: Any, rhs: Any, probe: Any, static: Static) -> tuple[Any, Any]:
    """``(fp8_dot_general(lhs, rhs), forward statistics)``; the backward statistics
    are `probe`'s cotangent (`probe` itself is never read)."""
    return _measured_fwd(lhs, rhs, probe, static)[0]


def _measured_fwd(lhs: Any, rhs: Any, probe: Any, static: Static) -> tuple[tuple[Any, Any], Any]:
    # The product's own forward and backward rule, whatever they are.
    out, vjp = jax.vjp(functools.partial(_fp8_gemm.fp8_dot_general, gemm=static.gemm), lhs, rhs)
    al, ar, _, _, ar_dgrad, al_wgrad = static.reduce_axes()
    inv = _fp8_gemm.scale_dtype(static.gemm)
    rows = [cast_stats(lhs, _fp8_gemm.E4M3, al, inv), cast_stats(rhs, _fp8_gemm.E4M3, ar, inv)]
    if static.gemm.rowwise:
        # Rowwise, each backward product contracts other axes than the forward: it
        # casts the forward's operands to e4m3 again, with their own scales.
        # (Measured in the backward pass instead, beside those quantizations, the
        # step's bytes are the same on XLA:CPU and its HLO 11 % longer.)
        rows += [
            cast_stats(rhs, _fp8_gemm.E4M3, ar_dgrad, inv),
            cast_stats(lhs, _fp8_gemm.E4M3, al_wgrad, inv),
        ]
    return (out, jnp.stack(rows)), (vjp, probe)


def _measured_bwd(
    static: Static, res: tuple[Any, Any], cts: tuple[Any, Any]
) -> tuple[Any, Any, Any]:
    vjp, probe = res
    g, _ = cts
    _, _, ad, aw, _, _ = static.reduce_axes()
    inv = _fp8_gemm.scale_dtype(static.gemm)
    dgrad = cast_stats(g, _fp8_gemm.E5M2, ad, inv)
    # Tensorwise both backward products read the one e5m2 cast of the gradient.
    wgrad = cast_stats(g, _fp8_gemm.E5M2, aw, inv) if static.gemm.rowwise else dgrad
    dl, dr = vjp(g)
    # Inside shard_map the probe varies over every manual axis (``fp8_health``), the
    # statistics over those the gradient does: the cotangent must have the probe's type.
    return dl, dr, jax_compat.like_varying(jnp.stack([dgrad, wgrad]), probe)


measured_dot.defvjp(_measured_fwd, _measured_bwd)
