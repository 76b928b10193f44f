"""A pointwise region's cache keys its literals exactly (issue 31, D6)."""

import jax.numpy as jnp
import numpy as np

import jaxamp


def test_regions_differing_only_in_the_sign_of_a_zero_literal_do_not_share_a_trace():
    x = jnp.ones((2, 4))
    w = jnp.ones((4, 4)) * 0.25
    f_pos = lambda x, w: 1.0 / (jnp.exp(x @ w) * 0.0)  # noqa: E731
    f_neg = lambda x, w: 1.0 / (jnp.exp(x @ w) * -0.0)  # noqa: E731
    for f in (f_pos, f_neg):
        np.testing.assert_array_equal(
            np.asarray(jaxamp.autocast(f, dtype=jnp.float16)(x, w), np.float32),
            np.asarray(f(x, w)),
        )
