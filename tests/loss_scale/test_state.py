"""The loss-scale state and its pure functions: scale, unscale_and_check, update."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from tests.helpers import trajectory

COUNTERS = ("growth_tracker", "hysteresis_tracker", "nonfinite_streak", "skipped_steps")


def test_dynamic_scale_defaults_and_dtypes():
    s = jaxamp.dynamic_scale()
    assert float(s.scale) == 2.0**15 and s.scale.dtype == jnp.float32
    for name in COUNTERS:
        assert getattr(s, name).dtype == jnp.int32
    assert int(s.hysteresis_tracker) == 1
    assert (float(s.growth_factor), float(s.backoff_factor)) == (2.0, 0.5)
    assert (int(s.growth_interval), int(s.hysteresis)) == (2000, 1)
    assert (float(s.min_scale), float(s.max_scale)) == (1.0, 2.0**24)
    assert s.dynamic and s.enabled and s.check_finite


def test_skip_nonfinite_property_is_check_finite_with_a_deprecation():
    """0.3's name of the flag warns at the reader's line and gives the same answer."""
    for s in (jaxamp.dynamic_scale(), jaxamp.static_scale(2.0, check_finite=False)):
        with pytest.warns(DeprecationWarning, match="check_finite") as caught:
            old = s.skip_nonfinite
        assert old is s.check_finite and caught[0].filename == __file__


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": math.inf}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -2.0}, "init_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": 0.0}, "max_scale"),
        ({"init_scale": 2.0**30}, "init_scale"),
        ({"max_consecutive_nonfinite": -1}, "max_consecutive_nonfinite"),
        ({"max_consecutive_nonfinite": 1.5}, "max_consecutive_nonfinite"),
    ],
)
def test_invalid_configuration_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        jaxamp.dynamic_scale(**kwargs)


def test_static_scale_validates():
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^scale must be finite"):
            jaxamp.static_scale(bad)


def test_replace_changes_configuration_at_run_time_and_validates():
    s = jaxamp.dynamic_scale(init_scale=4.0, growth_interval=1)
    s4 = s.replace(growth_factor=4.0)
    assert s4.growth_factor.dtype == jnp.float32 and not s4.growth_factor.weak_type
    assert float(jaxamp.update(s4, True).scale) == 16.0
    with pytest.raises(ValueError, match="growth_factor"):
        s.replace(growth_factor=0.5)
    with pytest.raises(ValueError, match="hysteresis"):
        s.replace(hysteresis=0)
    # A replaced state keeps its leaf types, so it is a valid scan carry.
    out = jax.lax.scan(lambda c, f: (jaxamp.update(c, f), None), s4, jnp.ones(3, bool))[0]
    assert float(out.scale) == 4.0**4


def test_configuration_survives_jit():
    """jmp loses min_loss_scale through jit (it sits in dropped aux data); we must not."""
    s = jaxamp.dynamic_scale(init_scale=64.0, min_scale=16.0, backoff_factor=0.5)

    @jax.jit
    def fail(s):
        return jaxamp.update(s, jnp.array(False))

    for _ in range(5):
        s = fail(s)
    assert float(s.min_scale) == 16.0
    assert float(s.scale) == 16.0


def test_scale_never_reaches_zero_with_defaults():
    """Keras lets the scale reach 0 after enough overflows; the default floor is 1."""
    s, seq = jaxamp.dynamic_scale(), jnp.zeros(3000, bool)
    scales = trajectory(s, seq)["scale"]
    assert scales.min() == 1.0
    assert int(trajectory(s, seq[:1])["skipped_steps"][-1]) == 1


def test_growth_happens_on_the_growth_interval_th_finite_step():
    """flax's DynamicScale grows one step late; we grow right after the N-th clean step."""
    s = jaxamp.dynamic_scale(init_scale=8.0, growth_interval=3)
    t = trajectory(s, jnp.ones(7, bool))
    np.testing.assert_array_equal(t["scale"], [8, 8, 16, 16, 16, 32, 32])
    np.testing.assert_array_equal(t["growth_tracker"], [1, 2, 0, 1, 2, 0, 1])


