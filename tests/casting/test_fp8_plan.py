"""Which products the FP8 plan (``jaxamp/casting/_fp8/_fp8.py``) runs in FP8: a shared
layer's first and last calls, attention products (``batched=``), module patterns.

Each test reads where products ran (the jaxpr, or the audit's per-op log) and, for attention,
the error against a float64 reference within a bound derived from the formats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import dot_input_dtypes

BF16 = jnp.bfloat16


def _f8_products_per_call(jaxpr) -> list[bool]:
    """For each ``dot_general`` the program runs, in order and counting an inner
    jaxpr once per call of it: whether its operands are FP8 (dequantized right
    before it, as XLA's GEMM rewriter wants them, or f8 themselves)."""
    return [all("float8" in str(d) for d in ins) for ins in dot_input_dtypes(jaxpr)]


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
