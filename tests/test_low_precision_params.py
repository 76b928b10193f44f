"""bfloat16 / float16 params without a float32 master copy: stochastic rounding and Kahan.

The rounding core against a reference built from bit patterns (hypothesis):
only the two neighbours come out, each with the right frequency, the draw a
function of the key; the float32 updates make ``optax.apply_updates`` land on the
chosen value exactly; Kahan tracks the float32 sum. Then every way jaxamp can
skip a step keeps params, compensation and key bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

N_DRAWS = 20_000
BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def _neighbours(x: np.float32, dtype: np.dtype) -> tuple[float, float]:
    """The two values of ``dtype`` around ``x`` (``down <= x < up``), from bit patterns."""
    if dtype == BF16:
        # bfloat16 is float32's top 16 bits: truncating the bits rounds toward zero.
        bits = np.array([x], np.float32).view(np.uint32)[0]
        toward0 = np.array([bits & 0xFFFF0000], np.uint32).view(np.float32)[0]
        away = np.array([(bits & 0xFFFF0000) + 0x10000], np.uint32).view(np.float32)[0]
        lo, hi = sorted([float(toward0), float(away)])
        if float(x) == float(toward0):
            return float(x), float(np.nextafter(np.array(x, BF16), np.array(np.inf, BF16)))
        return lo, hi
    with np.errstate(over="ignore"):  # the next value after 65504 is inf
        return _f16_neighbours(x)


def _f16_neighbours(x: np.float32) -> tuple[float, float]:
    h = np.float16(x)
    if float(h) == float(x):
        return float(x), float(np.nextafter(h, np.float16(np.inf)))
    if float(h) > float(x):
        return float(np.nextafter(h, np.float16(-np.inf))), float(h)
    return float(h), float(np.nextafter(h, np.float16(np.inf)))


@functools.partial(jax.jit, static_argnums=1)
def _round_many(x: jax.Array, dtype: np.dtype, key: jax.Array) -> jax.Array:
    return jaxamp.stochastic_round(key, jnp.broadcast_to(x, (N_DRAWS,)), dtype)


def _float32_in(dtype: np.dtype) -> st.SearchStrategy[float]:
    # float32 subnormals are read as 0 by XLA (flush to zero), as documented.
    top = 2.0**127 if dtype == BF16 else 65504.0
    return st.floats(
        -top, top, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False
    )


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([BF16, F16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_stochastic_round_is_unbiased(data, dtype, seed) -> None:
    """Only the two neighbours come out, ``up`` with probability ``(x - down) / gap``."""
    x = np.float32(data.draw(_float32_in(dtype), label="x"))
    down, up = _neighbours(x, dtype)
    out = np.asarray(_round_many(jnp.float32(x), dtype, jax.random.key(seed))).astype(np.float64)
    assert set(np.unique(out)) <= {down, up}
    p = (float(x) - down) / (up - down)
    ups = int((out == up).sum()) if up != down else 0
    # Binomial(N, p): 6 standard deviations (plus one draw) never fail by chance.
    sigma = np.sqrt(N_DRAWS * p * (1 - p))
    assert abs(ups - N_DRAWS * p) <= 6 * sigma + 1, (x, down, up, p, ups)
    # The mean is x to within the same bound: what "unbiased" means for the param.
    assert abs(out.mean() - float(x)) <= (6 * sigma + 1) / N_DRAWS * (up - down)


@pytest.mark.parametrize("x", [3.2523736e-37, -(2.0**-125) * 1.3, 2.0**-118 * 1.7, 2.0**-61 * 1.25])
def test_stochastic_round_is_unbiased_where_the_bfloat16_gap_is_a_float32_subnormal(x) -> None:
    # Below 2**-118 two neighbouring bfloat16 values are closer than float32's smallest
    # normal number: their difference, computed naively, is flushed to 0 by XLA and
    # every value rounded down (hypothesis found 3.25e-37: 0 ups in 20000 at p = 0.35).
    x = np.float32(x)
    down, up = _neighbours(x, BF16)
    out = np.asarray(_round_many(jnp.float32(x), BF16, jax.random.key(3))).astype(np.float64)
    assert set(np.unique(out)) <= {down, up}
    p = (float(x) - down) / (up - down)
    ups = int((out == up).sum())
    assert abs(ups - N_DRAWS * p) <= 6 * np.sqrt(N_DRAWS * p * (1 - p)) + 1, (x, p, ups)


def test_stochastic_round_mean_over_keys() -> None:
    """The same element rounded under 4096 keys: the mean is the float32 value."""
    x = jnp.float32(1.0 + 2.0**-8 + 2.0**-10)  # 0.625 of a bfloat16 ulp (2**-7) above 1
    keys = jax.random.split(jax.random.key(7), 4096)
    out = jax.vmap(lambda k: jaxamp.stochastic_round(k, x, jnp.bfloat16))(keys)
    frac = float(jnp.mean(out.astype(jnp.float32) == 1.0078125))
    assert abs(frac - 0.625) < 6 * np.sqrt(0.625 * 0.375 / 4096)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([BF16, F16]))
def test_stochastic_round_is_a_function_of_the_key(seed, dtype) -> None:
    x = jnp.linspace(-3.0, 3.0, N_DRAWS, dtype=jnp.float32) * 1.001
    a = _round_many(x, dtype, jax.random.key(seed))
    b = _round_many(x, dtype, jax.random.key(seed))
    c = _round_many(x, dtype, jax.random.key(seed + 1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # A legacy uint32 key and the typed key with the same data agree.
    legacy = _round_many(x, dtype, jax.random.PRNGKey(seed))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(legacy))


def test_stochastic_round_edges() -> None:
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 3.4e38, -3.4e38, 0.0, -0.0, 1.0], jnp.float32)
    out = jax.jit(jaxamp.stochastic_round, static_argnums=2)(jax.random.key(0), x, jnp.bfloat16)
    big = float(jnp.finfo(jnp.bfloat16).max)
    got = np.asarray(out.astype(jnp.float32))
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])
    assert got[3] == big and got[4] == -big  # beyond the range: saturates, no inf
    assert got[5] == 0.0 and got[7] == 1.0  # representable values come back unchanged
    assert np.signbit(got[6]) and not np.signbit(got[5])


def _bf16_pair(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Two bfloat16 values whose magnitudes are within 2**15 of each other (or new == 0)."""
    p = draw(st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False))
    p = np.array(p, BF16)
    if draw(st.booleans()):
        return p, np.array(0.0, BF16)
    ratio = 2.0 ** draw(st.floats(-14.9, 14.9))
    sign = draw(st.sampled_from([-1.0, 1.0]))
    new = np.array(sign * ratio * max(abs(float(p)), 1e-30), BF16)
    return p, new


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_float32_update_lands_exactly_on_the_chosen_value(data) -> None:
    """``apply_updates(p, new - p)`` gives ``new`` bit for bit (the transformations' device)."""
    p, new = _bf16_pair(data.draw)
    update = np.float32(new.astype(np.float32)) - np.float32(p.astype(np.float32))
    got = optax.apply_updates({"w": jnp.asarray(p)}, {"w": jnp.asarray(update)})["w"]
    assert got.dtype == jnp.bfloat16
    assert np.asarray(got).view(np.uint16) == new.view(np.uint16)


