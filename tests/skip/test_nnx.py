"""jaxamp.nnx: the nnx.Optimizer with a fused, whole-step skip, and value_and_grad.

A real nnx model with BatchNorm and Dropout (BatchStat and RNG counters are
model state the forward writes), trained with ``nnx.jit``, with ``jax.jit`` over
split / merge, and with ``nnx.scan`` over steps; checkpoints through orbax.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxamp


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))


def _setup(wrt=nnx.Param, every_k: int = 1, init_scale: float = 2.0**8, growth_interval=3):
    model = Net(nnx.Rngs(0))
    ls = jaxamp.dynamic_scale(init_scale, growth_interval=growth_interval)
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), ls, every_k=every_k)
    return model, jaxamp.nnx.Optimizer(model, tx, wrt=wrt)


def _loss(model: Net, x: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - 1.0) ** 2)


@nnx.jit
def _train_step(model, optimizer, x):
    loss, grads = jaxamp.nnx.value_and_grad(_loss)(optimizer, model, x)
    optimizer.update(model, grads)
    return loss, jaxamp.metrics(optimizer.opt_state)


def _snapshot(*nodes):
    """Every array of the nodes' state (PRNG keys as their data), on the host."""

    def host(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [jax.tree.map(host, nnx.state(n)) for n in nodes]


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


X = jax.random.normal(jax.random.key(1), (32, 4))
BAD = X.at[5, 2].set(jnp.inf)


def test_a_skipped_step_changes_nothing_but_the_loss_scale_counters() -> None:
    model, optimizer = _setup()
    with jax.transfer_guard("disallow"):
        _train_step(model, optimizer, X)
        before = _snapshot(model)
        step_before = int(optimizer.step)
        inner_before = _snapshot(optimizer)[0]["opt_state"]["inner_state"]
        _, m = _train_step(model, optimizer, BAD)
    assert bool(m["skipped"]) and int(m["skipped_steps"]) == 1
    assert _equal(before, _snapshot(model))  # Param, BatchStat, RNG counts
    assert _equal(inner_before, _snapshot(optimizer)[0]["opt_state"]["inner_state"])
    assert int(optimizer.step) == step_before == 1  # the step counter counts steps taken
    with jax.transfer_guard("disallow"):
        _, m = _train_step(model, optimizer, X)
    assert not bool(m["skipped"]) and int(optimizer.step) == 2
    assert not _equal(before, _snapshot(model))


def test_a_taken_step_writes_model_state_as_plain_nnx_does() -> None:
    model = Net(nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(2.0**8))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_model = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    for _ in range(3):
        _train_step(model, optimizer, X)
        ref_step(ref_model, ref_opt, X)
    # Params, BatchStat and RNG state as Flax's own optimizer writes them (two
    # programs compiled apart: equal up to float32 rounding).
    got, want = _snapshot(model)[0], _snapshot(ref_model)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
    assert not _equal(_snapshot(Net(nnx.Rngs(0))), [got])  # and it did train
    assert int(optimizer.step) == int(ref_opt.step) == 3


def test_metrics_are_plain_arrays_that_log_as_json() -> None:
    model, optimizer = _setup()
    _, first = _train_step(model, optimizer, X)
    for m in (first, jaxamp.metrics(optimizer.opt_state), jaxamp.metrics(optimizer.loss_scale)):
        assert all(type(v) is type(jnp.zeros(())) for v in m.values()), m
        json.dumps({k: v.item() for k, v in m.items()})
    assert isinstance(optimizer.loss_scale, jaxamp.LossScaleState)
    assert float(optimizer.loss_scale.scale) == 2.0**8


def test_jax_jit_with_split_and_merge() -> None:
    model, optimizer = _setup()
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = jaxamp.nnx.value_and_grad(_loss)(optimizer, model, x)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    state, _ = step(state, X)
    kept, _ = step(state, BAD)
    model_a, opt_a = nnx.merge(graphdef, state)
    model_b, opt_b = nnx.merge(graphdef, kept)
    assert _equal(_snapshot(model_a), _snapshot(model_b))
    assert int(opt_b.step) == int(opt_a.step) == 1
    assert bool(jaxamp.metrics(opt_b.opt_state)["skipped"])


def test_nnx_scan_over_steps_with_remat_inside() -> None:
    model, optimizer = _setup()
    xs = jnp.stack([X, BAD, X, X])

    @nnx.jit
    def train(model, optimizer, xs):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(carry, x):
            model, optimizer = carry
            loss_fn = nnx.remat(_loss)
            loss, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x)
            optimizer.update(model, grads)
            return (model, optimizer), jaxamp.metrics(optimizer.opt_state)["skipped"]

        _, skipped = body((model, optimizer), xs)
        return skipped

    skipped = train(model, optimizer, xs)
    np.testing.assert_array_equal(skipped, [False, True, False, False])
    assert int(optimizer.step) == 3


