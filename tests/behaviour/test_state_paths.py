"""Every path that builds a loss-scale state gives one that never applies a bad update.

The paths: the constructors (``dynamic_scale``, ``static_scale``, ``no_scale``, the
``jaxamp.compat`` family), ``replace`` with random fields and values (valid or not),
unflattening (``jax.tree.unflatten``, also into another mode's tree), and an orbax
round trip into a target built with another configuration. Each state then drives
``jaxamp.step`` with random float16 / float32 gradients holding inf, NaN and huge
values, and the step must never apply a non-finite value when the state checks,
must skip exactly the steps whose unscaled gradients are not finite, leaving params
and inner state bit for bit as they were, and must keep the scale in
[2**-126, 2**126].

An independent oracle (:func:`_replace_ok`, :func:`_expect_finite`) decides what
must be accepted and what must be skipped; it is written from the API contract,
not from ``_loss_scale._FIELDS``.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxamp

LO, HI = 2.0**-126, 2.0**126
MODES = ("dynamic", "static", "static_unchecked", "check_only", "disabled")
FLOATS = ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")
COUNTERS = (
    "growth_tracker",
    "hysteresis_tracker",
    "nonfinite_streak",
    "skipped_steps",
    "min_scale_backoffs",
)
INTS = (*COUNTERS, "growth_interval", "hysteresis", "max_consecutive_nonfinite")
REFILL = ("growth", "finite", "finite_and_backoff")
FIELDS = (*FLOATS, *INTS, "hysteresis_refill", "raise_at_min_scale")

# ---------------------------------------------------------------------------
# Constructors.

special_scales = st.sampled_from(
    [LO, 2.0**-125, 2.0**-20, 0.25, 0.5, 1.0, 3.0, 2.0**15, 2.0**24, 2.0**125, HI]
)
# float32 values throughout: a wider value's range is checked before the float32 cast
# (see test_out_of_float32_range_values_are_refused below).
scales = st.one_of(special_scales, st.floats(LO, HI, width=32))
factors_up = st.one_of(
    st.sampled_from([1.5, 2.0, 4.0, 2.0**60]), st.floats(1.0078125, 2.0**20, width=32)
)
factors_down = st.one_of(
    st.sampled_from([2.0**-60, 0.125, 0.5, 0.9]), st.floats(2.0**-20, 0.9921875, width=32)
)
intervals = st.sampled_from([1, 2, 3, 2000])


@st.composite
def dynamic_states(draw):
    lo, hi = sorted([draw(st.sampled_from([0.0, LO, 0.25, 1.0])), draw(scales)])
    if draw(st.booleans()):
        hi = math.inf
    init = draw(st.sampled_from([lo if lo > 0 else LO, min(hi, HI), min(max(1.0, lo), hi)]))
    return jaxamp.dynamic_scale(
        init_scale=init,
        growth_factor=draw(factors_up),
        backoff_factor=draw(factors_down),
        growth_interval=draw(intervals),
        hysteresis=draw(st.sampled_from([1, 2, 3])),
        min_scale=lo,
        max_scale=hi,
        max_consecutive_nonfinite=draw(st.sampled_from([None, 0, 3])),
        hysteresis_refill=draw(st.sampled_from(REFILL)),
        raise_at_min_scale=draw(st.booleans()),
    )


def _constructed():
    C = jaxamp.compat
    return st.one_of(
        dynamic_states(),
        st.builds(jaxamp.static_scale, scales, st.booleans()),
        st.just(jaxamp.no_scale()),
        st.builds(C.torch_grad_scaler, scales, factors_up, factors_down, intervals, st.booleans()),
        st.builds(
            C.paddle_grad_scaler,
            st.booleans(),
            st.one_of(st.just(1.0), scales.filter(lambda s: s >= 1)),
            factors_up,
            factors_down,
            intervals,
            st.sampled_from([1, 2, 3]),
            st.booleans(),
        ),
        st.builds(
            C.megengine_grad_scaler,
            scales,
            st.one_of(st.just(0.0), factors_up),
            factors_down,
            st.sampled_from([0, 1, 2, 2000]),
        ),
        st.builds(C.mindspore_fixed, scales.filter(lambda s: s >= 1), st.booleans()),
        st.builds(
            C.mindspore_dynamic,
            scales.filter(lambda s: s >= 1),
            st.sampled_from([2, 3, 4]),
            st.sampled_from([1, 2, 2000]),
        ),
    )


# ---------------------------------------------------------------------------
# replace: random fields and values, and an oracle for which must be accepted.

_BAD_TYPES = ["2", None, [1.0, 2.0], {"v": 1}]


def _values(field):
    """Values for one field: valid, out of range and of the wrong type."""
    if field in FLOATS:
        return st.one_of(
            st.sampled_from(
                [0.0, -1.0, 2.0**-127, LO, 0.25, 0.5, 0.9, 1.0, 2.0, 3.0, 65504.0, HI, 2.0**127]
                + [math.inf, -math.inf, math.nan, True, *_BAD_TYPES]
            ),
            st.floats(2.0**-130, 2.0**127, width=32),
            st.sampled_from(
                [jnp.float16(8), np.float64(0.5), jnp.int32(4), np.array([1.0]), jnp.bool_(True)]
            ),
        )
    if field in INTS:
        extra = [None] if field == "max_consecutive_nonfinite" else []
        return st.one_of(
            st.integers(-3, 6),
            # 2**31 - 1 only where it cannot be incremented (see
            # test_counters_saturate_instead_of_wrapping).
            st.sampled_from(
                [2**30, 2.0, 2.5, True, *extra, *_BAD_TYPES]
                + ([] if field in COUNTERS else [2**31 - 1])
            ),
            st.sampled_from([jnp.int32(1), np.int64(3), jnp.float32(2.0), np.array([1, 2])]),
        )
    if field == "hysteresis_refill":
        return st.sampled_from([*REFILL, "bogus", 0, 1, 2, 3, -1, 1.5, True, None])
    assert field == "raise_at_min_scale"
    return st.sampled_from([True, False, np.bool_(True), jnp.bool_(False), 0, 1, "yes", None])


def _number(value, integer):
    """``value`` as a Python number if a field of that kind accepts its type, else None."""
    if isinstance(value, bool | np.bool_) or getattr(value, "dtype", None) == np.bool_:
        return None
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        kind = np.dtype(value.dtype).kind
        if value.shape != () or kind not in "iuf" or (integer and kind == "f"):
            return None
        return value.item()
    if isinstance(value, int | float):
        return value
    return None


def _field_ok(field, value):
    """Whether ``value`` is acceptable for ``field`` on its own (type and range)."""
    if field == "mode":
        return value in MODES
    if field == "raise_at_min_scale":
        return isinstance(value, bool | np.bool_) or getattr(value, "dtype", None) == np.bool_
    if field == "hysteresis_refill":
        if isinstance(value, str):
            return value in REFILL
        v = _number(value, True)
        return v is not None and float(v).is_integer() and 0 <= v < len(REFILL)
    if field == "max_consecutive_nonfinite" and value is None:
        return True
    v = _number(value, field in INTS)
    if v is None:
        return False
    if field in INTS:
        if not float(v).is_integer() or not -(2**31) <= v < 2**31:
            return False
        return v >= (1 if field in ("growth_interval", "hysteresis") else 0)
    return {
        "scale": LO <= v <= HI,
        "growth_factor": 1 < v < math.inf,
        "backoff_factor": 0 < v < 1,
        "min_scale": 0 <= v < math.inf,
        "max_scale": v > 0,
    }[field]


def _replace_ok(state, updates):
    """Whether ``state.replace(**updates)`` must succeed (types, ranges, cross-field rules)."""
    if not all(_field_ok(f, v) for f, v in updates.items()):
        return False
    mode = updates.get("mode", state.mode)
    # Cross-field rules compare the stored (float32) values.
    get = lambda f: float(
        np.float32(_number(updates[f], False) if f in updates else getattr(state, f))
    )
    if get("min_scale") > get("max_scale"):
        return False
    if mode == "dynamic" and not get("min_scale") <= get("scale") <= get("max_scale"):
        return False
    if mode in ("check_only", "disabled") and get("scale") != 1:
        return False
    return get("hysteresis_tracker") <= get("hysteresis")


@st.composite
def replaced(draw, state):
    """``state`` after a few random ``replace`` calls; each is checked against the oracle."""
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["field", "field", "bounds", "mode"]))
        if kind == "field":
            field = draw(st.sampled_from(FIELDS))
            updates = {field: draw(_values(field))}
        elif kind == "bounds":  # several fields at once, as a consistent change needs
            updates = {f: draw(st.one_of(scales, _values(f))) for f in ("scale", "min_scale")}
            updates["max_scale"] = draw(st.one_of(scales, st.just(math.inf)))
        else:
            updates = {"mode": draw(st.sampled_from(MODES))}
            if draw(st.booleans()):
                updates["scale"] = 1.0
        expected = _replace_ok(state, updates)
        try:
            new = state.replace(**updates)
        except (ValueError, TypeError) as e:
            assert not expected, f"replace({updates!r}) refused a valid change: {e}"
            # The message names (one of) the field(s) the caller passed. A mode change
            # refused for the scale's bounds names the scale only (see
            # test_a_refused_mode_change_names_the_mode).
            named = [*updates, "scale"] if "mode" in updates else list(updates)
            assert any(f in str(e) for f in named), (updates, str(e))
            continue
        assert expected, f"replace({updates!r}) accepted an invalid change: {new}"
        _assert_well_typed(new)
        for f, v in updates.items():
            if f in FLOATS:
                assert float(getattr(new, f)) == float(np.float32(_number(v, False))), f
        # Never aliased: donating one must not delete the other's leaves.
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
            assert a is not b
        state = new
    return state


def _assert_well_typed(state):
    dtypes = {f: jnp.float32 for f in FLOATS}
    dtypes.update({f: jnp.int32 for f in (*INTS, "hysteresis_refill")})
    dtypes["raise_at_min_scale"] = jnp.bool_
    for f, dtype in dtypes.items():
        leaf = getattr(state, f)
        assert isinstance(leaf, jax.Array) and leaf.shape == () and leaf.dtype == dtype, f


# ---------------------------------------------------------------------------
# unflatten, into the same tree or another mode's.


def _retree(state, mode):
    """``state``'s leaves in the tree of a state of ``mode`` (no validation, by design)."""
    donor = {
        "dynamic": jaxamp.dynamic_scale(),
        "static": jaxamp.static_scale(),
        "static_unchecked": jaxamp.static_scale(check_finite=False),
        "check_only": jaxamp.no_scale().replace(mode="check_only"),
        "disabled": jaxamp.no_scale(),
    }[mode]
    return jax.tree.unflatten(jax.tree.structure(donor), jax.tree.leaves(state))