_SR_UPDATE = jax.jit(jaxamp.apply_with_stochastic_rounding(jax.random.key(0)).update)


@settings(max_examples=30, deadline=None)
@given(
    p=st.floats(-100, 100, width=32).filter(lambda v: abs(v) > 1e-3),
    u=st.floats(-1.0, 1.0, width=32),
    seed=st.integers(0, 2**31 - 1),
)
def test_stochastic_rounding_transform_applies_the_rounded_value(p, u, seed) -> None:
    params = {"w": jnp.full((64,), p, jnp.bfloat16), "f": jnp.full((3,), p, jnp.float32)}
    updates = {"w": jnp.full((64,), u, jnp.float32), "f": jnp.full((3,), u, jnp.float32)}
    # One transformation (one compile); the seed goes in through the state.
    state = jaxamp.types.StochasticRoundingState(jax.random.key_data(jax.random.key(seed)))
    out, new_state = _SR_UPDATE(updates, state, params)
    new = optax.apply_updates(params, out)
    assert out["w"].dtype == jnp.float32 and new["w"].dtype == jnp.bfloat16
    x = np.float32(np.float32(np.array(p, BF16)) + np.float32(u))
    down, up = _neighbours(x, BF16)
    assert set(np.unique(np.asarray(new["w"]).astype(np.float64))) <= {down, up}
    # The update is the exact difference: the rounded value comes back bit for bit.
    np.testing.assert_array_equal(
        np.asarray(out["w"]),
        np.asarray(new["w"], np.float32) - np.asarray(params["w"], np.float32),
    )
    np.testing.assert_array_equal(np.asarray(out["f"]), np.asarray(updates["f"]))  # untouched
    assert not np.array_equal(np.asarray(new_state.key), np.asarray(state.key))


