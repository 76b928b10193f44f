"""autocast: correctness first (docs/semantics.md#autocast-correctness; issue 31, items 1-3).

A float32 value meeting an activation keeps what float32 and torch.autocast
give: a float32 result, input, target or parameter promotes the op to float32
(torch's type promotion); only a scalar, a matmul's bias (torch's Linear casts
it) and a constant the low dtype holds (a fill) are cast down. A cast
down saturates for trace-time constants only: a run-time value beyond the low
dtype's range overflows visibly, as float16 arithmetic makes it. Each test here
fails on jaxamp 0.3, but ``test_constants_still_saturate``, which holds what
0.3 got right.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import jaxamp
from tests.casting import autocast_graphs as G

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


# ------------------------------------------------- item 1: float32 results promote


@pytest.mark.parametrize("op", ["mul", "where", "max"])
def test_a_float32_result_meeting_an_activation_is_not_cast_down(op):
    x, w = jnp.ones((4, 8)), jnp.full((8, 8), 1.5)  # x @ w = 12, exact in float16
    m = jnp.arange(32).reshape(4, 8) % 2 == 0

    def f(x, w, m):
        h = x @ w
        z = jnp.exp(h)  # 162755: finite in float32, beyond float16's 65504
        y = {"mul": z * h, "where": jnp.where(m, z, h), "max": jnp.maximum(z, h)}[op]
        # y feeds a float32 op and a product: it is not only read in float32.
        return jnp.log(y), y * h

    ref = f(x, w, m)
    got = jaxamp.autocast(f, dtype=F16)(x, w, m)
    for r, g in zip(ref, got, strict=True):
        assert g.dtype == F32
        # 0.3: log(z * h) = inf, where / max 11.09 (log 65504), y * h inf.
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5)


# ------------------------------------------------ item 2: float32 inputs promote


def test_huber_loss_of_targets_close_to_the_predictions_is_not_rounded_to_zero():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-2, 3, (256, 4)) / 2.0, F32)
    w = jnp.asarray(rng.integers(-8, 9, (4, 1)) / 8.0, F32)
    pred = np.asarray(x) @ np.asarray(w)  # exact in float16
    targets = jnp.asarray(pred + rng.choice([-1.0, 1.0], pred.shape) * 2.0**-12, F32)

    def f(x, w, targets):
        return optax.huber_loss(x @ w, targets)

    ref = f(x, w, targets)
    got = jaxamp.autocast(f, dtype=F16)(x, w, targets)
    # 0.5 * (2**-12)**2 = 3e-8 each; 0.3 cast the targets down: 163 of 256 were 0.
    assert (np.asarray(got) > 0).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)
    # The subtraction ran in float32 (torch promotes it: targets is float32).
    subs = [e for e in jax.make_jaxpr(jaxamp.autocast(f, dtype=F16))(x, w, targets).jaxpr.eqns
            if e.primitive.name == "sub"]  # fmt: skip
    assert subs and all(e.outvars[0].aval.dtype == F32 for e in subs)


def test_sigmoid_and_silu_of_an_activation_are_not_flushed_to_zero():
    # XLA's float16 logistic makes every input below -11.09 0 (exp(11.09) overflows
    # inside it); torch computes sigmoid in float32 and rounds once.
    x = jnp.arange(-12.5, -11.0, 0.25, dtype=F32)[:, None]  # exact in float16
    w = jnp.ones((1, 1))

    def f(x, w):
        return jax.nn.sigmoid(x @ w), jax.nn.silu(x @ w)

    for r, g in zip(f(x, w), jaxamp.autocast(f, dtype=F16)(x, w), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert (g != 0).all()  # 0.3: 0 (sigmoid 3.7e-6 to 1.7e-5, silu -4.6e-5 to -1.9e-4)
        # One rounding of a float16 subnormal (sigmoid), two for silu (x * sigmoid).
        np.testing.assert_allclose(g, r, rtol=2e-2)


# ------------------------------- item 3: run-time values overflow, never clipped


def _assert_overflows_visibly(got, ref, dtype=F16):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(ref).all()
    finite = np.isfinite(got)
    assert not finite.all(), "a value beyond the low dtype's range came back finite"
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-2)  # none clipped


def test_an_input_beyond_float16_reaching_a_dense_layer_overflows():
    model = nn.Dense(4)
    x = jnp.concatenate([jnp.full((2, 1), 2e5), jnp.ones((2, 7))], axis=1)
    params = model.init(jax.random.key(0), x)
    ref = model.apply(params, x)
    got = jaxamp.autocast(model.apply, dtype=F16)(params, x)
    _assert_overflows_visibly(got, ref)  # 0.3: 2e5 became 65504, finite and wrong

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    grads = jax.grad(jaxamp.autocast(loss, dtype=F16))(params, x)
    # The skip sees it: a non-finite gradient (0.3: finite, from the clipped input).
    assert not all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    report = jaxamp.find_overflow(loss, scale=1.0)(params, x)
    assert report.found and report.low_precision and report.pass_ == "forward", report
    assert report.magnitude == pytest.approx(2e5)


def test_raw_node_features_beyond_float16_do_not_give_wrong_finite_logits():
    # A GNN layer on raw features (counts up to 3.5e5): 0.3 gave logits 4% off, finite.
    rng = np.random.default_rng(1)
    feats = jnp.asarray(np.concatenate([rng.uniform(0, 3.5e5, (16, 1)),
                                        rng.normal(size=(16, 7))], 1), F32)  # fmt: skip
    adj = jnp.asarray(rng.random((16, 16)) < 0.3, F32) / 5.0
    w1 = jnp.asarray(rng.normal(size=(8, 8)) * 1e-3, F32)
    w2 = jnp.asarray(rng.normal(size=(8, 3)), F32)

    def logits(feats, adj, w1, w2):
        return adj @ jax.nn.relu(feats @ w1) @ w2

    _assert_overflows_visibly(
        jaxamp.autocast(logits, dtype=F16)(feats, adj, w1, w2), logits(feats, adj, w1, w2)
    )


def test_a_computed_value_beyond_float16_fed_to_a_matmul_overflows():
    x, w, v = jnp.ones((4, 8)), jnp.full((8, 8), 1.5), jnp.full((8, 8), 0.125)

    def f(x, w, v):
        return jnp.exp(x @ w) @ v  # torch casts the float32 exp to float16 too: inf

    _assert_overflows_visibly(jaxamp.autocast(f, dtype=F16)(x, w, v), f(x, w, v))


def test_constants_still_saturate():
    # A sentinel fill: finfo(float32).min stays finite in float16 (a fully masked
    # row would otherwise give NaN), as a constant, not a run-time value.
    x, w = jax.random.normal(jax.random.key(0), (4, 4)), jnp.eye(4)

    def f(x, w):
        scores = x @ w
        masked = jnp.where(jnp.zeros((4, 4), bool), scores, jnp.finfo(F32).min)
        return jax.nn.softmax(masked, axis=-1), jnp.tanh(masked)

    probs, t = jaxamp.autocast(f, dtype=F16)(x, w)
    assert np.isfinite(np.asarray(probs)).all() and np.isfinite(np.asarray(t)).all()
    np.testing.assert_allclose(np.asarray(probs), 0.25, rtol=1e-6)


# ---------------------------------------------------- the rule, read from the program


def test_a_bias_scalars_and_fills_are_cast_down_the_rest_promotes():
    b, t, f = 2, 3, 4
    rng = np.random.default_rng(2)
    args = {
        "x": rng.normal(size=(b, t, f)),
        "w": rng.normal(size=(f, f)),
        "bias": rng.normal(size=(f,)),  # a Dense bias: cast down
        "row_weight": rng.normal(size=(b, 1, 1)),  # a per-row weight: promotes
        "pad_mask": (rng.random((b, t, 1)) < 0.5) * 1.0,  # (batch, length): promotes
        "target": rng.normal(size=(b, t, f)),  # the activation's size: promotes
    }
    args = {k: jnp.asarray(v, F32) for k, v in args.items()}

    def fn(x, w, bias, row_weight, pad_mask, target):
        h = x @ w
        # tanh after each: the op is not right before a float32 output.
        return [jnp.tanh(v) for v in (
            h + bias, h * row_weight, h * 0.5, jnp.where(h > 0, h, -1e9),
            h * pad_mask, h - target, h + jnp.exp(x),
        )]  # fmt: skip

    closed = jax.make_jaxpr(jaxamp.autocast(fn, dtype=F16))(**args)
    tanhs = [e for e in closed.jaxpr.eqns if e.primitive.name == "tanh"]
    got = [np.dtype(e.invars[0].aval.dtype) for e in tanhs]
    f16, f32 = np.dtype(F16), np.dtype(F32)
    assert got == [f16, f32, f16, f16, f32, f32, f32], got
    ref = fn(**args)
    for r, g in zip(ref, jaxamp.autocast(fn, dtype=F16)(**args), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-2)


# ------------------------------------------------------------- random programs

_graphs = st.builds(
    G.Graph,
    st.lists(
        st.tuples(st.sampled_from(G.OPS), st.integers(0, 29), st.integers(0, 29)),
        min_size=1,
        max_size=6,
    ).map(tuple),
    st.sampled_from([0.5, 2.0, 3.0]),
)


def _final_ran_low(fn, args, dtype):
    """Whether the output's last op ran in `dtype` (its value came back through a cast)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    out = jaxpr.outvars[0]
    for eqn in jaxpr.eqns:
        if out in eqn.outvars:
            return eqn.primitive.name == "convert_element_type" and (
                eqn.invars[0].aval.dtype == dtype
            )
    return False


