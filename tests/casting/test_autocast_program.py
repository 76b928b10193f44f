"""autocast is a function of the program (docs/semantics.md#autocast-program), since 0.3.

Each test here fails on jaxamp 0.2 (process-wide hooks, float16 masks, float32
results cast back down, no float32 linear algebra).
"""

from __future__ import annotations

import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jaxamp

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
KEY = jax.random.key(0)


def _attention_with_padding(params, x, valid):
    # Flax's own attention with a padding mask: nn.make_attention_mask and the
    # finfo(float32).min bias inside nn.dot_product_attention.
    mask = nn.make_attention_mask(valid, valid)
    return nn.MultiHeadDotProductAttention(num_heads=2).apply(params, x, x, mask=mask)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_fully_masked_padding_rows_stay_finite(dtype):
    x = jax.random.normal(KEY, (2, 6, 8))
    valid = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    params = nn.MultiHeadDotProductAttention(num_heads=2).init(KEY, x, x)
    ref = _attention_with_padding(params, x, valid)
    got = jaxamp.autocast(_attention_with_padding, dtype=dtype)(params, x, valid)
    assert np.isfinite(np.asarray(ref)).all()
    assert np.isfinite(np.asarray(got)).all()  # 0.2: NaN in the padded query rows
    grads = jax.grad(lambda p: jnp.sum(jaxamp.autocast(_attention_with_padding, dtype=dtype)(
        p, x, valid) ** 2))(params)  # fmt: skip
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@settings(max_examples=25, deadline=None)
@given(
    value=st.sampled_from([
        float(np.finfo(np.float32).min), float(np.finfo(np.float32).max), -1e30, 7e4, 1e5, -65520.0
    ]),
    op=st.sampled_from(["where", "add", "max", "select_bias", "concat"]),
    dtype=st.sampled_from([F16, BF16]),
    as_argument=st.booleans(),
)  # fmt: skip
def test_a_large_finite_constant_never_becomes_inf(value, op, dtype, as_argument):
    # Any float32 constant meeting an activation in any op: float32 keeps it
    # finite, so autocast's casts must too (a constant's cast saturates). The
    # same value as an argument is a run-time value: it is never clipped to a
    # wrong finite number; where it is cast down (a scalar broadcast into the
    # activation, as torch casts a 0-dim tensor) it overflows visibly.
    def f(x, w, big):
        h = x @ w  # an activation
        c = jnp.broadcast_to(big, h.shape) if as_argument else jnp.full(h.shape, value, F32)
        if op == "where":
            return jnp.where(h > 0, h, c)
        if op == "add":
            return h * 0.0 + c
        if op == "max":
            return jnp.maximum(h, c)
        if op == "select_bias":
            return jax.nn.softmax(h + jnp.where(h > 100.0, c, 0.0))
        return jnp.concatenate([h, c], axis=-1)

    x, w, big = jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.float32(value)
    ref = np.asarray(f(x, w, big))
    got = np.asarray(jaxamp.autocast(f, dtype=dtype)(x, w, big))
    assert np.isfinite(ref).all()
    if not as_argument:
        assert np.isfinite(got).all(), (value, op)
        return
    beyond = np.abs(ref) > float(jnp.finfo(dtype).max)
    ok = np.isfinite(got)
    assert (ok | beyond).all(), (value, op)  # non-finite only beyond the range
    np.testing.assert_allclose(got[ok], ref[ok], rtol=1e-2)  # never clipped


def _fresh_log_softmax_kl(z):
    return optax.kl_divergence(jax.nn.log_softmax(z), jax.nn.softmax(z))


def test_answer_does_not_depend_on_what_was_traced_before():
    w = jax.random.normal(KEY, (16, 16))
    x = jax.random.normal(jax.random.key(1), (4, 16))

    def amp_call():  # a new function each time: nothing of autocast's own is reused
        return jaxamp.autocast(lambda x, w: _fresh_log_softmax_kl(x @ w), dtype=F16)(x, w)

    first = amp_call()
    # A float32 trace and call of the same library functions (jax.nn.log_softmax
    # is a jit: JAX caches its trace).
    jax.jit(lambda x, w: _fresh_log_softmax_kl(x @ w))(x, w)
    again = amp_call()
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    # KL(p || p) is zero up to float32 rounding: log_softmax ran in float32.
    assert np.abs(np.asarray(again)).max() < 1e-6