@settings(max_examples=30, deadline=None)
@given(
    p=st.floats(0.5, 64.0, width=32),
    rel=st.floats(1e-5, 1e-2),
    n=st.integers(10, 200),
)
def test_kahan_tracks_the_float32_sum(p, rel, n) -> None:
    """n equal updates far below half an ulp: Kahan follows the exact sum, plain bf16 not."""
    p0 = jnp.array([p], jnp.bfloat16)
    u = jnp.array([rel * p], jnp.float32)
    tx = jaxamp.apply_with_kahan_summation()

    @jax.jit
    def run(p0: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(_, carry):
            params, state = carry
            updates, state = tx.update({"w": u}, state, params)
            return optax.apply_updates(params, updates), state

        params, state = jax.lax.fori_loop(0, n, body, ({"w": p0}, tx.init({"w": p0})), unroll=False)
        return params["w"], state.compensation["w"]

    final, comp = run(p0, u)
    true = float(p0.astype(jnp.float32)[0]) + n * float(u[0])
    ulp = float(jnp.spacing(jnp.array(abs(true), jnp.bfloat16)).astype(jnp.float32))
    # Rounding to nearest leaves half an ulp; the bfloat16 buffer loses 2**-9 of
    # at most half an ulp per step.
    assert abs(float(final[0]) - true) <= ulp * (0.5 + n / 512) * 1.01
    # And the param plus its compensation is closer still.
    assert abs(float(final[0]) + float(comp[0]) - true) <= ulp * (n / 512 + 0.01) * 1.01


def test_plain_bf16_loses_small_updates_that_both_keep() -> None:
    params = {"w": jnp.ones(4096, jnp.bfloat16)}
    grads = {"w": -jnp.ones(4096, jnp.bfloat16)}
    finals = {}
    for name, last in {
        "plain": optax.identity(),
        "sr": jaxamp.apply_with_stochastic_rounding(jax.random.key(0)),
        "kahan": jaxamp.apply_with_kahan_summation(),
    }.items():
        tx = optax.chain(optax.sgd(1e-3), last)
        p, s = params, tx.init(params)
        step = jax.jit(lambda p, s, tx=tx: jaxamp.step(tx, grads, s, p))
        for _ in range(50):
            p, s = step(p, s)
        finals[name] = float(jnp.mean(p["w"].astype(jnp.float32)))
    assert finals["plain"] == 1.0  # every 1e-3 step is under half an ulp (2**-8)
    assert abs(finals["kahan"] - 1.05) <= 2.0**-7 / 2
    assert abs(finals["sr"] - 1.05) < 2e-3


# --- skipped steps keep everything -------------------------------------------------


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4).astype(jnp.bfloat16), "b": jnp.ones(4)}


def _grads(bad: bool):
    g = {"w": jnp.full((3, 4), 0.3, jnp.bfloat16), "b": jnp.full((4,), 0.1)}
    if bad:
        g["w"] = g["w"].at[1, 2].set(jnp.inf)
    return g


LASTS = {
    "sr": lambda: jaxamp.apply_with_stochastic_rounding(jax.random.key(3)),
    "kahan": jaxamp.apply_with_kahan_summation,
}


def _inner(last: str) -> optax.GradientTransformation:
    return optax.chain(optax.adamw(1e-3, mu_dtype=jnp.bfloat16), LASTS[last]())


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(la, lb, strict=True)
    )


def _last_state(opt_state):
    """The stochastic-rounding or Kahan state inside a skip_nonfinite state."""
    return opt_state.inner_state[-1]


@pytest.mark.parametrize("last", sorted(LASTS))
@pytest.mark.parametrize("fused", [False, True], ids=["update", "step"])
def test_skip_nonfinite_keeps_params_buffer_and_key(last: str, fused: bool) -> None:
    tx = jaxamp.skip_nonfinite(_inner(last), jaxamp.dynamic_scale(2.0**4))

    @jax.jit
    def one(params, state, grads):
        if fused:
            return jaxamp.step(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = _params()
    state = tx.init(params)
    params, state = one(params, state, _grads(False))  # a taken step first
    before = (params, _last_state(state), state.inner_state)
    params2, state2 = one(params, state, _grads(True))
    assert int(jaxamp.metrics(state2)["skipped_steps"]) == 1
    assert _same(params2, before[0]) and _same(state2.inner_state, before[2])
    params3, state3 = one(params2, state2, _grads(False))
    assert not _same(params3["w"], params2["w"])
    if last == "sr":
        assert not _same(_last_state(state3), before[1])  # the key moves on a taken step


@pytest.mark.parametrize("last", sorted(LASTS))
def test_step_equals_update_then_apply(last: str) -> None:
    tx = jaxamp.skip_nonfinite(_inner(last), jaxamp.dynamic_scale(2.0**4))
    params = _params()
    state = tx.init(params)
    a = jax.jit(lambda p, s: jaxamp.step(tx, _grads(False), s, p))(params, state)

    def plain(p, s):
        u, s = tx.update(_grads(False), s, p)
        return optax.apply_updates(p, u), s

    b = jax.jit(plain)(params, state)
    assert _same(a, b)


@pytest.mark.parametrize("last", sorted(LASTS))
def test_every_k_window_with_an_inf_is_skipped_whole(last: str) -> None:
    tx = jaxamp.skip_nonfinite(_inner(last), jaxamp.dynamic_scale(2.0**4), every_k=2)
    step = jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))
    params = _params()
    state = tx.init(params)
    kept = (params, state.inner_state)
    params, state = step(params, state, _grads(True))  # micro-batch 1: inf, accumulated
    params, state = step(params, state, _grads(False))  # window ends: skipped
    assert int(jaxamp.metrics(state)["skipped_steps"]) == 1
    assert _same(params, kept[0]) and _same(state.inner_state, kept[1])
    params, state = step(params, state, _grads(False))
    params, state = step(params, state, _grads(False))
    assert not _same(params["w"], kept[0]["w"])


