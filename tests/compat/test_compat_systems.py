"""DeepSpeed, Megatron-LM, Apex, Flax, jmp and Keras loss scalers, step for step.

Each reference model below restates, in plain Python, the update rule of one
original as read in its source (the file and the revision read are named in each
docstring). The models are written independently of jaxamp: they keep the
original's own state (iteration counters, a hysteresis that goes negative, a
count that starts one step late, ...) and its own arithmetic (Python floats
where the original uses them, float32 where it uses float32 tensors), and the
tests compare jaxamp's trajectory of scale and counters with theirs on fixed
sequences and on hypothesis-generated overflow sequences.

The originals have no bounds where jaxamp keeps the scale in [2**-126, 2**126]
(a documented deviation), so the random comparisons run up to the first step
where the reference leaves that range; separate tests pin the deviation itself.
Flax and jmp are also run directly (jmp only where installed).
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp import compat
from jaxamp.loss_scale._state import COUNTER_FIELDS

f32 = np.float32
LOW, HIGH = 2.0**-126, 2.0**126
PAD = 160  # every sequence is padded to this length, so each mode compiles once
COUNTERS = COUNTER_FIELDS  # what a step changes; the rest is configuration


@jax.jit
def _scan(state, overflow):
    def body(s, ovf):
        s = jaxamp.update(s, ~ovf)
        return s, tuple(getattr(s, f) for f in COUNTERS)

    return jax.lax.scan(body, state, overflow)[1]


def run(state, overflows):
    """jaxamp's counters after each step, as numpy arrays of len(overflows)."""
    n = len(overflows)
    padded = np.zeros(PAD, bool)
    padded[:n] = overflows
    outs = _scan(state, jnp.asarray(padded))
    return {f: np.asarray(v)[:n] for f, v in zip(COUNTERS, outs, strict=True)}


def in_range(scales):
    """How many leading reference scales lie in jaxamp's [2**-126, 2**126]."""
    for i, s in enumerate(scales):
        if not LOW <= s <= HIGH:
            return i
    return len(scales)


# --- reference models ------------------------------------------------------------


def deepspeed_reference(
    overflows,
    init_scale,
    scale_factor,
    scale_window,
    min_scale,
    delayed_shift,
    consecutive_hysteresis,
    raise_error_at_min_scale,
):
    """DeepSpeed DynamicLossScaler.update_scale, deepspeed/runtime/fp16/loss_scaler.py
    (microsoft/DeepSpeed 38327e07). Python floats; growth is decided from the
    iteration count since the last overflow; a backoff never refills the hysteresis.

    Returns (rows, raised_at): rows of (scale, cur_hysteresis) per completed step,
    and the index of the step whose update raised (the run ends there), or None.
    """
    scale, cur_iter, last_overflow_iter = float(init_scale), 0, -1
    hysteresis, rows = delayed_shift, []
    for i, overflow in enumerate(overflows):
        if overflow:
            if delayed_shift == 1 or hysteresis == 1:
                if scale == min_scale and raise_error_at_min_scale:
                    return rows, i
                scale = max(scale / scale_factor, min_scale)
            else:
                hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if consecutive_hysteresis:
                hysteresis = delayed_shift
            if (cur_iter - last_overflow_iter) % scale_window == 0:
                if not consecutive_hysteresis:
                    hysteresis = delayed_shift
                scale *= scale_factor
        cur_iter += 1
        rows.append((scale, hysteresis))
    return rows, None


def megatron_reference(
    overflows, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
):
    """Megatron-LM DynamicGradScaler.update, megatron/core/optimizer/grad_scaler.py
    (NVIDIA/Megatron-LM d98e8a64). float32 tensors; the hysteresis tracker is only
    refilled by a growth and keeps going down (below 0) on further overflows."""
    scale, growth, hyst, rows = f32(initial_scale), 0, hysteresis, []
    with np.errstate(over="ignore"):
        for found_inf in overflows:
            if found_inf:
                growth, hyst = 0, hyst - 1
                if hyst <= 0:
                    scale = max(f32(scale * f32(backoff_factor)), f32(min_scale))
            else:
                growth += 1
                if growth == growth_interval:
                    growth, hyst = 0, hysteresis
                    scale = f32(scale * f32(growth_factor))
            rows.append((float(scale), growth, hyst))
    return rows


def apex_reference(overflows, init_scale, scale_window, min_loss_scale, max_loss_scale):
    """Apex amp LossScaler (dynamic) update_scale, apex/amp/scaler.py (NVIDIA/apex at
    cb65b8ed~1, the last revision with apex.amp). Python floats; factor 2 hard-coded."""
    scale, unskipped, rows = min(max_loss_scale, init_scale), 0, []
    for overflow in overflows:
        if overflow:
            scale = max(min_loss_scale, scale / 2.0) if min_loss_scale else scale / 2.0
            unskipped = 0
        else:
            unskipped += 1
        if unskipped == scale_window:
            scale, unskipped = min(max_loss_scale, scale * 2.0), 0
        rows.append((scale, unskipped))
    return rows


