"""``convert_state`` takes what ``low_precision_state`` takes: an ``optax.MultiSteps``
object as the optimizer, its state converted both ways against float32 values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from jaxamp.types import Quantized8

PARAMS = {"w": jnp.ones((16, 64))}


def test_a_multisteps_object_converts_both_ways() -> None:
    plain = optax.MultiSteps(optax.adam(1e-2), 2)
    small = optax.MultiSteps(jaxamp.low_precision_state(optax.adam(1e-2), "8bit", min_size=64), 2)
    grads = {"w": jax.random.normal(jax.random.key(0), (16, 64))}
    state, step = plain.init(PARAMS), jax.jit(plain.update)
    for _ in range(2):
        _, state = step(grads, state, PARAMS)
    converted = jaxamp.convert_state(state, small, PARAMS)
    mu = converted.inner_opt_state.inner_state[0].mu["w"]
    assert isinstance(mu, Quantized8)
    back = jaxamp.convert_state(converted, plain, PARAMS)
    want = np.asarray(state.inner_opt_state[0].mu["w"])
    got = np.asarray(back.inner_opt_state[0].mu["w"])
    # within one step of the signed code (3 mantissa bits) at each value's block scale
    assert np.abs(got - want).max() <= np.abs(want).max() * 2.0**-3
    assert back.mini_step == state.mini_step