def test_hysteresis_tolerates_overflows_until_it_runs_out():
    s = jaxamp.dynamic_scale(init_scale=64.0, hysteresis=3, growth_interval=100)
    seq = jnp.array([0, 0, 1, 0, 0, 0, 0, 0, 0], bool)
    t = trajectory(s, seq)
    np.testing.assert_array_equal(t["scale"], [64, 64, 64, 64, 64, 32, 32, 32, 16])
    np.testing.assert_array_equal(t["hysteresis_tracker"], [2, 1, 3, 2, 1, 3, 2, 1, 3])
    np.testing.assert_array_equal(t["nonfinite_streak"], [1, 2, 0, 1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(t["skipped_steps"], [1, 2, 2, 3, 4, 5, 6, 7, 8])


def test_bounds_and_nonfinite_growth():
    s = jaxamp.dynamic_scale(init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    assert trajectory(s, jnp.ones(4, bool))["scale"].max() == 2.0**24
    # Unbounded (PyTorch-style) scales stop at 2**126, where 1/scale is still a normal
    # float32: past it the reciprocal is flushed to 0 and every gradient unscales to 0.
    s = jaxamp.dynamic_scale(init_scale=2.0**125, growth_interval=1, max_scale=math.inf)
    t = trajectory(s, jnp.ones(3, bool))
    np.testing.assert_array_equal(t["scale"], [2.0**126] * 3)
    np.testing.assert_array_equal(t["growth_tracker"], [0, 0, 0])


def test_static_and_disabled_move_only_counters():
    seq = jnp.array([1, 0, 1, 1, 0], bool)
    for s in (jaxamp.static_scale(128.0), jaxamp.no_scale()):
        t = trajectory(s, seq)
        assert set(np.unique(t["scale"])) == {float(s.scale)}
        np.testing.assert_array_equal(t["skipped_steps"], [0, 1, 1, 1, 2])
        np.testing.assert_array_equal(t["nonfinite_streak"], [0, 1, 0, 0, 1])


def test_scale_keeps_dtypes_and_skips_non_float_leaves():
    s = jaxamp.static_scale(2.0**16)
    tree = {
        "f16": jnp.array(0.5, jnp.float16),
        "bf16": jnp.array([1.0, 2.0], jnp.bfloat16),
        "f32": jnp.array(3.0),
        "i": jnp.array([1, 2], jnp.int32),
        "b": jnp.array(True),
        "none": None,
    }
    out = jaxamp.scale(s, tree)
    assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, tree)
    # 0.5 * 2**16 = 32768 fits float16 although the scale itself does not.
    assert float(out["f16"]) == 32768.0
    assert float(out["f32"]) == 3.0 * 2**16
    np.testing.assert_array_equal(out["i"], tree["i"])
    assert out["none"] is None
    assert jaxamp.scale(jaxamp.no_scale(), tree) is tree


def test_unscale_and_check_handles_every_leaf_kind():
    s = jaxamp.static_scale(4.0)
    float0 = np.zeros((2,), dtype=jax.dtypes.float0)
    grads = {
        "f16": jnp.array([8.0], jnp.float16),
        "bf16": jnp.array([8.0], jnp.bfloat16),
        "f32": jnp.array([8.0, 4.0]),
        "int": jnp.array([8]),
        "bool": jnp.array(True),
        "float0": float0,
        "none": None,
        "empty": (),
    }
    out, finite = jaxamp.unscale_and_check(s, grads)
    assert finite.dtype == jnp.bool_ and finite.shape == () and bool(finite)
    assert out["f16"].dtype == jnp.float16 and float(out["f16"][0]) == 2.0
    assert out["bf16"].dtype == jnp.bfloat16 and float(out["bf16"][0]) == 2.0
    np.testing.assert_array_equal(out["f32"], [2.0, 1.0])
    assert int(out["int"][0]) == 8 and bool(out["bool"])
    assert out["float0"] is float0 and out["none"] is None and out["empty"] == ()
    bad = dict(grads, bf16=jnp.array([jnp.nan], jnp.bfloat16))
    assert not bool(jaxamp.unscale_and_check(s, bad)[1])


def test_float16_unscale_does_not_underflow_in_the_reciprocal():
    # 1/2**25 is 0 in float16; computed in float32 it unscales 1024 to 2**-15 exactly.
    s = jaxamp.static_scale(2.0**25)
    out, finite = jaxamp.unscale_and_check(s, jnp.array([1024.0, 3.0], jnp.float16))
    assert bool(finite) and out.dtype == jnp.float16
    assert float(out[0]) == 2.0**-15 and float(out[1]) > 0


def test_unscale_overflow_is_caught():
    # With a scale below 1 unscaling can overflow float16: that step must be flagged.
    s = jaxamp.dynamic_scale(init_scale=0.5, min_scale=0.25)
    out, finite = jaxamp.unscale_and_check(s, jnp.array([60000.0], jnp.float16))
    assert not bool(finite) and bool(jnp.isinf(out[0]))


def test_float64_leaves_unscale_in_float64():
    if hasattr(jax, "enable_x64"):
        x64 = jax.enable_x64(True)
    else:  # JAX < 0.7
        from jax.experimental import enable_x64

        x64 = enable_x64()
    with x64:
        s = jaxamp.static_scale(3.0)
        g = jnp.array([1.0], jnp.float64)
        out, finite = jaxamp.unscale_and_check(s, g)
        assert out.dtype == jnp.float64 and bool(finite)
        assert float(out[0]) == 1.0 / 3.0  # exact in float64, not a float32 reciprocal


def test_no_scale_and_unchecked_static_are_pass_through():
    g = {"w": jnp.array([jnp.inf, 1.0])}
    for s in (jaxamp.no_scale(), jaxamp.static_scale(1.0, check_finite=False)):
        out, finite = jaxamp.unscale_and_check(s, g)
        assert bool(finite)
    out, _ = jaxamp.unscale_and_check(jaxamp.no_scale(), g)
    assert isinstance(out, jaxamp.types.Unscaled) and out.tree is g


def test_update_rejects_bad_finite_and_wrong_state():
    s = jaxamp.dynamic_scale()
    with pytest.raises(ValueError, match="finite"):
        jaxamp.update(s, jnp.array([True, False]))
    with pytest.raises(TypeError, match="LossScaleState"):
        jaxamp.update({"scale": 1.0}, True)
    with pytest.raises(TypeError, match="LossScaleState"):
        jaxamp.scale(None, jnp.ones(2))


def test_metrics_and_check_health():
    s = jaxamp.dynamic_scale(max_consecutive_nonfinite=2)
    m = jax.jit(jaxamp.metrics)(s)
    assert sorted(m) == [
        "growth_tracker",
        "loss_scale",
        "nonfinite_streak",
        "skipped",
        "skipped_steps",
    ]
    assert all(v.shape == () for v in m.values())
    for _ in range(2):
        s = jaxamp.update(s, False)
        jaxamp.check_health(s)
    s = jaxamp.update(s, False)
    with pytest.raises(FloatingPointError, match=r"3 steps in a row.*loss scale is now 4096"):
        jaxamp.check_health(s)
    jaxamp.check_health(jaxamp.update(s, True))  # recovered
    jaxamp.check_health(jaxamp.update(jaxamp.dynamic_scale(), False))  # default: tolerated
    with pytest.raises(ValueError, match="no LossScaleState"):
        jaxamp.check_health({"not": "a state"})


def test_vmap_over_states():
    s = jaxamp.dynamic_scale(init_scale=8.0, growth_interval=1)
    batched = jax.tree.map(lambda x: jnp.stack([x, x]), s)
    out = jax.vmap(jaxamp.update)(batched, jnp.array([True, False]))
    np.testing.assert_array_equal(out.scale, [16.0, 4.0])


# ---------------------------------------------------------------- property tests

float_dtypes = st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float32])


