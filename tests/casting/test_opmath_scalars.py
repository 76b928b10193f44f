"""Python scalars beyond the low dtype meeting an activation (issue 31, D4)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

F16 = jnp.float16


@pytest.mark.parametrize(
    "f",
    [
        lambda x, w: jnp.tanh((x @ w) * 1e5 * 1e-5),  # 1e5 beyond float16
        lambda x, w: jnp.tanh((x @ w) * 1e-7 * 1e3),  # 1e-7 subnormal in float16
    ],
)
def test_a_scalar_float16_cannot_hold_is_not_saturated_or_flushed(f):
    x = np.full((4, 8), 0.125, np.float32)
    w = np.full((8, 16), 0.125, np.float32)
    ref = np.asarray(f(x, w))
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w), np.float32)
    # Each op rounds once to float16 (as torch's opmath does): a few ulps.
    tol = 4 * float(jnp.finfo(F16).eps) * np.maximum(1.0, np.abs(ref))
    assert np.all(np.abs(got - ref) <= tol), (got[0, 0], ref[0, 0])


def test_a_literal_fill_in_where_still_saturates():
    x = np.full((2, 8), 0.5, np.float32)
    w = np.eye(8, dtype=np.float32)
    m = np.arange(8) < 4

    def f(x, w):
        return jnp.where(m, x @ w, -1e9)

    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w), np.float32)
    assert np.all(np.isfinite(got))