@st.composite
def states(draw):
    state = draw(_constructed())
    _assert_well_typed(state)
    state = draw(replaced(state))
    path = draw(st.sampled_from(["as built", "unflatten", "unflatten into another mode"]))
    if path == "unflatten":
        same = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(state))
        assert jax.tree.structure(same) == jax.tree.structure(state)
        state = same
    elif path == "unflatten into another mode":
        state = _retree(state, draw(st.sampled_from(MODES)))
    return state


# ---------------------------------------------------------------------------
# Driving jaxamp.step.

# Clipping first keeps the momentum finite for every finite gradient (up to float32's
# largest), so that a non-finite param can only come from a non-finite gradient; the
# global norm of an inf gradient is inf and clipping turns it into NaN, never hides it.
INNER = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-3, momentum=0.9))
TX = jaxamp.skip_nonfinite(INNER, jaxamp.dynamic_scale())  # its state's loss scale is ours
_step = jax.jit(lambda grads, opt_state, params: jaxamp.step(TX, grads, opt_state, params))

# A few layouts, so that jit's cache keeps the test fast: (shape, gradient dtype) leaves.
LAYOUTS = [
    {"a": ((3,), jnp.float16), "b": ((2,), jnp.float32)},
    {"w": ((4,), jnp.float16)},
    {"x": {"y": ((2,), jnp.float32)}},
]
_is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _grad_values(dtype):
    huge = [20000.0, 60000.0, 65504.0] if dtype == jnp.float16 else [1e20, 3e38]
    pool = [0.0, 1.0, -1.0, 2.5, 1e-4, -7.0, math.inf, -math.inf, math.nan, *huge]
    return st.sampled_from(pool)


