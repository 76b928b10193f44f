"""``full_precision`` and ``modules=`` hold for code run under a transformation
inside the autocast function (issue 33).

JAX writes a scope opened under ``jax.vmap`` or ``jax.grad`` into the name stack
wrapped in the transformation, ``vmap(head)/...``, ``transpose(jvp(head))``: an
equinox model called as ``jax.vmap(model)(x)`` has every module scope so wrapped.
autocast used to compare the wrapped names with the patterns and markers, so a
``full_precision`` region or a ``modules=`` rule under ``vmap`` was silently
ignored and its matmul ran in the lower dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import dot_input_dtypes

BF16 = jnp.bfloat16


def _dot_dtypes(fn, *args):
    """The operand dtypes of every ``dot_general`` of `fn`'s program, nested jaxprs included."""
    return [tuple(str(d) for d in ins) for ins in dot_input_dtypes(jax.make_jaxpr(fn)(*args))]


def _head(x, w):
    with jax.named_scope("head"):
        return x @ w


X = jnp.asarray(np.random.default_rng(0).standard_normal((3, 16, 16)), jnp.float32)
W = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)), jnp.float32)


def test_full_precision_under_vmap_runs_in_float32():
    def f(x, w):
        return jax.vmap(jaxamp.full_precision(lambda x: x @ w))(x)

    assert _dot_dtypes(jaxamp.autocast(f, dtype=BF16), X, W) == [("float32", "float32")]
    # and the result is float32's, not bfloat16's
    got = jaxamp.autocast(f, dtype=BF16)(X, W)
    np.testing.assert_allclose(got, X @ W, rtol=1e-6, atol=1e-5)


def test_a_modules_rule_holds_under_vmap():
    def f(x, w):
        return jax.vmap(_head, in_axes=(0, None))(x, w)

    amp = jaxamp.autocast(f, dtype=BF16, modules={"head": "float32"})
    assert _dot_dtypes(amp, X, W) == [("float32", "float32")]
    plain = jaxamp.autocast(f, dtype=BF16)  # without the rule: bfloat16
    assert _dot_dtypes(plain, X, W) == [("bfloat16", "bfloat16")]


@pytest.mark.parametrize("where", ["vmap", "grad"])
def test_a_modules_rule_holds_under_a_transformation_inside_f(where):
    def loss(w, x):
        return jnp.sum(_head(x, w) ** 2)

    if where == "vmap":

        def f(x, w):
            return jax.vmap(lambda x: jax.grad(loss)(w, x))(x)
    else:

        def f(x, w):
            return jax.grad(loss)(w, x[0])

    amp = jaxamp.autocast(f, dtype=BF16, modules={"head": "float32"})
    dots = _dot_dtypes(amp, X, W)
    assert dots and all(d == ("float32", "float32") for d in dots), dots


def test_fp8_module_rules_hold_under_vmap():
    def f(x, w):
        return jax.vmap(_head, in_axes=(0, None))(x, w)

    on = jaxamp.fp8(first_last_bf16=False)
    assert _dot_dtypes(jaxamp.autocast(f, dtype=BF16, fp8=on), X, W) == [
        ("float8_e4m3fn", "float8_e4m3fn")
    ]
    off = jaxamp.fp8(modules={"head": False}, first_last_bf16=False)
    assert _dot_dtypes(jaxamp.autocast(f, dtype=BF16, fp8=off), X, W) == [("bfloat16", "bfloat16")]


def test_an_einsums_subscripts_are_not_a_module():
    """``jnp.einsum`` opens a ``named_call`` scope named by its subscripts: an nnx
    ``Einsum``'s product is its module's (``proj``), in ``report.ops``, in the HLO
    view and for ``modules=`` patterns, not ``proj/BTD,DF->BTF``."""
    from flax import nnx

    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(32, 32, rngs=rngs)
            self.proj = nnx.Einsum("BTD,DF->BTF", (32, 32), rngs=rngs)
            self.head = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            with jax.named_scope("outer"):  # a plain einsum, implicit output, spaces
                y = jnp.einsum("btd, df", x, self.head.kernel[...]).transpose(0, 2, 1)  # bft
            return self.head(self.proj(self.lin(x))) + y

    m, x = M(nnx.Rngs(0)), jnp.ones((2, 16, 32))
    cfg = jaxamp.fp8(first_last_bf16=False, modules={"proj": False})
    report = jaxamp.audit(jaxamp.autocast(m, dtype=BF16, fp8=cfg))(x)
    dots = [(r.module, r.dtype) for r in report.ops if r.primitive == "dot_general"]
    assert dots == [
        ("outer", "float8_e4m3fn"), ("lin", "float8_e4m3fn"), ("proj", "bfloat16"),
        ("head", "float8_e4m3fn"),
    ]  # fmt: skip
    assert sorted(r.module for r in report.matmuls) == ["head", "lin", "outer", "proj"]