@st.composite
def trees(draw):
    """Random pytrees of float arrays (any of three dtypes) and int arrays."""
    n = draw(st.integers(0, 5))
    tree = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
        if draw(st.booleans()) or i == 0:
            dtype = draw(float_dtypes)
            values = draw(
                st.lists(
                    st.floats(-100, 100, allow_nan=False, width=16),
                    min_size=int(np.prod(shape)),
                    max_size=int(np.prod(shape)),
                )
            )
            tree[f"f{i}"] = jnp.asarray(np.reshape(values, shape), dtype)
        else:
            tree[f"i{i}"] = jnp.arange(int(np.prod(shape)), dtype=jnp.int32).reshape(shape)
    return tree


@settings(max_examples=40, deadline=None)
@given(
    tree=trees(),
    log2_scale=st.integers(0, 8),
    poison=st.sampled_from([None, math.inf, -math.inf, math.nan]),
    where=st.integers(0, 1000),
)
def test_unscale_inverts_scale_and_finds_any_nonfinite(tree, log2_scale, poison, where):
    s = jaxamp.static_scale(2.0**log2_scale)
    scaled = jaxamp.scale(s, tree)
    float_keys = [k for k in tree if k.startswith("f")]
    if poison is not None and float_keys:
        key = float_keys[where % len(float_keys)]
        leaf = scaled[key]
        flat = leaf.reshape(-1).at[where % leaf.size].set(poison)
        scaled = dict(scaled, **{key: flat.reshape(leaf.shape)})
    out, finite = jaxamp.unscale_and_check(s, scaled)
    assert bool(finite) == (poison is None or not float_keys)
    assert bool(jaxamp.all_finite(out)) == bool(finite)
    for k, v in tree.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        if poison is None:
            # Powers of two scale exactly unless float16 overflows (not with |x| <= 100, 2**8).
            np.testing.assert_array_equal(np.asarray(out[k], np.float32), np.asarray(v, np.float32))


