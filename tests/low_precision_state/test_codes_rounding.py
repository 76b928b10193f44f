"""How ``requantize`` rounds a stored moment's next value, against a float64 reference.

A signed block rounds each value to the nearer of its two grid neighbours, unless
that neighbour is the value stored before: then it rounds stochastically, so that a
change below half a step still moves the value in expectation (rounding to nearest
alone would give the stored value back at every step: a slowly decaying signed state
would never move). A non-negative block rounds stochastically, as ``quantize`` does.
The grid and the scale come from ``test_codes``' reference, built from the code's
field widths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from jaxamp.low_precision_state import _codes

from .test_codes import _check_against_reference, _grid, _untag

BLOCK = 64
N_KEYS = 2000

_quantize = jax.jit(_codes.quantize, static_argnums=2)
_dequantize = jax.jit(_codes.dequantize, static_argnums=2)


@functools.partial(jax.jit, static_argnums=2)
def _next(x, key, block_size, codes, scales):
    c, s = _codes.requantize(x, key, block_size, codes, scales)
    return c, s, _codes.dequantize(c, s, block_size)


@functools.partial(jax.jit, static_argnums=2)
def _next_many(x, keys, block_size, codes, scales):
    return jax.vmap(lambda k: _next(x, k, block_size, codes, scales)[2])(keys)


def _stored_and_next(seed: int) -> tuple[np.ndarray, jax.Array, jax.Array, np.ndarray]:
    """A stored state (signed rows, and non-negative rows 0 and 3) and a next value:
    each element moved by a random fraction of up to 3 steps of its code (a third of
    them by less than half a step, where nearest gives the stored value back), some
    not at all; each row's scale spread over 2**12."""
    rng = np.random.default_rng(seed)
    x0 = rng.uniform(-1, 1, (6, 4 * BLOCK)) * 2.0 ** rng.integers(-12, 12, (6, 1))
    x0[[0, 3]] = np.abs(x0[[0, 3]])
    x0 = x0.astype(np.float32)
    codes, scales = _quantize(jnp.asarray(x0), jax.random.key(seed), BLOCK)
    old = np.asarray(_dequantize(codes, scales, BLOCK), np.float64)
    step = _codes.bound(old.astype(np.float32), BLOCK)
    moved = rng.choice([0.0, 1.0], old.shape, p=[0.1, 0.9]) * np.where(
        rng.random(old.shape) < 1 / 3,
        rng.uniform(-0.5, 0.5, old.shape),
        rng.uniform(-3, 3, old.shape),
    )
    new = old + moved * step
    new[[0, 3]] = np.abs(new[[0, 3]])
    return old, codes, scales, new.astype(np.float32)


