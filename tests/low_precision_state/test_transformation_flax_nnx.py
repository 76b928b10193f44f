"""low_precision_state held by Flax's own ``nnx.Optimizer``: its ``nnx.update`` turns each
stored moment (a pytree node inside a parameter mapping) into an ``nnx.State`` of its
fields; the wrapper puts them back, so training goes on as with plain optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp


@pytest.mark.parametrize("dtype", ["8bit", jnp.bfloat16], ids=["8bit", "bf16"])
def test_flax_nnx_optimizer_trains_as_plain_optax_does(dtype):
    tx = jaxamp.low_precision_state(optax.adam(1e-2), dtype, min_size=64)
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    state = jax.jit(tx.init)(params)
    xs = jax.random.normal(jax.random.key(1), (4, 3, 16))

    def loss(m, x):
        return (m(x) ** 2).mean()

    @nnx.jit
    def flax_step(model, opt, x):
        opt.update(model, nnx.grad(loss)(model, x))

    @jax.jit
    def optax_step(params, state, x):
        graphdef = nnx.graphdef(model)
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), x))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x in xs:  # the second update is the one that met the fields as a mapping
        flax_step(model, opt, x)
        params, state = optax_step(params, state, x)
    got = jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))
    for a, b in zip(got, jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    held = jax.tree.leaves(nnx.as_pure(opt.opt_state))
    for a, b in zip(held, jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
