"""Which vector added after a matmul is a Linear layer's bias (issue 31).

torch's ``Linear`` and ``conv`` cast their bias with the product; any other
float32 tensor added to a float16 activation promotes the add. autocast casts a
vector down as a bias only where it varies along a Linear's output features:
the last axis of a ``dot_general`` without batch dimensions, or a convolution's
output feature axis. A per-row or per-token float32 input added after a matmul
is data, whatever the batch size, and keeps its value.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import dyadic as _dyadic

F16, F32 = jnp.float16, jnp.float32
U16, EPS32 = 2.0**-11, float(jnp.finfo(F32).eps)


def _add_dtypes(fn, *args):
    jaxpr = jax.make_jaxpr(jaxamp.autocast(fn, dtype=F16))(*args).jaxpr
    return [np.dtype(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "add"]


def test_a_per_row_input_added_after_a_matmul_is_not_a_bias():
    # A bias-free projection plus a raw per-node feature (up to 3.5e5, a float32
    # input), centred and scaled. Taken for a bias, the feature was cast down to
    # inf, and tanh hid it: a finite, wrong output and finite gradients.
    feats, w = _dyadic(0, (6, 4), 2.0), _dyadic(1, (4, 8), 4.0)
    raw = jnp.linspace(1e5, 3.5e5, 6, dtype=F32)

    def f(feats, w, raw):
        h = feats @ w + raw[:, None]
        return jnp.tanh((h - raw.mean()) * 1e-5)

    ref = np.asarray(f(feats, w, raw), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(feats, w, raw), np.float64)
    # Exact float16 products; the sum, the centring (of values up to 3.5e5) and
    # tanh in float32: a few float32 roundings of 3.5e5, times 1e-5.
    np.testing.assert_allclose(got, ref, rtol=0, atol=8 * EPS32 * 3.5e5 * 1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_per_token_offset_keeps_its_value_at_any_batch_size(batch):
    # off (batch, tokens): at batch 1 it has one axis longer than 1 and was taken
    # for a bias (cast down: float16's spacing at 1000 is 0.5), at batch 2 not.
    rng = np.random.default_rng(0)
    h_in, w = _dyadic(0, (batch, 5, 8), 8.0), _dyadic(1, (8, 3), 4.0)
    off = jnp.asarray(1000 + rng.normal(size=(batch, 5)) * 0.3, F32)

    def f(h_in, w, off):
        return jnp.tanh(h_in @ w + off[:, :, None] - 1000.0)

    ref = np.asarray(f(h_in, w, off), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(h_in, w, off), np.float64)
    # The sum with 1000 + noise and the subtraction in float32 (its rounding of
    # 1000), tanh in float32.
    np.testing.assert_allclose(got, ref, rtol=0, atol=4 * EPS32 * 1000)


def test_an_additive_mask_of_one_example_does_not_become_minus_inf():
    # An additive key mask input (batch, 1, 1, keys) of -1e9 for a fully padded
    # example. Batched scores (q @ k.T per example and head) are no Linear's
    # product: the mask promotes. Cast down as a "bias" at batch 1 it was -inf,
    # and the padded rows NaN (where the masked scores have a use besides the
    # softmax, here the clipped logits a distillation loss reads).
    q = _dyadic(0, (1, 2, 4, 8), 4.0)
    mask = jnp.full((1, 1, 1, 4), -1e9, F32)

    def attend(q, mask):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, q) + mask
        out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), q)
        return out, jnp.maximum(s, -30.0)

    ref = [np.asarray(r, np.float64) for r in attend(q, mask)]
    assert all(np.isfinite(r).all() for r in ref)
    got = [np.asarray(g, np.float64) for g in jaxamp.autocast(attend, dtype=F16)(q, mask)]
    # Uniform weights 1/4 (exact) in both; the float16 product of them with q.
    np.testing.assert_allclose(got[0], ref[0], rtol=2 * U16, atol=2 * U16 * np.abs(ref[0]).max())
    np.testing.assert_array_equal(got[1], ref[1])  # -30 everywhere


# ------------------------------------------------- Linear biases are still biases


def _nchw_conv(x, k, b):
    return jnp.tanh(jax.lax.conv(x, k, (1, 1), "SAME") + b[:, None, None])


def _equinox_style(w, x, b):
    return jnp.tanh(jax.vmap(lambda v: w @ v + b)(x))  # W @ x + b, vmapped


def _dense_general(x, kernel, bias):
    # DenseGeneral(16, axis=(-2, -1)): two contracted axes, one output axis.
    h = jax.lax.dot_general(x, kernel, (((1, 2), (0, 1)), ((), ())))
    return jnp.tanh(h + bias.reshape(1, 16))


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (_nchw_conv, [(2, 8, 6, 6), (16, 8, 3, 3), (16,)]),
        (_equinox_style, [(16, 8), (4, 8), (16,)]),
        (_dense_general, [(4, 5, 8), (5, 8, 16), (16,)]),
    ],
    ids=["nchw_conv", "w_at_x_vmapped", "dense_general"],
)
def test_a_linear_or_conv_bias_is_still_added_in_float16(fn, shapes):
    args = [_dyadic(i, s, 4.0) for i, s in enumerate(shapes)]
    assert _add_dtypes(fn, *args) == [np.dtype(F16)]
    ref = np.asarray(fn(*args), np.float64)
    got = np.asarray(jaxamp.autocast(fn, dtype=F16)(*args), np.float64)
    # Exact float16 product and bias (dyadic), tanh rounded once to float16.
    np.testing.assert_allclose(got, ref, rtol=2 * U16, atol=2 * U16)


def test_a_multi_axis_dense_general_bias_promotes():
    # DenseGeneral((2, 8)): a (2, 8) bias has two long axes, laid out as the
    # activation's own values: it promotes (documented; only memory).
    model = nn.DenseGeneral((2, 8))
    x = _dyadic(0, (4, 8), 2.0)
    params = model.init(jax.random.key(0), x)
    assert _add_dtypes(lambda p, x: jnp.tanh(model.apply(p, x)), params, x) == [np.dtype(F32)]
