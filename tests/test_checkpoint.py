"""Orbax round trips of jaxamp states: bit-for-bit resumes and a clear error for what is missing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp
from jaxamp._loss_scale import LossScaleState


def _assert_trees_equal(a, b) -> None:
    """Same structure, and every leaf equal bit for bit with the same dtype."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _advanced_dynamic() -> LossScaleState:
    s = jaxamp.dynamic_scale(
        init_scale=2.0**10,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=7,
        hysteresis=4,
        min_scale=2.0,
        max_scale=2.0**20,
        max_consecutive_nonfinite=9,
    )
    for finite in (True, True, False, True, False, False):
        s = jaxamp.update(s, jnp.array(finite))
    return s.replace(growth_factor=4.0)  # run-time reconfiguration is stored too


@pytest.mark.parametrize(
    "make",
    [
        _advanced_dynamic,
        lambda: jaxamp.update(jaxamp.static_scale(64.0, skip_nonfinite=False), jnp.array(False)),
        jaxamp.no_scale,
        lambda: jaxamp.compat.paddle_grad_scaler(decr_every_n_nan_or_inf=3),
    ],
    ids=["dynamic", "static", "none", "paddle"],
)
def test_loss_scale_state_round_trip_is_bit_for_bit(tmp_path, make) -> None:
    state = make()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ls", {"loss_scale": state})
    ckptr.wait_until_finished()
    restored = jaxamp.checkpoint.restore(
        ckptr, _abstract({"loss_scale": state}), directory=tmp_path / "ls"
    )["loss_scale"]
    assert isinstance(restored, LossScaleState)
    _assert_trees_equal(restored, state)
    assert (restored.dynamic, restored.enabled, restored.skip_nonfinite) == (
        state.dynamic,
        state.enabled,
        state.skip_nonfinite,
    )
    # The restored state goes on exactly as the original does.
    for finite in (False, False, True, False, True):
        state = jaxamp.update(state, jnp.array(finite))
        restored = jaxamp.update(restored, jnp.array(finite))
        _assert_trees_equal(restored, state)


def test_placeholder_trees_stay_placeholders() -> None:
    # orbax builds `jax.tree.map(lambda _: None, item)` for its save args; the
    # None of `max_consecutive_nonfinite` must not turn into the -1 sentinel there.
    placeholder = jax.tree.map(lambda _: None, jaxamp.dynamic_scale())
    assert all(getattr(placeholder, f) is None for f in ("scale", "max_consecutive_nonfinite"))
    assert jax.tree.leaves(placeholder) == []


# A small Flax TrainState run with growth and backoff in it.


def _setup():
    rng = np.random.default_rng(0)  # numpy, not jax.random: nothing to compile
    params = {
        "w1": jnp.asarray(rng.normal(size=(4, 16)) * 0.5, jnp.float32),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 1)) * 0.5, jnp.float32),
    }
    x = rng.normal(size=(12, 32, 4)).astype(np.float32)
    y = np.sin(x.sum(-1, keepdims=True))
    # One device array per step, put on the device before the transfer guard.
    x, y = [jnp.asarray(a) for a in x], [jnp.asarray(a) for a in y]
    tx = jaxamp.skip_nonfinite(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        jaxamp.dynamic_scale(init_scale=2.0**8, growth_interval=3, hysteresis=2),
    )
    return params, tx, x, y