@st.composite
def grad_trees(draw, layout):
    def leaf(spec):
        shape, dtype = spec
        values = draw(st.lists(_grad_values(dtype), min_size=shape[0], max_size=shape[0]))
        if draw(st.integers(0, 3)) > 0:  # mostly finite, so that steps also get applied
            values = [v if math.isfinite(v) else 1.0 for v in values]
        return jnp.asarray(np.array(values, dtype))

    return jax.tree.map(leaf, layout, is_leaf=_is_spec)


def _expect_finite(state, grads):
    """Whether the step must be applied: the unscaled gradients, computed as the contract says."""
    if state.mode not in ("dynamic", "static", "check_only"):
        return True
    for g in jax.tree.leaves(grads):
        g = np.asarray(g)
        if state.mode != "check_only":  # float32 reciprocal, product rounded to the leaf's dtype
            inv = np.float32(1.0) / np.asarray(state.scale, np.float32)
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is what we look for
                g = (g.astype(np.float32) * inv).astype(g.dtype)
        if not np.all(np.isfinite(g)):
            return False
    return True


def _bits_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def drive(state, data, steps=3):
    layout = data.draw(st.sampled_from(LAYOUTS))
    params = jax.tree.map(
        lambda s: jnp.asarray(np.linspace(-1.0, 1.0, s[0][0]), jnp.float32),
        layout,
        is_leaf=_is_spec,
    )
    opt_state = TX.init(params)._replace(loss_scale=state)
    in_bounds = state.mode == "dynamic" and (
        float(state.min_scale) <= float(state.scale) <= float(state.max_scale)
    )
    for _ in range(steps):
        grads = data.draw(grad_trees(layout))
        ls = opt_state.loss_scale
        expect = _expect_finite(ls, grads)
        new_params, new_state = _step(grads, opt_state, params)
        new_ls = new_state.loss_scale
        skipped = int(new_ls.skipped_steps) - int(ls.skipped_steps)
        assert skipped == (not expect), (ls.mode, float(ls.scale), grads)
        if skipped:
            _bits_equal(new_params, params)
            _bits_equal(new_state.inner_state, opt_state.inner_state)
        if ls.mode.checks:  # a checking state never applies a non-finite value
            assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(new_params))
        scale = float(new_ls.scale)
        assert LO <= scale <= HI, scale
        if in_bounds:
            assert float(new_ls.min_scale) <= scale <= float(new_ls.max_scale)
        if ls.mode != "dynamic":
            assert scale == float(ls.scale)
        params, opt_state = new_params, new_state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_path_builds_a_state_that_never_applies_a_nonfinite_update(data) -> None:
    drive(data.draw(states()), data)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_orbax_round_trip_into_another_configuration(data) -> None:
    saved, target = data.draw(states()), data.draw(states())
    with tempfile.TemporaryDirectory() as d:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(Path(d) / "c", {"ls": saved})
        ckptr.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"ls": target})
        consistent = target.mode in ("dynamic", "static", "static_unchecked") or (
            float(saved.scale) == 1
        )
        if target.mode == "dynamic":
            consistent &= float(saved.min_scale) <= float(saved.scale) <= float(saved.max_scale)
        try:
            restored = jaxamp.checkpoint.restore(ckptr, abstract, directory=Path(d) / "c")["ls"]
        except ValueError as e:
            assert not consistent, e
            assert "mode from the target" in str(e) and "scale" in str(e)
            return
    assert consistent
    # Every number from the checkpoint, the mode from the target.
    assert restored.mode == target.mode
    _bits_equal(jax.tree.leaves(restored), jax.tree.leaves(saved))
    _assert_well_typed(restored)
    drive(restored, data, steps=2)