def flax_reference(
    overflows, growth_factor, backoff_factor, growth_interval, fin_steps, scale, minimum_scale
):
    """flax.training.dynamic_scale.DynamicScale.value_and_grad's state update
    (flax 0.12.8): growth is tested on the count *before* this step is counted."""
    scale, rows, top = f32(scale), [], np.finfo(np.float32).max
    with np.errstate(over="ignore", under="ignore"):
        for overflow in overflows:
            grow = fin_steps == growth_interval
            if not overflow:
                if grow:
                    scale = min(f32(scale * f32(growth_factor)), top)
            else:
                scale = f32(scale * f32(backoff_factor))
                if minimum_scale is not None:
                    scale = max(scale, f32(minimum_scale))
            fin_steps = 0 if grow or overflow else fin_steps + 1
            rows.append((float(scale), fin_steps))
    return rows


def jmp_reference(overflows, loss_scale, counter, period, factor, min_loss_scale):
    """jmp DynamicLossScale.adjust, jmp/_src/loss_scale.py (jmp 0.0.4). float32; a
    growth that would overflow keeps the old scale; the counter wraps modulo period."""
    scale, rows = f32(loss_scale), []
    with np.errstate(over="ignore"):
        for overflow in overflows:
            if not overflow:
                if counter == period - 1:
                    grown = f32(scale * f32(factor))
                    scale = grown if np.isfinite(grown) else scale
            else:
                scale = max(f32(min_loss_scale), f32(scale / f32(factor)))
            counter = ((counter + 1) % period) * int(not overflow)
            rows.append((float(scale), counter))
    return rows


def keras_reference(overflows, initial_scale, dynamic_growth_steps):
    """Keras 3 LossScaleOptimizer, keras/src/optimizers/loss_scale_optimizer.py
    (keras-team/keras 3422977a). float32 variable; no floor and no ceiling."""
    scale, counter, rows = f32(initial_scale), 0, []
    with np.errstate(over="ignore", under="ignore"):
        for overflow in overflows:
            if overflow:
                counter, scale = 0, f32(scale * f32(0.5))
            elif counter == dynamic_growth_steps - 1:
                counter, scale = 0, f32(scale * f32(2.0))
            else:
                counter += 1
            rows.append((float(scale), counter))
    return rows


# --- sequences ---------------------------------------------------------------------

# Long enough, with windows of 1-6, to grow and back off several times in one run.
dense = st.lists(st.booleans(), min_size=20, max_size=PAD)
sparse = st.lists(st.sampled_from([False] * 5 + [True]), min_size=60, max_size=PAD)
bursts = st.lists(st.tuples(st.booleans(), st.integers(1, 12)), min_size=6, max_size=24).map(
    lambda runs: [v for v, n in runs for _ in range(n)][:PAD]
)
seqs = st.one_of(dense, sparse, bursts)
EXAMPLES = 40


def col(rows, j):
    return np.array([r[j] for r in rows])


# --- DeepSpeed ---------------------------------------------------------------------


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(0, 40),
    scale_factor=st.sampled_from([2.0, 4.0]),
    scale_window=st.integers(1, 6),
    min_scale=st.sampled_from([0.0, 0.125, 1.0, 4.0]),
    delayed_shift=st.integers(1, 4),
    consecutive_hysteresis=st.booleans(),
    raise_error=st.booleans(),
)
def test_deepspeed_trajectory(
    overflows,
    log2_init,
    scale_factor,
    scale_window,
    min_scale,
    delayed_shift,
    consecutive_hysteresis,
    raise_error,
):
    assume(2.0**log2_init >= min_scale)
    args = (
        2.0**log2_init,
        scale_factor,
        scale_window,
        min_scale,
        delayed_shift,
        consecutive_hysteresis,
        raise_error,
    )
    t = run(compat.deepspeed_loss_scaler(*args), overflows)
    rows, raised_at = deepspeed_reference(overflows, *args)
    n = in_range(col(rows, 0)) if rows else 0
    np.testing.assert_array_equal(t["scale"][:n], col(rows, 0)[:n])
    # DeepSpeed's cur_hysteresis stays at 1 after a backoff, where jaxamp's allowance is 0.
    np.testing.assert_array_equal(np.maximum(t["hysteresis_tracker"][:n], 1), col(rows, 1)[:n])
    np.testing.assert_array_equal(t["skipped_steps"], np.cumsum(overflows))
    stuck = t["min_scale_backoffs"]
    if n == len(rows):  # the reference stayed within jaxamp's range throughout
        if raised_at is not None:
            # The step DeepSpeed raises on is the first one check_health refuses.
            assert not stuck[:raised_at].any() and stuck[raised_at] == 1
        elif raise_error:
            assert not stuck.any()


def test_deepspeed_hysteresis_refills_only_on_growth():
    # delayed_shift=2: one overflow is tolerated; after a backoff, every overflow backs
    # off again until a growth refills the allowance (consecutive_hysteresis=False).
    ovf = [True, True, True, False, False, False, True, True]
    s = compat.deepspeed_loss_scaler(init_scale=16.0, scale_window=3, delayed_shift=2)
    np.testing.assert_array_equal(run(s, ovf)["scale"], [16, 8, 4, 4, 4, 8, 8, 4])
    rows, _ = deepspeed_reference(ovf, 16.0, 2.0, 3, 1, 2, False, True)
    np.testing.assert_array_equal(col(rows, 0), [16, 8, 4, 4, 4, 8, 8, 4])
    # A clean step between two overflows refills only with consecutive_hysteresis=True.
    ovf = [True, False, True]
    for consecutive, expected in ((False, [16, 16, 8]), (True, [16, 16, 16])):
        s = compat.deepspeed_loss_scaler(16.0, delayed_shift=2, consecutive_hysteresis=consecutive)
        np.testing.assert_array_equal(run(s, ovf)["scale"], expected)
        rows, _ = deepspeed_reference(ovf, 16.0, 2.0, 1000, 1, 2, consecutive, True)
        np.testing.assert_array_equal(col(rows, 0), expected)