@settings(max_examples=60, deadline=None, derandomize=True)
@given(graph=_graphs, seed=st.integers(0, 2**30))
def test_random_programs_in_float16_are_within_the_bound_of_torchs_dtypes(graph, seed):
    """Random graphs of activations, float32 inputs, parameters and constants:
    never non-finite where float32 and torch are finite, and within the error
    bound of a program that rounds each op to the dtype torch.autocast (CUDA,
    float16) gives it, against exact float64 arithmetic (numpy)."""
    data = G.make_data(seed)
    kinds = G.torch_model_dtypes(graph, data)
    exact, bound = G.reference(graph, data, kinds, G.FLOAT16)
    emulated = G.emulate(graph, data, kinds, G.FLOAT16)
    assume(np.isfinite(exact).all() and np.abs(exact).max() < 1e30)
    assume(np.isfinite(emulated).all())  # torch's program overflows float16 itself
    # The bound holds for the torch-like program itself (it checks the bound).
    assert (np.abs(emulated - exact) <= 4 * bound).all()
    fn = G.run_jnp(graph)
    args = [data[k] for k in "xwtpm"]
    amp = jaxamp.autocast(fn, dtype=F16)
    got = amp(*args)
    assert got.dtype == F32
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), (graph, kinds)
    ratio = np.max(np.abs(got - exact) / bound, initial=0.0, where=bound > 0)
    assert (np.abs(got - exact) <= 4 * bound).all(), (graph, kinds, ratio)
    if kinds[-1] == G.WIDE:  # torch's result is float32: so is autocast's
        assert not _final_ran_low(amp, args, F16), (graph, kinds)
