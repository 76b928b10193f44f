"""jaxamp.TrainState and where_stepped: a skipped step writes no model state.

A real Flax linen model with BatchNorm (mutable ``batch_stats`` passed to
``apply_gradients``), an nnx model with ``BatchStat`` Variables, and fp8
metadata in a ``FrozenDict``: on a skipped step every one of them keeps its old
value bit for bit; on a taken step each is written.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from flax.core import FrozenDict, freeze
from flax.training import train_state

import jaxamp


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(1)(nn.relu(x))


class _BNTrainState(jaxamp.TrainState):
    batch_stats: dict


def _linen_setup():
    model = _BNNet()
    x = jax.random.normal(jax.random.key(0), (16, 4))
    variables = model.init(jax.random.key(1), x)
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8))
    state = _BNTrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )
    return model, x, state


@jax.jit
def _train_step(state, x):
    def loss_fn(params):
        y, new = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
        )
        return jnp.mean(y**2), new["batch_stats"]

    (_, stats), grads = jaxamp.value_and_grad(loss_fn, has_aux=True)(state, state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats)


def test_train_state_keeps_batch_stats_on_a_skipped_step() -> None:
    _, x, state = _linen_setup()
    state = jax.device_put(state)  # `step` starts as a Python int
    bad = x.at[3, 1].set(jnp.inf)  # the batch's statistics are NaN, and so are its grads
    with jax.transfer_guard("disallow"):
        taken = _train_step(state, x)
        skipped = _train_step(taken, bad)
        again = _train_step(skipped, x)
    # A taken step writes the statistics.
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), taken.batch_stats, state.batch_stats)
    assert all(jax.tree.leaves(changed))
    # A skipped step keeps params, inner state and statistics bit for bit.
    assert bool(jaxamp.metrics(skipped.opt_state)["skipped"])
    for before, after in (
        (taken.params, skipped.params),
        (taken.batch_stats, skipped.batch_stats),
        (taken.opt_state.inner_state, skipped.opt_state.inner_state),
    ):
        jax.tree.map(np.testing.assert_array_equal, before, after)
    assert jaxamp.all_finite(skipped.batch_stats)
    assert int(skipped.step) == 2  # step counts calls, as Flax's does
    # Training goes on from the kept statistics.
    assert not bool(jaxamp.metrics(again.opt_state)["skipped"])
    assert jaxamp.all_finite(again.batch_stats)


def test_train_state_kwargs_of_another_structure_are_refused_by_name() -> None:
    _, _, state = _linen_setup()
    state = state.replace(batch_stats={"a": jnp.ones(2)})
    grads = jax.tree.map(jnp.zeros_like, state.params)
    with pytest.raises(ValueError, match="batch_stats="):
        state.apply_gradients(grads=grads, batch_stats={"a": jnp.ones(3)})


class _NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.lin(x))))


def test_where_stepped_keeps_nnx_batch_stats_on_a_skipped_step() -> None:
    model = _NNXNet(nnx.Rngs(0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(2.0**4))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, stats, opt_state, x):
        def loss_fn(params, stats):
            m = nnx.merge(graphdef, params, stats, copy=True)
            y = m(x)
            return jnp.mean(y**2), nnx.state(m, nnx.BatchStat)

        (_, new_stats), grads = jaxamp.value_and_grad(loss_fn, has_aux=True)(
            opt_state, params, stats
        )
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, jaxamp.where_stepped(opt_state, new_stats, stats), opt_state

    x = jax.random.normal(jax.random.key(0), (16, 4))
    bad = x.at[0, 0].set(jnp.nan)
    with jax.transfer_guard("disallow"):
        p1, s1, o1 = train_step(params, stats, opt_state, x)
        p2, s2, o2 = train_step(p1, s1, o1, bad)
    assert not bool(jaxamp.metrics(o1)["skipped"]) and bool(jaxamp.metrics(o2)["skipped"])
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), s1, stats)
    assert all(jax.tree.leaves(moved))
    jax.tree.map(np.testing.assert_array_equal, s1, s2)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


def _fp8_trees(frozen: bool):
    params = {
        "params": {"w": jnp.ones(3)},
        "_overwrite_with_gradient": {"amax_history": jnp.full(4, 2.0), "scale": jnp.ones(())},
    }
    grads = {
        "params": {"w": jnp.full(3, 0.5)},
        "_overwrite_with_gradient": {"amax_history": jnp.full(4, 7.0), "scale": jnp.full((), 3.0)},
    }
    return (freeze(params), freeze(grads)) if frozen else (params, grads)


@pytest.mark.parametrize("frozen", [False, True], ids=["dict", "FrozenDict"])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_fp8_metadata_is_overwritten_never_stepped(frozen: bool, inner: str) -> None:
    params, grads = _fp8_trees(frozen)
    opt = optax.sgd(0.1) if inner == "sgd" else optax.adam(0.1)
    tx = jaxamp.skip_nonfinite(opt, jaxamp.static_scale(1.0))
    state = jaxamp.TrainState.create(apply_fn=None, params=params["params"], tx=tx)
    state = state.replace(params=params)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    assert isinstance(new.params, FrozenDict) == frozen
    meta = new.params["_overwrite_with_gradient"]
    np.testing.assert_array_equal(meta["amax_history"], np.full(4, 7.0))
    np.testing.assert_array_equal(meta["scale"], 3.0)
    assert not np.allclose(new.params["params"]["w"], 1.0)  # the params did step
    # A skipped step keeps the old metadata too (an overflowed step's amax is not kept).
    bad = jax.tree.map(lambda x: x, grads)
    bad = (freeze if frozen else dict)({**bad, "params": {"w": jnp.array([jnp.inf, 0.0, 0.0])}})
    kept = jax.jit(lambda s, g: s.apply_gradients(grads=g))(new, bad)
    jax.tree.map(np.testing.assert_array_equal, kept.params, new.params)


def test_where_stepped_under_multi_transform_keeps_state_when_any_part_skips() -> None:
    tx = jaxamp.multi_transform({"a": optax.sgd(1.0), "b": optax.sgd(1.0)}, {"x": "a", "y": "b"})
    params = {"x": jnp.ones(2), "y": jnp.ones(2)}
    opt_state = tx.init(params)
    old, new = {"m": jnp.zeros(2)}, {"m": jnp.ones(2)}
    _, o = jaxamp.step(tx, {"x": jnp.ones(2), "y": jnp.ones(2)}, opt_state, params)
    np.testing.assert_array_equal(jaxamp.where_stepped(o, new, old)["m"], 1.0)
    _, o = jaxamp.step(tx, {"x": jnp.ones(2), "y": jnp.array([jnp.nan, 1.0])}, opt_state, params)
    np.testing.assert_array_equal(jaxamp.where_stepped(o, new, old)["m"], 0.0)


def test_where_stepped_never_skips_without_a_check() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.no_scale())
    params = {"x": jnp.ones(2)}
    _, o = jaxamp.step(tx, {"x": jnp.array([jnp.inf, 0.0])}, tx.init(params), params)
    assert bool(jaxamp.stepped(o))


# Flax's own TrainState is the reference: the same call, the same result on a finite
# step; on a skipped step the model state keeps its old values.
class _FlaxBNState(train_state.TrainState):
    batch_stats: Any


class _OursBNState(jaxamp.TrainState):
    batch_stats: Any


def _frozen_bn_pair():
    model = _BNNet()
    x = jax.random.normal(jax.random.key(0), (16, 4))
    variables = model.init(jax.random.key(1), x)
    stats = freeze(variables["batch_stats"])  # as a state built from flax.core.freeze holds it
    kw = {"apply_fn": model.apply, "params": variables["params"], "batch_stats": stats}
    ref = _FlaxBNState.create(tx=optax.sgd(0.1), **kw)
    ours = _OursBNState.create(
        tx=jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(1.0)), **kw
    )

    def grads_and_stats(state, x):
        def loss_fn(params):
            y, new = model.apply(
                {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
            )
            return jnp.mean(y**2), new["batch_stats"]  # a plain dict

        (_, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return grads, new

    return ref, ours, x, grads_and_stats


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_dict_for_a_frozen_dict_field_is_stored_as_flax_stores_it(jit: bool) -> None:
    ref, ours, x, grads_and_stats = _frozen_bn_pair()
    grads, new = grads_and_stats(ref, x)
    assert isinstance(ours.batch_stats, FrozenDict) and type(new) is dict
    apply = lambda s, g, b: s.apply_gradients(grads=g, batch_stats=b)
    apply = jax.jit(apply) if jit else apply
    want, got = apply(ref, grads, new), apply(ours, grads, new)
    assert type(got.batch_stats) is type(want.batch_stats)
    assert jax.tree.structure(got.batch_stats) == jax.tree.structure(want.batch_stats)
    jax.tree.map(np.testing.assert_array_equal, got.batch_stats, want.batch_stats)
    # sgd in float32: p - 0.1 * g either way; jaxamp unscales by 1.0 (exact).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-7, atol=1e-8),
        got.params,
        want.params,
    )
    # A skipped step: Flax's return type, the old values.
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)
    poisoned = jax.tree.map(lambda s: jnp.full_like(s, jnp.nan), new)
    kept = apply(got, bad, poisoned)
    assert bool(jaxamp.metrics(kept.opt_state)["skipped"])
    assert type(kept.batch_stats) is type(want.batch_stats)
    jax.tree.map(np.testing.assert_array_equal, kept.batch_stats, got.batch_stats)


class _FlaxPhased(train_state.TrainState):
    phase: str = struct.field(pytree_node=False, default="a")
    weight: Any = 1.0  # a pytree field given a Python number


class _OursPhased(jaxamp.TrainState):
    phase: str = struct.field(pytree_node=False, default="a")
    weight: Any = 1.0


@pytest.mark.parametrize("finite", [True, False], ids=["taken", "skipped"])
def test_static_fields_and_non_array_values_are_replaced_as_flax_does(finite: bool) -> None:
    params = {"w": jnp.ones(2)}
    ref = _FlaxPhased.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(1.0))
    ours = _OursPhased.create(apply_fn=None, params=params, tx=tx)
    grads = {"w": jnp.array([1.0, 2.0 if finite else jnp.inf])}
    want = ref.apply_gradients(grads=grads, phase="b", weight=0.5)
    got = ours.apply_gradients(grads=grads, phase="b", weight=0.5)
    assert (got.phase, got.weight) == (want.phase, want.weight) == ("b", 0.5)
    assert bool(jaxamp.stepped(got.opt_state)) == finite
    # Under jit the static field is part of the state's structure, as with Flax.
    jitted = jax.jit(lambda s, g: s.apply_gradients(grads=g, phase="c"))(ours, grads)
    assert jitted.phase == "c"


def test_a_chain_with_transformations_after_the_guard_is_refused() -> None:
    # What follows skip_nonfinite in an optax.chain runs on a skipped step too:
    # weight decay would move the params of a step the state reports as skipped.
    params = {"w": jnp.ones(3)}
    guard = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(4.0))
    tx = optax.chain(guard, optax.add_decayed_weights(0.5))
    state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(ValueError, match=r"Put them inside: jaxamp.skip_nonfinite\(optax.chain"):
        state.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0, 1.0])})
    with pytest.raises(ValueError, match="still run on a skipped step"):
        jaxamp.step(tx, {"w": jnp.ones(3)}, tx.init(params), params)
    wrapped = [
        optax.named_chain(("guard", guard), ("wd", optax.add_decayed_weights(0.5))),
        optax.chain(optax.chain(guard), optax.add_decayed_weights(0.5)),
        optax.MultiSteps(tx, 1),
        optax.partition({"x": tx}, {"w": "x"}),
    ]
    for other in wrapped:
        with pytest.raises(ValueError, match="still run on a skipped step"):
            jaxamp.step(other, {"w": jnp.ones(3)}, other.init(params), params)
    # The guard last in a chain is refused too: clipping before it would see scaled
    # gradients (issue 43; tests/loss_scale/test_placement.py has every structure).
    before = optax.chain(optax.clip_by_global_norm(1.0), guard)
    with pytest.raises(ValueError, match="see the scaled, unchecked gradients"):
        jaxamp.step(before, {"w": jnp.ones(3)}, before.init(params), params)