def test_deepspeed_raises_at_min_scale_through_check_health():
    ovf = [True, True, True]
    rows, raised_at = deepspeed_reference(ovf, 4.0, 2.0, 1000, 1, 1, False, True)
    assert raised_at == 2 and col(rows, 0).tolist() == [2.0, 1.0]
    s = compat.deepspeed_loss_scaler(init_scale=4.0)
    for i in range(3):
        s = jaxamp.update(s, False)
        if i < raised_at:
            jaxamp.check_health(s)
    assert float(s.scale) == 1.0
    with pytest.raises(FloatingPointError, match="already at its minimum"):
        jaxamp.check_health(s)
    # Also when the state sits inside an optimizer state.
    import optax

    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), compat.deepspeed_loss_scaler(init_scale=1.0))
    params = {"w": jnp.ones(2)}
    _, opt_state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, tx.init(params), params)
    with pytest.raises(FloatingPointError):
        jaxamp.check_health(opt_state)
    # raise_error_at_min_scale=False: the scale just stays at min_scale.
    s = compat.deepspeed_loss_scaler(init_scale=4.0, raise_error_at_min_scale=False)
    t = run(s, [True] * 5)
    np.testing.assert_array_equal(t["scale"], [2, 1, 1, 1, 1])
    rows, raised_at = deepspeed_reference([True] * 5, 4.0, 2.0, 1000, 1, 1, False, False)
    assert raised_at is None and col(rows, 0).tolist() == [2, 1, 1, 1, 1]
    last = functools.reduce(lambda s, _: jaxamp.update(s, False), range(5), s)
    jaxamp.check_health(last)  # no raise, though three backoffs found the floor
    assert int(last.min_scale_backoffs) == 3


def deepspeed_config_reference(fp16):
    """deepspeed/runtime/config.py get_loss_scale / get_dynamic_loss_scale_args and
    CreateLossScaler (loss_scaler.py): which scaler, with which arguments, a ZeRO
    engine builds from the "fp16" block. Returns None (no scaling), ("static", s)
    or ("dynamic", kwargs for DynamicLossScaler, {} meaning its defaults)."""
    if not fp16.get("enabled", False):
        return None
    if fp16.get("loss_scale", 0) != 0:
        return ("static", fp16["loss_scale"])
    keys = (
        "initial_scale_power",
        "loss_scale_window",
        "min_loss_scale",
        "hysteresis",
        "consecutive_hysteresis",
    )
    if not any(k in fp16 for k in keys):
        return ("dynamic", {})
    return (
        "dynamic",
        {
            "init_scale": 2 ** fp16.get("initial_scale_power", 16),
            "scale_window": fp16.get("loss_scale_window", 1000),
            "delayed_shift": fp16.get("hysteresis", 2),
            "consecutive_hysteresis": fp16.get("consecutive_hysteresis", False),
            "min_scale": fp16.get("min_loss_scale", 1),
        },
    )


@pytest.mark.parametrize(
    "fp16",
    [
        {},
        {"enabled": False, "loss_scale_window": 10},
        {"enabled": True},
        {"enabled": True, "auto_cast": False},
        {"enabled": True, "loss_scale": 128},
        {"enabled": True, "loss_scale_window": 3},
        {"enabled": True, "hysteresis": 3, "consecutive_hysteresis": True},
        {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 4, "loss_scale_window": 2},
    ],
)
def test_deepspeed_fp16_config(fp16):
    state = compat.deepspeed_fp16_config(fp16)
    ref = deepspeed_config_reference(fp16)
    ovf = [True, False, False, True, True, False, False, False, True, True, True, True]
    if ref is None:
        assert not state.enabled and not state.check_finite
        return
    if ref[0] == "static":
        assert not state.dynamic and state.check_finite  # ZeRO still skips overflows
        np.testing.assert_array_equal(run(state, ovf)["scale"], [ref[1]] * len(ovf))
        return
    # DynamicLossScaler's own defaults (loss_scaler.py), overridden by the config's values.
    defaults = {
        "init_scale": 2**32,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
    }
    a = {**defaults, **ref[1]}
    rows, raised_at = deepspeed_reference(
        ovf,
        a["init_scale"],
        2.0,
        a["scale_window"],
        a["min_scale"],
        a["delayed_shift"],
        a["consecutive_hysteresis"],
        True,
    )
    t = run(state, ovf)
    np.testing.assert_array_equal(t["scale"][: len(rows)], col(rows, 0))
    assert int(state.hysteresis) == a["delayed_shift"]
    assert (raised_at is not None) == bool(t["min_scale_backoffs"].any())


