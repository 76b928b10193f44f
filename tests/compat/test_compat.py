"""Compatibility constructors against plain-Python models of each framework's update rule.

Each reference model below restates the documented rule of one framework in a few
lines of Python over float32 numbers (jaxamp keeps the scale in float32; PyTorch
and Paddle do too). The trajectories of scale and counters must agree step for
step on random overflow sequences.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp import compat
from tests.helpers import trajectory

f32 = np.float32


def torch_reference(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    """torch.amp.GradScaler.update -> _amp_update_scale_ (CUDA/CPU kernel)."""
    scale, tracker, out = f32(init_scale), 0, []
    for found_inf in overflows:
        if found_inf:
            scale, tracker = f32(scale * f32(backoff_factor)), 0
        else:
            successful = tracker + 1
            if successful == growth_interval:
                new = f32(scale * f32(growth_factor))
                if np.isfinite(new):
                    scale = new
                tracker = 0
            else:
                tracker = successful
        out.append((scale, tracker))
    return out


def paddle_reference(overflows, init, incr_ratio, decr_ratio, incr_every, decr_every):
    """paddle update_loss_scaling: good/bad step counters, floor of 1 on decrease."""
    scale, good, bad, out = f32(init), 0, 0, []
    for found_inf in overflows:
        if found_inf:
            good, bad = 0, bad + 1
            if bad == decr_every:
                new = f32(scale * f32(decr_ratio))
                scale, bad = (f32(1) if new < 1 else new), 0
        else:
            bad, good = 0, good + 1
            if good == incr_every:
                new = f32(scale * f32(incr_ratio))
                scale, good = (new if np.isfinite(new) else scale), 0
        out.append((scale, good, bad))
    return out


def megengine_reference(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    """megengine.amp.GradScaler.update, with its two documented switches
    (docs/semantics.md#compat)."""
    scale, tracker, skipped, out = f32(init_scale), 0, 0, []
    for found_inf in overflows:
        checks = growth_interval != 0
        skipped += int(checks and found_inf)
        if checks and growth_factor != 0:
            if found_inf:
                scale, tracker = f32(scale * f32(backoff_factor)), 0
            else:
                tracker += 1
                if tracker >= growth_interval:
                    new = f32(scale * f32(growth_factor))
                    scale = new if np.isfinite(new) else scale
                    tracker = 0
        out.append((scale, skipped))
    return out


def mindspore_reference(overflows, init_loss_scale, scale_factor, scale_window):
    """mindspore.DynamicLossScaleManager.update_loss_scale (float32 scale; no growth to inf)."""
    scale, cur_iter, last_overflow, bad_step, out = f32(init_loss_scale), 1, 0, 0, []
    for overflow in overflows:
        if overflow:
            scale = max(f32(scale / f32(scale_factor)), f32(1))
            last_overflow, bad_step = cur_iter, bad_step + 1
        else:
            if (cur_iter - last_overflow) % scale_window == 0:
                new = f32(scale * f32(scale_factor))
                scale = new if np.isfinite(new) else scale
            bad_step = 0
        out.append((scale, bad_step, bad_step > 1000))
        cur_iter += 1
    return out


overflow_seqs = st.lists(st.booleans(), min_size=1, max_size=80)
biased_seqs = st.lists(st.sampled_from([False] * 4 + [True]), min_size=1, max_size=80)
seqs = st.one_of(overflow_seqs, biased_seqs)


def _run(state, overflows, pad=80):
    """The trajectory over ``overflows``, run padded to one length so it compiles once."""
    n = len(overflows)
    padded = np.zeros(max(pad, n), bool)
    padded[:n] = overflows
    return {f: v[:n] for f, v in trajectory(state, ~padded).items()}


@settings(max_examples=60, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(0, 20),
    growth_factor=st.sampled_from([2.0, 3.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.7]),
    growth_interval=st.integers(1, 5),
)
def test_torch_trajectory(overflows, log2_init, growth_factor, backoff_factor, growth_interval):
    args = (2.0**log2_init, growth_factor, backoff_factor, growth_interval)
    t = _run(compat.torch_grad_scaler(*args), overflows)
    ref = torch_reference(overflows, *args)
    np.testing.assert_array_equal(t["scale"], [r[0] for r in ref])
    np.testing.assert_array_equal(t["growth_tracker"], [r[1] for r in ref])
    np.testing.assert_array_equal(t["skipped_steps"], np.cumsum(overflows))


@settings(max_examples=30, deadline=None)
@given(overflows=seqs, log2_init=st.integers(0, 20), growth_interval=st.integers(1, 5))
def test_core_with_torch_settings_equals_torch(overflows, log2_init, growth_interval):
    """hysteresis=1, min_scale=0, max_scale=inf is torch's trajectory
    (docs/semantics.md#update-rule)."""
    s = jaxamp.dynamic_scale(
        init_scale=2.0**log2_init, growth_interval=growth_interval, min_scale=0, max_scale=math.inf
    )
    ref = torch_reference(overflows, 2.0**log2_init, 2.0, 0.5, growth_interval)
    np.testing.assert_array_equal(_run(s, overflows)["scale"], [r[0] for r in ref])


def test_torch_backs_off_below_one_and_grows_unbounded():
    t = _run(compat.torch_grad_scaler(init_scale=2.0, growth_interval=1), [True] * 4 + [False] * 3)
    np.testing.assert_array_equal(t["scale"], [1, 0.5, 0.25, 0.125, 0.25, 0.5, 1])


@settings(max_examples=60, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(0, 16),
    incr_every=st.integers(1, 5),
    decr_every=st.integers(1, 4),
    decr_ratio=st.sampled_from([0.5, 0.1, 0.8]),
)
def test_paddle_trajectory(overflows, log2_init, incr_every, decr_every, decr_ratio):
    init = 2.0**log2_init
    s = compat.paddle_grad_scaler(
        init_loss_scaling=init,
        decr_ratio=decr_ratio,
        incr_every_n_steps=incr_every,
        decr_every_n_nan_or_inf=decr_every,
    )
    t = _run(s, overflows)
    ref = paddle_reference(overflows, init, 2.0, decr_ratio, incr_every, decr_every)
    np.testing.assert_array_equal(t["scale"], [r[0] for r in ref])
    np.testing.assert_array_equal(t["growth_tracker"], [r[1] for r in ref])
    # Paddle counts bad steps up; jaxamp counts the remaining allowance down.
    np.testing.assert_array_equal(t["hysteresis_tracker"], [decr_every - r[2] for r in ref])
    assert t["scale"].min() >= 1.0


@settings(max_examples=50, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(0, 10),
    growth_factor=st.sampled_from([0.0, 2.0, 4.0]),
    growth_interval=st.integers(0, 4),
)
def test_megengine_trajectory(overflows, log2_init, growth_factor, growth_interval):
    args = (2.0**log2_init, growth_factor, 0.5, growth_interval)
    state = compat.megengine_grad_scaler(*args)
    ref = megengine_reference(overflows, *args)
    # Skipping is decided by the check; replay it as skip_nonfinite does.
    t = _run(state, [state.check_finite and o for o in overflows])
    np.testing.assert_array_equal(t["scale"], [r[0] for r in ref])
    np.testing.assert_array_equal(t["skipped_steps"], [r[1] for r in ref])


def test_megengine_switches_through_skip_nonfinite():
    import optax

    grads = {"w": jnp.array([jnp.inf, 1.0])}
    params = {"w": jnp.zeros(2)}
    for kwargs, skipped in (({"growth_factor": 0}, True), ({"growth_interval": 0}, False)):
        tx = jaxamp.skip_nonfinite(optax.sgd(1.0), compat.megengine_grad_scaler(**kwargs))
        updates, state = tx.update(grads, tx.init(params), params)
        assert bool(jnp.all(updates["w"] == 0)) == skipped
        assert float(jaxamp.get_loss_scale(state).scale) == 16.0


@settings(max_examples=60, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(0, 24),
    scale_factor=st.sampled_from([2, 4]),
    scale_window=st.integers(1, 6),
)
def test_mindspore_dynamic_trajectory(overflows, log2_init, scale_factor, scale_window):
    s = compat.mindspore_dynamic(2.0**log2_init, scale_factor, scale_window)
    t = _run(s, overflows)
    ref = mindspore_reference(overflows, 2.0**log2_init, scale_factor, scale_window)
    np.testing.assert_array_equal(t["scale"], [r[0] for r in ref])
    np.testing.assert_array_equal(t["nonfinite_streak"], [r[1] for r in ref])


def test_mindspore_more_than_1000_overflows_in_a_row_is_an_error():
    s = compat.mindspore_dynamic(init_loss_scale=2.0**10)
    overflows = [True] * 1000
    ref = mindspore_reference(overflows + [True], 2.0**10, 2, 2000)
    assert not ref[999][2] and ref[1000][2]  # the reference raises on the 1001st
    last = None
    import jax

    run = jax.jit(lambda s: jax.lax.fori_loop(0, 1000, lambda i, s: jaxamp.update(s, False), s))
    last = run(s)
    jaxamp.check_health(last)
    assert float(last.scale) == 1.0
    with pytest.raises(FloatingPointError, match="1001 steps in a row"):
        jaxamp.check_health(jaxamp.update(last, False))


def test_mindspore_fixed():
    s = compat.mindspore_fixed()
    assert float(s.scale) == 128.0 and not s.dynamic and s.check_finite
    assert not compat.mindspore_fixed(1024.0, drop_overflow_update=False).check_finite
    np.testing.assert_array_equal(_run(s, [True, False, True])["scale"], [128.0] * 3)


def test_defaults_match_the_originals():
    assert float(compat.torch_grad_scaler().scale) == 2.0**16
    assert int(compat.torch_grad_scaler().growth_interval) == 2000
    p = compat.paddle_grad_scaler()
    assert float(p.scale) == 32768.0 and int(p.growth_interval) == 1000
    assert int(p.hysteresis) == 2 and float(p.min_scale) == 1.0
    assert float(compat.megengine_grad_scaler().scale) == 16.0
    m = compat.mindspore_dynamic()
    assert float(m.scale) == 2.0**24 and int(m.growth_interval) == 2000
    assert float(m.min_scale) == 1.0 and int(m.max_consecutive_nonfinite) == 1000
    assert float(compat.mindspore_fixed().min_scale) <= 128.0
    assert not compat.torch_grad_scaler(enabled=False).enabled
    assert not compat.paddle_grad_scaler(enable=False).enabled
    assert not compat.paddle_grad_scaler(use_dynamic_loss_scaling=False).dynamic


@pytest.mark.parametrize(
    "ctor, kwargs, name",
    [
        (compat.torch_grad_scaler, {"growth_factor": 1.0}, "growth_factor"),
        (compat.torch_grad_scaler, {"backoff_factor": 1.0}, "backoff_factor"),
        (compat.torch_grad_scaler, {"growth_interval": 0}, "growth_interval"),
        (compat.paddle_grad_scaler, {"incr_ratio": 1.0}, "incr_ratio"),
        (compat.paddle_grad_scaler, {"decr_ratio": 1.0}, "decr_ratio"),
        (compat.paddle_grad_scaler, {"decr_ratio": 0.0}, "decr_ratio"),
        (compat.paddle_grad_scaler, {"incr_every_n_steps": 0}, "incr_every_n_steps"),
        (compat.paddle_grad_scaler, {"decr_every_n_nan_or_inf": 0}, "decr_every_n_nan_or_inf"),
        (compat.paddle_grad_scaler, {"init_loss_scaling": -1.0}, "init_loss_scaling"),
        (compat.megengine_grad_scaler, {"growth_interval": -1}, "growth_interval"),
        (compat.megengine_grad_scaler, {"backoff_factor": 2.0}, "backoff_factor"),
        (compat.mindspore_fixed, {"loss_scale": 0.5}, "loss_scale"),
        (compat.mindspore_dynamic, {"init_loss_scale": 0.5}, "init_loss_scale"),
        (compat.mindspore_dynamic, {"scale_factor": 0}, "scale_factor"),
        (compat.mindspore_dynamic, {"scale_window": 0}, "scale_window"),
        (compat.mindspore_dynamic, {"scale_window": 1.5}, "scale_window"),
    ],
)
def test_compat_validation(ctor, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ctor(**kwargs)


def test_mindspore_scale_factor_one_is_fixed():
    s = compat.mindspore_dynamic(init_loss_scale=8.0, scale_factor=1, scale_window=1)
    np.testing.assert_array_equal(_run(s, [False, True, False])["scale"], [8.0] * 3)


# Paddle 3: PyTorch's spellings, the conflict rule, Paddle 3's defaults.
_PADDLE_SETTINGS = {  # Paddle name: (PyTorch name, a valid non-default value)
    "init_loss_scaling": ("init_scale", 1024.0),
    "incr_ratio": ("growth_factor", 4.0),
    "decr_ratio": ("backoff_factor", 0.25),
    "incr_every_n_steps": ("growth_interval", 7),
    "enable": ("enabled", True),
}


@settings(max_examples=40, deadline=None)
@given(
    chosen=st.dictionaries(
        st.sampled_from(sorted(_PADDLE_SETTINGS)), st.sampled_from(["paddle", "torch"])
    ),
    defaults=st.sampled_from(["paddle2", "paddle3"]),
)
def test_paddle_takes_either_spelling(chosen, defaults):
    paddle_kw = {name: _PADDLE_SETTINGS[name][1] for name in chosen}
    mixed = {
        (name if how == "paddle" else _PADDLE_SETTINGS[name][0]): _PADDLE_SETTINGS[name][1]
        for name, how in chosen.items()
    }
    want = compat.paddle_grad_scaler(**paddle_kw, defaults=defaults)
    got = compat.paddle_grad_scaler(**mixed, defaults=defaults)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("paddle_name", sorted(_PADDLE_SETTINGS))
def test_paddle_refuses_a_setting_under_both_spellings(paddle_name):
    torch_name, value = _PADDLE_SETTINGS[paddle_name]
    with pytest.raises(ValueError, match=f"{torch_name} and {paddle_name}"):
        compat.paddle_grad_scaler(**{paddle_name: value, torch_name: value})


def test_paddle3_defaults_and_given_values_win():
    p3 = compat.paddle_grad_scaler(defaults="paddle3")
    assert (float(p3.scale), int(p3.growth_interval), int(p3.hysteresis)) == (2.0**16, 2000, 1)
    p2 = compat.paddle_grad_scaler()
    assert (float(p2.scale), int(p2.growth_interval), int(p2.hysteresis)) == (2.0**15, 1000, 2)
    mine = compat.paddle_grad_scaler(
        growth_interval=10, decr_every_n_nan_or_inf=3, defaults="paddle3"
    )
    assert (float(mine.scale), int(mine.growth_interval), int(mine.hysteresis)) == (2.0**16, 10, 3)
    with pytest.raises(ValueError, match="defaults"):
        compat.paddle_grad_scaler(defaults="paddle4")
    with pytest.raises(TypeError, match="paddle_grad_scaler.*bogus"):
        compat.paddle_grad_scaler(bogus=1)


# Errors speak the caller's spelling; a fixed Paddle scale keeps every setting.
@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"growth_factor": 0.5}, ValueError, "growth_factor (Paddle's incr_ratio) must be > 1.0"),
        ({"backoff_factor": 2.0}, ValueError, "backoff_factor (Paddle's decr_ratio) must be < 1."),
        ({"init_scale": 0.0}, ValueError, "init_scale (Paddle's init_loss_scaling) must be fin"),
        ({"growth_interval": 0}, ValueError, "growth_interval (Paddle's incr_every_n_steps) must"),
        ({"growth_factor": "2"}, TypeError, "growth_factor (Paddle's incr_ratio) must be a real"),
        ({"enabled": "yes"}, TypeError, "enabled (Paddle's enable) must be a bool"),
        ({"incr_ratio": 0.5}, ValueError, "incr_ratio must be > 1.0"),
        ({"use_dynamic_loss_scaling": False, "init_loss_scaling": 0.0}, ValueError, "init_loss_"),
        ({"use_dynamic_loss_scaling": False, "init_scale": 1e-50}, ValueError, "init_scale (Pad"),
        ({"use_dynamic_loss_scaling": False, "growth_factor": 1.0}, ValueError, "growth_factor"),
    ],
)
def test_paddle_errors_name_the_argument_as_written(kwargs, exc, words):
    with pytest.raises(exc) as info:
        compat.paddle_grad_scaler(**kwargs)
    message = str(info.value)
    assert message.startswith(words)
    assert "scale must" not in message and "growth_interval must" not in message


@pytest.mark.parametrize("spelling", ["paddle", "torch"])
def test_a_fixed_paddle_scale_keeps_what_paddles_getters_return(spelling):
    names = {"paddle": ("init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps")}
    names["torch"] = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    init, incr, decr, every = names[spelling]
    s = compat.paddle_grad_scaler(
        **{init: 1024.0, incr: 3.0, decr: 0.25, every: 7},
        decr_every_n_nan_or_inf=3,
        use_dynamic_loss_scaling=False,
    )
    # get_init_loss_scaling, get_incr_ratio, get_decr_ratio, get_incr_every_n_steps,
    # get_decr_every_n_nan_or_inf, is_use_dynamic_loss_scaling, is_enable.
    got = (float(s.scale), float(s.growth_factor), float(s.backoff_factor))
    assert got == (1024.0, 3.0, 0.25)
    assert (int(s.growth_interval), int(s.hysteresis), s.dynamic, s.enabled) == (7, 3, False, True)
    # Still a fixed scale that skips non-finite steps.
    assert s.check_finite
    np.testing.assert_array_equal(_run(s, [True] * 5 + [False] * 8)["scale"], [1024.0] * 13)
