"""What a run-time mask makes a constant (issue 31, D2)."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

F16 = jnp.float16


def test_a_count_of_a_run_time_mask_is_data_and_overflows():
    ind = jnp.ones((4, 100_000), bool)
    w = jnp.full((1, 4), 1e-4, jnp.float32)

    def f(ind, w):
        counts = jnp.sum(ind, axis=1, keepdims=True).astype(jnp.float32)  # 1e5
        return counts @ w

    np.testing.assert_allclose(np.asarray(f(ind, w)), 10.0, rtol=1e-6)
    # float16 cannot hold 1e5: inf (seen by the loss scale), not a clipped 65504.
    assert np.all(np.isinf(np.asarray(jaxamp.autocast(f, dtype=F16)(ind, w))))


def test_a_fill_scaled_from_a_run_time_mask_still_saturates():
    mask = jnp.zeros((2, 8), bool).at[0].set(True)  # row 1 fully masked
    q = jnp.ones((2, 8, 4), jnp.float32) * 0.1

    def f(q, mask):
        bias = (1.0 - mask.astype(jnp.float32)) * -1e9
        s = jnp.einsum("bqd,bkd->bqk", q, q) + bias[:, None, :]
        return jax.nn.softmax(s, axis=-1)

    got = np.asarray(jaxamp.autocast(f, dtype=F16)(q, mask), np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np.asarray(f(q, mask)), atol=8 * float(jnp.finfo(F16).eps))
