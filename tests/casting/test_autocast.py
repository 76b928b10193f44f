"""Tests for jaxamp.autocast and jaxamp.full_precision.

Most tests inspect the jaxpr of the autocast function: the dtype an equation's
operands have there is the dtype XLA runs it in. Numerics are compared with a
float32 reference with tolerances stated next to each check (float16 has an
11-bit significand, so ~1e-3 relative error per op; bfloat16 8 bits, ~1e-2).
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp._utils import jax_compat
from jaxamp.casting._rules._rules import DEFAULT_RULES, FLOAT32_OPS, LOWER_PRECISION_OPS
from tests.helpers import all_equations as _eqns
from tests.helpers import rel_err as _rel_err
from tests.helpers import tanh_proj

F16 = jnp.float16
BF16 = jnp.bfloat16
F32 = jnp.float32


# ---------------------------------------------------------------- helpers


def _operand_dtypes(fn, *args, prim):
    """Dtypes of the floating operands of every `prim` equation in fn's jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    found = []
    for eqn in _eqns(closed):
        if eqn.primitive.name == prim:
            found.append(tuple(np.dtype(v.aval.dtype) for v in eqn.invars))
    return found


def _assert_all(fn, *args, prim, dtype, at_least=1):
    found = _operand_dtypes(fn, *args, prim=prim)
    assert len(found) >= at_least, f"no {prim} equation found"
    for dts in found:
        floats = [d for d in dts if jnp.issubdtype(d, jnp.floating)]
        assert floats and all(d == np.dtype(dtype) for d in floats), (prim, found)


KEY = jax.random.key(0)


def _normal(shape, key=KEY, scale=1.0):
    return jax.random.normal(key, shape, F32) * scale


# ---------------------------------------------------------------- op classes


def test_matmul_and_einsum_run_in_float16():
    x, w = _normal((4, 8)), _normal((8, 16), jax.random.key(1))
    mm = jaxamp.autocast(lambda x, w: x @ w, dtype=F16)
    es = jaxamp.autocast(lambda x, w: jnp.einsum("bi,io->bo", x, w), dtype=F16)
    _assert_all(mm, x, w, prim="dot_general", dtype=F16)
    _assert_all(es, x, w, prim="dot_general", dtype=F16)
    # The matmul output itself is float16 (no float32 accumulate-and-return).
    eqn = next(e for e in _eqns(jax.make_jaxpr(mm)(x, w)) if e.primitive.name == "dot_general")
    assert eqn.outvars[0].aval.dtype == F16
    # Drop-in: outputs come back in float32, within float16 rounding (2^-10 rel).
    y = mm(x, w)
    assert y.dtype == F32
    assert _rel_err(y, x @ w) < 5e-3


def test_flax_dense_conv_lstm_run_in_float16():
    x = _normal((2, 8, 8, 3))
    conv = nn.Conv(4, (3, 3))
    pc = conv.init(KEY, x)
    _assert_all(
        jaxamp.autocast(conv.apply, dtype=F16), pc, x, prim="conv_general_dilated", dtype=F16
    )

    dense = nn.Dense(5)
    xd = _normal((2, 7))
    pd = dense.init(KEY, xd)
    _assert_all(jaxamp.autocast(dense.apply, dtype=F16), pd, xd, prim="dot_general", dtype=F16)

    cell = nn.LSTMCell(6)
    carry = cell.initialize_carry(KEY, (2, 7))
    pl = cell.init(KEY, carry, xd)
    _assert_all(
        jaxamp.autocast(cell.apply, dtype=F16),
        pl,
        carry,
        xd,
        prim="dot_general",
        dtype=F16,
        at_least=2,
    )
    (c, h), out = jaxamp.autocast(cell.apply, dtype=F16)(pl, carry, xd)
    (c_ref, h_ref), _ = cell.apply(pl, carry, xd)
    assert h.dtype == F32 and c.dtype == F32
    assert _rel_err(h, h_ref) < 1e-2