def test_tree_maps_to_other_leaf_values_are_not_validated():
    """Unflattening must not validate: sizes, None placeholders and ints are fine leaves."""
    s = jaxamp.dynamic_scale()
    sizes = jax.tree.map(lambda x: x.size, s)
    assert sizes.growth_factor == 1 and sum(jax.tree.leaves(sizes)) == 15
    assert jax.tree.map(lambda x: None, s).scale is None
    assert jax.tree.map(lambda x: 0, s).backoff_factor == 0
    with pytest.raises(TypeError, match="no field"):
        s.replace(growth=2.0)


def test_check_reads_the_unscaled_values_whatever_the_configuration_says():
    """Whether unscaling can overflow (a scale below 1) is a run-time fact: the check
    always reads the values the optimizer will see, so no stored flag can go stale."""
    g = jnp.array([60000.0], jnp.float16)  # finite, but 60000 / 0.5 overflows float16
    s = jaxamp.dynamic_scale(init_scale=4.0, min_scale=2.0)
    for state in (
        s.replace(min_scale=0.25, scale=0.5),
        s.replace(scale=jnp.float32(4.0)).replace(min_scale=0.0, scale=jnp.float32(0.5)),
        jaxamp.static_scale(0.5),
        jaxamp.dynamic_scale(init_scale=0.5, min_scale=0.5).replace(max_scale=0.5),
    ):
        out, finite = jax.jit(jaxamp.unscale_and_check)(state, g)
        assert not bool(finite) and bool(jnp.isinf(out[0]))
    # A torch-style scale that backed off below 1 still catches the overflow.
    t = jaxamp.compat.torch_grad_scaler(init_scale=1.0)
    t = jaxamp.update(t, False)
    assert float(t.scale) == 0.5 and not bool(jaxamp.unscale_and_check(t, g)[1])


# check_health's default rule: more than 100 non-finite steps in a row once the scale
# can go no lower (at its floor, or fixed).
def _all_nan_run(ls, n):
    import optax

    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), ls)
    params = {"w": jnp.ones(4)}
    nan = {"w": jnp.full(4, jnp.nan)}
    body = lambda _, carry: jaxamp.step(tx, nan, carry[1], carry[0])
    return jax.jit(lambda p, s: jax.lax.fori_loop(0, n, body, (p, s)))(params, tx.init(params))


@pytest.mark.parametrize(
    "ls, scale",
    [
        (jaxamp.dynamic_scale(), "1"),  # min_scale=1
        (jaxamp.compat.torch_grad_scaler(), "1.17549e-38"),  # no floor: 2**-126
        (jaxamp.static_scale(128.0), "128"),
        (None, None),  # bfloat16: check and skip, never scale
    ],
    ids=["dynamic_scale", "torch_grad_scaler", "static_scale", "check_only"],
)
def test_check_health_raises_by_default_when_training_stopped_recovering(ls, scale):
    params, state = _all_nan_run(ls, 300)
    assert int(jaxamp.metrics(state)["nonfinite_streak"]) == 300
    np.testing.assert_array_equal(params["w"], np.ones(4))
    where = "at its floor" if ls is not None and ls.dynamic else "fixed"
    with pytest.raises(FloatingPointError, match="300 steps in a row were skipped") as info:
        jaxamp.check_health(state)
    said = f"the loss scale is now {scale}, {where}" if scale else "the run has no loss scale"
    assert said in str(info.value) and ("loss scale is now" in str(info.value)) == bool(scale)
    assert "max_consecutive_nonfinite=N" in str(info.value)