# ---------------------------------------------------------------------------
# 0.1.0's silent holes on these paths, one test each.


def test_replace_max_scale_cannot_leave_a_stale_check() -> None:
    # 0.1.0 accepted replace(max_scale=0.5) here and kept its static flag "the scale
    # cannot drop below 1": one clean step "grew" the scale to min(2, 0.5) = 0.5, the
    # check read the *scaled* float16 gradients [40000, 1], and step applied their
    # unscaled value [inf, 2]. Fails on 0.1.0 (the replace is accepted).
    state = jaxamp.dynamic_scale(init_scale=1.0, growth_interval=1)
    with pytest.raises(ValueError, match="max_scale"):
        state.replace(max_scale=0.5)
    # The consistent way there: the bounds move with it, and the check reads the scale
    # at run time, so gradients that overflow on unscaling are skipped.
    state = state.replace(min_scale=0.25, max_scale=0.5, scale=0.5)
    params = {"w": jnp.zeros(2)}  # float32 master params, float16 gradients (compressed)
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), state)
    new_params, opt_state = jaxamp.step(
        tx, {"w": jnp.array([40000.0, 1.0], jnp.float16)}, tx.init(params), params
    )
    _bits_equal(new_params, params)
    assert int(opt_state.loss_scale.skipped_steps) == 1
    assert float(opt_state.loss_scale.scale) == 0.25


