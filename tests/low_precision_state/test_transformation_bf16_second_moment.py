"""The naive bfloat16 second moment stalls; ``low_precision_state(adam, jnp.bfloat16)`` does not.

The naive way to halve Adam's second moment: keep optax.adam, and store its ``nu`` in
bfloat16, rounded to nearest after each update (what users get by casting the state).
``nu`` is an EMA with ``b2 = 0.999``: each step moves it by 0.1 % of ``g**2 - nu``,
below half a bfloat16 step (2**-9 to 2**-8 of ``nu``) unless ``g**2`` is a few times
``nu``. So the 0.1 % decay is always rounded away: ``nu`` only ratchets up on the
larger of the noisy ``g**2`` draws and never comes down as the gradients shrink, and
Adam's steps, ``lr * mu / sqrt(nu)``, shrink with it: the run stalls. Stochastic
rounding keeps the decay in expectation, so jaxamp's state tracks float32's.

The model: a noisy linear regression, one coordinate per curvature (log-spaced over
two decades), gradients of 1e-5 to 1e-3 whose noise is as large as their signal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

D = 4096  # low_precision_state's default min_size: the moment is stored
STEPS = 2000
LR = 1e-3
B2 = 0.999
CURVATURE = jnp.asarray(np.logspace(-2, 0, D, dtype=np.float32)) * 1e-3


def _nu_to_bf16(state: tuple) -> tuple:
    adam = state[0]
    return (adam._replace(nu=adam.nu.astype(jnp.bfloat16)), *state[1:])


def naive_bf16_nu(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` (optax.adam) with its ``nu`` cast to bfloat16 (round to nearest) at
    init and after every update."""

    def update(g, state, params=None):
        updates, state = inner.update(g, state, params)
        return updates, _nu_to_bf16(state)

    return optax.GradientTransformation(lambda p: _nu_to_bf16(inner.init(p)), update)


@functools.cache
def _noise() -> jax.Array:
    """Each step's gradient noise, as large as the signal at ``w = 0``: drawn once, the
    same for every run."""
    keys = jax.random.split(jax.random.key(1), STEPS)
    return jax.jit(jax.vmap(lambda key: CURVATURE * jax.random.normal(key, (D,))))(keys)


def _train(tx: optax.GradientTransformation) -> tuple[jax.Array, jax.Array]:
    """Final loss and params of ``STEPS`` noisy gradient steps from ``w = 0`` toward 1."""

    def loss(w):
        return 0.5 * jnp.sum(CURVATURE * (w - 1.0) ** 2)

    def body(carry, noise):
        w, state = carry
        g = jax.grad(loss)(w) + noise
        updates, state = tx.update(g, state, w)
        return (optax.apply_updates(w, updates), state), None

    @jax.jit
    def run(noise):
        w = jnp.zeros((D,), jnp.float32)
        (w, _), _ = jax.lax.scan(body, (w, tx.init(w)), noise)
        return loss(w), w

    return run(_noise())


def test_naive_bf16_nu_stalls_and_low_precision_state_matches_float32():
    adam = optax.adam(LR, b2=B2)
    ref_loss, ref_w = _train(adam)
    naive_loss, naive_w = _train(naive_bf16_nu(adam))
    fixed_loss, fixed_w = _train(jaxamp.low_precision_state(adam, jnp.bfloat16))
    ref_loss, naive_loss, fixed_loss = float(ref_loss), float(naive_loss), float(fixed_loss)

    # Stochastic rounding's error per step has a standard deviation of at most half a
    # bfloat16 step, u = 2**-8 of nu; nu keeps b2 of it each step, so the error it
    # carries is at most u / sqrt(1 - b2**2) (8.7 %) of nu, and the step, nu**-0.5, half
    # that: the tolerance on the loss and the params.
    tol = 2.0**-8 / np.sqrt(1 - B2**2)
    assert abs(fixed_loss / ref_loss - 1) < tol, (fixed_loss, ref_loss)
    dist = float(jnp.linalg.norm(fixed_w - ref_w) / jnp.linalg.norm(ref_w))
    assert dist < tol / 2, dist

    # The failure is real: the naive run stalls far behind float32 (measured 1.54x its
    # loss), by several times the tolerance.
    assert naive_loss > ref_loss * (1 + 3 * tol), (naive_loss, ref_loss)