@pytest.mark.parametrize(
    "ls, first",
    [
        (jaxamp.dynamic_scale(), 101),  # at its floor after 15 backoffs
        (jaxamp.compat.torch_grad_scaler(), 142),  # 2**16 -> 2**-126: 142 backoffs
        (jaxamp.dynamic_scale(2.0**20, hysteresis=2, min_scale=2.0**-10), 101),
        (jaxamp.compat.mindspore_dynamic(), 1001),  # its own N=1000, scale or not
        (jaxamp.static_scale(8.0), 101),
    ],
)
def test_the_default_rule_raises_from_the_first_step_it_describes(ls, first):
    step = lambda s, f: (jaxamp.update(s, f),) * 2
    states = jax.lax.scan(step, ls, jnp.zeros(1100, bool))[1]  # states[i]: after i + 1 steps
    raises = []
    for steps in (1, first - 1, first, 1100):
        try:
            jaxamp.check_health(jax.tree.map(lambda x, i=steps - 1: x[i], states))
            raises.append(False)
        except FloatingPointError:
            raises.append(True)
    assert raises == [False, False, True, True]


def test_a_healthy_run_with_overflows_never_trips_the_default_rule():
    rng = np.random.default_rng(0)
    overflows = rng.random(4000) < 0.05
    overflows[999:1061] = [False] + [True] * 60 + [False]  # a bad patch of 60, then recovery
    overflows[2000:2004] = True
    for ls in (
        jaxamp.dynamic_scale(growth_interval=50),
        jaxamp.compat.torch_grad_scaler(),
        jaxamp.dynamic_scale(init_scale=1.0, growth_interval=10),
    ):
        step = lambda s, f: (jaxamp.update(s, f),) * 2
        states = jax.lax.scan(step, ls, jnp.asarray(~overflows))[1]
        assert int(np.max(states.nonfinite_streak)) == 60
        # A leading axis is checked element by element: every step's state at once.
        jaxamp.check_health(states)


def test_the_default_rule_can_be_turned_off_or_replaced():
    for ls in [
        jaxamp.dynamic_scale(max_consecutive_nonfinite=math.inf),
        jaxamp.compat.torch_grad_scaler().replace(max_consecutive_nonfinite=math.inf),
        jaxamp.dynamic_scale(max_consecutive_nonfinite=2**31 - 1),
        jaxamp.dynamic_scale(max_consecutive_nonfinite=500),
        jaxamp.static_scale(max_consecutive_nonfinite=math.inf),
        jaxamp.check_only(max_consecutive_nonfinite=math.inf),
    ]:
        _, state = _all_nan_run(ls, 300)
        jaxamp.check_health(state)
    assert (
        int(jaxamp.dynamic_scale(max_consecutive_nonfinite=math.inf).max_consecutive_nonfinite)
        == 2**31 - 1
    )
    _, state = _all_nan_run(jaxamp.dynamic_scale(max_consecutive_nonfinite=5), 6)
    with pytest.raises(
        FloatingPointError, match=r"6 steps in a row .*\(max_consecutive_nonfinite=5\)"
    ):
        jaxamp.check_health(state)
    with pytest.raises(ValueError, match=r"math.inf \(never raise\)"):
        jaxamp.dynamic_scale(max_consecutive_nonfinite=-math.inf)


def test_the_state_keeps_its_03_layout():
    # No field added: a 0.3 checkpoint restores, and its None (-1) is the default rule.
    assert jaxamp.loss_scale._state.FIELD_NAMES == (
        "scale",
        "growth_tracker",
        "hysteresis_tracker",
        "nonfinite_streak",
        "skipped_steps",
        "min_scale_backoffs",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "hysteresis_refill",
        "min_scale",
        "max_scale",
        "max_consecutive_nonfinite",
        "raise_at_min_scale",
    )
    assert int(jaxamp.dynamic_scale().max_consecutive_nonfinite) == -1
