"""A broadcast target in a subtraction is not cast down (issue 31, D3)."""

import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

F16 = jnp.float16


def test_a_per_row_target_close_to_the_prediction_is_not_rounded_away():
    x = np.full((4, 8), 0.5, np.float32)
    w = np.full((8, 16), 0.25, np.float32)  # x @ w = 1.0, exact in float16
    y = np.full((4,), 1 + 2.0**-12, np.float32)  # float16 rounds it to 1.0

    def f(x, w, y):
        return optax.huber_loss(x @ w, y[:, None])

    ref = np.asarray(f(x, w, y))
    assert np.all(ref > 0)
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w, y), np.float32)
    # The difference 2**-12 is exact in float32; its half-square is a normal
    # float32 number and must not be 0: a relative float16 tolerance.
    np.testing.assert_allclose(got, ref, rtol=2 * float(jnp.finfo(F16).eps))