@pytest.mark.parametrize(
    "name, fn, prim",
    [
        ("exp", jnp.exp, "exp"),
        ("log", lambda x: jnp.log(jnp.abs(x) + 1.0), "log"),
        ("sum", lambda x: jnp.sum(x, axis=-1), "reduce_sum"),
        ("cumsum", lambda x: jnp.cumsum(x, axis=-1), "cumsum"),
        ("softmax", lambda x: jax.nn.softmax(x, axis=-1), "exp"),
        ("log_softmax", lambda x: jax.nn.log_softmax(x, axis=-1), "exp"),
        (
            "cross_entropy",
            lambda x: optax.softmax_cross_entropy_with_integer_labels(x, jnp.arange(4) % 3),
            "reduce_sum",
        ),
    ],
)
def test_sensitive_ops_run_in_float32_even_when_fed_float16(name, fn, prim):
    x = _normal((4, 3))
    # Feed float16 explicitly: the matmul output is float16 under autocast.
    g = jaxamp.autocast(lambda x, w: fn(x @ w), dtype=F16)
    w = jnp.eye(3)
    _assert_all(g, x, w, prim=prim, dtype=F32)
    # An explicitly float16 input is upcast too.
    _assert_all(jaxamp.autocast(fn, dtype=F16), x.astype(F16), prim=prim, dtype=F32)
    assert _rel_err(g(x, w), fn(x)) < 5e-3


def test_softmax_chain_is_float32():
    x, w = _normal((4, 8)), _normal((8, 8), jax.random.key(1))
    g = jaxamp.autocast(lambda x, w: jax.nn.softmax(x @ w), dtype=F16)
    closed = jax.make_jaxpr(g)(x, w)
    names = {"sub", "exp", "reduce_sum", "div", "reduce_max"}
    for eqn in _eqns(closed):
        if eqn.primitive.name in names:
            assert all(v.aval.dtype == F32 for v in eqn.invars), eqn


def test_layer_norm_statistics_are_float32():
    ln = nn.LayerNorm()
    x = _normal((4, 16))
    params = ln.init(KEY, x)
    g = jaxamp.autocast(lambda p, x: ln.apply(p, x.astype(F16)), dtype=F16)
    _assert_all(g, params, x, prim="reduce_sum", dtype=F32)
    _assert_all(g, params, x, prim="rsqrt", dtype=F32)
    y = g(params, x)
    assert y.dtype == ln.apply(params, x.astype(F16)).dtype  # f's own output dtype
    assert _rel_err(y, ln.apply(params, x)) < 5e-3


def test_concatenate_mixed_gives_widest():
    g = jaxamp.autocast(lambda a, b: jnp.concatenate([a, b]), dtype=F16)
    a = jnp.ones(3, F16)
    b = jnp.ones(3, F32)
    _assert_all(g, a, b, prim="concatenate", dtype=F32)
    assert g(a, b).dtype == F32


def test_weak_python_scalars_do_not_upcast():
    g = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w * 2.0 + 1.0), dtype=F16)
    x = _normal((2, 2))
    _assert_all(g, x, x, prim="mul", dtype=F16)
    _assert_all(g, x, x, prim="tanh", dtype=F16)


def test_rules_override_per_call():
    x = _normal((4, 8))
    keep = jaxamp.autocast(lambda x: x @ x.T, dtype=F16, rules={"dot_general": "float32"})
    _assert_all(keep, x, prim="dot_general", dtype=F32)
    lower_exp = jaxamp.autocast(
        lambda x: jnp.exp(x @ x.T), dtype=F16, rules={jax.lax.exp_p: "lower"}
    )
    _assert_all(lower_exp, x, prim="exp", dtype=F16)
    assert DEFAULT_RULES["dot_general"] == "lower" and "exp" in FLOAT32_OPS
    assert "conv_general_dilated" in LOWER_PRECISION_OPS
    with pytest.raises(ValueError, match="op class|expected one of"):
        jaxamp.autocast(lambda x: x, dtype=F16, rules={"exp": "fast"})


# ---------------------------------------------------------------- transformations


