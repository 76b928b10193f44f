"""The eager cache's keys for static arguments (issue 31, D5)."""

import jax.numpy as jnp
import numpy as np

import jaxamp


def test_int_float_and_bool_static_arguments_do_not_share_a_program():
    g = lambda x, n: jnp.full((2,), n)  # noqa: E731
    x = jnp.ones((2, 4))
    for first, second in [(1, 1.0), (1.0, True), (True, 1)]:
        a = jaxamp.autocast(g, dtype=jnp.float16)
        a(x, first)
        assert a(x, second).dtype == g(x, second).dtype, (first, second)


def test_zero_and_negative_zero_static_arguments_do_not_share_a_program():
    h = lambda x, s: x * jnp.copysign(jnp.float32(1.0), s)  # noqa: E731
    x = jnp.ones((2, 2))
    a = jaxamp.autocast(h, dtype=jnp.float16)
    np.testing.assert_array_equal(np.asarray(a(x, 0.0)), 1.0)
    np.testing.assert_array_equal(np.asarray(a(x, -0.0)), -1.0)


def test_a_mutated_plain_config_object_is_not_answered_from_the_cache():
    class Cfg:
        scale = 1.0

    cfg = Cfg()
    f = lambda x, cfg: x * cfg.scale  # noqa: E731
    a = jaxamp.autocast(f, dtype=jnp.float16)
    x = jnp.ones(3)
    np.testing.assert_allclose(np.asarray(a(x, cfg)), 1.0)
    cfg.scale = 3.0
    np.testing.assert_allclose(np.asarray(a(x, cfg)), 3.0)