def test_no_jax_function_is_replaced_while_autocast_traces():
    names = ("einsum", "matmul", "dot", "tensordot", "inner", "vdot")
    before = {n: getattr(jnp, n) for n in names} | {
        "lax.dot_general": jax.lax.dot_general,
        "lax.convert_element_type": jax.lax.convert_element_type,
    }
    seen = {}

    def f(x, w):
        seen.update({n: getattr(jnp, n) for n in names})
        seen["lax.dot_general"] = jax.lax.dot_general
        seen["lax.convert_element_type"] = jax.lax.convert_element_type
        return x @ w

    jaxamp.autocast(f, dtype=F16)(jnp.ones((2, 2)), jnp.ones((2, 2)))
    assert seen == before


def test_concurrent_autocast_calls_agree_with_a_single_one():
    m = nn.Sequential([nn.Dense(32), nn.gelu, nn.LayerNorm(), nn.Dense(8)])
    x = jax.random.normal(KEY, (4, 16))
    params = m.init(KEY, x)
    fn = jaxamp.autocast(m.apply, dtype=F16, modules={"LayerNorm": "float32"})
    want = np.asarray(jax.jit(fn)(params, x))
    results, errors = [], []

    def run():
        try:
            results.append(np.asarray(jax.jit(jaxamp.autocast(
                m.apply, dtype=F16, modules={"LayerNorm": "float32"}))(params, x)))  # fmt: skip
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    for r in results:
        np.testing.assert_array_equal(r, want)


def test_float32_result_is_not_rounded_where_it_meets_an_activation():
    # optax.huber_loss on tiny errors: 0.5 * err**2 ~ 3e-8 is below float16's
    # smallest normal; 0.2 cast it down to 0 where it met the activation.
    w = jnp.eye(4)
    pred_in = jnp.full((2, 4), 2.5e-4)  # a float16 activation error of 2.5e-4

    def f(x, w):
        return optax.huber_loss(x @ w, jnp.zeros((2, 4)))

    ref = f(pred_in, w)
    got = jaxamp.autocast(f, dtype=F16)(pred_in, w)
    assert got.dtype == F32
    assert (np.asarray(got) > 0).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0.5)


def test_promote_list_ops_run_in_the_widest_input_dtype():
    def f(x, w, extra):
        return jnp.concatenate([x @ w, extra], axis=0)  # torch's cat: widest type

    x, w = jnp.ones((2, 4)), jnp.eye(4)
    extra = jnp.full((1, 4), 1.0 + 2**-20)  # not representable in float16
    closed = jax.make_jaxpr(jaxamp.autocast(f, dtype=F16))(x, w, extra)
    (cat,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "concatenate"]
    assert cat.outvars[0].aval.dtype == F32
    got = jaxamp.autocast(f, dtype=F16)(x, w, extra)
    assert float(got[2, 0]) == float(extra[0, 0])