def _mlp(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


_MLP_PARAMS = [_normal((8, 8), jax.random.key(i), 0.3) for i in range(3)]
_MLP_X = _normal((4, 8))


def test_grad_outside_has_float16_backward_matmuls():
    g = jax.grad(jaxamp.autocast(_mlp, dtype=F16))
    closed = jax.make_jaxpr(g)(_MLP_PARAMS, _MLP_X)
    dots = [e for e in _eqns(closed) if e.primitive.name == "dot_general"]
    assert len(dots) >= 3 + 3 + 2  # forward, grad wrt w, grad wrt x (not the first layer)
    assert all(v.aval.dtype == F16 for e in dots for v in e.invars)
    grads = g(_MLP_PARAMS, _MLP_X)
    ref = jax.grad(_mlp)(_MLP_PARAMS, _MLP_X)
    for a, b in zip(grads, ref, strict=True):
        assert a.dtype == F32
        assert _rel_err(a, b) < 2e-2  # float16 forward and backward: ~1e-3 per op


def test_jit_vmap_and_grad_inside():
    f16 = jaxamp.autocast(_mlp, dtype=F16)
    ref = _mlp(_MLP_PARAMS, _MLP_X)
    assert abs(float(jax.jit(f16)(_MLP_PARAMS, _MLP_X)) - float(ref)) / abs(float(ref)) < 1e-2
    batched = jax.vmap(f16, in_axes=(None, 0))(_MLP_PARAMS, _MLP_X[:, None])
    ref_b = jax.vmap(_mlp, in_axes=(None, 0))(_MLP_PARAMS, _MLP_X[:, None])
    assert batched.shape == (4,) and _rel_err(batched, ref_b) < 1e-2
    # grad taken inside the autocast function: the backward matmuls are traced
    # into f's jaxpr and cast like any other matmul.
    inner = jaxamp.autocast(jax.grad(_mlp), dtype=F16)
    _assert_all(inner, _MLP_PARAMS, _MLP_X, prim="dot_general", dtype=F16, at_least=8)


def _control_flow(w, x, use_while=True):
    def body(carry, xs):
        h = jnp.tanh(carry @ w + xs)
        return h, jnp.sum(h)

    h, ys = jax.lax.scan(body, x[0], x)
    if use_while:
        _, h2 = jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)), (0, h)
        )
    else:
        h2 = jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c @ w), h)
    h3 = jax.lax.cond(jnp.sum(h2) > 0, lambda a: a @ w, lambda a: -(a @ w), h2)
    h4 = jax.checkpoint(lambda a: jnp.cos(a @ w))(h3)
    h5 = jax.jit(lambda a: jax.jit(lambda b: b @ w)(a) + 1.0)(h4)
    return jnp.sum(h5) + jnp.sum(ys)


def _control_flow_no_while(w, x):
    return _control_flow(w, x, use_while=False)


def test_control_flow_remat_nested_jit():
    w = _normal((8, 8), jax.random.key(3), 0.3)
    x = _normal((5, 8), jax.random.key(4))
    g = jaxamp.autocast(_control_flow, dtype=F16)
    closed = jax.make_jaxpr(g)(w, x)
    kinds = {e.primitive.name for e in closed.jaxpr.eqns}
    assert {"scan", "while", "cond"} <= kinds
    _assert_all(g, w, x, prim="dot_general", dtype=F16, at_least=6)
    ref = _control_flow(w, x)
    assert abs(float(g(w, x)) - float(ref)) < 2e-2 * (1 + abs(float(ref)))
    # Reverse mode (while_loop has none: a fori_loop with static bounds is a scan).
    g = jaxamp.autocast(_control_flow_no_while, dtype=F16)
    gw = jax.jit(jax.grad(g))(w, x)
    gw_ref = jax.grad(_control_flow_no_while)(w, x)
    assert gw.dtype == F32 and _rel_err(gw, gw_ref) < 3e-2
    _assert_all(jax.grad(g), w, x, prim="dot_general", dtype=F16, at_least=10)


def test_scan_with_weak_typed_carry():
    def f(x):
        return jax.lax.scan(lambda c, xs: (c + jnp.sum(xs @ xs.T), None), 0.0, x)[0]

    x = _normal((3, 2, 2))
    assert abs(float(jaxamp.autocast(f, dtype=F16)(x)) - float(f(x))) < 1e-2 * (1 + abs(f(x)))


