"""``jaxamp.fp8_health`` inside loops and regions: the FP8 products of a ``lax.scan``
body (``nn.scan``, a ``fori_loop`` with static bounds) are measured each iteration and
pooled into one entry per product of the body; those of a ``jax.checkpoint`` /
``nn.remat`` region or a nested ``jax.jit`` inside the autocast function are measured
as if written inline.

The references are computed in float64 (``test_fp8_health.reference``) from the
operands each iteration's product reads, known exactly: the scanned inputs, weights
and output gradients rounded to bfloat16. Pooled as ``health_table`` pools mapped
figures: the largest amax, the mean of the fractions (each iteration casts as
many elements).
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.casting.test_fp8_health import E4M3, E5M2, FP8_ALL, B, D, reference

L = 2


class Cell(nn.Module):
    """One scanned layer: ``fc`` reads the iteration's input, ``sat`` one that may
    hold infs (its output masked back to finite, as a sentinel is)."""

    @nn.compact
    def __call__(self, c, xs):
        x, xi = xs
        s = nn.Dense(D, name="sat")(xi)
        return c, nn.Dense(D, name="fc")(x) + jnp.where(jnp.isfinite(s), s, 0.0)


class Scanned(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, xs):
        cell = nn.remat(Cell) if self.remat else Cell
        scan = nn.scan(cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        return scan(name="layers")(None, xs)[1]


def _pooled(per_iteration):
    """The references of the iterations ``(amax, saturated, flushed)``, pooled."""
    amax, sat, flush = zip(*per_iteration, strict=True)
    return max(amax), float(np.mean(sat)), float(np.mean(flush))


def _check(got, want, size):
    amax, sat, flush = want
    assert float(got["amax"]) == amax
    assert float(got["saturated"]) == pytest.approx(sat, abs=0.5 / size)
    assert float(got["flushed"]) == pytest.approx(flush, abs=0.5 / size)


@pytest.mark.parametrize(("scaling", "remat"), [("tensorwise", False), ("rowwise", True)])
def test_scanned_layers_are_pooled_over_iterations_against_float64(scaling, remat):
    kx, ki, kc, kp = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (L, B, D))
    # Only the second iteration's `sat` input holds infs; only the first
    # iteration's output gradient has a fifth of its entries 1e-12 (every row and
    # column keeps an amax of 1, so they flush rowwise too).
    xi = jax.random.normal(ki, (L, B, D)).at[1, 3, 5].set(jnp.inf).at[1, 17, 40].set(-jnp.inf)
    small = jax.random.bernoulli(kc, 0.2, (B, D))
    c = jnp.ones((L, B, D)).at[0].set(jnp.where(small, 1e-12, 1.0))
    model = Scanned(remat)
    params = model.init(kp, (x, x))
    fwd = jaxamp.autocast(
        model.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
    )

    def loss(params, x, xi):
        return jnp.sum(fwd(params, (x, xi)) * c)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unmeasured
        (value, health), grads = jax.jit(jaxamp.fp8_health(loss))(params, x, xi)
    # The measurement does not change training.
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(params, x, xi)
    assert float(value) == float(ref_value)
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)

    assert set(health) == {"Scanned/layers/fc", "Scanned/layers/sat"}
    rowwise = scaling == "rowwise"
    lhs_axes, rhs_axes = (1, 0) if rowwise else (None, None)
    grad_casts = {"grad_dgrad": 1, "grad_wgrad": 0} if rowwise else {"grad": None}

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)

    for name, inputs in (("fc", x), ("sat", xi)):
        casts = health[f"Scanned/layers/{name}"]
        kernel = params["params"]["layers"][name]["kernel"]
        lhs = _pooled(reference(bf16(inputs[i]), E4M3, lhs_axes) for i in range(L))
        _check(casts["lhs"], lhs, B * D)
        _check(
            casts["rhs"],
            _pooled(reference(bf16(kernel[i]), E4M3, rhs_axes) for i in range(L)),
            D * D,
        )
    # Half the iterations saturate: the pooled fraction is half the iteration's.
    assert float(health["Scanned/layers/sat"]["lhs"]["saturated"]) == pytest.approx(1 / (B * D))
    assert float(health["Scanned/layers/fc"]["lhs"]["saturated"]) == 0.0
    # The gradient reaching `fc` each iteration is that iteration's `c` in bfloat16.
    for cast, axes in grad_casts.items():
        want = _pooled(reference(bf16(c[i]), E5M2, axes) for i in range(L))
        assert want[2] > 0
        _check(health["Scanned/layers/fc"][cast], want, B * D)


def test_a_static_fori_loop_is_a_scan_and_is_measured_per_iteration():
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (L, B, D))
    # Iteration 1's weight has an eighth of its columns far below its amax: they flush.
    w = jax.random.normal(kw, (L, D, D)).at[1, :, :8].multiply(1e-12)
    c = jax.random.normal(kc, (B, D))

    def f(w, x):
        return jax.lax.fori_loop(0, L, lambda i, h: h + x[i] @ w[i], jnp.zeros((B, D)))

    fwd = jaxamp.autocast(f, dtype=jnp.bfloat16, fp8=FP8_ALL)
    loss = lambda w: jnp.sum(fwd(w, x) * c)  # noqa: E731
    (_, health), _ = jax.jit(jaxamp.fp8_health(loss))(w)
    assert list(health) == ["dot_general"]
    got = health["dot_general"]

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)

    _check(got["lhs"], _pooled(reference(bf16(x[i]), E4M3, None) for i in range(L)), B * D)
    rhs = _pooled(reference(bf16(w[i]), E4M3, None) for i in range(L))
    _check(got["rhs"], rhs, D * D)
    assert rhs[2] == pytest.approx(1 / 16)
    # The gradient of each iteration's product is `c`, rounded to bfloat16.
    _check(got["grad"], reference(bf16(c), E5M2, None), B * D)


def _block(w1, w2, h):
    return jnp.tanh(h @ w1) @ w2


@pytest.mark.parametrize(
    "wrap",
    [
        jax.checkpoint,
        jax.jit,
        lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable),
    ],
    ids=["checkpoint", "jit", "checkpoint_policy"],
)
def test_remat_and_nested_jit_are_measured_as_inline_products(wrap):
    """Exactly the figures, value and gradients of the same program written inline."""
    kx, k1, k2, kc = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(kx, (B, D))
    w1, w2 = jax.random.normal(k1, (D, D)), jax.random.normal(k2, (D, D)).at[:, :8].multiply(1e-12)
    c = jax.random.normal(kc, (B, D))

    def run(block):
        fwd = jaxamp.autocast(lambda w1, w2, x: block(w1, w2, x), dtype=jnp.bfloat16, fp8=FP8_ALL)
        loss = lambda w1, w2: jnp.sum(fwd(w1, w2, x) * c)  # noqa: E731
        return jax.jit(jaxamp.fp8_health(loss, argnums=(0, 1)))(w1, w2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unmeasured
        (value, health), grads = run(wrap(_block))
    (ref_value, ref_health), ref_grads = run(_block)
    assert list(health) == list(ref_health) == ["w1", "w2"]
    assert float(health["w2"]["rhs"]["flushed"]) > 0
    jax.tree.map(np.testing.assert_array_equal, health, ref_health)
    assert float(value) == float(ref_value)
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)


def _scan_block(w, h):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)[0]


def _remat_block(w, h):
    return jax.checkpoint(lambda w, h: jnp.tanh(h @ w[0]))(w, h)


@pytest.mark.parametrize("block", [_scan_block, _remat_block], ids=["scan", "remat"])
@pytest.mark.parametrize(
    "where",
    [
        lambda block, w, x: jax.lax.cond(x[0, 0] < 100.0, lambda: block(w, x), lambda: x),
        lambda block, w, x: (
            jax.lax.while_loop(
                lambda c: c[0] < 1,
                lambda c: (c[0] + 1, block(jax.lax.stop_gradient(w), c[1])),
                (0, x),
            )[1]
            + w[0, :1]
        ),
    ],
    ids=["cond", "while"],
)
def test_a_scan_or_remat_in_an_unmeasured_trace_is_named_unmeasured(block, where):
    """A scan or remat inside a cond branch or a while body runs in that trace: its
    figures cannot leave with the loss. Named unmeasured, as a product written
    there directly is, and training is untouched (no leaked tracer)."""
    w = jax.random.normal(jax.random.key(3), (L, D, D)) / 8
    x = jax.random.normal(jax.random.key(4), (B, D))
    fwd = jaxamp.autocast(lambda w, x: where(block, w, x), dtype=jnp.bfloat16, fp8=FP8_ALL)
    loss = lambda w: jnp.sum(fwd(w, x))  # noqa: E731
    # One product, named once though the branch is traced twice.
    with pytest.warns(UserWarning, match=r"not measured: \['\w+'\]"):
        (value, health), grad = jax.jit(jaxamp.fp8_health(loss))(w)
    assert health == {}
    ref_value, ref_grad = jax.jit(jax.value_and_grad(loss))(w)
    assert float(value) == float(ref_value)
    np.testing.assert_array_equal(grad, ref_grad)


@pytest.mark.parametrize(
    "wrap",
    [jax.checkpoint, jax.jit, lambda f: lambda w, x: jax.vmap(f, (None, 0))(w, x[None])[0]],
    ids=["checkpoint", "jit", "vmap"],
)
def test_a_scan_in_an_autocast_call_under_the_losss_own_jit_or_remat_is_unmeasured(wrap):
    """``jax.checkpoint(model)`` or ``jax.vmap(model)`` in the loss traces the autocast
    call apart: its scanned products are named unmeasured as its inline ones are."""
    w = jax.random.normal(jax.random.key(5), (L, D, D)) / 8
    x = jax.random.normal(jax.random.key(6), (B, D))
    fwd = wrap(jaxamp.autocast(_scan_block, dtype=jnp.bfloat16, fp8=FP8_ALL))
    with pytest.warns(UserWarning, match=r"not measured: \['dot_general'\]"):
        (_, health), grad = jax.jit(jaxamp.fp8_health(lambda w: jnp.sum(fwd(w, x))))(w)
    assert health == {} and grad.shape == w.shape


def test_a_scan_of_no_iterations_has_no_entry():
    """A scan of length 0 (a stack of no layers) runs its products no time: there
    is nothing to pool, and the step still runs as jax.value_and_grad does."""
    w = jax.random.normal(jax.random.key(7), (0, D, D))
    v = jax.random.normal(jax.random.key(8), (D, D))
    x = jax.random.normal(jax.random.key(9), (B, D))
    fwd = jaxamp.autocast(lambda w, v, x: _scan_block(w, x) @ v, dtype=jnp.bfloat16, fp8=FP8_ALL)
    loss = lambda w, v: jnp.sum(fwd(w, v, x))  # noqa: E731
    (value, health), grads = jax.jit(jaxamp.fp8_health(loss, argnums=(0, 1)))(w, v)
    assert list(health) == ["v"]
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, v)
    assert float(value) == float(ref_value)
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)
