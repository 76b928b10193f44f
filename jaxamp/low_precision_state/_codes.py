"""The 8-bit block code: minifloats scaled by a power of two per block of a row.

A stored moment is a ``uint8`` code per element and one float32 scale per block of
``block_size`` consecutive elements along the last axis. Codes are minifloats (an
exponent and a mantissa field, with subnormals, and no inf or NaN): their precision is
relative, which a moment needs (Adam divides by ``sqrt(nu)`` element by element, so an
element 1000 times smaller than its block's largest needs its own digits, which a
linear code relative to the block's absmax would flush), and every code is a finite
value.

Two codes, chosen per block from its values:
- a block with a negative value: 1 sign bit, 4 exponent bits, 3 mantissa bits
  (``SIGNED``: largest / smallest nonzero = ``15 * 2**14``, about ``2**17.9``);
- a block of non-negative values (a second moment, always): 4 exponent bits and 4
  mantissa bits (``NONNEGATIVE``: half the relative step, ``2**18.9`` of range); a
  positive value below its smallest nonzero code is stored as that code, never 0: a
  second moment flushed to zero turns ``mu / (sqrt(nu) + eps)`` into ``mu / eps``.
The scale's sign says which (negative: non-negative code), so choosing costs no byte.

The scale is a power of two: it costs no precision (the code's steps are relative)
and uses the code's top binade whenever the block's largest value fits it. A block
whose values come back unchanged (a step skipped inside the wrapped optimizer, a
frozen leaf) keeps its codes and scale bit for bit (``requantize``): rounding them
again could move the block's largest value down a binade and so its scale.

Rounding is stochastic, and unbiased: each value goes to one of its two neighbouring
codes with the probability that makes its expectation exact, so a moment's slow
decay (``0.999 * nu`` moves ``nu`` by 0.1 %, far below a code's step) is kept in
expectation instead of rounded away. Rounding to nearest would lose every change
below half a step, for both moments alike: a second moment would neither decay nor,
from its start at 0, climb past the point where ``(1 - b2) * g**2`` is below half a
step of it, a small fraction of ``g**2``, so Adam's steps would come out several times
too large and stay so. Stochastic rounding's price is noise: a moment stored as a
code moves by ``d`` (far below the step ``s``) to the next code with probability
``d / s``, an error of variance below ``d * s``, and the moment keeps ``b`` of its
past errors each step, so they add up like an AR(1) process, to a variance below
``d * s / (1 - b**2)``. With ``d`` of order ``(1 - b) * nu`` that is a fraction of
the moment's value, but unbiased, and it averages out over the steps and elements an
update sums; rounding to nearest's error is a bias that does not. The non-negative
code's extra mantissa bit halves ``s`` for the second moment, where ``1 - b`` is
smallest and the carried noise largest (of 4 exponent bits and 4 of mantissa, 3 and 5
or 5 and 3, the first tracks a second moment best: fewer exponent bits clamp a
block's small values up to the smallest code, fewer mantissa bits add noise). A fast
first moment (``b1 = 0.9``: each step moves it by more than half a step) would lose
nothing to rounding to nearest and carry less noise, but the code does not know the
decay of the moment it stores, and a slow one (``b1 = 0.99``, an EMA of params)
would lose its decay: both codes round stochastically.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Code(NamedTuple):
    """A minifloat code: its field widths, whether it has a sign bit, and the smallest
    exponent (of its subnormals' step and its first normal binade)."""

    exponent_bits: int
    mantissa_bits: int
    signed: bool

    @property
    def emin(self) -> int:
        # The largest binade is [1, 2): the top exponent field maps to exponent 0.
        return 2 - 2**self.exponent_bits

    @property
    def largest(self) -> float:
        m = self.mantissa_bits
        return float((2 ** (m + 1) - 1) * 2.0**-m)

    @property
    def smallest(self) -> float:
        return float(2.0 ** (self.emin - self.mantissa_bits))


SIGNED = Code(exponent_bits=4, mantissa_bits=3, signed=True)
NONNEGATIVE = Code(exponent_bits=4, mantissa_bits=4, signed=False)


def _binade(a: jax.Array, code: Code) -> jax.Array:
    """The exponent of each magnitude's binade in ``code`` (``emin`` for its subnormals
    and for 0)."""
    _, e = jnp.frexp(a)  # a = f * 2**e, f in [0.5, 1)
    return jnp.where(a > 0, jnp.maximum(e - 1, code.emin), code.emin)


def encode(
    a: jax.Array, code: Code, draw: jax.Array, positive: jax.Array | None = None
) -> jax.Array:
    """int32 codes of magnitudes ``0 <= a <= code.largest``, rounded stochastically.

    ``draw``: uniform in [0, 1), one per element. ``positive``: where the value is
    positive (default ``a > 0``); the caller's, because a value far below its block's
    largest scales to a float32 subnormal, which backends flush to 0, and the
    non-negative code still stores it as its smallest code. A magnitude's code is
    ``a / step + (e - emin) * 2**m`` for its binade ``e`` and that binade's step
    ``2**(e - m)``: piecewise linear and increasing, so rounding ``a / step`` up across
    a binade's end lands on the next binade's first code.
    """
    m = code.mantissa_bits
    e = _binade(a, code)
    t = jnp.ldexp(a, m - e)  # exact: a power-of-two scaling
    whole = jnp.floor(t)
    up = (draw < t - whole).astype(jnp.int32)  # P(up) = the fraction, exactly
    c = whole.astype(jnp.int32) + up + (e - code.emin) * 2**m
    if not code.signed:
        c = jnp.where(a > 0 if positive is None else positive, jnp.maximum(c, 1), c)
    return c


def decode(c: jax.Array, code: Code) -> jax.Array:
    """float32 magnitudes of int32 codes (the inverse of ``encode`` on its grid)."""
    m = code.mantissa_bits
    above = jnp.maximum((c >> m) - 1, 0)  # binades above the first
    return jnp.ldexp((c - above * 2**m).astype(jnp.float32), code.emin + above - m)


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """``x`` as ``(..., n_blocks, size)``, its last axis zero-padded.

    A row shorter than a block is one block of its own length: the same block (the
    scales' shape and values do not change), where padding it to ``block_size`` would
    make every temporary ``block_size / n`` times the moment (a ``(n, 1)`` kernel).
    """
    n = x.shape[-1]
    size = min(block_size, n) or block_size
    pad = -n % size
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], (n + pad) // size, size)


