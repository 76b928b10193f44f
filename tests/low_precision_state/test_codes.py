"""The 8-bit block code against a float64 reference built from the codes' field widths.

The reference grid of each code is derived here from ``exponent_bits`` and
``mantissa_bits`` alone (the top binade is [1, 2), subnormals below the first binade),
not from ``_codes``' arithmetic; the block's scale is the smallest power of two that
fits its largest magnitude in its family's 4-exponent-bit code, and its code is the
one the module's docstring states, chosen here from the reference grids (a
non-negative block: the most mantissa bits whose normal binades reach its smallest
positive value; a signed one: the least squared step summed over its nonzero values).
Against it: every stored value is one of the two grid neighbours of its input,
``bound`` is exactly the gap between them, stochastic rounding is unbiased, and the
rules the module states (never 0 for a positive value in the non-negative code, NaN
scale for non-finite blocks, unchanged blocks kept bit for bit) hold. Written against
``SIGNED_CODES``/``NONNEGATIVE_CODES`` generically: a change of widths changes the
reference with them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxamp._utils import draws
from jaxamp.low_precision_state import _codes

CODES = _codes.SIGNED_CODES + _codes.NONNEGATIVE_CODES
CODE_IDS = [f"{'s' if c.signed else 'u'}e{c.exponent_bits}m{c.mantissa_bits}" for c in CODES]
TINY = float(np.finfo(np.float32).tiny)


def _grid(code: _codes.Code) -> np.ndarray:
    """The magnitudes of a code's ``2**(E + M)`` codes, float64, from the field widths."""
    e_bits, m_bits = code.exponent_bits, code.mantissa_bits
    top = 2**e_bits - 1  # the exponent field of the binade [1, 2)
    c = np.arange(2 ** (e_bits + m_bits))
    field, mant = c >> m_bits, c & (2**m_bits - 1)
    normal = (2**m_bits + mant) * 2.0 ** (field - top - m_bits)
    subnormal = mant * 2.0 ** (1 - top - m_bits)
    return np.where(field == 0, subnormal, normal)


def _steps(code: _codes.Code, a: np.ndarray) -> np.ndarray:
    """The code's step at each magnitude ``a`` (on the block's scale): the gap from its
    grid value at or below ``a`` to the next."""
    g = _grid(code)
    i = np.clip(np.searchsorted(g, a, side="right") - 1, 0, len(g) - 2)
    return g[i + 1] - g[i]


def _untag(scale: float) -> tuple[float, int]:
    """A stored scale's power of two and its two lowest bits (the code's index)."""
    bits = np.array(scale, np.float32).view(np.int32)
    return float((bits & ~3).view(np.float32)), int(bits & 3)


def _expected_code(b: np.ndarray, mag: float) -> tuple[_codes.Code, float]:
    """The code the module's docstring says block ``b`` (float64) uses at scale ``mag``,
    and the least signed cost (0 for a non-negative block)."""
    if (b >= 0).all():
        pos = b[b > 0]
        for code in reversed(_codes.NONNEGATIVE_CODES):  # most mantissa bits first
            if pos.size == 0 or pos.min() >= 2.0**code.emin * mag:
                return code, 0.0
        return _codes.NONNEGATIVE_CODES[0], 0.0
    a = np.abs(b[b != 0]) / mag
    costs = [float((_steps(code, a) ** 2).sum()) for code in _codes.SIGNED_CODES]
    best = min(range(3), key=lambda t: (costs[t], -t))  # ties: more mantissa bits
    return _codes.SIGNED_CODES[best], min(costs)


# Compiled once per shape and block size: run op by op, each of the code's operations
# would compile on its own for every new shape.
_quantize = jax.jit(_codes.quantize, static_argnums=2)
_dequantize = jax.jit(_codes.dequantize, static_argnums=2)
_requantize = jax.jit(_codes.requantize, static_argnums=2)
_encode = jax.jit(_codes.encode, static_argnums=1)
_decode = jax.jit(_codes.decode, static_argnums=1)
_in_blocks = jax.jit(_codes._blocks, static_argnums=1)


