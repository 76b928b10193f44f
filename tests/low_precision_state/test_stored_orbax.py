"""The stored moments are the arrays a checkpoint saves: orbax writes and restores them bit
for bit (``ocp.StandardCheckpointer`` on a real directory, through
``jaxamp.checkpoint.restore``), inside a ``skip_nonfinite`` state, into a fresh
``tx.init`` target; the restored run goes on as the saved one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp
from jaxamp.types import Quantized8, Rounded16

PARAMS = {"b": jnp.zeros(16), "w": jax.random.normal(jax.random.key(0), (16, 512))}


def _grads(i, scale):
    """Call ``i``'s gradients of the loss scaled by ``scale``."""
    g = jax.random.normal(jax.random.key(10 + i), (16, 512)) * jnp.logspace(-3, 0, 16)[:, None]
    return {"b": jnp.full(16, 0.1 * i) * scale, "w": g * scale}


def _assert_bit_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), (x, y)


@pytest.mark.parametrize("dtype", ["8bit", jnp.bfloat16], ids=["8bit", "bf16"])
def test_orbax_round_trip_is_bit_for_bit(tmp_path, dtype) -> None:
    def tx():
        lps = jaxamp.low_precision_state(optax.adamw(1e-2), dtype, min_size=0, block_size=128)
        return jaxamp.skip_nonfinite(lps, jaxamp.dynamic_scale())

    one = jax.jit(lambda s, p, g: jaxamp.step(tx(), g, s, p))
    params, state = PARAMS, jax.jit(tx().init)(PARAMS)
    for i in range(3):
        params, state = one(state, params, _grads(i, jaxamp.get_loss_scale(state).scale))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", {"params": params, "opt_state": state})
    ckptr.wait_until_finished()
    # a fresh tx.init's shapes and dtypes (the arrays' values are not read)
    target = {"params": PARAMS, "opt_state": jax.eval_shape(tx().init, PARAMS)}
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    back = jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "c")
    _assert_bit_equal(back, {"params": params, "opt_state": state})
    mu = back["opt_state"].inner_state.inner_state[0].mu["w"]
    assert isinstance(mu, Quantized8 if dtype == "8bit" else Rounded16)
    stored = mu.codes if dtype == "8bit" else mu.values
    assert stored.dtype == (jnp.uint8 if dtype == "8bit" else jnp.bfloat16)
    assert int(back["opt_state"].inner_state.count) == 3
    # The restored run goes on as the saved one, bit for bit.
    g = _grads(3, jaxamp.get_loss_scale(state).scale)
    _assert_bit_equal(one(back["opt_state"], back["params"], g), one(state, params, g))
