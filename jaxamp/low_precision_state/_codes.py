"""The 8-bit block code: minifloats scaled by a power of two per block of a row.

A stored moment is a ``uint8`` code per element and one float32 scale per block of
``block_size`` consecutive elements along the last axis. Codes are minifloats (an
exponent and a mantissa field, with subnormals, and no inf or NaN): their precision is
relative, which a moment needs (Adam divides by ``sqrt(nu)`` element by element, so an
element 1000 times smaller than its block's largest needs its own digits, which a
linear code relative to the block's absmax would flush), and every code is a finite
value.

Each block chooses its code from its values, in one of two families of three: a code
of 4 exponent bits has the range of a moment's widest blocks, while most blocks span
a few binades and can spend the bits that range does not need on the mantissa.
- A block with a negative value: a sign bit and 4 exponent and 3 mantissa bits, 3 and
  4, or 2 and 5 (``SIGNED_CODES``), whichever stores the block with the least squared
  error summed over it. Adam's update is linear in a first moment, so its error there
  is the block's absolute error, which the block's large values dominate.
- A block of non-negative values (a second moment, always): 4 and 4, 3 and 5, or 2
  and 6 (``NONNEGATIVE_CODES``), the most mantissa bits whose normal binades reach down
  to the block's smallest positive value. Adam divides by ``sqrt(nu)``, so a small
  second moment needs its relative precision, which subnormals do not keep. A positive
  value below the smallest code (with 4 exponent bits, ``2**18.9`` below the largest)
  is stored as that code, never 0: a second moment flushed to zero turns
  ``mu / (sqrt(nu) + eps)`` into ``mu / eps``.
The scale says which code, at no byte's cost: its sign the family (negative: the
non-negative one), its two lowest bits (a power of two's mantissa is 0) the code's
index in it, 0 for 4 exponent bits.

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
update sums; rounding to nearest's error is a bias that does not. Each mantissa bit
a block's range leaves free halves ``s``.

A signed block's next value (``requantize``) rounds to nearest unless that gives back
the value stored before; there, stochastically. A fast first moment (``b1 = 0.9``)
moves by more than half a step on most steps: rounding to nearest loses nothing there
and its error, at most half a step and not carried as noise, is smaller than
stochastic rounding's, whose noise on the first moment (Adam's update is linear in
it) spreads runs by their seed. Where a value moves by less than half a step, nearest
would give the stored value back at every step and freeze it (a slow signed EMA:
``b1 = 0.99``, or an EMA of params); there the rounding is stochastic, so the value
moves in expectation exactly as before. The code does not know the decay of the
moment it stores, and it need not: the rule looks at each value's move. Its bias,
outside that band, is nearest's half a step of a value that moved by more than half a
step, and a signed moment's moves go either way, so it does not add up. A
non-negative block (a second moment) rounds stochastically: its moves are one-sided
(small decays, and jumps up where a gradient is large), so nearest's errors on the
jumps would not average out and its mean would drift from float32's. ``quantize`` (a
first store, a conversion) has no value before and rounds stochastically.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils import draws


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


# Each family's codes by index (the scale's tag): index t has 4 - t exponent bits and
# t more mantissa bits than index 0, so its fields are arithmetic in t (``_fields``).
SIGNED_CODES = tuple(Code(4 - t, 3 + t, True) for t in range(3))
NONNEGATIVE_CODES = tuple(Code(4 - t, 4 + t, False) for t in range(3))
SIGNED, NONNEGATIVE = SIGNED_CODES[0], NONNEGATIVE_CODES[0]

# The arithmetic below is elementwise and cheap (integer and bit operations, one
# floor): powers of two are built from their bits, not with ldexp and frexp, whose
# exp2 and log2 XLA counts as expensive and so computes once into a float32 array in
# memory instead of fusing it into each kernel that reads it. So the decoding, the
# wrapped optimizer's update and the encoding fuse into a pass over the block's
# statistics, one over its codes' costs and a pass that writes the codes
# (``_reduce``; benchmarks/bench_optimizer_state.py).


def _pow2(n: jax.Array) -> jax.Array:
    """float32 ``2.0**n`` for integers ``-126 <= n <= 127``, from its exponent bits."""
    return lax.bitcast_convert_type((jnp.asarray(n, jnp.int32) + 127) << 23, jnp.float32)


def _exponent(a: jax.Array) -> jax.Array:
    """``floor(log2(a))`` of a normal float32 ``a > 0`` (-127 for 0 and subnormals, 128
    for inf and NaN), from its exponent bits."""
    return ((lax.bitcast_convert_type(a, jnp.int32) >> 23) & 255) - 127


def _scaled(a: jax.Array, n: jax.Array) -> jax.Array:
    """``a * 2.0**n`` for integers ``-253 <= n <= 253``: in two exact halves, since
    ``2.0**n`` alone is not a normal float32 beyond ``[-126, 127]``."""
    half = n >> 1
    return a * _pow2(half) * _pow2(n - half)


def _encode(
    a: jax.Array,
    m: jax.Array | int,
    emin: jax.Array | int,
    draw: jax.Array,
    kept: jax.Array | None = None,
    nearest: jax.Array | bool = False,
) -> jax.Array:
    """int32 codes of magnitudes ``0 <= a <= largest`` of the code with ``m`` mantissa
    bits and smallest exponent ``emin``: ``a / step + (e - emin) * 2**m`` for ``a``'s
    binade ``e >= emin`` and that binade's step ``2**(e - m)``, piecewise linear and
    increasing, so rounding ``a / step`` up across a binade's end lands on the next
    binade's first code.

    Rounded stochastically; where ``nearest``, to the nearer neighbour (ties up)
    unless that is the magnitude ``kept`` (the one stored before, in ``a``'s units):
    then stochastically, so that a change below half a step still moves it in
    expectation."""
    e = jnp.maximum(_exponent(a), emin)
    step = _pow2(e - m)
    t = a * _pow2(m - e)  # exact: a power-of-two scaling
    whole = jnp.floor(t)
    fraction = t - whole
    up = draw < fraction  # P(up) = the fraction
    if kept is not None:
        near = fraction >= 0.5
        # (whole + near) * step is exact: a code's magnitude, on a's scale.
        frozen = (whole + near.astype(jnp.float32)) * step == kept
        up = jnp.where(nearest & ~frozen, near, up)
    return whole.astype(jnp.int32) + up.astype(jnp.int32) + ((e - emin) << m)


def _decode(c: jax.Array, m: jax.Array | int, emin: jax.Array | int) -> jax.Array:
    """float32 magnitudes of int32 codes of the code with ``m`` mantissa bits and
    smallest exponent ``emin``."""
    above = jnp.maximum((c >> m) - 1, 0)  # binades above the first
    return (c - (above << m)).astype(jnp.float32) * _pow2(emin + above - m)


def encode(
    a: jax.Array, code: Code, draw: jax.Array, positive: jax.Array | None = None
) -> jax.Array:
    """int32 codes of magnitudes ``0 <= a <= code.largest``, rounded stochastically.

    ``draw``: uniform in [0, 1), one per element. ``positive``: where the value is
    positive (default ``a > 0``); the caller's, because a value far below its block's
    largest scales to a float32 subnormal, which backends flush to 0, and the
    non-negative code still stores it as its smallest code.
    """
    c = _encode(a, code.mantissa_bits, code.emin, draw)
    if not code.signed:
        c = jnp.where(a > 0 if positive is None else positive, jnp.maximum(c, 1), c)
    return c


def decode(c: jax.Array, code: Code) -> jax.Array:
    """float32 magnitudes of int32 codes (the inverse of ``encode`` on its grid)."""
    return _decode(c, code.mantissa_bits, code.emin)


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


def _fields(nonneg: jax.Array, tag: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each block's mantissa bits and smallest exponent, from its family and its code's
    index in it (``SIGNED_CODES``, ``NONNEGATIVE_CODES``)."""
    m = jnp.where(nonneg, NONNEGATIVE.mantissa_bits, SIGNED.mantissa_bits) + tag
    return m, 2 - (2**SIGNED.exponent_bits >> tag)


def _reduce(xb: jax.Array, *parts: tuple[jax.Array, Any, Any]) -> tuple[jax.Array, ...]:
    """Several reductions over each block, ``(operand, identity, combine)`` each, as one.

    XLA:CPU fuses one reduction of several results with the elementwise ops that make
    its operands (here: decoding the stored moment and the wrapped optimizer's update),
    where it writes each single reduction's operand to memory first and reads it back;
    ``benchmarks/bench_optimizer_state.py`` measures the step's bytes.
    """
    operands, identities, combines = zip(*parts, strict=True)
    inits = tuple(jnp.asarray(i, o.dtype) for i, o in zip(identities, operands, strict=True))

    def combine(p: tuple, q: tuple) -> tuple:
        return tuple(f(a, b) for f, a, b in zip(combines, p, q, strict=True))

    return tuple(lax.reduce(operands, inits, combine, (xb.ndim - 1,)))


def _smaller_nonzero(p: jax.Array, q: jax.Array) -> jax.Array:
    # The smaller of two magnitudes, 0 standing for none.
    return jnp.where(p == 0, q, jnp.where(q == 0, p, jnp.minimum(p, q)))


def _block_stats(xb: jax.Array, kept: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Each block's largest magnitude, smallest nonzero magnitude (inf: none), whether
    no value is negative, and (given the values ``kept`` before) whether none changed."""
    a = jnp.abs(xb)
    parts = [(a, 0, jnp.maximum), (a, 0, _smaller_nonzero), (xb, jnp.inf, jnp.minimum)]
    if kept is not None:
        parts.append((xb == kept, True, jnp.logical_and))
    absmax, smallest, least, *same = _reduce(xb, *parts)
    return absmax, jnp.where(smallest == 0, jnp.inf, smallest), least >= 0, *same


def _tags(
    xb: jax.Array, a: jax.Array, k: jax.Array, smallest: jax.Array, nonneg: jax.Array
) -> jax.Array:
    """Each block's code, as its index in its family: the module's docstring says how
    it is chosen. ``a``: the block's magnitudes on the scale ``2**k``."""
    # Non-negative: the binade of the smallest positive value, below the scale.
    low = _exponent(smallest) - k
    fits = [low >= code.emin for code in NONNEGATIVE_CODES[1:]]
    nonneg_tag = sum(f.astype(jnp.int32) for f in fits)
    # Signed: each code's squared step summed over the block's nonzero values (its
    # error's variance, up to a factor the same for every code); ties to more mantissa.
    e = _exponent(a)
    steps = [_pow2(2 * (jnp.maximum(e, c.emin) - c.mantissa_bits)) for c in SIGNED_CODES]
    cost = _reduce(xb, *((jnp.where(xb != 0, s, 0), 0, jnp.add) for s in steps))
    signed_tag = jnp.where(
        cost[2] <= jnp.minimum(cost[0], cost[1]), 2, (cost[1] <= cost[0]).astype(jnp.int32)
    )
    return jnp.where(nonneg, nonneg_tag, signed_tag)


def _tagged(scales: jax.Array, tag: jax.Array) -> jax.Array:
    """Scales (powers of two or NaN) with each block's code index in their lowest bits."""
    bits = lax.bitcast_convert_type(scales, jnp.int32) | tag
    return lax.bitcast_convert_type(bits, jnp.float32)


def _untagged(scales: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The stored scales' powers of two, families (non-negative or not) and code indices."""
    bits = lax.bitcast_convert_type(scales, jnp.int32)
    scales = lax.bitcast_convert_type(bits & ~3, jnp.float32)
    return scales, scales < 0, bits & 3


def _quantize_blocks(
    xb: jax.Array,
    stats: tuple[jax.Array, jax.Array, jax.Array],
    key: jax.Array,
    kept: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Block-form uint8 codes and float32 scales of float32 blocks ``xb``, given each
    block's first three ``_block_stats``. ``kept``: the
    values stored before (block form); with it, signed blocks round to nearest unless
    that gives back the value kept (``_encode``)."""
    absmax, smallest, nonneg = stats
    largest = jnp.where(nonneg, NONNEGATIVE.largest, SIGNED.largest)
    # The smallest power of two 2**k with absmax <= largest * 2**k (largest is in
    # [1, 2), so k is absmax's exponent or the next); never a float32 subnormal
    # (backends flush those).
    e = _exponent(absmax)
    k = jnp.maximum(e + (_scaled(absmax, -jnp.clip(e, -126, 127)) > largest), -126)
    # A block within a code step of float32's largest value would need a scale of
    # 2**128: it is stored as non-finite (a NaN scale), as the float32 moment's next
    # step would overflow, so that a guard sees it and skips; never clipped.
    finite = jnp.isfinite(absmax) & (k <= 127)
    k = jnp.where(finite, k, 0)
    a = _scaled(jnp.abs(xb), -k[..., None])
    tag = _tags(xb, a, k, smallest, nonneg)
    m, emin = (f[..., None] for f in _fields(nonneg, tag))
    a = jnp.minimum(a, largest[..., None])
    if kept is None:
        c = _encode(a, m, emin, draws.uniform(key, xb.shape))
    else:
        # The value kept, as a magnitude on this block's new scale, or -1 (no code's)
        # where its sign is not the new value's: nearest cannot give it back there.
        same_sign = (kept < 0) == (xb < 0)
        was = jnp.where(same_sign | (kept == 0), _scaled(jnp.abs(kept), -k[..., None]), -1.0)
        c = _encode(a, m, emin, draws.uniform(key, xb.shape), was, ~nonneg[..., None])
    c = jnp.where(
        nonneg[..., None],
        jnp.where(xb > 0, jnp.maximum(c, 1), c),  # a positive value is never stored as 0
        jnp.where(xb < 0, c | 128, c),  # the sign bit; int32 under x64 too
    )
    scales = jnp.where(nonneg, -1.0, 1.0).astype(jnp.float32) * _pow2(k)
    return c.astype(jnp.uint8), _tagged(jnp.where(finite, scales, jnp.nan), tag)


def quantize(x: jax.Array, key: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """uint8 codes (``x``'s shape) and float32 scales (``n_blocks``) of ``x``.

    A block holding inf or NaN gets a NaN scale (its codes are meaningless), so a
    check for non-finite values sees the stored state as it would the float32 one.
    """
    xb = _blocks(x.astype(jnp.float32), block_size)
    codes, scales = _quantize_blocks(xb, _block_stats(xb), key)
    return _rows(codes, x.shape[-1]), scales


def requantize(
    x: jax.Array, key: jax.Array, block_size: int, codes: jax.Array, scales: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``x`` quantized as the next value of what ``codes`` and ``scales`` store: each
    block whose values equal what they decode to keeps them; a signed block's values
    round to nearest unless that gives back the value stored, then stochastically (the
    module's docstring says why); a non-negative block's stochastically, as
    ``quantize``'s."""
    xb = _blocks(x.astype(jnp.float32), block_size)
    cb = _blocks(codes, block_size)
    kept = _dequantize_blocks(cb, scales)
    *stats, same = _block_stats(xb, kept)
    new_codes, new_scales = _quantize_blocks(xb, tuple(stats), key, kept)
    new_codes = _rows(jnp.where(same[..., None], cb, new_codes), x.shape[-1])
    return new_codes, jnp.where(same, scales, new_scales)


def _dequantize_blocks(cb: jax.Array, scales: jax.Array) -> jax.Array:
    c = cb.astype(jnp.int32)
    scales, nonneg, tag = _untagged(scales)
    m, emin = (f[..., None] for f in _fields(nonneg, tag))
    nonneg = nonneg[..., None]
    mag = _decode(jnp.where(nonneg, c, c & 127), m, emin)
    values = jnp.where(nonneg | (c < 128), mag, -mag)
    return values * jnp.abs(scales)[..., None]


def dequantize(codes: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
    """The float32 values of ``quantize``'s codes and scales."""
    return _rows(_dequantize_blocks(_blocks(codes, block_size), scales), codes.shape[-1])


@functools.partial(jax.jit, static_argnums=1)
def _scales_of(x: jax.Array, block_size: int) -> jax.Array:
    return quantize(x, jax.random.key(0), block_size)[1]


def bound(x: np.ndarray, block_size: int) -> np.ndarray:
    """The largest error ``dequantize(quantize(x))`` can make at each element of ``x``:
    one step, at the element, of the code ``quantize`` chooses for its block (the
    choice does not depend on the key; stochastic rounding goes to a neighbour), or
    the smallest code's value where the element is below it. For tests and docs."""
    x = np.asarray(x, np.float32)
    scales, nonneg, tag = _untagged(_scales_of(jnp.asarray(x), block_size))
    m, emin = (np.asarray(f) for f in _fields(nonneg, tag))
    block = np.arange(x.shape[-1]) // (min(block_size, x.shape[-1]) or 1)
    mag = np.abs(np.asarray(scales, np.float64))[..., block]
    a = np.abs(x.astype(np.float64)) / mag
    e = np.maximum(np.floor(np.log2(np.maximum(a, 1e-300))), emin[..., block])
    return 2.0 ** (e - m[..., block]) * mag