@functools.partial(jax.jit, static_argnums=2)
def _round_trip(x, key, block_size):
    codes, scales = _codes.quantize(x, key, block_size)
    return codes, scales, _codes.dequantize(codes, scales, block_size)


def _blocks(x: np.ndarray, block_size: int) -> list[tuple[tuple, slice]]:
    """(row index, slice of the last axis) of every block of ``x``."""
    rows = np.ndindex(*x.shape[:-1])
    n = x.shape[-1]
    return [(r, slice(s, s + block_size)) for r in rows for s in range(0, n, block_size)]


def _check_against_reference(x: np.ndarray, block_size: int, scales, out) -> np.ndarray:
    """Asserts the scales and each stored value against the float64 reference; returns
    the gap between each input's grid neighbours (0 where it is on the grid)."""
    x64, out = x.astype(np.float64), np.asarray(out, np.float64)
    scales = np.asarray(scales, np.float64)
    assert scales.shape == (*x.shape[:-1], -(-x.shape[-1] // block_size))
    gaps = np.zeros_like(x64)
    for row, sl in _blocks(x, block_size):
        b, o = x64[row][sl], out[row][sl]
        s, tag = _untag(scales[row][sl.start // block_size])
        nonneg = bool((b >= 0).all())
        family = _codes.NONNEGATIVE_CODES if nonneg else _codes.SIGNED_CODES
        # The scale: a normal power of two, its sign naming the family, the smallest
        # that fits in the family's code of 4 exponent bits.
        assert (s < 0) == nonneg, (b, s)
        mag = abs(s)
        assert mag >= TINY and np.frexp(mag)[0] == 0.5, mag
        absmax = np.abs(b).max()
        largest = family[0].largest
        assert absmax <= largest * mag
        # (an all-zero block's scale is any: it scales nothing)
        assert absmax == 0 or mag == TINY or absmax > largest * mag / 2, (absmax, mag)
        # The code: the reference's, or for a signed block one whose cost is the least
        # to float32's rounding of the sums (a near tie may go either way).
        code = family[tag]
        want, least = _expected_code(b, mag)
        if nonneg:
            assert code == want, (b, code, want)
        else:
            cost = float((_steps(code, np.abs(b[b != 0]) / mag) ** 2).sum())
            assert cost <= least * (1 + 2.0**-16), (b, code, want)
        g = _grid(code) * mag
        a = np.abs(b)
        i = np.searchsorted(g, a, side="right") - 1
        down = g[i]
        up = np.where(down < a, g[np.minimum(i + 1, len(g) - 1)], down)
        got = np.abs(o)
        if code.signed:
            ok = (got == down) | (got == up)
        else:  # a positive value is never stored as 0: below the smallest code, that code
            ok = np.where(a > 0, (got == up) | ((got == down) & (down > 0)), got == 0)
        assert ok.all(), (b[~ok], o[~ok], down[~ok], up[~ok], s)
        assert (np.sign(o) * np.sign(b) >= 0).all()  # the sign kept (or 0)
        gaps[row][sl] = up - down
    return gaps


SHAPES = [(300,), (1, 5), (3, 64), (2, 3, 100), (4, 130), (7,)]
# Each shape with the block sizes that make its layouts (every (shape, block size) pair
# compiles its own program): rows shorter than a block, exactly one block, whole
# blocks, whole blocks and a short last one, in 1, 2 and 3 dimensions.
LAYOUTS = [
    ((300,), 64),  # 4 whole blocks and one of 44
    ((1, 5), 16),  # a row shorter than a block
    ((3, 64), 64),  # one whole block per row
    ((3, 64), 16),  # whole blocks only
    ((2, 3, 100), 32),  # 3 whole blocks and one of 4, in 3 dimensions
    ((4, 130), 16),  # 8 whole blocks and one of 2
    ((7,), 32),  # a vector shorter than a block
]


@st.composite
def _inputs(draw) -> tuple[np.ndarray, int]:
    """float32 arrays of many magnitudes: each block its own exponent, values spread over
    up to 2**40 below it; signed or non-negative rows; zeros and -0.0 sprinkled in."""
    shape, block_size = draw(st.sampled_from(LAYOUTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = rng.integers(-100, 100, size=shape[:-1] + (1,))
    spread = draw(st.sampled_from([1, 8, 40]))
    x = rng.uniform(1, 2, size=shape) * 2.0 ** (top - rng.integers(0, spread, size=shape))
    sign = draw(st.sampled_from(["signed", "nonneg", "nonpos"]))
    if sign == "signed":
        x *= rng.choice([-1.0, 1.0], size=shape)
    elif sign == "nonpos":
        x = -x
    zeros = rng.random(shape) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    x = np.where(zeros, rng.choice([0.0, -0.0], size=shape), x).astype(np.float32)
    # float32 subnormals are read as 0 by XLA: the inputs are normal numbers or zeros.
    x = np.where(np.abs(x) < TINY, np.float32(0), x)
    return x, block_size


@settings(max_examples=60, deadline=None)
@given(case=_inputs(), seed=st.integers(0, 2**31 - 1))
def test_round_trip_is_a_grid_neighbour_within_bound(case, seed) -> None:
    x, block_size = case
    codes, scales, out = _round_trip(jnp.asarray(x), jax.random.key(seed), block_size)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert scales.dtype == np.float32 and out.shape == x.shape
    gaps = _check_against_reference(x, block_size, scales, out)
    err = np.abs(np.asarray(out, np.float64) - x.astype(np.float64))
    bnd = _codes.bound(x, block_size)
    assert (err <= bnd).all(), (x[err > bnd], err[err > bnd], bnd[err > bnd])
    # `bound` is one step of the code: the gap between an off-grid input's neighbours.
    off = gaps > 0
    np.testing.assert_array_equal(bnd[off], gaps[off])


def test_bound_is_reached() -> None:
    """The largest error over many draws comes near the bound (it is not loose)."""
    rng = np.random.default_rng(0)
    x = (rng.uniform(-1, 1, (64, 256)) * 2.0 ** rng.integers(-20, 20, (64, 1))).astype(np.float32)
    x[::2] = np.abs(x[::2])  # the non-negative code too
    _, _, out = _round_trip(jnp.asarray(x), jax.random.key(1), 64)
    ratio = np.abs(np.asarray(out, np.float64) - x) / _codes.bound(x, 64)
    assert ratio.max() <= 1
    assert ratio[::2].max() > 0.97 and ratio[1::2].max() > 0.97


def test_a_blocks_fields_are_its_codes() -> None:
    """``_fields`` computes each block's mantissa bits and smallest exponent from its
    family and tag; they are the fields of ``SIGNED_CODES[tag]`` / ``NONNEGATIVE_CODES[tag]``."""
    for nonneg, family in ((False, _codes.SIGNED_CODES), (True, _codes.NONNEGATIVE_CODES)):
        for tag, code in enumerate(family):
            m, emin = _codes._fields(jnp.array(nonneg), jnp.array(tag))
            assert (int(m), int(emin)) == (code.mantissa_bits, code.emin), code


@pytest.mark.parametrize("code", CODES, ids=CODE_IDS)
def test_encode_decode_are_inverse_on_every_code(code) -> None:
    grid = _grid(code)
    n = len(grid)
    assert n == (128 if code.signed else 256)  # with the sign bit, one byte either way
    assert (np.diff(grid) > 0).all()  # monotone: a code's order is its value's
    assert grid[-1] == code.largest and grid[1] == code.smallest
    c = jnp.arange(n, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(_decode(c, code), np.float64), grid)
    for draw in (0.0, 0.5, 1 - 2**-24):  # a value on the grid is never rounded away
        back = _encode(jnp.asarray(grid, jnp.float32), code, jnp.full(n, draw))
        np.testing.assert_array_equal(np.asarray(back), np.arange(n))


@pytest.mark.parametrize("code", CODES, ids=CODE_IDS)
def test_every_byte_round_trips_through_dequantize(code) -> None:
    """All 256 bytes of a block, stored with this code (the scale's sign and tag):
    dequantize gives the code's grid (the signed code's two zeros, 0 and 128, both
    0); quantizing it gives the bytes back where the block chooses this code, and
    otherwise as the reference stores it."""
    family = _codes.NONNEGATIVE_CODES if not code.signed else _codes.SIGNED_CODES
    bits = np.array(1.0 if code.signed else -1.0, np.float32).view(np.int32) | family.index(code)
    scale = jnp.asarray(bits.view(np.float32).reshape(1, 1))
    codes = jnp.arange(256, dtype=jnp.uint8)[None]
    values = np.asarray(_dequantize(codes, scale, 256))
    grid = _grid(code)
    want = np.concatenate([grid, -grid]) if code.signed else grid
    np.testing.assert_array_equal(values[0].astype(np.float64), want)
    back, back_scale = _quantize(jnp.asarray(values), jax.random.key(0), 256)
    # The scale fits the family's 4-exponent-bit code: 1 where this code's largest
    # value is no larger than that code's.
    if code.largest <= family[0].largest and _expected_code(want, 1.0)[0] == code:
        expect = np.arange(256)
        if code.signed:
            expect[128] = 0
        np.testing.assert_array_equal(np.asarray(back)[0], expect)
        np.testing.assert_array_equal(np.asarray(back_scale), np.asarray(scale))
    else:
        _check_against_reference(values, 256, back_scale, _dequantize(back, back_scale, 256))


N_KEYS = 2000


@functools.partial(jax.jit, static_argnums=2)
def _many(x, keys, block_size):
    return jax.vmap(lambda k: _round_trip(x, k, block_size)[2])(keys)


def test_stochastic_rounding_is_unbiased() -> None:
    """The mean over many keys is the input, to within the CLT's 6 sigma (a value
    rounds to a neighbour one gap apart: its standard deviation is at most gap / 2)."""
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (4, 96)) * 2.0 ** rng.integers(-30, 30, (4, 1))
    x[1] = np.abs(x[1])
    x = x.astype(np.float32)
    keys = jax.random.split(jax.random.key(5), N_KEYS)
    out = np.asarray(_many(jnp.asarray(x), keys, 32), np.float64)
    gap = _codes.bound(x, 32)
    # The draw is uniform on a 2**-24 grid: P(up) is the fraction to within 2**-24.
    tol = 6 * gap / (2 * np.sqrt(N_KEYS)) + gap * 2.0**-22
    bias = np.abs(out.mean(axis=0) - x.astype(np.float64))
    assert (bias <= tol).all(), (bias / gap).max()


@pytest.mark.parametrize("code", CODES, ids=CODE_IDS)
@pytest.mark.parametrize("fraction", [0.125, 0.3, 0.75])
def test_up_is_drawn_with_the_fraction(code, fraction) -> None:
    """A value ``fraction`` of a gap above a code goes up with that probability, with
    the draws quantize makes (every code: a block's choice of code is tested above)."""
    grid = _grid(code)
    i = len(grid) // 2 + 3  # a normal binade inside the range
    value = grid[i] + fraction * (grid[i + 1] - grid[i])
    draw = draws.uniform(jax.random.key(11), (N_KEYS,))
    c = _encode(jnp.full(N_KEYS, value, jnp.float32), code, draw)
    out = np.asarray(_decode(c, code), np.float64)
    assert set(np.unique(out)) <= {grid[i], grid[i + 1]}
    ups = int((out == grid[i + 1]).sum())
    sigma = np.sqrt(N_KEYS * fraction * (1 - fraction))
    assert abs(ups - N_KEYS * fraction) <= 6 * sigma + 1, ups


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top=st.integers(-60, 120),
    below=st.integers(1, 240),
)
def test_a_positive_value_is_never_stored_as_zero(seed, top, below) -> None:
    """In the non-negative code (second moments) a positive value, however far below
    its block's largest, comes back positive (0 would make Adam divide by eps)."""
    small = max(top - below, -126)  # float32 normal numbers only
    x = np.array([[2.0**top * 1.5, 2.0**small, 2.0**small * 1.25, 0.0]], np.float32)
    _, scales, out = _round_trip(jnp.asarray(x), jax.random.key(seed), 4)
    out = np.asarray(out)
    assert np.asarray(scales)[0, 0] < 0  # the non-negative code
    assert (out[0, :3] > 0).all(), (x, out)
    assert out[0, 3] == 0


def test_requantize_keeps_unchanged_blocks_bit_for_bit() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 200)).astype(np.float32)
    x[:3] = x[:3] ** 2  # non-negative rows too
    block = 64
    codes, scales = _quantize(jnp.asarray(x), jax.random.key(0), block)
    stored = np.asarray(_dequantize(codes, scales, block))
    new = stored.copy()
    new[1, 70] *= 1.5  # block (1, 1) changes
    new[4, 199] = -new[4, 199] - 1  # block (4, 3), the short last one, changes
    changed = np.zeros(scales.shape, bool)
    changed[1, 1] = changed[4, 3] = True
    for seed in range(5):  # under any key
        key = jax.random.key(100 + seed)
        c2, s2 = _requantize(jnp.asarray(new), key, block, codes, scales)
        fresh_c, fresh_s = _quantize(jnp.asarray(new), key, block)
        c_blocks, old_blocks, fresh_blocks = (
            np.asarray(_in_blocks(c, block)) for c in (c2, codes, fresh_c)
        )
        np.testing.assert_array_equal(c_blocks[~changed], old_blocks[~changed])
        np.testing.assert_array_equal(np.asarray(s2)[~changed], np.asarray(scales)[~changed])
        # A changed block is quantized afresh: its scale from its new values, and a
        # non-negative one's codes as quantize's (a signed one's by the rule
        # test_codes_rounding checks).
        np.testing.assert_array_equal(c_blocks[1, 1], fresh_blocks[1, 1])
        np.testing.assert_array_equal(np.asarray(s2)[changed], np.asarray(fresh_s)[changed])


def test_requantize_keeps_a_block_that_quantizing_again_would_move() -> None:
    """A block whose largest value rounded down into a lower binade: quantizing its
    stored values again picks a smaller scale (other bytes, same values);
    ``requantize`` keeps the bytes."""
    # Just above largest / 2 of the code the block chooses: the scale is 1, and the
    # value sits between two codes.
    largest = _codes.SIGNED.largest
    x = jnp.array([[largest / 2 + 2.0**-8, -0.25, 0.125, 0.0]], jnp.float32)
    assert _expected_code(np.asarray(x[0], np.float64), 1.0)[0] == _codes.SIGNED_CODES[2]
    for seed in range(64):
        codes, scales = _quantize(x, jax.random.key(seed), 4)
        stored = _dequantize(codes, scales, 4)
        if float(jnp.max(jnp.abs(stored))) <= largest / 2:
            break
    else:
        pytest.fail("no draw rounded the largest value down")
    again_c, again_s = _quantize(stored, jax.random.key(0), 4)
    assert float(again_s[0, 0]) != float(scales[0, 0])  # the test's premise
    np.testing.assert_array_equal(np.asarray(_dequantize(again_c, again_s, 4)), np.asarray(stored))
    kept_c, kept_s = _requantize(stored, jax.random.key(0), 4, codes, scales)
    np.testing.assert_array_equal(np.asarray(kept_c), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(kept_s), np.asarray(scales))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_block_gets_a_nan_scale(bad) -> None:
    x = np.array([[1.0, 2.0, bad, 3.0, 1.0, -2.0, 0.5, 0.25]], np.float32)
    codes, scales, out = _round_trip(jnp.asarray(x), jax.random.key(0), 4)
    scales, out = np.asarray(scales), np.asarray(out)
    assert np.isnan(scales[0, 0])
    assert np.isfinite(scales[0, 1])  # the other block is unaffected
    assert np.isnan(out[0, :4]).all()
    assert (np.abs(out[0, 4:] - x[0, 4:]) <= _codes.bound(x[:, 4:], 4)[0]).all()
    # requantize sees the block as changed (NaN != NaN) and stores it non-finite again.
    _, s2 = _requantize(jnp.asarray(x), jax.random.key(1), 4, codes, jnp.asarray(scales))
    assert np.isnan(np.asarray(s2)[0, 0])


def test_tiny_and_zero_blocks_get_normal_scales() -> None:
    """A block of zeros, and a block of float32's smallest normal numbers: the scale
    stays a normal power of two (backends flush subnormals), the values come back."""
    x = np.array([[0.0, -0.0, 0.0, 0.0], [TINY, 2 * TINY, 0.0, TINY * 1.5]], np.float32)
    _, scales, out = _round_trip(jnp.asarray(x), jax.random.key(0), 4)
    scales = np.abs([_untag(s)[0] for s in np.asarray(scales).ravel()])
    assert (scales >= TINY).all() and (np.frexp(scales)[0] == 0.5).all()
    np.testing.assert_array_equal(np.asarray(out), np.where(x == 0, 0, x))


def test_n_blocks_is_the_scales_shape() -> None:
    key = jax.random.key(0)
    for shape in SHAPES:
        for block in (1, 7, 64, 512):
            x = jax.ShapeDtypeStruct(shape, jnp.float32)
            codes, scales = jax.eval_shape(lambda x, b=block: _codes.quantize(x, key, b), x)
            assert codes.shape == shape and scales.shape == _codes.n_blocks(shape, block)


def test_a_block_at_float32s_edge_is_stored_as_non_finite_never_clipped() -> None:
    """Its scale would be 2**128: a NaN scale (what a guard's check sees) rather than a
    clipped value; a block one binade lower is stored within the bound."""
    x = np.array([[3.3e38, 1.0, -1.0, 0.0], [1.6e38, 1.0, -1.0, 0.0]], np.float32)
    _, scales, out = _round_trip(jnp.asarray(x), jax.random.key(0), 4)
    scales = np.asarray(scales)
    assert np.isnan(scales[0]).all() and np.isfinite(scales[1]).all()
    err = np.abs(np.asarray(out, np.float64)[1] - x[1].astype(np.float64))
    assert (err <= _codes.bound(x[1:], 4)[0]).all()


def test_codes_stored_before_the_per_block_choice_decode_as_then() -> None:
    """A moment stored by the code before blocks chose their code (one code per family,
    so the scales' low bits 0: tag 0, ``data/make_codes_before_per_block_choice.py``)
    decodes to the values it decoded to then, bit for bit, and stored again unchanged
    keeps its bytes and scales: a checkpoint saved before resumes as it was."""
    saved = np.load(Path(__file__).parent / "data" / "codes_before_per_block_choice.npz")
    codes, scales, values = (jnp.asarray(saved[k]) for k in ("codes", "scales", "values"))
    assert (np.asarray(scales).view(np.int32) & 3 == 0).all()
    out = np.asarray(_dequantize(codes, scales, 32))
    np.testing.assert_array_equal(out.view(np.int32), np.asarray(values).view(np.int32))
    again_codes, again_scales = _requantize(values, jax.random.key(1), 32, codes, scales)
    finite = np.repeat(np.isfinite(np.asarray(scales)), 32, axis=-1)
    np.testing.assert_array_equal(np.asarray(again_codes)[finite], np.asarray(codes)[finite])
    np.testing.assert_array_equal(
        np.asarray(again_scales).view(np.int32), np.asarray(scales).view(np.int32)
    )