def test_deepspeed_fp16_config_defaults_depend_on_which_keys_are_present():
    # No dynamic key: DynamicLossScaler's defaults. One key: the config's defaults.
    bare = compat.deepspeed_fp16_config({"enabled": True})
    assert float(bare.scale) == 2.0**32 and int(bare.hysteresis) == 1
    keyed = compat.deepspeed_fp16_config({"enabled": True, "min_loss_scale": 1})
    assert float(keyed.scale) == 2.0**16 and int(keyed.hysteresis) == 2
    with pytest.raises(TypeError, match="fp16"):
        compat.deepspeed_fp16_config('{"enabled": true}')
    with pytest.raises(TypeError, match="enabled"):
        compat.deepspeed_fp16_config({"enabled": "true"})
    with pytest.raises(TypeError, match="loss_scale_window"):
        compat.deepspeed_fp16_config({"enabled": True, "loss_scale_window": "1000"})
    with pytest.raises(ValueError, match="hysteresis"):
        compat.deepspeed_fp16_config({"enabled": True, "hysteresis": 0})
    with pytest.raises(ValueError, match="loss_scale"):
        compat.deepspeed_fp16_config({"enabled": True, "loss_scale": -1})


# --- Megatron-LM -------------------------------------------------------------------


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(0, 40),
    min_scale=st.sampled_from([1.0, 0.25, 2.0**-20]),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.7]),
    growth_interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
)
def test_megatron_trajectory(
    overflows, log2_init, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
):
    args = (2.0**log2_init, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis)
    t = run(compat.megatron_grad_scaler(*args), overflows)
    rows = megatron_reference(overflows, *args)
    n = in_range(col(rows, 0))
    np.testing.assert_array_equal(t["scale"][:n], col(rows, 0)[:n])
    np.testing.assert_array_equal(t["growth_tracker"][:n], col(rows, 1)[:n])
    # Megatron's tracker goes below 0 after a backoff; jaxamp's stops at 0.
    np.testing.assert_array_equal(t["hysteresis_tracker"][:n], np.maximum(col(rows, 2), 0)[:n])


def test_megatron_hysteresis_refills_only_on_growth():
    s = compat.megatron_grad_scaler(initial_scale=16.0, growth_interval=2)
    cases = (
        ([True, False, True], [16, 16, 8]),  # a clean step does not refill
        ([True, True, True], [16, 8, 4]),  # nor does a backoff
        ([True, False, False, True, True], [16, 16, 32, 32, 16]),  # a growth does
    )
    for ovf, expected in cases:
        np.testing.assert_array_equal(run(s, ovf)["scale"], expected)
        np.testing.assert_array_equal(
            col(megatron_reference(ovf, 16, 1, 2, 0.5, 2, 2), 0), expected
        )


# --- Apex ----------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    overflows=seqs,
    log2_init=st.integers(-4, 30),
    scale_window=st.integers(1, 6),
    min_loss_scale=st.sampled_from([None, 0.0, 1.0, 0.25]),
    log2_max=st.integers(4, 30),
)
def test_apex_trajectory(overflows, log2_init, scale_window, min_loss_scale, log2_max):
    args = (2.0**log2_init, scale_window, min_loss_scale, 2.0**log2_max)
    assume(min(args[0], args[3]) >= (min_loss_scale or 0))
    s = compat.apex_loss_scaler("dynamic", args[0], 2.0, *args[1:])
    t = run(s, overflows)
    rows = apex_reference(overflows, *args)
    n = in_range(col(rows, 0))
    np.testing.assert_array_equal(t["scale"][:n], col(rows, 0)[:n])
    np.testing.assert_array_equal(t["growth_tracker"][:n], col(rows, 1)[:n])
    assert t["scale"].max() <= 2.0**log2_max


def test_apex_fixed_sequences_and_static():
    s = compat.apex_loss_scaler(init_scale=2.0**30, scale_window=2)
    assert float(s.scale) == 2.0**24  # min(max_loss_scale, init_scale)
    ovf = [False, False, True, False, False, False, False]
    expected = [2**24, 2**24, 2**23, 2**23, 2**24, 2**24, 2**24]
    np.testing.assert_array_equal(run(s, ovf)["scale"], expected)
    np.testing.assert_array_equal(col(apex_reference(ovf, 2.0**30, 2, None, 2.0**24), 0), expected)
    # scale_factor is taken and ignored, as in Apex: the factor is always 2.
    s4 = compat.apex_loss_scaler(init_scale=8.0, scale_factor=4.0, scale_window=1)
    np.testing.assert_array_equal(run(s4, [True, False, False])["scale"], [4, 8, 16])
    # A number: a fixed scale, and Apex neither checks nor skips.
    fixed = compat.apex_loss_scaler(128.0)
    assert not fixed.dynamic and not fixed.check_finite and float(fixed.scale) == 128.0
    np.testing.assert_array_equal(run(fixed, [True, False])["scale"], [128.0, 128.0])


# --- Flax --------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    overflows=seqs,
    growth_factor=st.sampled_from([2.0, 3.0, 1.5]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.7]),
    growth_interval=st.integers(0, 6),
    fin_steps=st.integers(0, 6),
    log2_scale=st.integers(-10, 40),
    minimum_scale=st.sampled_from([float(np.finfo(np.float32).tiny), 1.0, None]),
)
def test_flax_trajectory(
    overflows, growth_factor, backoff_factor, growth_interval, fin_steps, log2_scale, minimum_scale
):
    fin_steps = min(fin_steps, growth_interval)
    scale = 2.0**log2_scale
    assume(minimum_scale is None or scale >= minimum_scale)
    args = (growth_factor, backoff_factor, growth_interval, fin_steps, scale, minimum_scale)
    t = run(compat.flax_dynamic_scale(*args), overflows)
    rows = flax_reference(overflows, *args)
    n = in_range(col(rows, 0))
    np.testing.assert_array_equal(t["scale"][:n], col(rows, 0)[:n])
    np.testing.assert_array_equal(t["growth_tracker"][:n], col(rows, 1)[:n])


