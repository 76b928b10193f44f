"""FP8 through autocast: fixes from the hostile review of issue 33.

Numerical checks compare with a float64 reference of the same inputs, within a
bound derived from the formats (see each test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

import jaxamp

BF16 = jnp.bfloat16


def _f8_products_per_call(jaxpr: Jaxpr) -> list[bool]:
    """For each ``dot_general`` the program runs, in order and counting an inner
    jaxpr once per call of it: whether its operands are FP8."""
    found: list[bool] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(all("float8" in str(v.aval.dtype) for v in eqn.invars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    found += _f8_products_per_call(getattr(sub, "jaxpr", sub))
    return found


def _layer(h, w):
    return jnp.tanh(h @ w)


@pytest.mark.parametrize(
    "wrap", [lambda f: f, jax.jit, jax.checkpoint], ids=["plain", "jit", "remat"]
)
def test_first_last_bf16_excludes_only_the_first_and_last_call_of_a_shared_layer(wrap):
    # One layer function (jitted or checkpointed) called four times is four
    # layers: the first and last call stay bfloat16, the two between run FP8.
    layer = wrap(_layer)
    x = jnp.ones((32, 64))
    ws = [jnp.full((64, 64), 0.01) for _ in range(4)]

    def net(ws, x):
        for w in ws:
            x = layer(x, w)
        return x

    f = jaxamp.autocast(net, dtype=BF16, fp8=jaxamp.fp8())
    # The forward program: 4 products (the grad's would add the transposes).
    fwd = jax.make_jaxpr(f)(ws, x).jaxpr
    products = _f8_products_per_call(fwd)
    assert products == [False, True, True, False], products


def _attention(q, k, v):
    # flax's dot_product_attention without its import: two batched einsums.
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def test_attention_products_stay_bfloat16_unless_batched():
    # q, k, v ~ N(0, 1), d = 64: logits ~ N(0, 1), |logit| < 6 here. Each of q, k,
    # v, the logits, the probabilities and the output rounds once to bfloat16
    # (relative u = 2**-9 each, the logits' absolute error u * 6 entering the
    # probabilities relatively): a relative L2 error below (5 + 6) u = 0.022.
    # e4m3 (u = 2**-4) in the two products exceeds it (about 0.05).
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 512, 4, 64)), jnp.float32) for _ in range(3))
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q64, k64) / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v64)
    bound = 11 * 2.0**-9

    def err(cfg):
        f = jaxamp.autocast(_attention, dtype=BF16, fp8=cfg)
        got = np.asarray(jax.jit(f)(q, k, v), np.float64)
        return np.linalg.norm(got - ref) / np.linalg.norm(ref)

    default = jaxamp.fp8(first_last_bf16=False)
    rows = jaxamp.audit(jaxamp.autocast(_attention, dtype=BF16, fp8=default))(q, k, v).ops
    dots = [r for r in rows if r.primitive == "dot_general"]
    assert [r.dtype for r in dots] == ["bfloat16", "bfloat16"]
    assert all("a batched product (attention)" in r.reason for r in dots)
    assert err(default) < bound
    opted = jaxamp.fp8(first_last_bf16=False, batched=True)
    rows = jaxamp.audit(jaxamp.autocast(_attention, dtype=BF16, fp8=opted))(q, k, v).ops
    assert [r.dtype for r in rows if r.primitive == "dot_general"] == ["float8_e4m3fn"] * 2
    assert err(opted) > bound  # what the default avoids


def test_batched_must_be_a_bool():
    with pytest.raises(TypeError, match="batched must be True or False"):
        jaxamp.fp8(batched="yes")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("case", ["tiny cotangent", "huge disjoint operands"])
def test_dequantization_is_range_safe(case, scaling):
    # The two inverse scales are applied one after the other: their product
    # underflows float32 for a cotangent ~1e-32 (all-zero dx, dw) and overflows
    # for operands ~1e25 (0 * inf = NaN where the product is exactly 0).
    from tests.casting.test_fp8 import check_matmul

    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 32))
    w = rng.standard_normal((32, 48)) * 0.05
    g = rng.standard_normal((16, 48))
    if case == "tiny cotangent":
        g = g * 1e-32
    else:
        x[:, :16], w[16:, :] = 0.0, 0.0  # x @ w is exactly 0
        x, w = x * 1e25, w * 1e25
    check_matmul(*(jnp.asarray(t, BF16) for t in (x, w, g)), scaling)


@pytest.mark.parametrize(
    "how",
    ["hessian", "jvp of grad", "grad of grad"],
)
def test_second_derivatives_of_an_fp8_product_raise_instead_of_nan(how):
    # JAX's jvp of the cast to e4m3fn rounds the tangent unscaled; e4m3fn has no
    # inf, so a tangent past 448 is NaN: the Hessian came back all NaN, silently.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32)
    w = jnp.full((32, 16), 0.1)
    f = jaxamp.autocast(lambda w, x: x @ w, dtype=BF16, fp8=jaxamp.fp8(first_last_bf16=False))

    def loss(w):
        return jnp.sum(f(w, x).astype(jnp.float32) ** 2)

    run = {
        "hessian": lambda: jax.hessian(loss)(w),
        "jvp of grad": lambda: jax.jvp(jax.grad(loss), (w,), (w,)),
        "grad of grad": lambda: jax.grad(lambda w: jnp.sum(jax.grad(loss)(w)))(w),
    }[how]
    with pytest.raises(TypeError, match=r"fp8=.*forward mode.*without fp8="):
        run()
    # Without fp8=, the Hessian-vector product is bfloat16 autocast's, against float64.
    b16 = jaxamp.autocast(lambda w, x: x @ w, dtype=BF16)
    hvp = jax.jvp(jax.grad(lambda w: jnp.sum(b16(w, x).astype(jnp.float32) ** 2)), (w,), (w,))[1]
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = 2 * x64.T @ (x64 @ w64)  # d/dt grad(w + t w) of sum((x w)^2)
    # Three bfloat16 roundings (x, w, the product) and one of the result: 4 * 2**-9.
    rel = np.linalg.norm(np.asarray(hvp, np.float64) - ref) / np.linalg.norm(ref)
    assert rel < 4 * 2.0**-9


@pytest.mark.parametrize("loop", ["cond", "scan", "while"])
def test_audit_lists_a_product_inside_a_loop_or_branch_once(loop):
    x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
    fn = {
        "cond": lambda x, w: jax.lax.cond(x[0, 0] > 0, lambda h: jnp.tanh(h @ w), lambda h: h, x),
        "scan": lambda x, w: jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[
            0
        ],
        "while": lambda x, w: jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0)
        )[0],
    }[loop]
    ops = jaxamp.audit(jaxamp.autocast(fn, dtype=BF16))(x, w).ops
    assert [o.primitive for o in ops if o.primitive in ("dot_general", "tanh")] == [
        "dot_general",
        "tanh",
    ]


def test_an_fp8_module_pattern_that_matches_nothing_warns_naming_it():
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, name="lm_head")(nn.Dense(32, name="fc")(x))

    m = M()
    p = m.init(jax.random.key(0), jnp.ones((16, 32)))
    with pytest.warns(UserWarning, match=r"modules=\{'head': \.\.\.\}\) matches no module.*M/fc"):
        jax.jit(jaxamp.autocast(m.apply, dtype=BF16, fp8=jaxamp.fp8(modules={"head": True})))(
            p, jnp.ones((16, 32))
        )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pattern that matches: silent
        fp8 = jaxamp.fp8(modules={"lm_head": True, "Dense": False})
        jax.jit(jaxamp.autocast(m.apply, dtype=BF16, fp8=fp8))(p, jnp.ones((16, 32)))
