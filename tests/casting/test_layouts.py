"""A float32 vector broadcast into an activation promotes, but a Linear's bias (issue 31).

torch's type promotion: a float16 activation meeting a float32 tensor of
dimension >= 1 gives float32, so a per-channel multiplier, a layer scale of
1e-6 or a per-feature offset of 1e5 keeps its value; torch's ``Linear`` and
``conv`` cast their bias down with the matmul, and so does autocast for
``dot + bias`` (Flax's Dense and Conv, NNX and equinox Linear). Trace-time
constant vectors the low dtype holds are cast down, and a sentinel fill
saturates. Each test here but the bias and fill ones fails on the rule that
cast every broadcast vector down.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' listing

import jaxamp
from tests.helpers import dyadic as _dyadic

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
EPS32 = float(jnp.finfo(F32).eps)


def _out_dtypes(fn, args, name):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [np.dtype(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == name]


# ------------------------------------------------- run-time vectors promote


@pytest.mark.parametrize(
    "dtype, value",
    # 1e-8 is 0 in float16; 1e-8 * (1 + 2**-10) is rounded by bfloat16's 8 bits.
    [(F16, 1e-8), (BF16, 1e-8 * (1 + 2.0**-10))],
    ids=["f16", "bf16"],
)
def test_a_per_channel_multiplier_of_a_matmul_keeps_its_value(dtype, value):
    x, w = _dyadic(0, (4, 8), 2.0), _dyadic(1, (8, 16), 4.0)  # x @ w exact in both
    g = jnp.full((16,), value, F32)

    def f(x, w, g):
        return (x @ w) * g

    ref = np.asarray(f(x, w, g), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=dtype)(x, w, g), np.float64)
    # One float32 rounding of an exact product (the rule that cast g down: 0 in
    # float16, 2**-10 off in bfloat16).
    np.testing.assert_allclose(got, ref, rtol=2 * EPS32, atol=0)


def _layer_scale_net(params, x):
    # ConvNeXt / CaiT: stream + gamma * branch(stream), gamma initialised to 1e-6
    # (a float16 subnormal, 1.3% off; gamma * branch is far below the stream's
    # float16 spacing, so a float16 add leaves the stream unchanged).
    stream = x @ params["embed"]  # an activation, as after a patch embedding
    for p in params["blocks"]:
        branch = stream @ p["w"] + p["b"]  # the branch's last Dense
        stream = stream + p["gamma"] * branch
    return stream


def _layer_scale_params(d):
    blocks = [
        {"w": _dyadic(2 + k, (d, d), 1.0), "b": _dyadic(4 + k, (d,), 8.0),
         "gamma": jnp.full((d,), 1e-6, F32)}
        for k in range(2)
    ]  # fmt: skip
    return {"embed": _dyadic(1, (d, d), 16.0), "blocks": blocks}


def test_a_layer_scale_of_1e_6_on_a_residual_branch_value_and_gradient():
    b, d = 32, 16
    x, params = _dyadic(0, (b, d), 2.0), _layer_scale_params(d)
    c = jnp.asarray(np.random.default_rng(9).normal(size=(b, d)), F32)
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    stream = np.asarray(x, np.float64) @ p64["embed"]  # exact in float16
    branch1 = stream @ p64["blocks"][0]["w"] + p64["blocks"][0]["b"]  # exact too
    y1 = stream + 1e-6 * branch1
    w2 = np.abs(p64["blocks"][1]["w"])

    ref = np.asarray(_layer_scale_net(params, x), np.float64)
    got = np.asarray(jaxamp.autocast(_layer_scale_net, dtype=F16)(params, x), np.float64)
    # float32's rounding, and the second branch's matmul reading the stream in
    # float16 (times gamma). The rule that cast gamma down lost gamma * branch1.
    tol = 4 * EPS32 * np.abs(ref).max() + 1e-6 * 2.0**-11 * (np.abs(y1) @ w2)
    assert (np.abs(got - ref) <= tol).all(), np.abs(got - ref).max()

    def loss(params, x, c):
        return jnp.sum(_layer_scale_net(params, x) * c)

    def dgamma1(fn):
        return np.asarray(jax.grad(fn)(params, x, c)["blocks"][0]["gamma"], np.float64)

    ref_g, got_g = dgamma1(loss), dgamma1(jaxamp.autocast(loss, dtype=F16))
    # d loss / d gamma1_j = sum_i ct_ij branch1_ij, ct = c + the second branch's
    # cotangent (gamma2 * c through its float16 matmul: a float16 subnormal, off by
    # at most half its 2**-24 step per term). A float32 sum of b products; the
    # rule that cast gamma1 down multiplied in float16 (2**-11 off).
    ct_err = 2.0**-25 * w2.sum(axis=1) * 2
    ct_bound = np.abs(np.asarray(c, np.float64)) + ct_err
    tol = np.sum(np.abs(branch1) * (2 * b * EPS32 * ct_bound + ct_err), axis=0)
    assert (np.abs(got_g - ref_g) <= tol).all(), (np.abs(got_g - ref_g), tol)


def test_a_large_per_feature_offset_stays_finite_in_float16():
    x, w = _dyadic(0, (4, 8), 2.0), _dyadic(1, (8, 16), 4.0)
    offset = jnp.full((16,), 1e5, F32)  # finite in float32, beyond float16's 65504

    def f(x, w, offset):
        h = x @ w
        z = jax.nn.relu(h) + offset  # not a matmul's bias: relu comes between
        return z * h

    ref = np.asarray(f(x, w, offset), np.float64)
    assert np.isfinite(ref).all()
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w, offset), np.float64)
    # The rule that cast the offset down made it inf.
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=4 * EPS32, atol=0)


# ------------------------- a Linear's bias follows its matmul (residual memory)


def _equinox_mlp():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.key(0), 2)
    l1, l2 = eqx.nn.Linear(8, 32, key=keys[0]), eqx.nn.Linear(32, 8, key=keys[1])

    def apply(params, x):
        l1, l2 = params
        return jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(x)

    return apply, (l1, l2)


def _linen_mlp():
    model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(8)])
    return model.apply, model.init(jax.random.key(0), jnp.ones((1, 8)))


def _nnx_mlp():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 8, rngs=rngs))
    graph, state = nnx.split(model)
    return (lambda state, x: nnx.merge(graph, state)(x)), state


def _conv_net():
    model = nn.Sequential([nn.Conv(32, (3,)), nn.relu, nn.Conv(8, (3,))])
    return model.apply, model.init(jax.random.key(0), jnp.ones((1, 4, 8)))


@pytest.mark.parametrize("make", [_linen_mlp, _nnx_mlp, _equinox_mlp, _conv_net])
def test_a_linear_layers_bias_is_added_in_float16(make):
    apply, params = make()
    x = jax.random.normal(jax.random.key(1), (16, 4, 8) if make is _conv_net else (16, 8))
    amp = jaxamp.autocast(apply, dtype=F16)
    # The hidden layer's bias add and relu run in float16 (torch's Linear casts its
    # bias); the last bias add feeds f's float32 output and runs in float32.
    adds = _out_dtypes(amp, (params, x), "add")
    assert adds == [np.dtype(F16), np.dtype(F32)], adds

    def loss(params, x):
        return jnp.sum(amp(params, x) ** 2)

    # The backward pass keeps no float32 copy of the hidden activation.
    saved = [a for a, _ in saved_residuals(loss, params, x) if a.dtype != bool]  # relu's mask
    hidden = [a for a in saved if a.shape[-1] == 32 and a.ndim > 1]
    assert hidden and all(a.dtype == F16 for a in hidden), hidden
    ref = apply(params, x)
    got = amp(params, x)
    # Two float16 layers: a relative error of a few float16 roundings per layer.
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(got, ref, atol=8 * 2.0**-11 * 24 * scale)


def test_a_bias_after_a_reshaped_matmul_is_a_linear_bias():
    # HF's Conv1D and Flax's DenseGeneral lay the product out again before the bias.
    x, w = _dyadic(0, (4, 6, 8), 2.0), _dyadic(1, (8, 16), 4.0)
    bias = _dyadic(2, (16,), 8.0)

    def f(x, w, bias):
        h = jax.lax.dot_general(x.reshape(24, 8), w, (((1,), (0,)), ((), ())))
        return jnp.tanh(h.reshape(4, 6, 16) + bias)

    assert _out_dtypes(jaxamp.autocast(f, dtype=F16), (x, w, bias), "add") == [np.dtype(F16)]


# ------------------------------------------------------- trace-time constants


def test_a_constant_fill_vector_still_saturates():
    # A closed-over mask bias: 0 where a key is kept, finfo(float32).min where not.
    fill = np.where(np.arange(8) < 6, 0.0, np.finfo(np.float32).min).astype(np.float32)
    x, w = _dyadic(0, (4, 8), 2.0), _dyadic(1, (8, 8), 4.0)

    def f(x, w):
        return jnp.tanh(x @ w + fill)

    amp = jaxamp.autocast(f, dtype=F16)
    assert _out_dtypes(amp, (x, w), "add") == [np.dtype(F16)]  # cast down, saturating
    got, ref = np.asarray(amp(x, w), np.float64), np.asarray(f(x, w), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=2 * 2.0**-11)  # tanh in float16


@pytest.mark.parametrize("value", [1e-8, 1e5], ids=["flushes", "overflows"])
def test_a_constant_vector_float16_cannot_hold_promotes(value):
    scale = np.full((8,), value, np.float32)  # closed over: a trace-time constant
    x, w = _dyadic(0, (4, 8), 2.0), _dyadic(1, (8, 8), 4.0)

    def f(x, w):
        h = x @ w
        return jnp.tanh(h) * scale * h

    ref = np.asarray(f(x, w), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w), np.float64)
    assert np.isfinite(got).all()
    # tanh of an exact float16 h is rounded once to float16; the rest is float32.
    np.testing.assert_allclose(got, ref, rtol=2 * 2.0**-11 + 4 * EPS32, atol=0)
