"""Only sentinels saturate: a data constant is never clipped or flushed (issue 31).

A trace-time constant is cast down saturating only when it is a sentinel fill
(its values within the low dtype's range are all 0: ``{0, -1e9}``, ``{0,
finfo.min}``) or holds nothing the low dtype changes beyond rounding. A
closed-over data vector with one value beyond float16 (``[1, 2, 1e5]``) and a
vector computed from an ``arange`` or ``linspace`` inside ``f`` are data: they
promote where they meet an activation, as float32 and torch.autocast keep them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from tests.helpers import all_equations
from tests.helpers import dyadic as _dyadic

F16, F32 = jnp.float16, jnp.float32
U16, EPS32 = 2.0**-11, float(jnp.finfo(F32).eps)


def test_a_closed_over_data_vector_with_one_value_beyond_float16_is_not_clipped():
    # A de-normalisation vector (per-target units): one entry beyond 65504. Its
    # out-of-range values being one single value made it a "fill" that
    # saturated to 65504: 35 % off, finite, seen by no overflow check.
    y_std = np.array([1.0, 2.0, 1e5], np.float32)
    x, w = _dyadic(0, (8, 4), 2.0), _dyadic(1, (4, 3), 4.0)  # x @ w exact in float16

    def f(x, w):
        return jnp.tanh(x @ w) * y_std

    ref = np.asarray(f(x, w), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w), np.float64)
    # tanh of an exact float16 activation, rounded once to float16; the product
    # with y_std in float32 (torch.autocast promotes it: a float32 tensor).
    np.testing.assert_allclose(got, ref, rtol=2 * U16 + 4 * EPS32, atol=0)

    def loss(w, x):
        return jnp.sum(f(x, w) * 1e-5)

    ref_g = np.asarray(jax.grad(loss)(w, x), np.float64)
    got_g = np.asarray(jax.grad(jaxamp.autocast(loss, dtype=F16))(w, x), np.float64)
    # Each gradient entry sums 8 terms x * (1 - tanh^2) * y_std * 1e-5 whose
    # float16 factors (tanh, its derivative, the cotangent cast down for the
    # matmul) are off by a few float16 roundings each.
    scale = np.abs(np.asarray(x, np.float64)).T @ np.broadcast_to(y_std * 1e-5, (8, 3))
    assert (np.abs(got_g - ref_g) <= 8 * U16 * scale).all(), np.abs(got_g - ref_g) / scale


@pytest.mark.parametrize(
    "fill",
    [
        [0.0, 0.0, -1e9, 0.0],
        [0.0, float(np.finfo(np.float32).min), 0.0, float(np.finfo(np.float32).min)],
        [0.0, -1e9, -1e30, 0.0],  # several sentinels: still a fill
    ],
    ids=["minus_1e9", "finfo_min", "two_sentinels"],
)
def test_a_closed_over_sentinel_fill_still_saturates(fill):
    fill = np.asarray(fill, np.float32)
    q = _dyadic(0, (4, 4), 4.0)

    def attend(q):
        return jax.nn.softmax(q @ q.T + fill, axis=-1)

    ref = np.asarray(attend(q), np.float64)
    got = np.asarray(jaxamp.autocast(attend, dtype=F16)(q), np.float64)
    assert np.isfinite(got).all()
    # Exact float16 scores, the softmax in float32: masked keys get 0 either way.
    np.testing.assert_allclose(got, ref, rtol=8 * EPS32, atol=8 * EPS32)


def _h(x, w):
    return x @ w  # 0.25 everywhere: an activation exact in float16


_COMPUTED = {
    # a float16 0 or subnormal each, cast down: tanh(0) = 0
    "arange_times_1e-9": lambda h: jnp.tanh(h * (jnp.arange(16) * 1e-9 + 1e-9) * 1e8),
    "linspace_1e-9_1e-8": lambda h: jnp.tanh(h * jnp.linspace(1e-9, 1e-8, 16) * 1e8),
    # beyond float16 from 70000 on, cast down: saturated to 65504 (wrong, finite)
    "arange_times_1e4": lambda h: jnp.tanh(h * ((jnp.arange(16) + 1) * 1e4) * 1e-5),
    "float_arange": lambda h: jnp.tanh(h * jnp.arange(1e4, 1.7e5, 1e4) * 1e-5),
}


@pytest.mark.parametrize("name", sorted(_COMPUTED))
def test_a_vector_computed_from_an_arange_in_f_is_data_and_promotes(name):
    g = _COMPUTED[name]
    x, w = jnp.full((4, 8), 0.125, F32), jnp.full((8, 16), 0.25, F32)

    def f(x, w):
        return g(_h(x, w))

    ref = np.asarray(f(x, w), np.float64)
    assert np.all(ref != 0)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w), np.float64)
    # The activation is exact; everything after it runs in float32 (torch
    # promotes with a float32 vector): a few float32 roundings.
    np.testing.assert_allclose(got, ref, rtol=8 * EPS32, atol=0)


@pytest.mark.parametrize("kept", [5, 0], ids=["padded", "fully_masked"])
def test_fills_built_from_a_run_time_mask_still_saturate(kept):
    # One example: the (1, keys) fill is a vector broadcast into the scores,
    # cast down to float16 (saturating: -65504, not -inf, so a fully masked row
    # is uniform as in float32, not NaN).
    mask = jnp.zeros((1, 8), bool).at[0, :kept].set(True)
    q = _dyadic(3, (1, 8, 4), 4.0)
    lowest = float(np.finfo(np.float32).min)

    def f(q, mask):
        a = (1.0 - mask.astype(F32)) * lowest  # HF's extended attention mask
        b = jnp.where(mask, 0.0, -1e9)
        s = jnp.einsum("bqd,bkd->bqk", q, q)
        return jax.nn.softmax(s + a[:, None, :], axis=-1), jax.nn.softmax(s + b[:, None, :], -1)

    for r, g in zip(f(q, mask), jaxamp.autocast(f, dtype=F16)(q, mask), strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=8 * EPS32, atol=8 * EPS32)


# One constant vector, spelled ten ways (issue 43, item 4): its value in f must not
# depend on the jnp function that built it. `c` is a Python float; `row` is a traced
# (16,) float32 value, `arg` the constant passed as an argument.
_SPELLINGS = {
    "jnp.full": lambda c, row, arg: jnp.full((16,), c),
    "jnp.ones_times_c": lambda c, row, arg: jnp.ones(16) * c,
    "jnp.tile": lambda c, row, arg: jnp.tile(jnp.array([c], F32), 16),
    "jnp.broadcast_to": lambda c, row, arg: jnp.broadcast_to(jnp.float32(c), (16,)),
    "jnp.array_literal": lambda c, row, arg: jnp.array([c] * 16, F32),
    "np_closed_over": lambda c, row, arg: np.full((16,), c, np.float32),
    "argument": lambda c, row, arg: arg,
    "jnp.full_like": lambda c, row, arg: jnp.full_like(row, c),
    "jnp.zeros_plus_c": lambda c, row, arg: jnp.zeros(16) + c,
    "lax.full": lambda c, row, arg: jax.lax.full((16,), c, F32),
}

# Magnitudes float16 flushes to 0 or keeps few digits of, cannot hold, and holds.
_MAGNITUDES = {"tiny": (-30, -5), "huge": (5, 30), "normal": (-3, 3)}


@pytest.mark.parametrize("spelling", sorted(_SPELLINGS))
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(sorted(_MAGNITUDES)),
    unit=st.floats(0.0, 1.0),
    mantissa=st.floats(1.0, 9.99),
    negative=st.booleans(),
)
def test_a_constant_vector_has_its_float32_value_however_it_is_built(
    spelling, kind, unit, mantissa, negative
):
    lo, hi = _MAGNITUDES[kind]
    c = float(np.float32((-1) ** negative * mantissa * 10.0 ** round(lo + unit * (hi - lo))))
    k = 0.25 / c  # a Python scalar: brings the product back to about 1
    build = _SPELLINGS[spelling]
    x, w = _dyadic(5, (4, 8), 4.0), _dyadic(6, (8, 16), 4.0)  # x @ w exact in float16

    def f(x, w, arg):
        h = x @ w
        return jnp.tanh(h * build(c, h[0], arg) * k)

    arg = jnp.full((16,), c, F32)
    arg_ref = np.abs(np.asarray(x @ w, np.float64)) * 0.25  # |h * c * k|, at most 2
    ref = np.asarray(f(x, w, arg), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w, arg), np.float64)
    # float32 and torch.autocast keep the constant: at most the constant and the
    # two products rounded to float16 (the activation is exact), and tanh's
    # result rounded once.
    tol = 3 * U16 * arg_ref + U16 * np.abs(ref) + 4 * EPS32
    assert (np.abs(got - ref) <= tol).all(), (c, np.max(np.abs(got - ref)))


_FILLS = {
    "jnp.full": lambda v: jnp.full((8,), v),
    "jnp.ones_times_c": lambda v: jnp.ones(8) * v,
    "np_closed_over": lambda v: np.full((8,), v, np.float32),
    "lax.full": lambda v: jax.lax.full((8,), v, F32),
    "scalar": lambda v: v,
}


@pytest.mark.parametrize("spelling", sorted(_FILLS))
@pytest.mark.parametrize("fill", [-1e9, float(np.finfo(np.float32).min), -np.inf])
def test_a_mask_fill_picked_by_where_saturates_however_it_is_built(spelling, fill):
    mask = jnp.tril(jnp.ones((8, 8), bool))
    q = _dyadic(7, (8, 4), 4.0)

    def attend(q):
        s = q @ q.T
        return jax.nn.softmax(jnp.where(mask, s, _FILLS[spelling](fill)), axis=-1)

    ref = np.asarray(attend(q), np.float64)
    amp = jaxamp.autocast(attend, dtype=F16)
    got = np.asarray(amp(q), np.float64)
    assert np.isfinite(got).all()
    # Exact float16 scores, the softmax in float32: masked keys get 0 either way.
    np.testing.assert_allclose(got, ref, rtol=8 * EPS32, atol=8 * EPS32)
    # The fill saturates into the float16 scores: the where stays in float16.
    selects = [e for e in _eqns(jax.make_jaxpr(amp)(q).jaxpr) if e.primitive.name == "select_n"]
    assert selects and all(e.outvars[0].aval.dtype == F16 for e in selects), selects


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it, but for those of
    custom_jvp functions (autocast's saturating casts are ones)."""
    return all_equations(jaxpr, skip=("custom_jvp_call",))