def _nearest(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A signed block's values' grid neighbours (below and above in magnitude, signed)
    and the nearer of them (ties away from 0), on the grid of the signed code the
    stored ``scale`` names (``_check_against_reference`` checks the choice)."""
    mag, tag = _untag(scale)
    g = _grid(_codes.SIGNED_CODES[tag]) * abs(mag)
    x = x.astype(np.float64)
    a = np.abs(x)
    i = np.searchsorted(g, a, side="right") - 1
    down = g[i]
    up = np.where(down < a, g[np.minimum(i + 1, len(g) - 1)], down)
    nearest = np.where(a - down < up - a, down, up)
    return np.sign(x) * down, np.sign(x) * up, np.sign(x) * nearest


def test_a_signed_block_rounds_to_nearest_unless_that_gives_back_the_stored_value() -> None:
    for seed in range(3):
        old, codes, scales, new = _stored_and_next(seed)
        key = jax.random.key(10 + seed)
        c, s, out = _next(jnp.asarray(new), key, BLOCK, codes, scales)
        out, s = np.asarray(out, np.float64), np.asarray(s, np.float64)
        _check_against_reference(new, BLOCK, s, out)  # a grid neighbour, the scale right
        fresh_c, fresh_s = _quantize(jnp.asarray(new), key, BLOCK)
        for r in range(new.shape[0]):
            for b in range(s.shape[1]):
                sl = slice(b * BLOCK, (b + 1) * BLOCK)
                x, o, was = new[r, sl].astype(np.float64), out[r, sl], old[r, sl]
                if s[r, b] < 0:  # non-negative: stochastically, as quantize
                    np.testing.assert_array_equal(np.asarray(c)[r, sl], np.asarray(fresh_c)[r, sl])
                    continue
                down, up, nearest = _nearest(x, s[r, b])
                kept = nearest == was
                np.testing.assert_array_equal(o[~kept], nearest[~kept])
                assert ((o[kept] == down[kept]) | (o[kept] == up[kept])).all()


def test_where_nearest_gives_back_the_stored_value_the_rounding_is_unbiased() -> None:
    """Values within half a step of the stored one (nearest would give it back): the
    mean over many keys is the value, to within the CLT's 6 sigma (one gap apart:
    sigma at most gap / 2)."""
    rng = np.random.default_rng(7)
    x0 = rng.uniform(-1, 1, (4, 2 * BLOCK)) * 2.0 ** rng.integers(-8, 8, (4, 1))
    codes, scales = _quantize(jnp.asarray(x0, jnp.float32), jax.random.key(0), BLOCK)
    old = np.asarray(_dequantize(codes, scales, BLOCK), np.float64)
    step = _codes.bound(old.astype(np.float32), BLOCK)
    new = (old + rng.uniform(-0.45, 0.45, old.shape) * step).astype(np.float32)
    keys = jax.random.split(jax.random.key(3), N_KEYS)
    c, s, _ = _next(jnp.asarray(new), keys[0], BLOCK, codes, scales)
    s = np.asarray(s)
    # the block's largest stays in its binade, so the scale (and the grid) stays
    assert (s == np.asarray(scales)).all() and (s > 0).all()
    nearest = np.concatenate(
        [_nearest(new[r, b * BLOCK : (b + 1) * BLOCK], s[r, b])[2] for r, b in np.ndindex(s.shape)]
    ).reshape(new.shape)
    kept = (nearest == old) & (new != old)
    assert kept.mean() > 0.8  # (at a binade's lower end the step below is half as large)
    out = np.asarray(_next_many(jnp.asarray(new), keys, BLOCK, codes, scales), np.float64)
    gap = _codes.bound(new, BLOCK)
    tol = 6 * gap / (2 * np.sqrt(N_KEYS)) + gap * 2.0**-22
    bias = np.abs(out.mean(axis=0) - new.astype(np.float64))
    assert (bias[kept] <= tol[kept]).all(), (bias / gap)[kept].max()
    # and the draws do move them: about |new - old| / gap of the keys do
    moved = (out != old).mean(axis=0)
    np.testing.assert_allclose(moved[kept], (np.abs(new - old) / gap)[kept], atol=0.05)


def test_a_slow_signed_ema_stored_in_8_bits_keeps_decaying_to_its_target() -> None:
    """An EMA with decay 0.999 (of params, say) starting at ``p`` and fed ``p / 2``:
    each step moves it by 0.05 % of ``p``, far below half a step of the signed code
    (1/32 to 1/16 of the value), so rounding to nearest alone would keep ``p`` for
    ever. Stored in 8 bits it follows float32's ``p / 2 + (p / 2) * 0.999**n``."""
    steps, decay = 700, 0.999
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.uniform(0.5, 2.0, (4, 256)) * rng.choice([-1.0, 1.0], (4, 256)))
    p = p.astype(jnp.float32)
    plain = optax.ema(decay, debias=False)
    tx = jaxamp.low_precision_state(plain, "8bit", min_size=p.size)
    start = plain.init(p)._replace(ema=p)
    state = jaxamp.convert_state(start, tx, p)

    @jax.jit
    def run(state):
        def body(state, _):
            return tx.update(p / 2, state)[1], None

        return jax.lax.scan(body, state, None, length=steps)[0]

    got = np.asarray(run(state).inner_state.ema.value(), np.float64)
    p64 = np.asarray(p, np.float64)
    want = p64 / 2 + p64 / 2 * decay**steps
    # The way from p to its target covered, per element: 1 - 0.999**700 = 0.50 in
    # float32; 0 if the EMA froze. A stored value's error is a sum of zero-mean
    # rounding errors, each step's of variance below d * s (a move d <= |p| / 2000,
    # a code step s <= |p| / 8), kept with weight 0.999 a step: a variance below
    # d * s / (1 - 0.999**2), a standard deviation of the way below 0.36 per
    # element; the mean over the 1024 elements is within 6 sigma of float32's.
    covered = (p64 - got) / (p64 / 2)
    sigma = 2 * np.sqrt((1 / 2000) * (1 / 8) / (1 - decay**2)) / np.sqrt(p64.size)
    assert abs(covered.mean() - (1 - decay**steps)) <= 6 * sigma, covered.mean()
    # and no element is stuck where it started
    assert (np.abs(got - want) < np.abs(p64 - want)).mean() > 0.9