def test_donating_a_new_state_never_deletes_the_old_ones_leaves() -> None:
    # 0.1.0's eager tx.update returned the input's configuration leaves as they were
    # (the same buffers), so donating the new state deleted the old state's leaves:
    # reading them raised "Array has been deleted". Fails on 0.1.0.
    params = {"w": jnp.ones(3)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1, momentum=0.9), jaxamp.dynamic_scale())
    old = tx.init(params)
    before = jax.device_get(tx.init(params))  # not `old`: a host copy would be cached on it
    _, new = tx.update({"w": jnp.ones(3)}, old, params)
    _, skipped = tx.update({"w": jnp.array([1.0, jnp.inf, 0.0])}, old, params)
    news = [new, skipped, jaxamp.update(old.loss_scale, True), old.loss_scale.replace(hysteresis=2)]

    touch = jax.jit(
        lambda s: jax.tree.map(lambda x: x if x.dtype == jnp.bool_ else x + 0, s),
        donate_argnums=0,
    )
    for n in news:
        jax.block_until_ready(touch(n))
    assert not [x for x in jax.tree.leaves(old) if x.is_deleted()]
    _bits_equal(old, before)  # every leaf of the old state is still there, unchanged


# ---------------------------------------------------------------------------
# Holes the property tests found in the core's validation, now closed: values that
# change when stored, counters past int32, mode changes named, counters that saturate.


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: jaxamp.dynamic_scale(growth_factor=1e39), "growth_factor"),  # stored: inf
        (lambda: jaxamp.dynamic_scale(backoff_factor=1e-50), "backoff_factor"),  # stored: 0
        (lambda: jaxamp.static_scale(4.0).replace(min_scale=1e39), "min_scale"),  # stored: inf
    ],
    ids=["growth_factor", "backoff_factor", "min_scale"],
)
def test_out_of_float32_range_values_are_refused(build, field) -> None:
    # The contract: growth_factor finite and > 1, backoff_factor in (0, 1), min_scale
    # finite. These pass the check as float64 and are stored out of range.
    with pytest.raises(ValueError, match=field):
        build()


@pytest.mark.parametrize("value", [2**31, np.int64(2**40)], ids=["int", "int64"])
def test_counters_beyond_int32_are_refused_naming_the_field(value) -> None:
    # Today: 2**31 raises OverflowError (not ValueError/TypeError, field unnamed), and
    # np.int64(2**40) is silently stored as 0.
    with pytest.raises(ValueError, match="skipped_steps"):
        jaxamp.static_scale(4.0).replace(skipped_steps=value)


def test_a_refused_mode_change_names_the_mode() -> None:
    # A static state may hold a scale outside [min_scale, max_scale]; switching it to
    # dynamic is refused with "scale (...) must lie in [min_scale, max_scale]", which
    # does not name the argument the caller passed (mode=).
    state = jaxamp.static_scale(4.0).replace(max_scale=2.0)
    with pytest.raises(ValueError, match="mode"):
        state.replace(mode="dynamic")


@pytest.mark.parametrize(
    ("field", "finite", "after", "scale"),
    [
        # A non-finite step: the counter stays at its largest value; the scale backs off.
        ("skipped_steps", False, 2**31 - 1, 2.0**14),
        ("nonfinite_streak", False, 2**31 - 1, 2.0**14),
        # A finite step: the tracker stays at 2**31 - 1 >= growth_interval, so the
        # scale grows and the tracker restarts at 0 (wrapped, it would be -2**31 and
        # postpone growth by 2**31 steps).
        ("growth_tracker", True, 0, 2.0**16),
    ],
)
def test_counters_saturate_instead_of_wrapping(field, finite, after, scale) -> None:
    # replace accepts 2**31 - 1 (an integer >= 0); one more step wraps it to -2**31,
    # a state that replace and a checkpoint restore then refuse ("must be >= 0").
    # optax's numerics.safe_increment saturates instead.
    state = jaxamp.dynamic_scale(growth_interval=2**31 - 1).replace(**{field: 2**31 - 1})
    new = jaxamp.update(state, finite)
    assert int(getattr(new, field)) == after
    assert float(new.scale) == scale
