"""``jaxamp.explain`` on the shapes a user brings, named as the user reads the model.

Flax fp8 metadata in a TrainState (left out, as no optimizer sees it), nnx params
held in a TrainState (named as through ``jaxamp.nnx.Optimizer``: ``up.kernel``),
and params of another tree than ``tx.init`` saw (refused by name, also after an
orbax round trip, whose checkpoint holds nothing new).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxamp


def test_fp8_metadata_is_left_out_as_the_optimizer_leaves_it_out() -> None:
    params = {
        "params": {"v": jnp.ones(3), "w": jnp.ones(2)},
        "_overwrite_with_gradient": {"amax_history": jnp.ones(4), "scale": jnp.ones(())},
    }
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(1.0))
    # Flax's create gives tx.init only params["params"], as apply_gradients steps it.
    state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=tx)
    grads = {
        "params": {"v": jnp.array([1.0, jnp.inf, 0.0]), "w": jnp.ones(2)},
        "_overwrite_with_gradient": {"amax_history": jnp.ones(4), "scale": jnp.ones(())},
    }
    state = state.apply_gradients(grads=grads)
    why = jaxamp.explain(state)
    assert why.last == ("v",) and why.n_leaves == 2
    assert jaxamp.explain(state.opt_state, state.params).last == ("v",)


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(3, 8, rngs=rngs)
        self.down = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def test_nnx_params_in_a_train_state_are_named_as_in_the_model() -> None:
    # The lm1b_nnx shape: nnx.split, then a Flax-style TrainState over the Param state.
    graphdef, params, rest = nnx.split(_Net(nnx.Rngs(0)), nnx.Param, ...)
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale())
    state = jaxamp.TrainState.create(apply_fn=graphdef.apply, params=params, tx=tx)

    @jax.jit
    def train(state, x, blow):
        def loss_fn(p):
            y = nnx.merge(graphdef, p, rest)(x)
            return jnp.mean(y**2) + jnp.sum(p["up"]["kernel"][...]) * blow

        _, grads = jaxamp.value_and_grad(loss_fn)(state, state.params)
        return state.apply_gradients(grads=grads)

    x = jnp.ones((4, 3))
    state = train(train(state, x, jnp.float32(0.0)), x, jnp.float32(jnp.inf))
    through_state = jaxamp.explain(state)
    assert through_state.last == ("up.kernel",)

    # The same model stepped by the nnx optimizer: the same names.
    model = _Net(nnx.Rngs(0))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_nnx(model, optimizer, x, blow):
        def loss_fn(m, x):
            return jnp.mean(m(x) ** 2) + jnp.sum(m.up.kernel[...]) * blow

        _, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x)
        optimizer.update(model, grads)

    train_nnx(model, optimizer, x, jnp.float32(0.0))
    train_nnx(model, optimizer, x, jnp.float32(jnp.inf))
    through_optimizer = jaxamp.explain(optimizer, model)
    assert through_optimizer.last == through_state.last
    assert list(through_optimizer.counts) == list(through_state.counts) == ["up.kernel"]
    # Flax's own nnx.Optimizer with a jaxamp tx is read the same way.
    plain = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert jaxamp.explain(plain, model).n_leaves == 4


def _planted():
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    params = {"enc": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}, "head": jnp.ones(3)}
    grads = jax.tree.map(jnp.ones_like, params)
    grads["head"] = grads["head"].at[0].set(jnp.inf)
    params, state = jaxamp.step(tx, grads, tx.init(params), params)
    return tx, params, state


def test_params_of_another_tree_with_as_many_leaves_are_refused_by_name() -> None:
    tx, params, state = _planted()
    assert jaxamp.explain(state, params).last == ("head",)
    # Three leaves as well, but other names: on 0.3 this named `b` as the bad leaf.
    other = {"a": jnp.ones((4, 3)), "b": jnp.ones(3), "c": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"leaf 0 is `a` of shape \(4, 3\), where tx.init saw "):
        jaxamp.explain(state, other)
    # The same names, other shapes (the bias and the head swapped in size).
    swapped = {"enc": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(5)}, "head": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"`enc.bias` of shape \(5,\), where tx.init saw "):
        jaxamp.explain(state, swapped)
    # Replicated (pmap-style) params and record: a leading device axis on both is fine.
    replicated = jax.tree.map(lambda x: jnp.stack([x, x]), (state, params))
    assert jaxamp.explain(*replicated).last == ("head",)


def test_the_layout_survives_a_checkpoint_that_stores_nothing_new(tmp_path) -> None:
    tx, params, state = _planted()
    # The checkpoint holds the counts alone, as jaxamp 0.3 wrote it: the same leaves.
    assert [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(state.nonfinite_leaves)[0]
    ] == [".signed_counts"]
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "c", state)
        ckptr.wait_until_finished()
        target = jax.eval_shape(tx.init, params)  # the restore target brings the layout
        restored = jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "c")
    assert jaxamp.explain(restored, params).last == ("head",)
    with pytest.raises(ValueError, match="is not the tree this optimizer state"):
        jaxamp.explain(restored, {"a": jnp.ones((4, 3)), "b": jnp.ones(3), "c": jnp.ones(3)})
