"""A 0-dim float32 run-time value meeting an activation (issue 31).

torch computes ``h * s`` of a float16 ``h`` and a 0-dim float32 tensor ``s`` in
float32 ("opmath") and rounds the result once to float16 (CPU: ``4096 * 1e-9``
is 4.11e-6, a float16 subnormal). autocast does the same with an argument or a
scalar parameter it cannot check at trace time; casting ``s`` down first gave
0 for 1e-9 and 19 % off for 1e-7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' listing

import jaxamp

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
EPS32 = float(jnp.finfo(F32).eps)


def _round_once_tolerance(ref, dtype):
    """One rounding to `dtype`: half its spacing at `ref`, subnormals included."""
    fi = jnp.finfo(dtype)
    return (
        float(fi.eps) / 2 * np.abs(ref) + float(fi.smallest_subnormal) / 2 + 2 * EPS32 * np.abs(ref)
    )


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("s", [1e-9, 1e-7, 3e-3])
def test_an_activation_times_a_0_dim_argument_is_rounded_once(s, dtype):
    a = jnp.full((2, 8), 64.0, F32)
    b = jnp.eye(8, dtype=F32) * 64.0  # a @ b = 4096, exact in both dtypes

    def f(a, b, s):
        return ((a @ b) * s) * 1.0  # the product stays an activation

    ref = np.asarray(f(a, b, jnp.float32(s)), np.float64)
    got = np.asarray(jaxamp.autocast(f, dtype=dtype)(a, b, jnp.float32(s)), np.float64)
    assert (np.abs(got - ref) <= _round_once_tolerance(ref, dtype)).all(), (got[0, 0], ref[0, 0])


def test_the_same_value_as_an_argument_and_closed_over_gives_the_same_answer():
    a = jnp.full((2, 8), 64.0, F32)
    b = jnp.eye(8, dtype=F32) * 64.0
    s = np.float32(1e-7)
    as_arg = jaxamp.autocast(lambda a, b, s: jnp.tanh((a @ b) * s), dtype=F16)(a, b, s)
    closed = jaxamp.autocast(lambda a, b: jnp.tanh((a @ b) * s), dtype=F16)(a, b)
    np.testing.assert_array_equal(np.asarray(as_arg), np.asarray(closed))


def test_a_scalar_parameter_keeps_its_value_gradient_and_no_float32_copy():
    # A ReZero-style gate alpha (a scalar parameter of 1e-6, a float16 subnormal:
    # cast down first it is 1.3 % off) on an activation a matmul reads next:
    # alpha * h is rounded once to float16, as torch's opmath does.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(1, 5, (32, 16)) * 16.0, F32)
    w = jnp.asarray(rng.integers(1, 5, (16, 16)) / 4.0, F32)  # x @ w exact, 64 to 1024
    c = jnp.asarray(rng.uniform(0.5, 1.5, (32, 16)), F32)
    eye = jnp.eye(16, dtype=F32)  # the next matmul hands on its float16 input exactly

    def loss(alpha, x):
        g = ((x @ w) * alpha) @ eye
        return jnp.sum(g * c)

    alpha = jnp.float32(1e-6)
    amp = jaxamp.autocast(loss, dtype=F16)
    ref, ref_g = (np.asarray(v, np.float64) for v in jax.value_and_grad(loss)(alpha, x))
    got, got_g = (np.asarray(v, np.float64) for v in jax.value_and_grad(amp)(alpha, x))
    ch = np.asarray(c, np.float64) * (np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    # Each h * alpha (a normal float16 number) rounded once, a float32 sum of 512.
    u = 2.0**-11
    assert abs(got - ref) <= np.sum(ch) * 1e-6 * (u + 512 * EPS32), (got, ref)
    # d/d alpha = sum(c * h): the cotangent c reaches the product through the
    # float16 matmul (rounded once), the sum over h in float32.
    assert abs(got_g - ref_g) <= np.sum(ch) * (u + 512 * EPS32), (got_g, ref_g)
    saved = [(a, why) for a, why in saved_residuals(amp, alpha, x) if not why.startswith("from")]
    big = [a for a, _ in saved if a.shape == (32, 16) and a.dtype == F32]
    assert not big, saved  # the activation is kept in float16, not a float32 copy
