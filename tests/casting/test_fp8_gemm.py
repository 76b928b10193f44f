"""One FP8 product (``jaxamp/casting/_fp8/_fp8_gemm.py``): dequantization that neither
underflows nor overflows, second derivatives refused instead of NaN, and the HLO
form XLA's GPU GEMM rewriter folds into one cuBLASLt FP8 call.

Numerical checks compare with a float64 reference of the same inputs, within a
bound derived from the formats (see each test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

BF16 = jnp.bfloat16


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


# ------------------------------------------------ the form XLA's GEMM rewriter folds
#
# XLA's GPU GEMM rewriter (xla/service/gpu/transforms/gemm_rewriter.cc) makes one
# cuBLASLt FP8 call of a dot whose operands are each ``convert(f8) * broadcast(scalar
# scale)`` (MatchFp8Param; CreateF8CustomCall takes the scalars as the call's scale
# operands), the form flax.linen.fp8_ops.Fp8DotGeneralOp emits. These tests read the
# HLO JAX gives XLA (no GPU needed) and the CPU-optimized HLO.


def _signatures(text: str) -> list[tuple]:
    """Each dot of `text`: its operands' (f8 dtype, form, dtype fed to the dot),
    sorted, its result dtype and its dimensions sorted (a wgrad may be computed
    transposed)."""
    from tests.casting.test_fp8 import _dims, _dtype, _norm, fp8_operand, parse_hlo

    instrs = parse_hlo(text)
    out = []
    for typ, op, ops in instrs.values():
        if op == "dot":
            srcs = [(*(fp8_operand(instrs, o) or ("-", "-")), _dtype(instrs[o][0])) for o in ops]
            out.append((tuple(sorted(srcs)), _dtype(typ), _norm(_dims(typ))))
    return sorted(out)


def _grad_hlo(loss, *args) -> str:
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).as_text(dialect="hlo")


# Flax deprecates Fp8DotGeneralOp for Fp8DirectDotGeneralOp, whose f8 operands enter
# the dot themselves; the deprecated one is the form the rewriter folds scales into.
@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")
@pytest.mark.parametrize("x_shape", [(32, 64), (4, 8, 64)], ids=["matrix", "tokens"])
def test_every_fp8_product_has_the_form_flax_fp8_ops_emits(x_shape):
    import flax.linen as nn
    from flax.linen import fp8_ops

    x = jnp.ones(x_shape, BF16)
    dense = nn.Dense(48, use_bias=False, dtype=BF16, param_dtype=BF16,
                     dot_general_cls=fp8_ops.Fp8DotGeneralOp)  # fmt: skip
    variables = dense.init(jax.random.key(0), x)
    w = variables["params"]["kernel"]

    def flax_loss(params, x):
        y = dense.apply({**variables, "params": params}, x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    f = jaxamp.autocast(lambda x, w: x @ w, dtype=BF16, fp8=jaxamp.fp8(first_last_bf16=False))

    def loss(x, w):
        return jnp.sum(f(x, w).astype(jnp.float32) ** 2)

    ours = _signatures(_grad_hlo(loss, x, w))
    theirs = _signatures(_grad_hlo(flax_loss, variables["params"], x))
    # Forward (e4m3 x e4m3), dgrad and wgrad (e5m2 gradient x e4m3), each operand
    # dequantized to bfloat16 right before the dot, the dot's result bfloat16.
    deq = "dequantized"
    e4, e5 = ("f8e4m3fn", deq, "bf16"), ("f8e5m2", deq, "bf16")
    want = [((e4, e4), "bf16"), ((e4, e5), "bf16"), ((e4, e5), "bf16")]
    assert [s[:2] for s in theirs] == want
    assert ours == theirs


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_batched_products_have_the_form_too(scaling):
    from tests.casting.test_fp8 import fp8_dots

    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((2, 32, 64)), BF16) for _ in range(2))
    cfg = jaxamp.fp8(scaling, batched=True, first_last_bf16=False)
    f = jaxamp.autocast(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), dtype=BF16, fp8=cfg)

    def loss(q, k):
        return jnp.sum(f(q, k).astype(jnp.float32) ** 2)

    # fp8_dots asserts the form of each: dequantized operands tensorwise, f8
    # operands and a rescaled float32 result rowwise.
    dots = fp8_dots(_grad_hlo(loss, q, k), rowwise=scaling == "rowwise")
    assert sorted(dots) == sorted(
        [("[2,32,32]", "e4m3"), ("[2,32,64]", "e5m2"), ("[2,64,32]", "e5m2")]  # dk transposed
    )


_TRIVIAL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def _compiled_ops(fp8) -> list[str]:
    """The opcodes of the top-level instructions XLA:CPU runs for one layer's
    training step (forward, dgrad, wgrad), constants and plumbing left out."""
    from tests.casting.test_fp8 import parse_hlo

    f = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), dtype=BF16, fp8=fp8)

    def loss(x, w):
        return jnp.sum(f(x, w).astype(jnp.float32) ** 2)

    x, w = jnp.ones((32, 64), BF16), jnp.ones((64, 48), BF16)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    return [op for _, op, _ in parse_hlo(entry).values() if op not in _TRIVIAL]


def test_the_ops_around_each_fp8_product_against_bfloat16():
    # A recorded measure on XLA:CPU (the GPU's kernel count needs a GPU). Each
    # of the three quantized tensors (x, w, the gradient) costs at most five
    # top-level ops here: |x| (a loop), its maximum (XLA:CPU reduces in two
    # stages, a reduce-window then a reduce), the scale (a scalar op) and the
    # quantize-dequantize loop feeding the product, nothing between it and the
    # product. Over the layer's three products: at most 5 more per product.
    bf16 = _compiled_ops(None)
    fp8 = _compiled_ops(jaxamp.fp8(first_last_bf16=False))
    assert len(fp8) - len(bf16) <= 5 * 3, (bf16, fp8)


def test_a_float16_product_dequantizes_in_float32():
    # The dequantization factor of a gradient of 1e-4 is ~5e-9, below float16's
    # smallest subnormal (6e-8): dequantized in float16, dx and dw were all zeros.
    from tests.casting.test_fp8 import E4M3, E5M2, _f64, fp8_bound

    rng = np.random.default_rng(1)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float16) for s in [(16, 32), (32, 48)])
    g = jnp.asarray(rng.standard_normal((16, 48)) * 1e-4, jnp.float16)
    f = jaxamp.autocast(
        lambda x, w: x @ w, dtype=jnp.float16, fp8=jaxamp.fp8(first_last_bf16=False)
    )
    dx, dw = jax.jit(lambda x, w, g: jax.vjp(f, x, w)[1](g))(x, w, g)
    x64, w64, g64 = _f64(x), _f64(w), _f64(g)
    for got, spec, a, b, da, db, k in [
        (dx, "mn,kn->mk", g64, w64, E5M2, E4M3, 48),
        (dw, "mk,mn->kn", x64, g64, E4M3, E5M2, 16),
    ]:
        assert got.dtype == jnp.float16
        err = np.abs(_f64(got) - np.einsum(spec, a, b))
        assert np.all(err <= fp8_bound(spec, a, b, da, db, k)), spec
