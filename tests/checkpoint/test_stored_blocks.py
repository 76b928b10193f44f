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
    assert "saved by jaxamp.low_precision_state with block_size=256." in msg, msg
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


def test_a_block_size_that_could_cut_as_many_blocks_elsewhere_is_refused_when_built():
    # 512 elements: 256 and 300 both make 2 blocks, cut at different places; a restore
    # from one into the other would read every moment with the wrong scales.
    with pytest.raises(ValueError, match=r"`block_size` must be a power of two.*got 300"):
        _tx(300)


@pytest.mark.parametrize("n", [1, 7, 100, 128, 129, 255, 256, 300, 512, 1000, 4097])
def test_powers_of_two_make_as_many_blocks_only_where_each_is_one_block(n):
    """Why powers of two suffice: where two of them give a row as many blocks, both give
    it one (the same decode), so any other restore fails on the scales' shape."""
    sizes = [2**e for e in range(14)]
    for a in sizes:
        for b in sizes:
            if a != b and -(-n // a) == -(-n // b):
                assert n <= min(a, b), (n, a, b)


def test_a_restore_into_another_power_of_two_with_one_block_reads_the_saved_values(tmp_path):
    params = {"w": jnp.ones((4, 96))}  # one block at 128 and at 256
    tx = lambda b: jaxamp.low_precision_state(  # noqa: E731
        optax.adam(1e-2), "8bit", block_size=b, min_size=0
    )
    state = tx(256).init(params)
    g = {"w": jax.random.normal(jax.random.key(1), (4, 96))}
    _, state = jax.jit(tx(256).update)(g, state, params)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", state)
    ckptr.wait_until_finished()
    target = jax.eval_shape(tx(128).init, params)
    back = jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "c")
    for field in ("mu", "nu"):
        was = getattr(state.inner_state[0], field)["w"].value()
        now = getattr(back.inner_state[0], field)["w"].value()
        np.testing.assert_array_equal(np.asarray(now), np.asarray(was))