@functools.partial(jax.jit, static_argnames="no_minimum")
def _real_flax(
    overflows,
    growth_factor,
    backoff_factor,
    growth_interval,
    fin_steps,
    scale,
    minimum_scale,
    no_minimum,
):
    from flax.training.dynamic_scale import DynamicScale

    def body(carry, overflow):
        ds = DynamicScale(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            fin_steps=carry[0],
            scale=carry[1],
            minimum_scale=None if no_minimum else minimum_scale,
        )
        x = jnp.where(overflow, jnp.inf, 1.0)
        new, finite, _, _ = ds.value_and_grad(lambda p, x: p * x)(jnp.float32(1.0), x)
        return (new.fin_steps, new.scale), (new.scale, new.fin_steps, finite)

    return jax.lax.scan(body, (fin_steps, scale), overflows)[1]


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(
    overflows=seqs,
    growth_factor=st.sampled_from([2.0, 3.0]),
    growth_interval=st.integers(0, 5),
    log2_scale=st.integers(0, 30),
    no_minimum=st.booleans(),
)
def test_flax_matches_the_real_dynamic_scale(
    overflows, growth_factor, growth_interval, log2_scale, no_minimum
):
    scale = 2.0**log2_scale
    minimum = None if no_minimum else 1.0
    ovf = np.zeros(PAD, bool)
    ovf[: len(overflows)] = overflows
    real = _real_flax(
        jnp.asarray(ovf),
        jnp.float32(growth_factor),
        jnp.float32(0.5),
        jnp.int32(growth_interval),
        jnp.int32(0),
        jnp.float32(scale),
        jnp.float32(1.0),
        no_minimum,
    )
    n = len(overflows)
    real_scale, real_fin, real_finite = (np.asarray(r)[:n] for r in real)
    np.testing.assert_array_equal(real_finite, ~np.asarray(overflows))
    t = run(
        compat.flax_dynamic_scale(growth_factor, 0.5, growth_interval, 0, scale, minimum), overflows
    )
    m = in_range(real_scale)
    np.testing.assert_array_equal(t["scale"][:m], real_scale[:m])
    np.testing.assert_array_equal(t["growth_tracker"][:m], real_fin[:m])


def test_flax_grows_one_step_late():
    s = compat.flax_dynamic_scale(growth_interval=2, scale=4.0)
    ovf = [False] * 6 + [True, False, False, False]
    expected = [4, 4, 8, 8, 8, 16, 8, 8, 8, 16]  # the 3rd clean step in a row grows
    np.testing.assert_array_equal(run(s, ovf)["scale"], expected)
    np.testing.assert_array_equal(col(flax_reference(ovf, 2.0, 0.5, 2, 0, 4.0, 1.0), 0), expected)
    assert int(s.growth_interval) == 3
    # fin_steps carries a DynamicScale's count over: one clean step left before growing.
    s = compat.flax_dynamic_scale(growth_interval=2, fin_steps=2, scale=4.0)
    np.testing.assert_array_equal(run(s, [False, False])["scale"], [8, 8])


# --- jmp ---------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    overflows=seqs,
    log2_scale=st.integers(0, 40),
    counter=st.integers(0, 6),
    period=st.integers(1, 6),
    factor=st.sampled_from([2, 4]),
    min_loss_scale=st.sampled_from([1.0, 0.5, 2.0**-30]),
)
def test_jmp_trajectory(overflows, log2_scale, counter, period, factor, min_loss_scale):
    args = (2.0**log2_scale, counter % period, period, factor, min_loss_scale)
    t = run(compat.jmp_dynamic_loss_scale(*args), overflows)
    rows = jmp_reference(overflows, *args)
    n = in_range(col(rows, 0))
    np.testing.assert_array_equal(t["scale"][:n], col(rows, 0)[:n])
    np.testing.assert_array_equal(t["growth_tracker"][:n], col(rows, 1)[:n])