def test_wrt_filter_is_respected_and_argnums_diffstate() -> None:
    only_out = nnx.All(nnx.Param, nnx.PathContains("out"))
    model, optimizer = _setup(wrt=only_out)
    lin_before = _snapshot(model.lin)

    @nnx.jit
    def step(model, optimizer, x):
        diff = nnx.DiffState(0, only_out)
        (loss, aux), grads = jaxamp.nnx.value_and_grad(
            lambda m, x: (_loss(m, x), {"n": x.shape[0]}), argnums=diff, has_aux=True
        )(optimizer, model, x)
        optimizer.update(model, grads)
        return loss, aux

    _, aux = step(model, optimizer, X)
    assert int(aux["n"]) == 32
    assert _equal(lin_before, _snapshot(model.lin))  # outside wrt: never stepped
    assert int(optimizer.step) == 1


def test_bad_tx_is_refused_with_what_to_do() -> None:
    with pytest.raises(TypeError, match="jaxamp.skip_nonfinite"):
        jaxamp.nnx.Optimizer(Net(nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)


def test_checkpoint_resume_is_bit_for_bit_and_restore_into_another_configuration(
    tmp_path,
) -> None:
    model, optimizer = _setup()
    for x in (X, BAD, X):
        _train_step(model, optimizer, x)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "c", nnx.state((model, optimizer)))
    for x in (X, X, BAD, X):
        _train_step(model, optimizer, x)
    # Resume into fresh objects of another configuration: every number comes from
    # the checkpoint (here the growth interval too), as for optax states.
    fresh_model, fresh_opt = _setup(init_scale=4.0, growth_interval=99)
    abstract = nnx.state((fresh_model, fresh_opt))
    with ocp.StandardCheckpointer() as ckpt:
        restored = jaxamp.checkpoint.restore(ckpt, abstract, directory=tmp_path / "c")
    nnx.update((fresh_model, fresh_opt), restored)
    assert int(fresh_opt.loss_scale.growth_interval) == 3
    for x in (X, X, BAD, X):
        _train_step(fresh_model, fresh_opt, x)
    assert _equal(_snapshot(model, optimizer), _snapshot(fresh_model, fresh_opt))


def test_restore_validates_an_nnx_loss_scale_state(tmp_path) -> None:
    model, optimizer = _setup()
    state = nnx.state((model, optimizer))
    ls = state[1]["opt_state"]["loss_scale"]
    ls["growth_tracker"] = ls["growth_tracker"].replace(jnp.array(-3, jnp.int32))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "bad", state)
    with ocp.StandardCheckpointer() as ckpt:
        with pytest.raises(ValueError, match="growth_tracker"):
            jaxamp.checkpoint.restore(ckpt, nnx.state(_setup()), directory=tmp_path / "bad")


def test_restore_validates_an_nnx_per_leaf_record(tmp_path) -> None:
    # nnx.state flattens the record into a mapping of its field: still validated.
    model, optimizer = _setup()
    state = nnx.state((model, optimizer))
    rec = state[1]["opt_state"]["nonfinite_leaves"]
    n = rec["signed_counts"].get_value().shape[0]
    rec["signed_counts"] = rec["signed_counts"].replace(jnp.full((n,), -(2**31), jnp.int32))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "bad", state)
    with ocp.StandardCheckpointer() as ckpt:
        with pytest.raises(ValueError, match="nonfinite_leaves.*invalid per-leaf"):
            jaxamp.checkpoint.restore(ckpt, nnx.state(_setup()), directory=tmp_path / "bad")
