"""One FP8 product (``jaxamp/casting/_fp8/_fp8_gemm.py``): dequantization that neither
underflows nor overflows, and second derivatives refused instead of NaN.

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