@jax.jit
def _real_jmp(overflows, loss_scale, counter, period, factor, min_loss_scale):
    import jmp

    def body(carry, overflow):
        # Rebuilt from array leaves each step: a DynamicLossScale carried through
        # scan itself would lose min_loss_scale (it is not part of jmp's pytree).
        ls = jmp.DynamicLossScale(carry[0], carry[1], period, factor, min_loss_scale)
        new = ls.adjust(~overflow)
        return (new.loss_scale, new.counter), (new.loss_scale, new.counter)

    return jax.lax.scan(body, (loss_scale, counter), overflows)[1]


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(
    overflows=seqs,
    log2_scale=st.integers(0, 40),
    period=st.integers(1, 6),
    factor=st.sampled_from([2, 4]),
    min_loss_scale=st.sampled_from([1.0, 0.25]),
)
def test_jmp_matches_the_real_dynamic_loss_scale(
    overflows, log2_scale, period, factor, min_loss_scale
):
    pytest.importorskip("jmp")
    ovf = np.zeros(PAD, bool)
    ovf[: len(overflows)] = overflows
    real = _real_jmp(
        jnp.asarray(ovf),
        jnp.float32(2.0**log2_scale),
        jnp.int32(0),
        jnp.int32(period),
        jnp.int32(factor),
        jnp.float32(min_loss_scale),
    )
    n = len(overflows)
    real_scale, real_counter = (np.asarray(r)[:n] for r in real)
    s = compat.jmp_dynamic_loss_scale(2.0**log2_scale, 0, period, factor, min_loss_scale)
    t = run(s, overflows)
    m = in_range(real_scale)
    np.testing.assert_array_equal(t["scale"][:m], real_scale[:m])
    np.testing.assert_array_equal(t["growth_tracker"][:m], real_counter[:m])


def test_jmp_fixed_sequence_and_factor_one():
    s = compat.jmp_dynamic_loss_scale(2.0**15, period=2)
    ovf = [False, False, True, True, False, False]
    expected = [2**15, 2**16, 2**15, 2**14, 2**14, 2**15]
    np.testing.assert_array_equal(run(s, ovf)["scale"], expected)
    np.testing.assert_array_equal(col(jmp_reference(ovf, 2.0**15, 0, 2, 2, 1.0), 0), expected)
    fixed = compat.jmp_dynamic_loss_scale(8.0, factor=1, period=1)
    assert not fixed.dynamic and fixed.check_finite
    np.testing.assert_array_equal(run(fixed, [False, True])["scale"], [8, 8])
    np.testing.assert_array_equal(col(jmp_reference([False, True], 8.0, 0, 1, 1, 1.0), 0), [8, 8])
    with pytest.raises(TypeError):
        compat.jmp_dynamic_loss_scale()  # loss_scale has no default, as in jmp
    # jaxamp keeps min_loss_scale through jit (jmp's pytree drops it).
    s = jax.jit(lambda s: s)(compat.jmp_dynamic_loss_scale(4.0, min_loss_scale=4.0))
    assert float(jaxamp.update(s, False).scale) == 4.0


# --- Keras -------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(overflows=seqs, log2_init=st.integers(-20, 40), dynamic_growth_steps=st.integers(1, 6))
def test_keras_trajectory(overflows, log2_init, dynamic_growth_steps):
    t = run(compat.keras_loss_scale_optimizer(2.0**log2_init, dynamic_growth_steps), overflows)
    rows = keras_reference(overflows, 2.0**log2_init, dynamic_growth_steps)
    n = in_range(col(rows, 0))
    np.testing.assert_array_equal(t["scale"][:n], col(rows, 0)[:n])
    np.testing.assert_array_equal(t["growth_tracker"][:n], col(rows, 1)[:n])


def test_keras_fixed_sequence():
    s = compat.keras_loss_scale_optimizer(dynamic_growth_steps=2)
    ovf = [False, False, False, True, False, False]
    expected = [2**15, 2**16, 2**16, 2**15, 2**15, 2**16]
    np.testing.assert_array_equal(run(s, ovf)["scale"], expected)
    np.testing.assert_array_equal(col(keras_reference(ovf, 2.0**15, 2), 0), expected)


def test_no_floor_no_ceiling_originals_stay_in_range_here():
    """The documented deviation: where an original has no bound, jaxamp stops at 2**±126."""
    down, up = [True] * PAD, [False] * PAD
    keras_down = col(keras_reference(down, 1.0, 1), 0)
    assert keras_down[-1] == 0.0  # Keras's float32 scale reaches 0
    cases = [
        (
            compat.keras_loss_scale_optimizer(1.0, 1),
            keras_down,
            col(keras_reference(up, 1.0, 1), 0),
        ),
        (
            compat.deepspeed_loss_scaler(1.0, 2.0, 1, 0.0, raise_error_at_min_scale=False),
            col(deepspeed_reference(down, 1.0, 2.0, 1, 0.0, 1, False, False)[0], 0),
            col(deepspeed_reference(up, 1.0, 2.0, 1, 0.0, 1, False, False)[0], 0),
        ),
        (
            compat.megatron_grad_scaler(1.0, 1.0, 2.0, 0.5, 1, 1),
            None,
            col(megatron_reference(up, 1.0, 1.0, 2.0, 0.5, 1, 1), 0),
        ),
        (
            compat.flax_dynamic_scale(growth_interval=0, scale=1.0, minimum_scale=None),
            col(flax_reference(down, 2.0, 0.5, 0, 0, 1.0, None), 0),
            col(flax_reference(up, 2.0, 0.5, 0, 0, 1.0, None), 0),
        ),
        (
            compat.apex_loss_scaler(init_scale=1.0, scale_window=1),
            col(apex_reference(down, 1.0, 1, None, 2.0**24), 0),
            None,
        ),
    ]
    for state, ref_down, ref_up in cases:
        if ref_down is not None:
            t = run(state, down)["scale"]
            assert ref_down.min() < LOW and t.min() == LOW and (t > 0).all()
            n = in_range(ref_down)
            np.testing.assert_array_equal(t[:n], ref_down[:n])
        if ref_up is not None:
            t = run(state, up)["scale"]
            assert ref_up.max() > HIGH and t.max() == HIGH
            n = in_range(ref_up)
            np.testing.assert_array_equal(t[:n], ref_up[:n])
    # jmp keeps the last finite scale (2**127 with factor 2); jaxamp stops at 2**126.
    ref = col(jmp_reference(up, 1.0, 0, 1, 2, 1.0), 0)
    assert ref.max() == 2.0**127
    assert run(compat.jmp_dynamic_loss_scale(1.0, period=1), up)["scale"].max() == HIGH


