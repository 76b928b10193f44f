"""A spike rule's configuration: NumPy / JAX numbers, and resuming with another window.

``jaxamp.checkpoint.restore`` of a run saved with ``spike_rule(window=W)`` into an
optimizer built with another window keeps the newest values of the history: a
smaller window then continues exactly as a run built with it would have (same
decisions, same params, same history up to a rotation of the ring); a larger one
continues as the plain-Python rule seeded with the saved values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp
from tests.skip.test_spikes import N, Reference, _grads


def _tx(window):
    return jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=window))


def _run(tx, params, state, events):
    step = jax.jit(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v))
    skipped = []
    for loss, g in events:
        params, state = step(_grads(g), state, params, jnp.float32(loss))
        skipped.append(bool(state.spikes.skipped))
    return params, state, skipped


def _history(state, window):
    """The recorded values as a sorted list (the ring's order is a rotation)."""
    filled = min(int(state.spikes.count), window)
    return sorted(np.asarray(state.spikes.losses)[:filled].tolist())


# Smooth steps (no spike under any window), then spikes and a lasting change of level.
_CALM = [(1.0 + 0.01 * (i % 5), 1.0 + 0.02 * (i % 3)) for i in range(21)]
_AFTER = [(1.5, 1.0), (1.0, 9.0), *[(2.0, 1.0)] * 10, (1.01, 1.0), (2.0, 30.0), (2.0, 1.0)]


def _save(tmp_path, state, manager):
    if manager:
        mngr = ocp.CheckpointManager(tmp_path / "mngr")
        mngr.save(0, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        return lambda target: jaxamp.checkpoint.restore(mngr, target)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", state)
    ckptr.wait_until_finished()
    return lambda target: jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "ckpt")


@pytest.mark.parametrize("manager", [False, True], ids=["checkpointer", "manager"])
def test_a_run_resumed_with_a_smaller_window_continues_as_one_built_with_it(
    tmp_path, manager
) -> None:
    params = {"w": jnp.zeros(N)}
    big, small = _tx(16), _tx(8)
    p16, s16, calm16 = _run(big, params, big.init(params), _CALM)
    p8, s8, calm8 = _run(small, params, small.init(params), _CALM)
    assert not any(calm16) and not any(calm8)
    restore = _save(tmp_path, s16, manager)
    back = restore(jax.eval_shape(small.init, params))
    assert back.spikes.losses.shape == (8,) and _history(back, 8) == _history(s8, 8)
    p_resumed, s_resumed, resumed = _run(small, p16, back, _AFTER)
    p_built, s_built, built = _run(small, p8, s8, _AFTER)
    assert resumed == built and any(built)
    np.testing.assert_array_equal(p_resumed["w"], p_built["w"])
    assert _history(s_resumed, 8) == _history(s_built, 8)
    assert int(s_resumed.spikes.skips) == int(s_built.spikes.skips)


def test_a_run_resumed_with_a_larger_window_keeps_its_whole_history(tmp_path) -> None:
    params = {"w": jnp.zeros(N)}
    small, big = _tx(4), _tx(16)
    p4, s4, _ = _run(small, params, small.init(params), _CALM)
    restore = _save(tmp_path, s4, manager=False)
    back = restore(jax.eval_shape(big.init, params))
    newest = [np.float32(loss).item() for loss, _ in _CALM[-4:]]
    # Oldest first, then empty slots; the count says four were kept.
    np.testing.assert_array_equal(back.spikes.losses, newest + [0.0] * 12)
    assert int(back.spikes.count) == 4
    ref = Reference(window=16, sigmas=6.0, warmup=8)
    ref.losses = newest
    ref.norms = [2.0 * np.float32(g).item() for _, g in _CALM[-4:]]
    _, _, resumed = _run(big, p4, back, _AFTER)
    want = [ref.step(np.float32(loss).item(), 2.0 * g, True) for loss, g in _AFTER]
    assert resumed == want and any(want)


def test_when_the_window_cannot_be_changed_the_error_names_both(tmp_path, monkeypatch) -> None:
    params = {"w": jnp.zeros(N)}
    restore = _save(tmp_path, _tx(8).init(params), manager=False)
    # As if moving the history into the other window had failed too.
    monkeypatch.setattr("jaxamp.checkpoint._spike_windows.restore_other_windows", lambda *a: None)
    with pytest.raises(ValueError) as info:
        restore(jax.eval_shape(_tx(16).init, params))
    message = str(info.value)
    assert "spike history at `spikes` with window=8" in message
    assert "built with jaxamp.spike_rule(window=16)" in message
    assert "jaxamp.spike_rule(window=8, ...) to resume" in message


@pytest.mark.parametrize(
    "window, sigmas, warmup",
    [
        (np.int64(16), np.float32(4.0), None),
        (np.int32(16), np.float64(4.0), np.int16(8)),
        (jnp.int32(16), jnp.float32(4.0), jnp.int32(8)),
        (16, np.int64(4), np.uint8(8)),
    ],
)
def test_numpy_and_jax_scalars_are_numbers(window, sigmas, warmup) -> None:
    rule = jaxamp.spike_rule(window=window, sigmas=sigmas, warmup=warmup)
    assert rule == jaxamp.spike_rule(window=16, sigmas=4.0, warmup=8)
    assert type(rule.window) is int and type(rule.sigmas) is float and type(rule.warmup) is int
    hash(rule)  # static configuration: hashed with the transformation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": np.bool_(True)}, "window must be an int, got the bool"),
        ({"window": True}, "window must be an int, got the bool"),
        ({"sigmas": True}, "sigmas must be a real number, got the bool"),
        ({"window": np.float32(16.0)}, "window must be an int, got an array of dtype float32"),
        ({"window": 16.0}, "window must be an int, got float 16.0"),
        ({"sigmas": np.array([4.0, 5.0])}, r"sigmas must be a real number \(a scalar\), got an"),
        ({"window": jnp.arange(2)}, r"window must be an int \(a scalar\), got an array of sh"),
        ({"sigmas": np.complex64(4.0)}, "sigmas must be a real number, got an array of dtype c"),
        ({"sigmas": "4"}, "sigmas must be a real number, got str '4'"),
        ({"warmup": jnp.float32(8.0)}, "warmup must be an int, got an array of dtype float32"),
    ],
)
def test_bools_arrays_and_other_types_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(TypeError, match=message):
        jaxamp.spike_rule(**kwargs)


def test_a_traced_window_is_refused() -> None:
    with pytest.raises(TypeError, match="window must be a concrete number"):
        jax.jit(lambda w: jaxamp.spike_rule(window=w))(16)


def test_an_nnx_optimizer_resumes_with_another_window(tmp_path) -> None:
    from flax import nnx

    def setup(window):
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        tx = jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=window))
        return model, jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, opt = setup(8)
    for i in range(11):
        grads = nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 4))) ** 2))(model)
        opt.update(model, grads, value=jnp.float32(1.0 + 0.01 * i))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "c", nnx.state((model, opt)))
    fresh = setup(16)
    with ocp.StandardCheckpointer() as ckptr:
        restored = jaxamp.checkpoint.restore(ckptr, nnx.state(fresh), directory=tmp_path / "c")
    nnx.update(fresh, restored)
    spikes = nnx.state(fresh[1])["opt_state"]["spikes"]
    want = [np.float32(1.0 + 0.01 * i) for i in range(3, 11)] + [0.0] * 8
    np.testing.assert_array_equal(spikes["losses"][...], want)
    assert int(spikes["count"][...]) == 8