@pytest.mark.parametrize(
    "op",
    [
        lambda a: jnp.linalg.solve(a, a[:, :1]),
        lambda a: jnp.linalg.inv(a),
        lambda a: jnp.linalg.qr(a)[1],
        lambda a: jnp.linalg.slogdet(a)[1],
        lambda a: jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(4)),
        lambda a: jnp.linalg.eigh(a @ a.T)[0],
        lambda a: jnp.linalg.svd(a, compute_uv=False),
        lambda a: jnp.abs(jnp.fft.rfft(a)),
        lambda a: jnp.abs(jnp.fft.fft(a)),
    ],
    ids=["solve", "inv", "qr", "slogdet", "cholesky", "eigh", "svd", "rfft", "fft"],
)
def test_linear_algebra_and_fft_fed_by_a_matmul_run_in_float32(op):
    x = jax.random.normal(KEY, (4, 4)) + 3 * jnp.eye(4)
    f = lambda x: op(x @ jnp.eye(4))  # noqa: E731
    got = jaxamp.autocast(f, dtype=F16)(x)  # 0.2: Unsupported dtype float16
    ref = f(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_keep_float32_marks_a_value_float32_until_a_matmul():
    x = jnp.full((2, 4), 300.0)
    w = jnp.eye(4)

    def f(x, w):
        y = jaxamp.keep_float32(x @ w)
        return (y * y) @ w  # 9e4: beyond float16; the matmul casts it down again

    closed = jax.make_jaxpr(jaxamp.autocast(f, dtype=F16))(x, w)
    (mul,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "mul"]
    assert mul.outvars[0].aval.dtype == F32
    dots = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [d.invars[0].aval.dtype for d in dots] == [F16, F16]
    # Outside autocast it is an astype(float32).
    assert jaxamp.keep_float32(jnp.ones(2, F16)).dtype == F32
    np.testing.assert_array_equal(jaxamp.keep_float32(x), x)


def test_a_float32_op_of_an_activation_keeps_a_low_precision_residual():
    """gelu's x**3 (and a norm's square) of a float16 activation runs in float32 but
    is rematerialised from the float16 input: the backward pass keeps no float32
    copy of the activation (0.2 kept one per MLP: 8 of bench_autocast's 122 MB)."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' listing

    x = jax.random.normal(jax.random.key(0), (16, 32))
    w1 = jax.random.normal(jax.random.key(1), (32, 64)) / 6
    w2 = jax.random.normal(jax.random.key(2), (64, 32)) / 8

    def f(w1, w2, x):
        h = jax.nn.gelu(x @ w1)
        return jnp.sum(jnp.square(h @ w2))

    amp = jaxamp.autocast(f, dtype=jnp.float16)
    hidden = [a for a, _ in saved_residuals(amp, w1, w2, x) if a.shape == (16, 64)]
    assert hidden and all(a.dtype == jnp.float16 for a in hidden), hidden
    # The same values as before: the cast up is exact, only the storage changed.
    g = jax.grad(amp)(w1, w2, x)
    ref = jax.grad(f)(w1, w2, x)
    np.testing.assert_allclose(g, ref, rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(ref))))


def _checkpoints(jaxpr: Any, in_loop: bool = False) -> list[tuple[bool, Any]]:
    """(inside a loop body?, equation) for every checkpoint (remat) in a jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat", "remat2"):  # by JAX version
            found.append((in_loop, eqn))
        loop = in_loop or eqn.primitive.name in ("scan", "while")
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found.extend(_checkpoints(sub, loop))
    return found


def test_an_upcast_in_a_loop_body_is_checkpointed_without_cse_barriers():
    """The rematerialised float32 op of an activation: outside loops with JAX's
    optimisation barriers (prevent_cse, so XLA keeps forward and backward apart);
    in a scan body without them (forward and backward are separate loops there: the
    barriers only cost compile time). Checked on the program; the gradients of
    both are float16's rounding of the float32 gradient."""
    k, layers = 32, 4
    w = jax.random.normal(jax.random.key(1), (layers, k, k)) / 6
    x = jax.random.normal(jax.random.key(0), (8, k))

    def unrolled(w, x):
        for i in range(w.shape[0]):
            x = jax.nn.gelu(x @ w[i])
        return jnp.sum(x)

    def scanned(w, x):
        return jnp.sum(lax.scan(lambda h, wi: (jax.nn.gelu(h @ wi), None), x, w)[0])

    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.grad(unrolled)(w, x), np.float64)
    # Each float16 matmul (forward and backward) rounds a k-term sum: an error of
    # about eps * sqrt(k) of the gradient's magnitude (measured: under 1 eps).
    tol = float(np.finfo(np.float16).eps) * np.sqrt(k) * np.abs(ref).max()
    for f in (unrolled, scanned):
        amp = jaxamp.autocast(f, dtype=jnp.float16)
        cps = _checkpoints(jax.make_jaxpr(amp)(w, x).jaxpr)
        assert any(in_loop for in_loop, _ in cps) == (f is scanned), f.__name__
        for in_loop, eqn in cps:
            assert eqn.params["prevent_cse"] == (not in_loop), (f.__name__, eqn)
        g = jax.grad(amp)(w, x)
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=0, atol=tol)