# --- defaults and argument checks --------------------------------------------------


def test_defaults_match_the_originals():
    ds = compat.deepspeed_loss_scaler()
    assert float(ds.scale) == 2.0**32 and float(ds.growth_factor) == 2.0
    assert int(ds.growth_interval) == 1000 and float(ds.min_scale) == 1.0
    assert int(ds.hysteresis) == 1 and bool(ds.raise_at_min_scale)
    assert int(ds.hysteresis_refill) == 0  # "growth"
    consecutive = compat.deepspeed_loss_scaler(consecutive_hysteresis=True)
    assert int(consecutive.hysteresis_refill) == 1  # "finite"
    mg = compat.megatron_grad_scaler()
    assert float(mg.scale) == 2.0**32 and float(mg.min_scale) == 1.0
    assert int(mg.growth_interval) == 1000 and int(mg.hysteresis) == 2
    assert float(mg.growth_factor) == 2.0 and float(mg.backoff_factor) == 0.5
    assert int(mg.hysteresis_refill) == 0
    ap = compat.apex_loss_scaler()
    assert float(ap.scale) == 2.0**16 and int(ap.growth_interval) == 2000
    assert float(ap.max_scale) == 2.0**24 and float(ap.min_scale) == 0.0
    fl = compat.flax_dynamic_scale()
    assert float(fl.scale) == 65536.0 and int(fl.growth_interval) == 2001
    assert float(fl.min_scale) == float(np.finfo(np.float32).tiny) == LOW
    jm = compat.jmp_dynamic_loss_scale(2.0**15)
    assert int(jm.growth_interval) == 2000 and float(jm.min_scale) == 1.0
    assert float(jm.growth_factor) == 2.0 and int(jm.growth_tracker) == 0
    ke = compat.keras_loss_scale_optimizer()
    assert float(ke.scale) == 2.0**15 and int(ke.growth_interval) == 2000
    assert float(ke.min_scale) == 0.0
    for s in (ds, mg, ap, fl, jm, ke):
        assert s.dynamic and s.check_finite