def _rows(xb: jax.Array, n: int) -> jax.Array:
    # The length spelt out: reshape cannot infer -1 for an empty moment.
    return xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])[..., :n]


def n_blocks(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The scales' shape for a value of ``shape``."""
    return (*shape[:-1], -(-shape[-1] // block_size))


def quantize(x: jax.Array, key: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """uint8 codes (``x``'s shape) and float32 scales (``n_blocks``) of ``x``.

    A block holding inf or NaN gets a NaN scale (its codes are meaningless), so a
    check for non-finite values sees the stored state as it would the float32 one.
    """
    xb = _blocks(x.astype(jnp.float32), block_size)
    a = jnp.abs(xb)
    absmax = jnp.max(a, axis=-1)
    nonneg = jnp.all(xb >= 0, axis=-1)
    largest = jnp.where(nonneg, NONNEGATIVE.largest, SIGNED.largest)
    # The smallest power of two 2**k with absmax <= largest * 2**k; never a float32
    # subnormal (backends flush those).
    f, e = jnp.frexp(absmax)
    k = jnp.maximum(e - (2 * f <= largest).astype(e.dtype), -126)
    # A block within a code step of float32's largest value would need a scale of
    # 2**128: it is stored as non-finite (a NaN scale), as the float32 moment's next
    # step would overflow, so that a guard sees it and skips; never clipped.
    finite = jnp.isfinite(absmax) & (k <= 127)
    k = jnp.where(finite, k, 0)
    a = jnp.ldexp(a, -k[..., None])
    draw = jax.random.uniform(key, xb.shape, jnp.float32)
    unsigned = encode(jnp.minimum(a, NONNEGATIVE.largest), NONNEGATIVE, draw, xb > 0)
    signed = encode(jnp.minimum(a, SIGNED.largest), SIGNED, draw)
    signed = jnp.where(xb < 0, signed | 128, signed)  # the sign bit; int32 under x64 too
    codes = jnp.where(nonneg[..., None], unsigned, signed).astype(jnp.uint8)
    scales = jnp.ldexp(jnp.where(nonneg, -1.0, 1.0), k).astype(jnp.float32)
    scales = jnp.where(finite, scales, jnp.nan)
    return _rows(codes, x.shape[-1]), scales


def requantize(
    x: jax.Array, key: jax.Array, block_size: int, codes: jax.Array, scales: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``quantize(x)``, except that each block whose values equal what ``codes`` and
    ``scales`` decode to keeps them."""
    new_codes, new_scales = quantize(x, key, block_size)
    old = _blocks(dequantize(codes, scales, block_size), block_size)
    same = jnp.all(_blocks(x.astype(jnp.float32), block_size) == old, axis=-1)
    kept = _blocks(codes, block_size), _blocks(new_codes, block_size)
    new_codes = _rows(jnp.where(same[..., None], *kept), x.shape[-1])
    return new_codes, jnp.where(same, scales, new_scales)


def dequantize(codes: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
    """The float32 values of ``quantize``'s codes and scales."""
    cb = _blocks(codes.astype(jnp.int32), block_size)
    nonneg = (scales < 0)[..., None]
    unsigned = decode(cb, NONNEGATIVE)
    signed = decode(cb & 127, SIGNED)
    signed = jnp.where(cb >= 128, -signed, signed)
    values = jnp.where(nonneg, unsigned, signed) * jnp.abs(scales)[..., None]
    return _rows(values, codes.shape[-1])


def bound(x: np.ndarray, block_size: int) -> np.ndarray:
    """The largest error ``dequantize(quantize(x))`` can make at each element of ``x``:
    one step of the code at the element (stochastic rounding goes to a neighbour), or
    the smallest code's value where the element is below it. For tests and docs."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    flat_x, flat_o = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for row, o in zip(flat_x, flat_o, strict=True):
        for s in range(0, row.shape[0], block_size):
            b = row[s : s + block_size]
            code = NONNEGATIVE if (b >= 0).all() else SIGNED
            absmax = np.abs(b).max()
            k = np.ceil(np.log2(absmax / code.largest)) if absmax > 0 else 0.0
            k = max(k, -126)
            a = np.abs(b) * 2.0**-k
            e = np.maximum(np.floor(np.log2(np.maximum(a, 1e-300))), code.emin)
            o[s : s + block_size] = 2.0 ** (e - code.mantissa_bits + k)
    return out
