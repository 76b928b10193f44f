"""Restoring into an optimizer built with another ``every_k`` names ``every_k``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxamp

PARAMS = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}


def _tx(k: int) -> optax.GradientTransformation:
    return jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(), every_k=k)


@pytest.mark.parametrize("saved_k,target_k", [(2, 1), (1, 2)])
def test_an_optax_state_restored_into_another_every_k_names_it(tmp_path, saved_k, target_k):
    state = {"params": PARAMS, "opt_state": _tx(saved_k).init(PARAMS)}
    target = {"params": PARAMS, "opt_state": _tx(target_k).init(PARAMS)}
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        with pytest.raises(ValueError, match=r"every_k.*Build the optimizer with the every_k"):
            jaxamp.checkpoint.restore(mngr, target, step=1)


@pytest.mark.parametrize("saved_k,target_k", [(2, 1), (1, 2)])
def test_an_nnx_optimizer_restored_into_another_every_k_names_it(tmp_path, saved_k, target_k):
    def make(k):
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        return model, jaxamp.nnx.Optimizer(model, _tx(k), wrt=nnx.Param)

    model, opt = make(saved_k)
    path = tmp_path / "c"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.state((model, opt)))
        ckptr.wait_until_finished()
        target = nnx.state(make(target_k))
        with pytest.raises(ValueError, match=r"every_k"):
            jaxamp.checkpoint.restore(ckptr, target, directory=path)


def test_the_same_every_k_restores_and_the_recipe_changes_it(tmp_path):
    # The message's recipe: restore with the saved every_k, carry the inner state and
    # the loss scale into a fresh state built with the new one.
    old = _tx(2).init(PARAMS)
    old = old._replace(loss_scale=old.loss_scale.replace(scale=jnp.float32(64.0)))
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, args=ocp.args.StandardSave({"opt_state": old}))
        mngr.wait_until_finished()
        back = jaxamp.checkpoint.restore(mngr, {"opt_state": _tx(2).init(PARAMS)}, step=1)
    old = back["opt_state"]
    new = _tx(4).init(PARAMS)._replace(inner_state=old.inner_state, loss_scale=old.loss_scale)
    assert float(jaxamp.get_loss_scale(new).scale) == 64.0 and int(new.mini_step) == 0
    updates, _ = _tx(4).update(jax.tree.map(jnp.ones_like, PARAMS), new, PARAMS)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))  # mid-window