@pytest.mark.parametrize(
    "ctor, kwargs, name",
    [
        (compat.deepspeed_loss_scaler, {"scale_factor": 1.0}, "scale_factor"),
        (compat.deepspeed_loss_scaler, {"scale_window": 0}, "scale_window"),
        (compat.deepspeed_loss_scaler, {"scale_window": 2.5}, "scale_window"),
        (compat.deepspeed_loss_scaler, {"delayed_shift": 0}, "delayed_shift"),
        (compat.deepspeed_loss_scaler, {"min_scale": -1.0}, "min_scale"),
        (compat.deepspeed_loss_scaler, {"init_scale": 0.5}, "init_scale"),
        (compat.megatron_grad_scaler, {"initial_scale": 0.0}, "initial_scale"),
        (compat.megatron_grad_scaler, {"min_scale": 0.0}, "min_scale"),
        (compat.megatron_grad_scaler, {"initial_scale": 2.0, "min_scale": 4.0}, "min_scale"),
        (compat.megatron_grad_scaler, {"growth_factor": 1.0}, "growth_factor"),
        (compat.megatron_grad_scaler, {"backoff_factor": 1.0}, "backoff_factor"),
        (compat.megatron_grad_scaler, {"backoff_factor": 0.0}, "backoff_factor"),
        (compat.megatron_grad_scaler, {"growth_interval": 0}, "growth_interval"),
        (compat.megatron_grad_scaler, {"growth_interval": 1.5}, "growth_interval"),
        (compat.megatron_grad_scaler, {"hysteresis": 0}, "hysteresis"),
        (compat.apex_loss_scaler, {"loss_scale": "128.0"}, "loss_scale"),
        (compat.apex_loss_scaler, {"loss_scale": 0.0}, "loss_scale"),
        (compat.apex_loss_scaler, {"scale_window": 0}, "scale_window"),
        (compat.apex_loss_scaler, {"min_loss_scale": 2.0**17}, "init_scale"),
        (compat.apex_loss_scaler, {"max_loss_scale": 0.0}, "max_loss_scale"),
        (compat.flax_dynamic_scale, {"growth_factor": 1.0}, "growth_factor"),
        (compat.flax_dynamic_scale, {"backoff_factor": 1.5}, "backoff_factor"),
        (compat.flax_dynamic_scale, {"growth_interval": -1}, "growth_interval"),
        (compat.flax_dynamic_scale, {"growth_interval": 3, "fin_steps": 4}, "fin_steps"),
        (compat.flax_dynamic_scale, {"fin_steps": -1}, "fin_steps"),
        (compat.flax_dynamic_scale, {"scale": 0.0}, "scale"),
        (compat.flax_dynamic_scale, {"minimum_scale": 2.0**20}, "minimum_scale"),
        (compat.jmp_dynamic_loss_scale, {"loss_scale": 0.5}, "loss_scale"),
        (compat.jmp_dynamic_loss_scale, {"loss_scale": 1.0, "period": 0}, "period"),
        (compat.jmp_dynamic_loss_scale, {"loss_scale": 1.0, "counter": 2000}, "counter"),
        (compat.jmp_dynamic_loss_scale, {"loss_scale": 1.0, "factor": 0.5}, "factor"),
        (
            compat.jmp_dynamic_loss_scale,
            {"loss_scale": 1.0, "min_loss_scale": -1.0},
            "min_loss_scale",
        ),
        (compat.keras_loss_scale_optimizer, {"initial_scale": 0.0}, "initial_scale"),
        (compat.keras_loss_scale_optimizer, {"dynamic_growth_steps": 0}, "dynamic_growth_steps"),
    ],
)
def test_new_compat_validation(ctor, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ctor(**kwargs)


# Every compat constructor's numeric and bool arguments, by the original's names.
NUMBERS = {
    compat.torch_grad_scaler: ("init_scale", "growth_factor", "backoff_factor", "growth_interval"),
    compat.paddle_grad_scaler: (
        "init_loss_scaling",
        "incr_ratio",
        "decr_ratio",
        "incr_every_n_steps",
        "decr_every_n_nan_or_inf",
    ),
    compat.megengine_grad_scaler: (
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
    ),
    compat.mindspore_fixed: ("loss_scale",),
    compat.mindspore_dynamic: ("init_loss_scale", "scale_factor", "scale_window"),
    compat.deepspeed_loss_scaler: (
        "init_scale",
        "scale_factor",
        "scale_window",
        "min_scale",
        "delayed_shift",
    ),
    compat.megatron_grad_scaler: (
        "initial_scale",
        "min_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
    ),
    compat.apex_loss_scaler: (
        "init_scale",
        "scale_factor",
        "scale_window",
        "min_loss_scale",
        "max_loss_scale",
    ),
    compat.flax_dynamic_scale: (
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "fin_steps",
        "scale",
        "minimum_scale",
    ),
    compat.jmp_dynamic_loss_scale: ("loss_scale", "counter", "period", "factor", "min_loss_scale"),
    compat.keras_loss_scale_optimizer: ("initial_scale", "dynamic_growth_steps"),
}
FLAGS = {
    compat.torch_grad_scaler: ("enabled",),
    compat.paddle_grad_scaler: ("enable", "use_dynamic_loss_scaling"),
    compat.mindspore_fixed: ("drop_overflow_update",),
    compat.deepspeed_loss_scaler: ("consecutive_hysteresis", "raise_error_at_min_scale"),
}
# Where the original takes None (no floor), None is a value, not a bad type.
NONE_OK = {
    (compat.apex_loss_scaler, "min_loss_scale"),
    (compat.flax_dynamic_scale, "minimum_scale"),
}
REQUIRED = {compat.jmp_dynamic_loss_scale: {"loss_scale": 2.0**15}}


def _bad_type_cases():
    for ctor, names in NUMBERS.items():
        for name in names:
            for bad in ("2", True, None, [2.0], jnp.ones(2)):
                if bad is None and (ctor, name) in NONE_OK:
                    continue
                yield pytest.param(ctor, name, bad, id=f"{ctor.__name__}-{name}-{bad!r:.8}")
    for ctor, names in FLAGS.items():
        for name in names:
            for bad in ("False", None, 1, 0.0):
                yield pytest.param(ctor, name, bad, id=f"{ctor.__name__}-{name}-{bad!r}")


@pytest.mark.parametrize("ctor, name, bad", list(_bad_type_cases()))
def test_bad_types_are_named(ctor, name, bad):
    """Issue 10: strings, bools, None (...) raise at once, naming the original's argument."""
    kwargs = {**REQUIRED.get(ctor, {}), name: bad}
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        ctor(**kwargs)


@pytest.mark.parametrize("bad", [True, None, [128.0], "128.0", "static"])
def test_apex_loss_scale_is_dynamic_or_a_number(bad):
    with pytest.raises((TypeError, ValueError), match="loss_scale"):
        compat.apex_loss_scaler(bad)


@pytest.mark.parametrize("ctor", list(NUMBERS))
def test_numpy_and_jax_scalars_are_numbers(ctor):
    """Numbers may come as NumPy scalars or 0-d arrays (jmp users pass jnp arrays)."""
    params = inspect.signature(ctor).parameters
    values = {**{n: params[n].default for n in NUMBERS[ctor] if n not in REQUIRED.get(ctor, {})}}
    values.update(REQUIRED.get(ctor, {}))
    values = {n: v for n, v in values.items() if v is not None}
    expected = ctor(**values)
    # (2**32, DeepSpeed's int default, does not fit a JAX int32: pass it as a float.)
    to_jax = lambda v: jnp.asarray(v if abs(v) < 2**31 else float(v))
    for convert in (lambda v: np.asarray(v)[()], to_jax):
        state = ctor(**{n: convert(v) for n, v in values.items()})
        assert state.mode == expected.mode
        for f in ("scale", "growth_interval", "growth_tracker", "min_scale", "max_scale"):
            assert float(getattr(state, f)) == float(getattr(expected, f)), f
