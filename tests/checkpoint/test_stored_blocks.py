"""jaxamp.checkpoint.restore of 8-bit moments into an optimizer with another block_size:
a clear error naming the moment and the block sizes, and the route it gives works."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp

PARAMS = {"w": jnp.ones((4, 512)), "b": jnp.ones((96,))}


def _tx(block_size: int):
    return jaxamp.low_precision_state(optax.adam(1e-2), "8bit", block_size=block_size, min_size=0)


def _trained(tx):
    state = tx.init(PARAMS)
    for key in jax.random.split(jax.random.key(0), 2):
        g = jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape), PARAMS)
        _, state = jax.jit(tx.update)(g, state, PARAMS)
    return state


@pytest.mark.parametrize("how", ["checkpointer", "manager"])
def test_another_block_size_is_named_and_convert_state_moves_the_restored_state(tmp_path, how):
    saved = _trained(_tx(256))
    if how == "checkpointer":
        ckptr, kwargs = ocp.StandardCheckpointer(), {"directory": tmp_path / "c"}
        ckptr.save(tmp_path / "c", saved)
        ckptr.wait_until_finished()
    else:
        ckptr, kwargs = ocp.CheckpointManager(tmp_path / "m"), {"step": 0}
        ckptr.save(0, args=ocp.args.StandardSave(saved))
        ckptr.wait_until_finished()
    target = jax.eval_shape(_tx(128).init, PARAMS)
    with pytest.raises(ValueError) as err:
        jaxamp.checkpoint.restore(ckptr, target, **kwargs)
    msg = str(err.value)
    # "b" (96 elements) is one block under both sizes: the first moment named is w's.
    assert "mu" in msg and "w" in msg and "last axis 512" in msg, msg
    assert "in 2 blocks" in msg and "block_size=128 makes 4" in msg, msg
    assert "256 to 511" in msg and "power of two among them: 256" in msg, msg
    assert "jaxamp.convert_state" in msg, msg
    # The route the message gives: restore with the saved block size, then convert.
    back = jaxamp.checkpoint.restore(ckptr, jax.eval_shape(_tx(256).init, PARAMS), **kwargs)
    moved = jaxamp.convert_state(back, _tx(128), PARAMS)
    for field in ("mu", "nu"):
        was = getattr(saved.inner_state[0], field)["w"]
        now = getattr(moved.inner_state[0], field)["w"]
        assert now.block_size == 128 and now.scales.shape == (4, 4)
        a, b = np.asarray(was.value()), np.asarray(now.value())
        # Each block's values re-encoded within one step of the 8-bit grid of its block:
        # the saved values' largest magnitude bounds the error of either encoding.
        assert np.max(np.abs(a - b)) <= 2 * np.max(np.abs(a)) / 8, field
    if how == "manager":
        ckptr.close()


@pytest.mark.xfail(
    strict=True,
    reason="a checkpoint does not record block_size: another block size cutting the last "
    "axis into as many blocks (512 elements: 256 and 300 both make 2) restores without "
    "error, and the moments decode with the wrong block boundaries",
)
def test_another_block_size_with_as_many_blocks_is_refused_or_decodes_the_saved_values(tmp_path):
    saved = _trained(_tx(256))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", saved)
    ckptr.wait_until_finished()
    target = jax.eval_shape(_tx(300).init, PARAMS)
    try:
        restored = jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "c")
    except ValueError as err:
        assert "block_size" in str(err)
        return
    was = saved.inner_state[0].mu["w"].value()
    now = restored.inner_state[0].mu["w"].value()
    np.testing.assert_array_equal(np.asarray(now), np.asarray(was))