@pytest.mark.skipif(
    not jax_compat.CUSTOM_VJP_ENTERED,
    reason="JAX 0.5 writes custom_vjp as custom_vjp_call_jaxpr, which autocast runs as "
    "written (with a warning); see test_old_jax_custom_vjp_runs_as_written_with_a_warning",
)
def test_custom_vjp_and_custom_jvp():
    x, w = _normal((4, 8)), _normal((8, 8), jax.random.key(1), 0.3)

    def f(x, w):
        return jnp.sum(tanh_proj(jax.nn.relu(x), w) ** 2)

    g = jaxamp.autocast(f, dtype=F16)
    # The primal of the custom_vjp function is autocast.
    _assert_all(g, x, w, prim="dot_general", dtype=F16)
    assert abs(float(g(x, w)) - float(f(x, w))) < 1e-2 * abs(float(f(x, w)))
    # Its rules run as written (float32) and give the right gradient.
    gx, gw = jax.grad(g, argnums=(0, 1))(x, w)
    rx, rw = jax.grad(f, argnums=(0, 1))(x, w)
    assert gx.dtype == F32 and _rel_err(gx, rx) < 1e-2 and _rel_err(gw, rw) < 1e-2


@pytest.mark.skipif(jax_compat.CUSTOM_VJP_ENTERED, reason="JAX 0.5 only")
def test_old_jax_custom_vjp_runs_as_written_with_a_warning():
    x, w = _normal((4, 8)), _normal((8, 8), jax.random.key(1), 0.3)

    def f(x, w):
        return jnp.sum(tanh_proj(x, w) ** 2)

    with pytest.warns(UserWarning, match="custom_vjp_call_jaxpr.*newer JAX"):
        g = jax.grad(jaxamp.autocast(f, dtype=F16), argnums=1)(x, w)
    assert _rel_err(g, jax.grad(f, argnums=1)(x, w)) < 1e-5


# ---------------------------------------------------------------- models


class _Block(nn.Module):
    dim: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        return x + nn.Dense(self.dim)(nn.gelu(h))


@pytest.mark.parametrize("dtype, tol", [(F16, 1e-2), (BF16, 6e-2)])
def test_linen_transformer_block(dtype, tol):
    block = _Block()
    x = _normal((2, 8, 32))
    params = block.init(KEY, x)
    g = jaxamp.autocast(block.apply, dtype=dtype)
    _assert_all(g, params, x, prim="dot_general", dtype=dtype, at_least=6)
    y = jax.jit(g)(params, x)
    assert y.dtype == F32
    assert jax.tree_util.tree_all(jax.tree.map(lambda p: p.dtype == F32, params))
    assert _rel_err(y, block.apply(params, x)) < tol


@pytest.mark.parametrize("dtype, tol", [(F16, 1e-2), (BF16, 6e-2)])
def test_nnx_mlp(dtype, tol):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    x = _normal((3, 8))
    g = jaxamp.autocast(model, dtype=dtype)
    _assert_all(g, x, prim="dot_general", dtype=dtype, at_least=2)
    y = g(x)
    assert y.dtype == F32 and _rel_err(y, model(x)) < tol

    def loss(m, x):
        return jnp.mean(jaxamp.autocast(m, dtype=dtype)(x) ** 2)

    grads = nnx.grad(loss)(model, x)
    ref = nnx.grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert _rel_err(a, b) < 5 * tol


# ---------------------------------------------------------------- regions and dtypes


def test_full_precision_region_and_nested_autocast():
    x, w = _normal((4, 8)), _normal((8, 8), jax.random.key(1))

    def f(x, w):
        a = x @ w  # float16
        b = jaxamp.full_precision(lambda x, w: x @ w)(x, w)  # float32
        c = jaxamp.full_precision(
            lambda x, w: jaxamp.autocast(lambda p, q: p @ q, dtype=BF16)(x, w)
        )(x, w)
        return a, b, c

    found = _operand_dtypes(jaxamp.autocast(f, dtype=F16), x, w, prim="dot_general")
    assert [d[0] for d in found] == [np.dtype(F16), np.dtype(F32), np.dtype(BF16)]
    # full_precision outside autocast is the function itself.
    np.testing.assert_array_equal(jaxamp.full_precision(jnp.sin)(x), jnp.sin(x))
    # The region's backward stays float32 as well.
    region = jaxamp.full_precision(lambda x, w: jnp.sum(jnp.tanh(x @ w)))
    g = jax.grad(jaxamp.autocast(lambda w: region(x, w), dtype=F16))
    _assert_all(g, w, prim="dot_general", dtype=F32, at_least=2)


