"""The stochastic rounding's random bits: uniform, unrelated between neighbours, keys and
steps, a function of the key and each element's index only, and fused where they are
used (no array of random bits in memory).

Every check uses fixed keys, so it is deterministic; its threshold is six standard
deviations of the statistic for truly random bits (a chi-square with ``k`` degrees of
freedom: mean ``k``, deviation ``sqrt(2k)``; a correlation of ``n`` pairs: ``1/sqrt(n)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._utils import draws

SHAPE = (256, 1024)


def _bits(key: jax.Array, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.asarray(jax.jit(draws.bits, static_argnums=1)(key, shape)).astype(np.int64)


def _chi2_ok(counts: np.ndarray) -> bool:
    k = counts.size - 1
    expected = counts.sum() / counts.size
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    return abs(chi2 - k) < 6 * np.sqrt(2 * k)


@pytest.mark.parametrize("shift", [0, 8, 16, 24])
def test_each_byte_is_uniform(shift) -> None:
    b = _bits(jax.random.key(0))
    assert _chi2_ok(np.bincount(((b >> shift) & 255).ravel(), minlength=256))


def test_the_uniform_draw_covers_0_to_1_evenly() -> None:
    u = np.asarray(draws.uniform(jax.random.key(1), SHAPE))
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert _chi2_ok(np.histogram(u, bins=1000, range=(0, 1))[0])


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(np.corrcoef(a, b)[0, 1])


def test_neighbours_keys_and_steps_are_unrelated() -> None:
    key = jax.random.key(2)
    b = _bits(key) >> 8  # the bits the draw uses
    pairs = {
        "along a row": (b[:, :-1], b[:, 1:]),
        "along a column": (b[:-1], b[1:]),
        "the next step's key": (b, _bits(jax.random.fold_in(key, 1)) >> 8),
        "another moment's key": (b, _bits(jax.random.key(3)) >> 8),
    }
    for name, (x, y) in pairs.items():
        assert abs(_corr(x, y)) < 6 / np.sqrt(x.size), name
        # Not only linearly: the low bits of neighbours agree half the time.
        assert abs(float(((x ^ y) & 1).mean()) - 0.5) < 6 * 0.5 / np.sqrt(x.size), name


def _repeated_pairs(b: np.ndarray) -> int:
    """How many (word, next word) pairs along the last axis occur more than once: for
    random 32-bit words about ``n**2 / 2**65`` of ``n`` pairs (well under one here), so a
    repeat is structure, e.g. two rows drawing the same bits shifted."""
    b = b.astype(np.uint64)
    pairs = ((b[..., :-1] << np.uint64(32)) | b[..., 1:]).ravel()
    return int(pairs.size - np.unique(pairs).size)


def test_rows_of_a_draw_and_steps_of_a_leaf_are_not_shifted_copies() -> None:
    """A hash linear in the index along a row (``mix(c + i * odd)``, ``c`` from the key
    and the leading indices) makes every row a window of one sequence: rows, leaves and
    steps whose ``c`` fall within a row's length of each other repeat each other's bits.
    Blocks of 256 as the 8-bit code draws them, and a 1-D leaf over 2048 steps."""
    b = np.asarray(jax.jit(draws.bits, static_argnums=1)(jax.random.key(0), (8192, 256)))
    assert _repeated_pairs(b) == 0
    seed = jax.random.key(0)
    keys = jax.vmap(lambda t: jax.random.fold_in(seed, t))(jnp.arange(2048))
    b = np.asarray(jax.jit(jax.vmap(lambda k: draws.bits(k, (1024,))))(keys))
    assert _repeated_pairs(b) == 0


def test_the_bits_depend_on_the_index_not_the_shape() -> None:
    """What makes a sharded moment draw what the whole one does: a block of rows or
    columns, wherever it sits, gets the bits of those indices."""
    key = jax.random.key(4)
    whole = _bits(key, (64, 96))
    np.testing.assert_array_equal(_bits(key, (40, 70)), whole[:40, :70])
    assert (_bits(key, (64, 96)) == whole).all()  # deterministic
    assert (_bits(jax.random.key(5), (64, 96)) != whole).mean() > 0.99


@pytest.mark.parametrize("shape", [(), (7,), (3, 4, 5)])
def test_any_rank(shape) -> None:
    b = _bits(jax.random.key(6), shape)
    assert b.shape == shape
    if b.size > 1:
        assert len(np.unique(b)) == b.size


def test_no_array_of_bits_is_stored() -> None:
    """The draw fuses into its consumer: compiled, rounding a float32 array
    stochastically reads the array and writes the result, and nothing the size of the
    array besides (jax.random's threefry, on CPU, is a loop writing two uint32 arrays
    per round)."""

    def round_up_or_down(key, x):
        return x + (draws.uniform(key, x.shape) < 0.5).astype(x.dtype)

    x = jnp.zeros(SHAPE, jnp.float32)
    compiled = jax.jit(round_up_or_down).lower(jax.random.key(0), x).compile()
    accessed = compiled.cost_analysis()["bytes accessed"]
    assert accessed < 2.1 * x.nbytes, accessed / x.nbytes
    assert compiled.memory_analysis().temp_size_in_bytes < 0.1 * x.nbytes