def test_multi_transform_skips_only_the_overflowed_partition() -> None:
    opts = {"sr": _inner("sr"), "kahan": _inner("kahan")}
    params = {"a": _params()["w"], "c": _params()["w"] * 2}
    tx = jaxamp.multi_transform(opts, {"a": "sr", "c": "kahan"}, jaxamp.dynamic_scale(2.0**4))
    step = jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))
    state = tx.init(params)
    good = {"a": _grads(False)["w"], "c": _grads(False)["w"]}
    params, state = step(params, state, good)
    bad_c = {"a": good["a"], "c": good["c"].at[0, 0].set(jnp.nan)}
    new, new_state = step(params, state, bad_c)
    assert _same(new["c"], params["c"]) and _same(
        new_state.inner_states["kahan"], state.inner_states["kahan"]
    )
    assert not _same(new["a"], params["a"])
    assert not _same(new_state.inner_states["sr"][-1], state.inner_states["sr"][-1])


@pytest.mark.parametrize("last", sorted(LASTS))
def test_train_state_skip(last: str) -> None:
    tx = jaxamp.skip_nonfinite(_inner(last), jaxamp.dynamic_scale(2.0**4))
    ts = jaxamp.TrainState.create(apply_fn=None, params=_params(), tx=tx)
    apply = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))
    ts = apply(ts, _grads(False))
    ts2 = apply(ts, _grads(True))
    assert _same(ts2.params, ts.params) and _same(
        ts2.opt_state.inner_state, ts.opt_state.inner_state
    )
    assert ts2.params["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("last", sorted(LASTS))
def test_nnx_optimizer_skip(last: str) -> None:
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    tx = jaxamp.skip_nonfinite(_inner(last), jaxamp.dynamic_scale(2.0**4))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train(optimizer, model, x):
        loss_fn = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
        _, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x)
        optimizer.update(model, grads)

    def snapshot():
        leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
        return leaves(nnx.state(model)), leaves(optimizer.opt_state.inner_state)

    train(optimizer, model, jnp.ones((2, 4), jnp.bfloat16))
    before = snapshot()
    train(optimizer, model, jnp.full((2, 4), jnp.inf, jnp.bfloat16))
    after = snapshot()
    assert int(optimizer.step) == 1
    assert _same(before[0], after[0])
    assert len(before[1]) >= 5 and _same(before[1], after[1])  # adamw's, and the key or buffer
    assert model.kernel[...].dtype == jnp.bfloat16


# --- errors ---------------------------------------------------------------------------


def test_bad_key_is_named() -> None:
    with pytest.raises(TypeError, match="`key`"):
        jaxamp.apply_with_stochastic_rounding(0)
    with pytest.raises(TypeError, match="`key`"):
        jaxamp.apply_with_stochastic_rounding(jnp.zeros(2, jnp.float32))
    with pytest.raises(ValueError, match="`key`"):
        jaxamp.apply_with_stochastic_rounding(jax.random.split(jax.random.key(0), 2))


@pytest.mark.parametrize("last", sorted(LASTS))
def test_missing_params_is_named(last: str) -> None:
    tx = LASTS[last]()
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="`params`"):
        tx.update({"w": jnp.ones(2)}, tx.init(params))


def test_kahan_state_for_other_params_is_an_error() -> None:
    tx = jaxamp.apply_with_kahan_summation()
    state = tx.init({"w": jnp.ones(2, jnp.float32)})
    with pytest.raises(ValueError, match="compensation"):
        tx.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2, jnp.bfloat16)})


def test_stochastic_round_rejects_other_dtypes() -> None:
    with pytest.raises(TypeError, match="`x`"):
        jaxamp.stochastic_round(jax.random.key(0), jnp.ones(2, jnp.bfloat16), jnp.bfloat16)
    with pytest.raises(TypeError, match="`dtype`"):
        jaxamp.stochastic_round(jax.random.key(0), jnp.ones(2), jnp.float32)


def test_ml_dtypes_bfloat16_is_jax_bfloat16() -> None:
    """The reference above builds bfloat16 values with numpy: the same type as JAX's."""
    assert np.dtype(ml_dtypes.bfloat16) == BF16