def _apply(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


@jax.jit
def _train_step(state: jaxamp.TrainState, x, y, poison):
    def loss_fn(p):
        loss = jnp.mean((state.apply_fn(p, x) - y) ** 2)
        return jaxamp.scale(state.loss_scale, loss * poison)

    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


# poison = inf makes the step overflow; steps 3 and 4 form one hysteresis window.
_POISON = [1.0, 1.0, 1.0, np.inf, np.inf, 1.0, 1.0, 1.0, 1.0, np.inf, 1.0, 1.0]


def _run(state, x, y, poison, start, stop):
    state = jax.device_put(state)  # TrainState.create leaves `step` a Python int
    with jax.transfer_guard("disallow"):
        for i in range(start, stop):
            state = _train_step(state, x[i], y[i], poison[i])
    return state


def test_train_state_resumes_bit_for_bit_from_checkpoint_manager(tmp_path) -> None:
    params, tx, x, y = _setup()
    poison = [jnp.asarray(p, jnp.float32) for p in _POISON]
    state = jaxamp.TrainState.create(apply_fn=_apply, params=params, tx=tx)
    full = _run(state, x, y, poison, 0, len(_POISON))
    assert int(full.loss_scale.skipped_steps) == 3

    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mid = _run(state, x, y, poison, 0, 7)
        assert int(mid.loss_scale.growth_tracker) == 2  # saved mid growth interval
        mngr.save(7, args=ocp.args.StandardSave(mid))
        mngr.wait_until_finished()

    # A fresh manager, as after a restart; the target is abstract.
    target = jax.eval_shape(lambda: jaxamp.TrainState.create(apply_fn=_apply, params=params, tx=tx))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.latest_step() == 7
        restored = jaxamp.checkpoint.restore(mngr, target)
    _assert_trees_equal(restored, mid)
    resumed = _run(restored, x, y, poison, 7, len(_POISON))
    _assert_trees_equal(resumed, full)


# Checkpoints written without a loss-scale state.


def _plain_optax_checkpoint(tmp_path):
    params, tx, _, _ = _setup()
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    plain = {"params": params, "opt_state": inner.init(params)}
    target = _abstract({"params": params, "opt_state": tx.init(params)})
    return params, tx, inner, plain, target


def _assert_names_missing_loss_scale(err: pytest.ExceptionInfo) -> None:
    msg = str(err.value)
    assert "no loss-scale state at `opt_state.loss_scale`" in msg
    for field in ("scale", "growth_tracker", "hysteresis_tracker", "growth_factor"):
        assert field in msg
    assert "jaxamp.skip_nonfinite" in msg and "SkipNonfiniteState" in msg


def test_plain_optax_checkpoint_gives_a_clear_error_with_a_checkpointer(tmp_path) -> None:
    _, _, _, plain, target = _plain_optax_checkpoint(tmp_path)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "plain", plain)
    ckptr.wait_until_finished()
    with pytest.raises(ValueError) as err:
        jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "plain")
    _assert_names_missing_loss_scale(err)


@pytest.mark.parametrize("fresh_manager", [False, True])
def test_plain_optax_checkpoint_gives_a_clear_error_with_a_manager(tmp_path, fresh_manager) -> None:
    _, _, _, plain, target = _plain_optax_checkpoint(tmp_path)
    mngr = ocp.CheckpointManager(tmp_path / "plain")
    mngr.save(5, args=ocp.args.StandardSave(plain))
    mngr.wait_until_finished()
    if fresh_manager:  # one that has not learnt the item's handler yet
        mngr.close()
        mngr = ocp.CheckpointManager(tmp_path / "plain")
    with pytest.raises(ValueError) as err:
        jaxamp.checkpoint.restore(mngr, target)
    _assert_names_missing_loss_scale(err)
    assert "step 5" in str(err.value)
    mngr.close()


def test_migrating_a_plain_optax_checkpoint(tmp_path) -> None:
    # The recipe the error message gives: restore the inner state, wrap it.
    params, tx, inner, plain, _ = _plain_optax_checkpoint(tmp_path)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "plain", plain)
    ckptr.wait_until_finished()
    old = jaxamp.checkpoint.restore(
        ckptr,
        {"params": _abstract(params), "opt_state": jax.eval_shape(inner.init, params)},
        directory=tmp_path / "plain",
    )
    opt_state = jaxamp.SkipNonfiniteState(old["opt_state"], jaxamp.dynamic_scale(2.0**8))
    assert jax.tree.structure(opt_state) == jax.tree.structure(tx.init(params))
    _assert_trees_equal(opt_state.inner_state, plain["opt_state"])
    new_params, _ = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))(
        jax.tree.map(jnp.ones_like, params), opt_state, old["params"]
    )
    assert bool(jaxamp.all_finite(new_params))


def test_check_restorable_accepts_a_matching_checkpoint_and_names_other_gaps(tmp_path) -> None:
    params, tx, _, _, target = _plain_optax_checkpoint(tmp_path)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ok", {"params": params, "opt_state": tx.init(params)})
    ckptr.wait_until_finished()
    meta = ckptr.metadata(tmp_path / "ok")
    jaxamp.checkpoint.check_restorable(meta, target)  # quiet
    bigger = dict(target, extra={"w3": jax.ShapeDtypeStruct((2,), jnp.float32)})
    with pytest.raises(ValueError, match=r"lacks 1 leaves the target needs: `extra\.w3`"):
        jaxamp.checkpoint.check_restorable(meta, bigger)


def test_restore_argument_errors(tmp_path) -> None:
    with pytest.raises(TypeError, match="directory="):
        jaxamp.checkpoint.restore(ocp.StandardCheckpointer(), {})
    with ocp.CheckpointManager(tmp_path / "empty") as mngr:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            jaxamp.checkpoint.restore(mngr, {})
