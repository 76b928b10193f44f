"""Orbax round trips of jaxamp states: bit-for-bit resumes and a clear error for what is missing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

LossScaleState = jaxamp.LossScaleState


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
        lambda: jaxamp.update(jaxamp.static_scale(64.0, check_finite=False), jnp.array(False)),
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
    assert (restored.dynamic, restored.enabled, restored.check_finite) == (
        state.dynamic,
        state.enabled,
        state.check_finite,
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
    assert "jaxamp.skip_nonfinite" in msg and "tx.init(params)._replace(inner_state=" in msg


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
    opt_state = tx.init(params)._replace(inner_state=old["opt_state"])
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
    # A path where the checkpointer goes: say what to pass instead.
    for path in ("some/path", tmp_path / "ckpt"):
        with pytest.raises(TypeError, match=r"directory=.*StandardCheckpointer"):
            jaxamp.checkpoint.restore(path, {})
    with pytest.raises(TypeError, match="orbax checkpointer"):
        jaxamp.checkpoint.restore(42, {})


# Missing and corrupted checkpoints: orbax's own error comes through.


def _small_state():
    params = {"w": jnp.arange(4.0)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    return {"params": params, "opt_state": tx.init(params)}


def _corrupt(item: Path, how: str) -> None:
    """Damages an orbax item directory as a crash, a full disk or a bad copy would."""
    if how == "missing":
        shutil.rmtree(item)
        return
    name, action = how.split(":")
    files = sorted(item.glob("d/*")) if name == "d" else [item / name]
    assert files and all(f.is_file() for f in files), (how, sorted(item.iterdir()))
    for f in files:
        if action == "delete":
            f.unlink()
        else:
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])


_CORRUPTIONS = [
    "missing",
    "_METADATA:delete",
    "_METADATA:truncate",
    "manifest.ocdbt:delete",
    "manifest.ocdbt:truncate",
    "d:delete",
    "d:truncate",
]


def _error(fn) -> Exception:
    with pytest.raises(Exception) as err:
        fn()
    return err.value


def _assert_is_orbax_error(ours: Exception, orbax_own: Exception) -> None:
    # 0.1.0 (and the metadata probe before the restore) said "the checkpoint has no
    # loss-scale state" for every one of these.
    assert "loss-scale" not in str(ours)
    assert type(ours) is type(orbax_own)
    # Same error; which leaf orbax reads first (named in the message) may vary.
    assert str(ours).split(":")[0] == str(orbax_own).split(":")[0]


@pytest.mark.parametrize("how", _CORRUPTIONS)
def test_corrupted_checkpoint_raises_orbax_error_with_a_checkpointer(tmp_path, how) -> None:
    state = _small_state()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", state)
    ckptr.wait_until_finished()
    _corrupt(tmp_path / "c", how)
    target = _abstract(state)
    orbax_own = _error(lambda: ckptr.restore(tmp_path / "c", target))
    ours = _error(lambda: jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "c"))
    _assert_is_orbax_error(ours, orbax_own)
    assert any(str(tmp_path / "c") in note for note in getattr(ours, "__notes__", []))


@pytest.mark.parametrize("how", _CORRUPTIONS[1:])
def test_corrupted_checkpoint_raises_orbax_error_with_a_manager(tmp_path, how) -> None:
    state = _small_state()
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(3, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    _corrupt(tmp_path / "m" / "3" / "default", how)
    target = _abstract(state)
    with ocp.CheckpointManager(tmp_path / "m") as mngr:  # fresh, as after a restart
        orbax_own = _error(lambda: mngr.restore(3, args=ocp.args.StandardRestore(target)))
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        ours = _error(lambda: jaxamp.checkpoint.restore(mngr, target))
    _assert_is_orbax_error(ours, orbax_own)


def test_missing_step_or_item_with_a_manager_is_named(tmp_path) -> None:
    # orbax says "Must provide `args` of type `Composite` ..." for both; 0.1.0 added a
    # KeyError or "no loss-scale state".
    state = _small_state()
    target = _abstract(state)
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 7 in .*\[1, 2\]"):
            jaxamp.checkpoint.restore(mngr, target, step=7)
    shutil.rmtree(tmp_path / "m" / "2" / "default")
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        with pytest.raises(ValueError, match="step 2 in .* holds no readable item") as err:
            jaxamp.checkpoint.restore(mngr, target)
        assert "loss-scale" not in str(err.value)
    # The intact step, from a fresh manager: after reading step 2, orbax's manager
    # takes this directory for a multi-item one (plain orbax's restore does the same).
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        _assert_trees_equal(jaxamp.checkpoint.restore(mngr, target, step=1), state)


def test_check_restorable_on_unreadable_metadata_says_so(tmp_path) -> None:
    state = _small_state()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", state)
    ckptr.wait_until_finished()
    (tmp_path / "c" / "_METADATA").unlink()
    with pytest.raises(ValueError, match="no readable metadata") as err:
        jaxamp.checkpoint.check_restorable(ckptr.metadata(tmp_path / "c"), _abstract(state))
    assert "loss-scale" not in str(err.value)


# Restores log nothing plain orbax does not.


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_restore_logs_nothing_plain_orbax_does_not(tmp_path, caplog) -> None:
    state = _small_state()
    target = _abstract(state)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "c", state)
    ckptr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()

    caplog.set_level(logging.WARNING)
    caplog.clear()
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.restore(0, args=ocp.args.StandardRestore(target))
    ckptr.restore(tmp_path / "c", target)
    plain = set(_warnings(caplog))

    caplog.clear()
    with ocp.CheckpointManager(tmp_path / "m") as mngr:  # a fresh manager: 0.1.0 warned twice
        _assert_trees_equal(jaxamp.checkpoint.restore(mngr, target), state)
    _assert_trees_equal(jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "c"), state)
    ours = _warnings(caplog)
    assert not [m for m in ours if "could not be restored" in m], ours
    assert set(ours) <= plain, set(ours) - plain


# Restored loss-scale states are validated.


def _hostile(state: LossScaleState, **values) -> LossScaleState:
    """``state`` with leaves swapped in as a hand-edited checkpoint would hold them."""
    leaves = dict(zip(jaxamp.loss_scale._state.FIELDS, jax.tree.leaves(state), strict=True))
    for name, v in values.items():
        leaves[name] = jnp.asarray(v, leaves[name].dtype)
    return jax.tree.unflatten(jax.tree.structure(state), list(leaves.values()))


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"growth_tracker": -3}, "growth_tracker"),
        ({"skipped_steps": -1}, "skipped_steps"),
        ({"scale": 0.0}, "scale"),
        ({"scale": np.inf}, "scale"),
        ({"scale": np.nan}, "scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "scale": 6.0}, "min_scale"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"hysteresis": 0}, "hysteresis"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None,
)
def test_restore_rejects_a_hand_edited_loss_scale_state(tmp_path, edit, field) -> None:
    params = {"w": jnp.ones(3)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    good = {"params": params, "opt_state": tx.init(params)}
    bad = dict(
        good,
        opt_state=good["opt_state"]._replace(
            loss_scale=_hostile(good["opt_state"].loss_scale, **edit)
        ),
    )
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "bad", bad)
    ckptr.wait_until_finished()
    with pytest.raises(ValueError) as err:
        jaxamp.checkpoint.restore(ckptr, _abstract(good), directory=tmp_path / "bad")
    msg = str(err.value)
    assert f"the checkpoint {tmp_path / 'bad'} at `opt_state.loss_scale`" in msg
    assert f"{field} " in msg and "invalid loss-scale state" in msg


def test_restore_validates_each_replica_and_reads_only_loss_scale_scalars(
    tmp_path, monkeypatch
) -> None:
    # A replicated state (leading device axis, as pmap keeps it) next to large params.
    good = jaxamp.dynamic_scale()
    bad = _hostile(good, hysteresis_tracker=5)  # > hysteresis (1)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), good, bad)
    tree = {"params": jnp.ones(4096), "loss_scale": stacked}
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "r", tree)
    ckptr.wait_until_finished()

    fetched = []
    device_get = jax.device_get

    def spy(x):
        fetched.extend(np.size(leaf) for leaf in jax.tree.leaves(x))
        return device_get(x)

    monkeypatch.setattr(jax, "device_get", spy)
    with pytest.raises(ValueError, match=r"`loss_scale` \(replica \(1,\)\).*hysteresis_tracker"):
        jaxamp.checkpoint.restore(ckptr, _abstract(tree), directory=tmp_path / "r")
    assert fetched and max(fetched) <= 2  # the loss-scale leaves, never the params
    ok = jax.tree.map(lambda a: jnp.stack([a, a]), good)
    ckptr.save(tmp_path / "ok", {"params": tree["params"], "loss_scale": ok})
    ckptr.wait_until_finished()
    restored = jaxamp.checkpoint.restore(ckptr, _abstract(tree), directory=tmp_path / "ok")
    _assert_trees_equal(restored["loss_scale"], ok)


# Restoring into a target built with another configuration (issue 10 item 7).


def test_restore_into_another_configuration_takes_the_checkpoints_numbers(tmp_path) -> None:
    # The case. 0.1.0 restored the numbers but kept the target's static flag
    # "the scale cannot drop below 1": it checked the *scaled* gradients, [20000, 1]
    # in float16 unscaled by 1/0.25 to -inf, and jaxamp.step applied it. Fails on 0.1.0.
    params = {"w": jnp.zeros(2)}  # float32 master params, float16 gradients (compressed)
    saved_tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.compat.torch_grad_scaler(0.25))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "torch", {"params": params, "opt_state": saved_tx.init(params)})
    ckptr.wait_until_finished()

    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.dynamic_scale())  # min_scale=1, max 2**24
    target = _abstract({"params": params, "opt_state": tx.init(params)})
    restored = jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "torch")
    grads = {"w": jnp.array([20000.0, 1.0], jnp.float16)}
    new_params, opt_state = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))(
        grads, restored["opt_state"], restored["params"]
    )
    _assert_trees_equal(new_params, params)  # skipped: nothing applied (0.1.0: [-inf, -4])

    ls = jaxamp.get_loss_scale(restored["opt_state"])
    _assert_trees_equal(ls, jaxamp.compat.torch_grad_scaler(0.25))  # every number saved
    assert ls.mode == "dynamic"  # the mode: the target's
    ls = jaxamp.get_loss_scale(opt_state)
    assert int(ls.skipped_steps) == 1 and float(ls.scale) == 0.125  # torch's backoff, no floor


def test_restore_into_another_mode_keeps_numbers_or_says_why_not(tmp_path) -> None:
    dynamic = _advanced_dynamic()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "d", {"ls": dynamic})
    ckptr.wait_until_finished()
    static = jaxamp.checkpoint.restore(
        ckptr, _abstract({"ls": jaxamp.static_scale(4.0)}), directory=tmp_path / "d"
    )["ls"]
    assert static.mode == "static"
    _assert_trees_equal(jax.tree.leaves(static), jax.tree.leaves(dynamic))
    assert float(jaxamp.update(static, jnp.array(False)).scale) == float(dynamic.scale)
    # A disabled state must have scale 1: the saved scale cannot be restored into one.
    with pytest.raises(ValueError, match=r"scale must be 1 in mode 'disabled'.*mode from the"):
        jaxamp.checkpoint.restore(
            ckptr, _abstract({"ls": jaxamp.no_scale()}), directory=tmp_path / "d"
        )


def test_a_checkpoint_without_the_per_leaf_record_is_named_and_resumes(tmp_path) -> None:
    # jaxamp 0.2 wrote skip_nonfinite states without `nonfinite_leaves`. Restoring one
    # into a 0.3 target names the cause; the recipe in the message resumes it.
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    old = {"params": params, "opt_state": tx.init(params)._replace(nonfinite_leaves=None)}
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "v02", old)
    ckptr.wait_until_finished()
    target = _abstract({"params": params, "opt_state": tx.init(params)})
    with pytest.raises(ValueError, match=r"jaxamp < 0\.3") as err:
        jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "v02")
    assert "target._replace(nonfinite_leaves=None)" in str(err.value)
    old_target = dict(target, opt_state=target["opt_state"]._replace(nonfinite_leaves=None))
    got = jaxamp.checkpoint.restore(ckptr, old_target, directory=tmp_path / "v02")
    state = got["opt_state"]._replace(nonfinite_leaves=tx.init(params).nonfinite_leaves)
    assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
    _assert_trees_equal(state.inner_state, old["opt_state"].inner_state)
    bad = {"w": jnp.full((3, 2), jnp.inf), "b": jnp.ones(2)}
    _, state = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))(bad, state, got["params"])
    assert jaxamp.explain(state, params).last == ("w",)


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.one_of(st.integers(-(2**31), 2**31 - 1), st.just(-(2**31))), min_size=3, max_size=3)
)
def test_restore_takes_a_per_leaf_record_only_with_counts_in_range(tmp_path_factory, signed):
    # The record `jaxamp.explain` reads. Every int32 but -2**31 is a record (a count,
    # negative if the leaf was non-finite on the last skipped step): those come back
    # exactly; a hand-edited -2**31 (whose count would not fit) is refused by name.
    params = {"a": jnp.ones(3), "b": jnp.ones(()), "c": jnp.ones((2, 2))}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    good = {"params": params, "opt_state": tx.init(params)}
    # tx.init's record with other counts: its layout (static) is the target's too.
    record = good["opt_state"].nonfinite_leaves._replace(signed_counts=jnp.array(signed, jnp.int32))
    saved = dict(good, opt_state=good["opt_state"]._replace(nonfinite_leaves=record))
    path = tmp_path_factory.mktemp("record") / "ckpt"
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, saved)
    ckptr.wait_until_finished()
    if min(signed) == -(2**31):
        with pytest.raises(ValueError) as err:
            jaxamp.checkpoint.restore(ckptr, _abstract(good), directory=path)
        msg = str(err.value)
        assert "at `opt_state.nonfinite_leaves`" in msg and "must be >= -(2**31 - 1)" in msg
    else:
        got = jaxamp.checkpoint.restore(ckptr, _abstract(good), directory=path)
        _assert_trees_equal(got["opt_state"].nonfinite_leaves, record)
        why = jaxamp.explain(got["opt_state"], params)
        assert why.last == tuple(p for p, v in zip("abc", signed, strict=True) if v < 0)


def test_a_record_of_the_wrong_length_is_refused_when_the_step_traces() -> None:
    # A record restored for other params (another leaf count) is caught at trace time.
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    state = tx.init(params)._replace(nonfinite_leaves=tx.init({"a": jnp.ones(3)}).nonfinite_leaves)
    with pytest.raises(ValueError, match="tracks 1 gradient leaves but the gradients have 2"):
        jax.jit(tx.update)(params, state, params)


def test_a_checkpoint_names_no_python_module(tmp_path) -> None:
    # What a restore reads is key paths and arrays: where jaxamp's classes live (they
    # moved in 0.4's re-cut by concept) is in no file of a checkpoint, so checkpoints
    # written by 0.3 restore unchanged.
    from flax import nnx

    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    skip = jaxamp.skip_nonfinite(
        optax.adam(1e-2), jaxamp.dynamic_scale(), every_k=2, spikes=jaxamp.spike_rule(window=4)
    )
    multi = jaxamp.multi_transform(
        {"a": optax.sgd(0.1), "b": optax.adam(0.1)}, {"w": "a", "b": "b"}, jaxamp.static_scale(8.0)
    )
    rounding = optax.chain(optax.sgd(0.1), jaxamp.apply_with_stochastic_rounding(jax.random.key(0)))
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = jaxamp.nnx.Optimizer(
        model, jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale()), wrt=nnx.Param
    )
    state = {
        "skip": skip.init(params),
        "multi": multi.init(params),
        "rounding": rounding.init(params),
        "kahan": jaxamp.apply_with_kahan_summation().init(params),
        "nnx": nnx.state(optimizer),
    }
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "all", state)
    ckptr.wait_until_finished()
    named = [
        str(f.relative_to(tmp_path))
        for f in (tmp_path / "all").rglob("*")
        if f.is_file() and b"jaxamp" in f.read_bytes()
    ]
    assert not named, named
    restored = jaxamp.checkpoint.restore(ckptr, _abstract(state), directory=tmp_path / "all")
    assert jax.tree.structure(restored) == jax.tree.structure(state)


@pytest.mark.parametrize("manager", [True, False], ids=["manager", "checkpointer"])
def test_a_spike_rule_on_one_side_only_is_named_with_the_way_on(tmp_path, manager) -> None:
    params = {"w": jnp.ones(3)}
    build = lambda **kw: jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(), **kw)
    plain, spiky = build(), build(spikes=jaxamp.spike_rule(window=8))

    def round_trip(saved_tx, target_tx, name):
        state = {"p": params, "s": saved_tx.init(params)}
        target = jax.eval_shape(lambda: {"p": params, "s": target_tx.init(params)})
        if manager:
            with ocp.CheckpointManager(tmp_path / name) as m:
                m.save(1, args=ocp.args.StandardSave(state))
                m.wait_until_finished()
                return jaxamp.checkpoint.restore(m, target)
        with ocp.StandardCheckpointer() as c:
            c.save(tmp_path / name, state)
            c.wait_until_finished()
            return jaxamp.checkpoint.restore(c, target, directory=tmp_path / name)

    with pytest.raises(ValueError, match=r"saved with a spike rule .*spike_rule\(window=8"):
        round_trip(spiky, plain, "on")
    with pytest.raises(ValueError, match=r"saved without a spike rule.*guard._replace\(spikes="):
        round_trip(plain, spiky, "off")
    # The way the message gives: restore as saved, then a fresh history.
    restored = round_trip(plain, plain, "as_saved")["s"]
    state = restored._replace(spikes=spiky.init(params).spikes)
    new, state = jaxamp.step(spiky, {"w": jnp.ones(3)}, state, params, value=jnp.float32(1.0))
    assert bool(jaxamp.stepped(state)) and not np.array_equal(np.asarray(new["w"]), np.ones(3))
