"""Values `f` closes over: only trace-time sentinels saturate (issue 31, D1)."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

F16 = jnp.float16


def test_a_tracer_of_an_outer_jit_closed_over_overflows_instead_of_saturating():
    x = jnp.full((4, 8), 2e5, jnp.float32)
    w = jnp.full((8, 16), 0.125, jnp.float32)

    @jax.jit
    def step(x, w):
        return jaxamp.autocast(lambda w: x @ w, dtype=F16)(w)

    # float32 gives 2e5; a float16 program overflows to inf (as the argument form
    # does), never a clipped finite 65504 that no overflow check sees.
    assert np.all(np.isinf(np.asarray(step(x, w))))
    assert np.all(np.isinf(np.asarray(jaxamp.autocast(lambda x, w: x @ w, dtype=F16)(x, w))))


def test_a_closed_over_tracer_under_grad_is_not_clipped():
    feats = jnp.linspace(1e5, 3.5e5, 64, dtype=jnp.float32).reshape(8, 8)

    @jax.jit
    def grads(w, feats):
        return jax.grad(jaxamp.autocast(lambda w: jnp.sum(feats @ w), dtype=F16))(w)

    g = grads(jnp.ones((8, 4), jnp.float32), feats)
    # d/dw sum(feats @ w) = column sums of feats (beyond float16): float16
    # arithmetic gives inf in the backward pass, a clip would give finite values.
    assert not np.all(np.isfinite(np.asarray(g)))


def test_a_concrete_data_array_closed_over_is_data_and_a_fill_still_saturates():
    feats = jnp.linspace(1e5, 3.5e5, 64, dtype=jnp.float32).reshape(8, 8)
    w = jnp.ones((8, 4), jnp.float32)
    out = jaxamp.autocast(lambda w: feats @ w, dtype=F16)(w)
    assert np.all(np.isinf(np.asarray(out)))

    bias = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), 0.0, jnp.finfo(jnp.float32).min)
    q = jnp.ones((8, 8), jnp.float32) * 0.1

    def attend(q):
        return jax.nn.softmax(q @ q.T + bias, axis=-1)

    ref = attend(q)
    got = jaxamp.autocast(attend, dtype=F16)(q)
    assert np.all(np.isfinite(np.asarray(got)))
    tol = 8 * float(jnp.finfo(F16).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), atol=tol)


def test_a_closed_over_scale_vector_of_one_large_value_is_data_not_a_fill():
    x = jnp.full((4, 8), 0.125, jnp.float32)
    w = jnp.full((8, 16), 0.125, jnp.float32)
    ystd = jnp.full((16,), 1e5, jnp.float32)
    out = jaxamp.autocast(lambda x, w: (x @ w) * ystd, dtype=F16)(x, w)
    # float32 gives 12500, and so does torch.autocast (a float32 vector promotes
    # the product): data promotes where it meets an activation, never multiplied
    # by a clipped 65504 (8188, wrong and finite).
    np.testing.assert_allclose(np.asarray(out), 12500.0, rtol=float(jnp.finfo(jnp.float32).eps))


def test_a_closed_over_scalar_float16_cannot_hold_multiplies_at_float32_precision():
    s = jnp.float32(1e5)
    x = jnp.full((4, 8), 0.125, jnp.float32)
    w = jnp.full((8, 16), 0.125, jnp.float32)
    f = lambda x, w: jnp.tanh((x @ w) * s * 1e-5)  # noqa: E731
    ref = np.asarray(f(x, w))
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(x, w), np.float32)
    np.testing.assert_allclose(got, ref, rtol=4 * float(jnp.finfo(F16).eps))