def test_enabled_false_returns_f():
    def f(x):
        return x

    assert jaxamp.autocast(f, dtype=F16, enabled=False) is f


def test_integer_bool_untouched_and_output_dtypes():
    def f(x, i, b):
        y = x @ x.T
        return y, i * 2 + jnp.sum(i), jnp.logical_not(b), jnp.argmax(y, axis=-1)

    x = _normal((3, 3))
    i = jnp.arange(3, dtype=jnp.int32)
    b = jnp.array([True, False, True])
    out = jaxamp.autocast(f, dtype=F16)(x, i, b)
    ref = f(x, i, b)
    assert [o.dtype for o in out] == [r.dtype for r in ref]
    np.testing.assert_array_equal(out[1], ref[1])
    np.testing.assert_array_equal(out[2], ref[2])
    # A policy's output_dtype applies to floating outputs only.
    pol = jaxamp.Policy(F32, F16, BF16)
    out = jaxamp.autocast(f, policy=pol)(x, i, b)
    assert out[0].dtype == BF16 and out[1].dtype == jnp.int32 and out[3].dtype == ref[3].dtype


def test_float64_not_downcast():
    enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64
    with enable_x64(True):
        x = jnp.linspace(0.0, 1.0, 8, dtype=jnp.float64).reshape(2, 4)
        g = jaxamp.autocast(lambda x: jnp.exp(x) + jnp.sum(x @ x.T), dtype=F16)
        _assert_all(g, x, prim="exp", dtype=jnp.float64)
        _assert_all(g, x, prim="dot_general", dtype=jnp.float64)
        assert g(x).dtype == jnp.float64


def test_kwargs_and_static_python_arguments():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(4)(x)
            return nn.Dropout(0.5, deterministic=not train)(x)

    m = Drop()
    x = _normal((2, 4))
    p = m.init(KEY, x, train=False)
    g = jaxamp.autocast(m.apply, dtype=F16)
    y = g(p, x, train=False)
    assert _rel_err(y, m.apply(p, x, train=False)) < 5e-3
    y = g(p, x, train=True, rngs={"dropout": jax.random.key(2)})
    assert y.shape == (2, 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="floating"):
        jaxamp.autocast(jnp.sin, dtype=jnp.int8)
    with pytest.raises(ValueError, match="bogus"):
        jaxamp.autocast(jnp.sin, policy="bogus")
    with pytest.raises(TypeError, match="callable"):
        jaxamp.autocast(3)
    with pytest.raises(TypeError, match="callable"):
        jaxamp.full_precision("x")
    with pytest.raises(ValueError, match="not both"):
        jaxamp.autocast(jnp.sin, dtype=F16, policy="half")
    with pytest.raises(ValueError, match="unknown_higher_order"):
        jaxamp.autocast(jnp.sin, dtype=F16, unknown_higher_order="maybe")


def test_scatter_runs_as_written():
    g = jaxamp.autocast(lambda x, w: (x @ w).at[0].add(1.0), dtype=F16)
    x = _normal((2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_all(g, x, x, prim="scatter-add", dtype=F32)


@pytest.mark.skipif(not jax_compat.HAS_SHARD_MAP, reason="jax.shard_map is JAX >= 0.7")
def test_shard_map():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("i",))

    def f(x, w):
        return jax.shard_map(
            lambda a, b: jax.lax.psum(jnp.tanh(a @ b), "i"),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(),
        )(x, w)

    x, w = _normal((4, 8)), _normal((8, 8), jax.random.key(1), 0.3)
    g = jaxamp.autocast(f, dtype=F16)
    _assert_all(g, x, w, prim="dot_general", dtype=F16)
    assert _rel_err(jax.jit(g)(x, w), f(x, w)) < 1e-2
