"""Tests for autocast's 0.2 rules (issue 12).

Norm statistics and losses against float32 with large activations, activations
that stay in the compute dtype, explicit casts kept, custom derivatives with
PyTorch's custom_fwd / custom_bwd semantics, per-module rules, nnx state,
the decorator form and the caching of eager calls. Dtypes are read from the
jaxpr of the autocast function (the dtype an equation has there is the dtype
XLA runs it in); numerics are compared with float32.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.numpy import matmul

import jaxamp
from jaxamp._utils import jax_compat
from tests.helpers import all_equations as _eqns
from tests.helpers import rel_err as _rel_err
from tests.helpers import tanh_proj

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
KEY = jax.random.key(0)


def _prims(fn, *args):
    """[(primitive name, input dtypes, output dtypes)] of fn's jaxpr, depth first."""
    closed = jax.make_jaxpr(fn)(*args)
    return [
        (
            e.primitive.name,
            tuple(np.dtype(v.aval.dtype) for v in e.invars if hasattr(v.aval, "dtype")),
            tuple(np.dtype(v.aval.dtype) for v in e.outvars if hasattr(v.aval, "dtype")),
        )
        for e in _eqns(closed)
    ]


def _big(shape, key=KEY):
    # Activations far above 256: their square overflows float16 (max 65504).
    return 300.0 + 200.0 * jax.random.uniform(key, shape, F32)


# ------------------------------------------------------------ 0. no wrong results


def test_rms_norm_of_a_large_matmul_output_matches_float32():
    x = 300.0 * jnp.ones((2, 3))
    model = nn.RMSNorm()
    params = model.init(KEY, x)

    def f(p, x):
        return model.apply(p, x @ jnp.eye(3))  # the matmul makes x a float16 activation

    got = jaxamp.autocast(f, dtype=F16)(params, x)
    np.testing.assert_allclose(got, f(params, x), rtol=2e-3)  # [1, 1, 1], not zeros


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(),
        lambda: nn.RMSNorm(),
        lambda: nn.GroupNorm(num_groups=2),
        lambda: nn.BatchNorm(use_running_average=False),
    ],
    ids=["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"],
)
def test_linen_norms_with_large_activations_match_float32(make):
    norm = make()
    x = _big((4, 8))
    w = jnp.eye(8) + 0.01 * jax.random.normal(KEY, (8, 8))
    variables = norm.init(KEY, x)
    mutable = ["batch_stats"] if "batch_stats" in variables else False

    def f(v, x):
        return norm.apply(v, x @ w, mutable=mutable)

    ref = f(variables, x)
    got = jaxamp.autocast(f, dtype=F16)(variables, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert a.dtype == b.dtype
        assert np.isfinite(np.asarray(a)).all()
        # float16 rounding of x (~0.5 at 400) is all that separates them.
        assert _rel_err(a, b) < 2e-2, (a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda r: nnx.LayerNorm(8, rngs=r),
        lambda r: nnx.RMSNorm(8, rngs=r),
        lambda r: nnx.GroupNorm(8, num_groups=2, rngs=r),
        lambda r: nnx.BatchNorm(8, rngs=r),
    ],
    ids=["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"],
)
def test_nnx_norms_with_large_activations_match_float32(make):
    def eye(key, shape, dtype=F32):
        return jnp.eye(*shape, dtype=dtype)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, kernel_init=eye, rngs=rngs)
            self.norm = make(rngs)

        def __call__(self, x):
            return self.norm(self.lin(x))

    x = _big((4, 8))
    ref_model, model = Model(nnx.Rngs(0)), Model(nnx.Rngs(0))
    ref = ref_model(x)
    got = jaxamp.autocast(model, dtype=F16)(x)
    assert got.dtype == F32 and np.isfinite(np.asarray(got)).all()
    assert _rel_err(got, ref) < 2e-2
    states = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))
    for a, b in zip(*states, strict=True):
        assert np.isfinite(np.asarray(a)).all() and _rel_err(a, b) < 2e-2  # running stats


def test_elementwise_feeders_of_float32_reductions_run_in_float32():
    x, w = _big((4, 8)), jnp.eye(8)
    y = _big((4, 8), jax.random.key(1))

    def losses(x, w, y):
        pred = x @ w
        return jnp.mean(jnp.square(pred - y)), jnp.mean(jnp.abs(pred - y))

    prims = _prims(jaxamp.autocast(losses, dtype=F16), x, w, y)
    for name in ("sub", "abs", "square"):
        found = [p for p in prims if p[0] == name]
        assert found and all(d == np.dtype(F32) for p in found for d in p[1]), (name, found)
    got = jaxamp.autocast(losses, dtype=F16)(x, w, y)
    for a, b in zip(got, losses(x, w, y), strict=True):
        assert _rel_err(a, b) < 1e-2


def test_conv_batchnorm_on_pixels_trains_like_float32():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(2)(jnp.mean(nn.relu(x), axis=(1, 2)))

    net = Net()
    x = jnp.round(255.0 * jax.random.uniform(KEY, (4, 6, 6, 3)))  # 0-255 pixels
    labels = jnp.array([0, 1, 0, 1])
    variables = net.init(KEY, x)

    def loss(params, batch_stats, apply):
        logits, upd = apply({"params": params, "batch_stats": batch_stats}, x,
                            mutable=["batch_stats"])  # fmt: skip
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

    vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
    ref = vg(variables["params"],
                                                 variables["batch_stats"], net.apply)  # fmt: skip
    amp = vg(variables["params"], variables["batch_stats"],
                                                 jaxamp.autocast(net.apply, dtype=F16))  # fmt: skip
    (l_ref, s_ref), g_ref = ref
    (l_amp, s_amp), g_amp = amp
    assert abs(float(l_amp) - float(l_ref)) < 1e-2 * abs(float(l_ref))
    for a, b in zip(jax.tree.leaves(s_amp), jax.tree.leaves(s_ref), strict=True):
        assert np.isfinite(np.asarray(a)).all() and _rel_err(a, b) < 1e-2
    # Gradients as one vector (the conv bias gradient is ~0 after BatchNorm).
    flat_amp = np.concatenate([np.ravel(a) for a in jax.tree.leaves(g_amp)])
    flat_ref = np.concatenate([np.ravel(a) for a in jax.tree.leaves(g_ref)])
    assert _rel_err(flat_amp, flat_ref) < 5e-2


# ------------------------------------------------------------ 1. activations stay low


def _remats(jaxpr):
    return [e for e in _eqns(jaxpr) if e.primitive.name in ("checkpoint", "remat", "remat2")]


def test_dense_bias_and_activation_run_in_float16():
    model = nn.Sequential([nn.Dense(16), nn.gelu, nn.Dense(16), nn.relu, nn.Dense(4)])
    x = jax.random.normal(KEY, (8, 4))
    params = model.init(KEY, x)
    closed = jax.make_jaxpr(jaxamp.autocast(model.apply, dtype=F16))(params, x)
    f16, f32 = np.dtype(F16), np.dtype(F32)
    # The bias adds (a parameter broadcast into the activation: cast down, as
    # torch's Linear casts its bias) and relu's max run in float16; the last
    # bias add feeds f's float32 output and runs in float32.
    top = [e for e in closed.jaxpr.eqns if e.primitive.name == "add"]
    assert [e.outvars[0].aval.dtype for e in top] == [f16, f16, f32]
    maxes = [e for e in _eqns(closed) if e.primitive.name == "max"]
    assert maxes and all(e.outvars[0].aval.dtype == f16 for e in maxes)
    # gelu's x**3 is a float32-list op (pow, as in torch.autocast); the rest of
    # gelu meets its float32 result and runs in float32 (torch's type
    # promotion), all inside one checkpoint of the float16 activation: the
    # backward pass keeps that input only, as a fused gelu kernel does.
    (remat,) = _remats(closed)
    assert [v.aval.dtype for v in remat.invars] == [f16]
    inner = {e.primitive.name: e.outvars[0].aval.dtype for e in _eqns(remat.params["jaxpr"])}
    assert inner["integer_pow"] == f32 and inner["tanh"] == f32
    y = jaxamp.autocast(model.apply, dtype=F16)(params, x)
    assert y.dtype == F32 and _rel_err(y, model.apply(params, x)) < 1e-2


def test_float32_list_ops_still_float32_and_softmax_output_matches():
    x = jax.random.normal(KEY, (4, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16))

    def f(x, w):
        logits = x @ w
        return jax.nn.log_softmax(logits), jax.nn.softmax(logits)

    prims = _prims(jaxamp.autocast(f, dtype=F16), x, w)
    for name in ("exp", "log", "reduce_sum", "reduce_max"):
        found = [p for p in prims if p[0] == name]
        assert found and all(d == np.dtype(F32) for p in found for d in p[1]), name
    for a, b in zip(jaxamp.autocast(f, dtype=F16)(x, w), f(x, w), strict=True):
        assert _rel_err(a, b) < 1e-2


def test_large_float32_constant_saturates_instead_of_inf():
    x, w = jax.random.normal(KEY, (4, 4)), jnp.eye(4)

    def f(x, w):
        scores = x @ w
        mask = jnp.tril(jnp.ones((4, 4), bool))
        return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(F32).min), axis=-1)

    got = jaxamp.autocast(f, dtype=F16)(x, w)
    assert np.isfinite(np.asarray(got)).all() and _rel_err(got, f(x, w)) < 1e-2


def _loop_eqn(fn, *args, name):
    closed = jax.make_jaxpr(fn)(*args)
    found = [e for e in closed.jaxpr.eqns if e.primitive.name == name]
    assert len(found) == 1, [e.primitive.name for e in closed.jaxpr.eqns]
    return found[0]


def _rnn(w, u, xs):
    # An RNN cell: the hidden state is a float32 zeros init the body returns
    # as a float16 activation, so it is carried in float16 (torch's RNN cells
    # return float16 under autocast).
    def cell(h, x):
        h = jnp.tanh(x @ w + h @ u)
        return h, h

    return jax.lax.scan(cell, jnp.zeros((xs.shape[1], u.shape[0])), xs)


def test_scan_carries_and_outputs_activations_in_float16():
    w = 0.3 * jax.random.normal(KEY, (8, 16))
    u = 0.3 * jax.random.normal(jax.random.key(1), (16, 16))
    xs = jax.random.normal(jax.random.key(2), (5, 4, 8))
    amp = jaxamp.autocast(_rnn, dtype=F16)
    eqn = _loop_eqn(amp, w, u, xs, name="scan")
    assert [np.dtype(v.aval.dtype) for v in eqn.outvars] == [np.dtype(F16)] * 2
    (h, hs), (h_ref, hs_ref) = amp(w, u, xs), _rnn(w, u, xs)
    assert h.dtype == hs.dtype == F32  # the outputs keep f's dtypes
    assert _rel_err(h, h_ref) < 1e-2 and _rel_err(hs, hs_ref) < 1e-2
    # Reverse mode and vmap through the float16 carry.
    loss = lambda w, u, xs: jnp.sum(_rnn(w, u, xs)[1] ** 2)  # noqa: E731
    g = jax.jit(jax.grad(jaxamp.autocast(loss, dtype=F16), argnums=(0, 1)))(w, u, xs)
    g_ref = jax.grad(loss, argnums=(0, 1))(w, u, xs)
    for a, b in zip(g, g_ref, strict=True):
        assert a.dtype == F32 and _rel_err(a, b) < 3e-2
    batched = jax.vmap(amp, in_axes=(None, None, 0))(w, u, jnp.stack([xs, -xs]))
    assert _rel_err(batched[1][1], _rnn(w, u, -xs)[1]) < 1e-2


@pytest.mark.parametrize("project", [False, True])
def test_scan_over_layers_residual_stream(project):
    # nn.scan over blocks: the residual stream is the carry. Entering as a
    # float16 activation (after a Dense projection) it stays float16, as in
    # the unrolled and the hand-cast model. Entering as the float32 input, the
    # first block's LayerNorm reads it in float32 (as the unrolled model's
    # first block does), so it is carried in float32: a loop may differ from
    # its unrolled form only towards more precision.
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(8)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x)))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            if project:
                x = nn.Dense(8)(x)
            body = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3)  # fmt: skip
            return body()(x, None)[0]

    x = jax.random.normal(KEY, (4, 8))
    model = Stack()
    params = model.init(KEY, x)
    amp = jaxamp.autocast(model.apply, dtype=F16)
    eqn = _loop_eqn(amp, params, x, name="scan")
    carry = eqn.outvars[: eqn.params["num_carry"]]
    want = F16 if project else F32
    assert [np.dtype(v.aval.dtype) for v in carry] == [np.dtype(want)]
    assert _rel_err(amp(params, x), model.apply(params, x)) < 1e-2


def test_scan_carry_first_read_by_a_float32_op_is_not_cast_down():
    # Power iteration: the carry is normalised (float32 ops) before the matmul.
    # Casting the 1e5-sized start vector to float16 on entry would make it inf.
    def power(w, v0):
        return jax.lax.scan(lambda v, _: ((v / jnp.linalg.norm(v)) @ w, None), v0, None,
                            length=4)[0]  # fmt: skip

    w = jax.random.normal(KEY, (8, 8)) / 3
    v0 = 1e5 * jax.random.normal(jax.random.key(1), (8,))
    amp = jaxamp.autocast(power, dtype=F16)
    eqn = _loop_eqn(amp, w, v0, name="scan")
    assert np.dtype(eqn.outvars[0].aval.dtype) == np.dtype(F32)
    got = amp(w, v0)
    assert np.isfinite(np.asarray(got)).all() and _rel_err(got, power(w, v0)) < 1e-2


def test_a_carry_pinned_in_the_loop_leaves_it_pinned():
    # acc + (x @ w).astype(float32) is pinned inside the loop; after it, acc +
    # an activation runs in float32 as in the unrolled program (|acc| ~ 7e4
    # would overflow float16).
    w = jnp.abs(jax.random.normal(KEY, (8, 8)))
    xs = 30 * jax.random.normal(jax.random.key(1), (64, 4, 8)) + 100

    def f(w, xs):
        acc = jax.lax.scan(lambda a, x: (a + (x @ w).astype(F32), None), jnp.zeros((4, 8)), xs)[0]
        return acc + xs[0] @ w

    amp = jaxamp.autocast(f, dtype=F16)
    adds = [e for e in jax.make_jaxpr(amp)(w, xs).jaxpr.eqns if e.primitive.name == "add"]
    assert np.dtype(adds[-1].outvars[0].aval.dtype) == np.dtype(F32)
    got = amp(w, xs)
    assert np.isfinite(np.asarray(got)).all() and _rel_err(got, f(w, xs)) < 1e-2


def test_float32_accumulator_carry_stays_float32():
    # A running sum of a float32-list reduction is not an activation: it is
    # carried in float32 (a float16 accumulator would lose the small terms).
    def f(w, xs):
        def body(total, x):
            return total + jnp.sum(x @ w), None

        return jax.lax.scan(body, jnp.float32(4096.0), xs)[0]

    w, xs = jnp.eye(4), jnp.full((64, 2, 4), 0.01)
    eqn = _loop_eqn(jaxamp.autocast(f, dtype=F16), w, xs, name="scan")
    assert np.dtype(eqn.outvars[0].aval.dtype) == np.dtype(F32)
    got = jaxamp.autocast(f, dtype=F16)(w, xs)
    assert abs(float(got) - float(f(w, xs))) < 1e-2  # 4096 + 5.12; float16 would round

    # A float32 accumulator of activations stays float32 too (torch's type
    # promotion: 4096 + a small term in float16 would round it away);
    # jaxamp.keep_float32 says so explicitly (y is float32 in f, so
    # y.astype(float32) would leave no trace in the jaxpr).
    def acc(w, xs, explicit):
        def body(a, x):
            y = x @ w
            return a + (jaxamp.keep_float32(y) if explicit else y), None

        return jax.lax.scan(body, jnp.full((2, 4), 4096.0), xs)[0]

    for explicit in (False, True):
        amp = jaxamp.autocast(functools.partial(acc, explicit=explicit), dtype=F16)
        eqn = _loop_eqn(amp, w, xs, name="scan")
        assert np.dtype(eqn.outvars[0].aval.dtype) == np.dtype(F32), explicit
        np.testing.assert_allclose(amp(w, xs), acc(w, xs, explicit), rtol=1e-6)


def test_activation_carry_the_body_widens_runs_in_its_original_dtype():
    # The carry enters as a float16 activation but the body returns exp() of
    # it (float32): no fixed point in float16, so it is carried in float32.
    def f(w, x):
        h = x @ w
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.exp(-c * c), h)

    w, x = jnp.eye(4), jax.random.normal(KEY, (2, 4))
    amp = jaxamp.autocast(f, dtype=F16)
    eqn = _loop_eqn(amp, w, x, name="scan" if "scan" in str(jax.make_jaxpr(amp)(w, x)) else "while")
    assert all(np.dtype(v.aval.dtype) == np.dtype(F32) for v in eqn.outvars
               if jnp.issubdtype(v.aval.dtype, jnp.floating))  # fmt: skip
    assert _rel_err(amp(w, x), f(w, x)) < 1e-2


def test_while_loop_carry_keeps_its_dtype_and_the_loop_ends():
    # t += dt with dt = x @ w ~ 1e-4 (an activation): in float16, t would stall
    # at 0.25 and the loop would never end. The carry decides the trip count,
    # so it runs pinned to float32 (the matmul inside still runs in float16).
    w, x = jnp.full((8,), 1.25e-5), jnp.ones((8,))

    def f(w, x):
        dt = x @ w
        return jax.lax.while_loop(lambda c: (c[0] < 1.0) & (c[1] < 30000),
                                  lambda c: (c[0] + dt, c[1] + 1), (0.0, 0))  # fmt: skip

    amp = jaxamp.autocast(f, dtype=F16)
    t, steps = amp(w, x)
    t_ref, steps_ref = f(w, x)
    assert abs(int(steps) - int(steps_ref)) <= 20 and abs(float(t) - float(t_ref)) < 1e-3

    def loop(w, x):
        _, h = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)),
                                  (0, x @ w))  # fmt: skip
        return h

    w, x = 0.5 * jax.random.normal(KEY, (4, 4)), jax.random.normal(jax.random.key(1), (2, 4))
    amp = jaxamp.autocast(loop, dtype=F16)
    body = _loop_eqn(amp, w, x, name="while").params["body_jaxpr"]
    dots = [e for e in body.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(np.dtype(v.aval.dtype) == np.dtype(F16) for e in dots for v in e.invars)
    assert _rel_err(amp(w, x), loop(w, x)) < 1e-2


def test_cond_keeps_activations_when_the_branches_agree():
    w = 0.5 * jax.random.normal(KEY, (4, 4))
    x = jax.random.normal(jax.random.key(1), (2, 4))

    def branch(w, x, agree):
        h = x @ w
        other = (lambda a: -(a @ w)) if agree else (lambda a: jnp.exp(a))
        return jax.lax.cond(jnp.sum(h) > 0, lambda a: a @ w, other, h)

    for agree, want in ((True, F16), (False, F32)):
        amp = jaxamp.autocast(functools.partial(branch, agree=agree), dtype=F16)
        eqn = _loop_eqn(amp, w, x, name="cond")
        assert np.dtype(eqn.outvars[0].aval.dtype) == np.dtype(want), agree
        assert _rel_err(amp(w, x), branch(w, x, agree)) < 1e-2


# ------------------------------------------------------------ 2. what the user wrote


def test_explicit_astype_float32_is_kept():
    x, w = _big((2, 8)), jnp.eye(8)

    def f(x, w):
        y32 = jaxamp.keep_float32(x @ w)
        # mul is not a float32-list op and nothing float32 follows: only the
        # explicit cast keeps y**2 (~1.6e5) out of float16's range (max 65504).
        return y32 * y32 * 0.5

    got = jaxamp.autocast(f, dtype=F16)(x, w)
    assert np.isfinite(np.asarray(got)).all()
    assert _rel_err(got, f(x, w)) < 1e-2
    muls = [p for p in _prims(jaxamp.autocast(f, dtype=F16), x, w) if p[0] == "mul"]
    assert muls and all(p[2][0] == np.dtype(F32) for p in muls)
    # Without the cast the same product is a float16 activation (and overflows).
    g = jaxamp.autocast(lambda x, w: (x @ w) * (x @ w) * 0.5, dtype=F16)
    assert not np.isfinite(np.asarray(g(x, w))).all()


def test_explicit_square_of_astype_float32_rms_norm():
    x, w = _big((2, 8)), jnp.eye(8)

    def rms(x, w):
        y = x @ w
        return y * jax.lax.rsqrt(jnp.mean(jnp.square(y.astype(jnp.float32)), -1, keepdims=True))

    got = jaxamp.autocast(rms, dtype=F16)(x, w)
    assert _rel_err(got, rms(x, w)) < 2e-3


def test_explicit_astype_float32_of_a_float32_value_leaves_no_trace():
    # What autocast cannot see (JAX drops a same-dtype astype): it then follows
    # its rules, the same whichever way f was written or imported.
    x, w = _big((2, 8)), jnp.eye(8)
    plain = jaxamp.autocast(lambda x, w: (x @ w) * (x @ w), dtype=F16)
    cast = jaxamp.autocast(lambda x, w: (x @ w).astype(jnp.float32) * (x @ w), dtype=F16)
    assert _prims(plain, x, w) == _prims(cast, x, w)


@pytest.mark.parametrize(
    "dot",
    [
        lambda a, b: jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32),
        lambda a, b: matmul(a, b, preferred_element_type=jnp.float32),
        lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32),
    ],
    ids=["einsum", "from_import_matmul", "dot_general"],
)  # fmt: skip
def test_preferred_element_type_is_read_from_the_jaxpr(dot):
    a, b = jax.random.normal(KEY, (4, 8)), jax.random.normal(jax.random.key(1), (8, 4))
    # float32 inputs asking for float32: the jnp default, indistinguishable in
    # the jaxpr, so the accumulation type follows the cast, however imported.
    dots = [p for p in _prims(jaxamp.autocast(dot, dtype=F16), a, b) if p[0] == "dot_general"]
    assert dots == [("dot_general", (np.dtype(F16),) * 2, (np.dtype(F16),))]
    # A wider accumulation than f's inputs is visible and kept: the documented
    # way to ask for a float32 matmul result.
    wide = lambda a, b: dot(a.astype(F16), b.astype(F16))  # noqa: E731
    dots = [p for p in _prims(jaxamp.autocast(wide, dtype=F16), a, b) if p[0] == "dot_general"]
    assert dots == [("dot_general", (np.dtype(F16),) * 2, (np.dtype(F32),))]


# ------------------------------------------------------------ 3. custom derivatives


@jax.custom_jvp
def _jproj(x, w):
    return jnp.tanh(x @ w)


@_jproj.defjvp
def _jproj_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    y = jnp.tanh(x @ w)
    return y, (1 - y * y) * (dx @ w + x @ dw)


_OLD_VJP = pytest.mark.skipif(
    not jax_compat.CUSTOM_VJP_ENTERED,
    reason="JAX 0.5: custom_vjp runs as written under autocast (warned)",
)


@pytest.mark.parametrize(
    "fn",
    [pytest.param(tanh_proj, marks=_OLD_VJP), _jproj],
    ids=["custom_vjp", "custom_jvp"],
)
def test_custom_derivative_primal_same_with_and_without_grad(fn):
    x = jax.random.normal(KEY, (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
    g = jaxamp.autocast(fn, dtype=F16)
    eval_out = g(x, w)
    train_out, vjp = jax.vjp(g, x, w)
    np.testing.assert_array_equal(np.asarray(eval_out), np.asarray(train_out))
    # Forward and backward rules ran under autocast: their matmuls are float16.
    step = jax.make_jaxpr(lambda x, w: jax.vjp(g, x, w)[1](jnp.ones((4, 8))))(x, w)
    dots = [e for e in _eqns(step) if e.primitive.name == "dot_general"]
    assert len(dots) >= 3 and all(v.aval.dtype == F16 for e in dots for v in e.invars)
    gx, gw = vjp(jnp.ones((4, 8)))
    rx, rw = jax.vjp(fn, x, w)[1](jnp.ones((4, 8)))
    assert gx.dtype == F32 and _rel_err(gx, rx) < 2e-2 and _rel_err(gw, rw) < 2e-2


def test_full_precision_is_custom_fwd_cast_inputs_float32():
    x = jax.random.normal(KEY, (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))

    def f(x, w):
        h = x @ w  # float16 activation
        return jnp.sum(jaxamp.full_precision(tanh_proj)(h, w))

    grad = jax.make_jaxpr(jax.grad(jaxamp.autocast(f, dtype=F16), argnums=1))(x, w)
    dots = [e for e in _eqns(grad) if e.primitive.name == "dot_general"]
    # The outer matmul (forward + 2 backward) in float16, the region's
    # matmuls (forward + its bwd rule's 2) in float32 with float32 inputs.
    dtypes = sorted(str(e.invars[0].aval.dtype) for e in dots)
    assert dtypes.count("float32") >= 3 and dtypes.count("float16") >= 2, dtypes


# ------------------------------------------------------------ 4. per-module rules


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(8)(x))
        x = nn.LayerNorm(name="ln_out")(nn.relu(nn.Dense(8)(x)))
        return nn.Dense(3, name="head")(x)


def test_linen_module_rules_by_name_and_class():
    x = jax.random.normal(KEY, (2, 8))
    params = _Net().init(KEY, x)
    f = jaxamp.autocast(_Net().apply, dtype=F16, modules={"head": "float32"})
    dots = [p for p in _prims(f, params, x) if p[0] == "dot_general"]
    assert [p[1][0].name for p in dots] == ["float16", "float16", "float32"]
    f = jaxamp.autocast(_Net().apply, dtype=F16, modules={"LayerNorm": "float32"})
    np.testing.assert_allclose(f(params, x), _Net().apply(params, x), rtol=0, atol=5e-2)


def test_linen_module_rule_by_class_matches_explicitly_named_modules():
    # `nn.Dense(3, name="head")` is matched by its class like the auto-named
    # `Dense_0` / `Dense_1`: the same program as naming all three.
    x = jax.random.normal(KEY, (2, 8))
    params = _Net().init(KEY, x)

    def prims(modules):
        return _prims(jaxamp.autocast(_Net().apply, dtype=F16, modules=modules), params, x)

    by_class = prims({"Dense": "float32"})
    assert by_class == prims({"Dense_0": "float32", "Dense_1": "float32", "head": "float32"})
    assert by_class != prims({"Dense_0": "float32", "Dense_1": "float32"})
    # Path patterns still see module names only, not the class scopes.
    assert prims({"_Net/ln_out": "float32"}) == prims({"ln_out": "float32"})
    assert prims({"*/Dense_1": "float32"}) == prims({"Dense_1": "float32"})
    dots = [p for p in by_class if p[0] == "dot_general"]
    assert len(dots) == 3 and all(p[1][0] == np.float32 for p in dots), dots


def test_nnx_module_rules_by_path_and_class():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(8, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.norm(self.body(x)))

    net = Net(nnx.Rngs(0))
    x = jax.random.normal(KEY, (2, 8))
    f = jaxamp.autocast(net, dtype=F16, modules={"head": "float32", "LayerNorm": "float32"})
    dots = [p for p in _prims(f, x) if p[0] == "dot_general"]
    assert [p[1][0].name for p in dots] == ["float16", "float32"]
    assert _rel_err(f(x), net(x)) < 1e-2


def test_nnx_module_rule_by_class_matches_named_attributes():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(8, 8, rngs=rngs)
            self.ln = nnx.LayerNorm(8, rngs=rngs)
            self.mid = nnx.Linear(8, 8, rngs=rngs)
            self.out = nnx.LayerNorm(8, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.out(self.mid(self.ln(self.body(x)))))

    net = Net(nnx.Rngs(0))
    x = jax.random.normal(KEY, (2, 8))

    def prims(modules):
        return _prims(jaxamp.autocast(net, dtype=F16, modules=modules), x)

    by_class = prims({"Linear": "float32"})
    assert by_class == prims({"body": "float32", "mid": "float32", "head": "float32"})
    assert by_class != prims({"body": "float32", "mid": "float32"})
    dots = [p for p in by_class if p[0] == "dot_general"]
    assert len(dots) == 3 and all(p[1][0] == np.float32 for p in dots), dots


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.lin(x))


def _nnx_block_stack():
    """Three stacked nnx blocks (nnx.vmap) and a forward pass over them with nnx.scan."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return _NnxBlock(nnx.Rngs(key))

    def scan_fwd(stack, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, x):
            return block(x)

        return body(stack, x)

    return make(jax.random.split(KEY, 3)), scan_fwd


def test_nnx_module_rules_by_class_and_name_inside_nnx_scan():
    # nnx.scan rebuilds the modules it scans over from autocast's copies, which
    # carry their paths: a class pattern and an attribute name select them.
    stack, scan_fwd = _nnx_block_stack()
    x = jax.random.normal(KEY, (2, 8))
    graphdef, state = nnx.split(stack)
    for modules, want in ((None, F16), ({"Linear": "float32"}, F32), ({"lin": "float32"}, F32)):
        amp = jaxamp.autocast(scan_fwd, dtype=F16, modules=modules)

        def pure(state, x, amp=amp):  # no module closed over by the trace
            return amp(nnx.merge(graphdef, state), x)

        dots = [p for p in _prims(pure, state, x) if p[0] == "dot_general"]
        assert dots and all(d == np.dtype(want) for p in dots for d in p[1]), (modules, dots)
        assert _rel_err(amp(stack, x), scan_fwd(stack, x)) < 1e-2


class _NnxTwoBlocks(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([_NnxBlock(rngs), _NnxBlock(rngs)])

    def __call__(self, x):
        for block in self.blocks:
            x = nnx.remat(lambda b, x: b(x))(block, x)
        return x


def test_nnx_module_rules_by_path_inside_nnx_remat():
    # nnx.remat rebuilds each block from autocast's named copy: a path rule
    # holds there, as it does without nnx.remat.
    graphdef, state = nnx.split(_NnxTwoBlocks(nnx.Rngs(0)))
    amp = jaxamp.autocast(lambda m, x: m(x), dtype=F16, modules={"blocks/1": "float32"})

    def pure(state, x):  # no module closed over by the trace (nnx.remat writes to it)
        return amp(nnx.merge(graphdef, state), x)

    dots = [p for p in _prims(pure, state, jax.random.normal(KEY, (2, 8))) if p[0] == "dot_general"]
    assert [p[1] for p in dots] == [(F16, F16), (F32, F32)], dots


def test_module_rules_validation():
    with pytest.raises(ValueError, match="modules\\['head'\\]"):
        jaxamp.autocast(lambda x: x, modules={"head": "lower"})
    with pytest.raises(ValueError, match="dot_general"):
        jaxamp.autocast(lambda x: x, modules={"head": {"dot": "float32"}})


# ------------------------------------------------------------ 5. nnx state


class _Stateful(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_batchnorm_dropout_state_updates_as_without_autocast(jit):
    x = jax.random.normal(KEY, (16, 4)) * 3 + 1
    ref, model = _Stateful(nnx.Rngs(0)), _Stateful(nnx.Rngs(0))

    def run(m, x):
        return jaxamp.autocast(m, dtype=F16)(x)

    call = nnx.jit(run) if jit else run
    ref_call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    for _ in range(2):
        y, r = call(model, x), ref_call(ref, x)
    assert y.dtype == F32
    np.testing.assert_array_equal(np.asarray(y) == 0, np.asarray(r) == 0)  # same dropout mask
    assert _rel_err(y, r) < 1e-2
    sa, sr = nnx.state(model, nnx.BatchStat), nnx.state(ref, nnx.BatchStat)
    for a, b in zip(jax.tree.leaves(sa), jax.tree.leaves(sr), strict=True):
        assert _rel_err(a, b) < 1e-2 and not np.allclose(np.asarray(b), 0)
    counts = [jax.tree.leaves(nnx.state(m, nnx.RngCount)) for m in (model, ref)]
    assert [int(c) for c in counts[0]] == [int(c) for c in counts[1]]


def test_nnx_rnn_remat_and_scan_stacks():
    stack, scan_fwd = _nnx_block_stack()
    x = jax.random.normal(KEY, (2, 8))
    ref = scan_fwd(stack, x)
    got = jaxamp.autocast(scan_fwd, dtype=F16)(stack, x)
    assert got.dtype == F32 and _rel_err(got, ref) < 1e-2

    block = _NnxBlock(nnx.Rngs(1))
    remat = nnx.remat(lambda m, x: m(m(x)))
    ref = remat(block, x)
    got = jaxamp.autocast(remat, dtype=F16)(block, x)
    assert _rel_err(got, ref) < 1e-2
    assert block(x).dtype == F32  # the module is intact afterwards

    rnn = nnx.RNN(nnx.LSTMCell(8, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
    seq = jax.random.normal(KEY, (2, 5, 8))
    ref = rnn(seq)
    got = jaxamp.autocast(rnn, dtype=F16)(seq)
    assert _rel_err(got, ref) < 1e-2
    got = nnx.jit(lambda m, s: jaxamp.autocast(m, dtype=F16)(s))(rnn, seq)
    assert _rel_err(got, ref) < 1e-2


def test_typed_prng_keys_pass_through():
    def f(key, x):
        k1, k2 = jax.random.split(key)
        return k1, x @ x.T + jax.random.normal(k2, (2, 2))

    key = jax.random.key(0)
    k, y = jaxamp.autocast(f, dtype=F16)(key, jnp.ones((2, 3)))
    assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) and y.dtype == F32
    ref = f(key, jnp.ones((2, 3)))[0]
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(ref))


# ------------------------------------------------------------ 6. forms users expect


class _Decorated(nn.Module):
    @functools.partial(jaxamp.autocast, dtype=F16)
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=not train)(x))


def test_linen_decorator_init_and_apply():
    x = jax.random.normal(KEY, (4, 3))
    variables = _Decorated().init(KEY, x)
    assert variables["params"]["Dense_0"]["kernel"].dtype == F32
    y = _Decorated().apply(variables, x)
    assert y.dtype == F32
    prims = _prims(lambda v, x: _Decorated().apply(v, x), variables, x)
    assert [p[1][0] for p in prims if p[0] == "dot_general"] == [np.dtype(F16)] * 2
    y, upd = _Decorated().apply(variables, x, train=True, mutable=["batch_stats"],
                                rngs={"dropout": KEY})  # fmt: skip
    assert np.isfinite(np.asarray(y)).all()
    assert not np.allclose(upd["batch_stats"]["BatchNorm_0"]["mean"], 0)


def test_nnx_decorator_on_call():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)

        @functools.partial(jaxamp.autocast, dtype=F16)
        def __call__(self, x):
            return self.lin(x)

    m = M(nnx.Rngs(0))
    dots = [p for p in _prims(lambda x: m(x), jnp.ones((2, 3))) if p[0] == "dot_general"]
    assert dots and dots[0][1][0] == np.dtype(F16)


@pytest.mark.parametrize(
    "act", [jax.nn.relu, jax.nn.silu, jax.nn.gelu, lambda h: jnp.cross(h[:, :3], h[:, 3:6])],
    ids=["relu", "silu", "gelu", "cross"],
)  # fmt: skip
def test_activation_functions_keep_float16(act):
    x, w = jax.random.normal(KEY, (4, 8)), jax.random.normal(jax.random.key(1), (8, 8))

    def f(x, w):
        h = act(x @ w)
        return h @ w[: h.shape[-1]]

    closed = jax.make_jaxpr(jaxamp.autocast(f, dtype=F16))(x, w)
    dots = [e for e in _eqns(closed) if e.primitive.name == "dot_general"]
    # The second matmul gets the activation's float16 output directly: no
    # float32 round trip at the custom_jvp / jit boundary (the only upcasts
    # left: the function's output, and gelu's, which runs in float32 after its
    # x**3, inside one checkpoint of its float16 input: no float32 residual).
    outs = set(closed.jaxpr.outvars)
    remats = _remats(closed)
    in_remat = {id(x) for r in remats for x in _eqns(r.params["jaxpr"])}
    ups = [e for e in _eqns(closed) if e.primitive.name == "convert_element_type"
           and e.invars[0].aval.dtype == F16 and e.outvars[0].aval.dtype == F32
           and e.outvars[0] not in outs and id(e) not in in_remat]  # fmt: skip
    assert len(dots) == 2 and all(v.aval.dtype == F16 for e in dots for v in e.invars)
    assert not ups, ups
    tanhs = [r for r in remats if any(x.primitive.name == "tanh"
                                      for x in _eqns(r.params["jaxpr"]))]  # fmt: skip
    assert len(tanhs) == (1 if act is jax.nn.gelu else 0)
    assert all(v.aval.dtype == F16 for r in remats for v in r.invars)


def test_nested_jit_called_many_times_is_autocast_once():
    # Item 7 (compile cost): a nested jit called in every layer becomes one
    # autocast program bound at every call site (JAX then differentiates and
    # lowers it once), with values crossing its boundary in their autocast dtype.
    @jax.jit
    def block(h, w):
        return jnp.tanh(h @ w) + h

    @jax.jit
    def ln(h):
        return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)

    def f(x, w):
        for _ in range(4):
            x = ln(block(x, w))
        return x

    x, w = jax.random.normal(KEY, (4, 8)), 0.3 * jax.random.normal(jax.random.key(1), (8, 8))
    closed = jax.make_jaxpr(jaxamp.autocast(f, dtype=F16))(x, w)
    calls = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert len(calls) == 8
    blocks = {id(e.params["jaxpr"]) for e in calls if e.params["name"] == "block"}
    lns = {id(e.params["jaxpr"]) for e in calls if e.params["name"] == "ln"}
    assert len(lns) == 1
    # The first block gets f's float32 input, the later ones ln's float32
    # result: two programs. The residual stream `tanh(h @ w) + h` meets a
    # float32 value of its own size, so it stays float32 as under torch's type
    # promotion; the matmuls run in float16.
    assert len(blocks) == 2
    assert [e.outvars[0].aval.dtype for e in calls] == [F32] * 8
    dots = [e for e in _eqns(closed) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == F16 for e in dots for v in e.invars)
    np.testing.assert_allclose(jaxamp.autocast(f, dtype=F16)(x, w), f(x, w), atol=2e-2)
    g = jax.grad(lambda w: jnp.sum(jaxamp.autocast(f, dtype=F16)(x, w)))(w)
    np.testing.assert_allclose(g, jax.grad(lambda w: jnp.sum(f(x, w)))(w), rtol=5e-2, atol=5e-2)


def test_nested_jit_under_module_rules_follows_each_call_sites_rule():
    @jax.jit
    def act(h):
        return h * jnp.tanh(h)

    class Act(nn.Module):
        def __call__(self, h):
            return act(h)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = Act(name="a")(nn.Dense(8)(x))
            return Act(name="b")(nn.Dense(8)(x))

    x = jax.random.normal(KEY, (2, 8))
    params = Net().init(KEY, x)
    rules = {"b": {"tanh": "float32"}}
    closed = jax.make_jaxpr(jaxamp.autocast(Net().apply, dtype=F16, modules=rules))(params, x)
    # Same jaxpr, same input dtypes, different rules: two programs.
    tanhs = [e.outvars[0].aval.dtype for e in _eqns(closed) if e.primitive.name == "tanh"]
    assert tanhs == [F16, F32]


def test_unknown_primitive_in_rules_names_the_closest():
    with pytest.raises(ValueError, match="'dot'.*dot_general"):
        jaxamp.autocast(lambda x: x, rules={"dot": "float32"})
    with pytest.raises(ValueError, match="expected one of"):
        jaxamp.autocast(lambda x: x, rules={"dot_general": "half"})
    jaxamp.autocast(lambda x: x, rules={jax.lax.exp_p: "lower"})  # primitives are accepted


def test_default_rules_public_and_readable():
    rules = jaxamp.DEFAULT_RULES
    assert rules["dot_general"] == "lower" and rules["reduce_sum"] == "float32"
    assert rules["add"] == "elementwise" and rules["square"] == "float32"
    with pytest.raises(TypeError):
        rules["add"] = "float32"  # read-only


# ------------------------------------------------------------ 7. no needless cost


def test_eager_calls_trace_once_per_signature():
    calls = []

    def f(x, w):
        calls.append(1)
        return jax.nn.relu(x @ w)

    g = jaxamp.autocast(f, dtype=F16)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    for _ in range(3):
        g(x, w)
    assert len(calls) == 1
    g(jnp.ones((4, 3)), w)  # a new shape: one more trace
    assert len(calls) == 2


def test_no_value_cast_twice_to_the_same_dtype():
    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(6):
                h = nn.LayerNorm()(x)
                x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(h)))
            return x

    x = jax.random.normal(KEY, (2, 16))
    params = Deep().init(KEY, x)
    closed = jax.make_jaxpr(jaxamp.autocast(Deep().apply, dtype=F16))(params, x)
    seen = set()
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "convert_element_type":
            key = (e.invars[0], e.params["new_dtype"])
            assert key not in seen, key
            seen.add(key)


def test_module_rules_example_claims():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "module_rules.py"
    spec = importlib.util.spec_from_file_location("module_rules_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.Classifier()
    x = jax.random.normal(KEY, (4, 64))
    params = model.init(KEY, x)
    apply = jaxamp.autocast(model.apply, dtype=F16, modules=example.RULES)
    got = dict(example.matmul_dtypes(model, apply, params, x))
    assert got.pop("Classifier/head") == "float32"
    assert set(got.values()) == {"float16"} and len(got) == 4
    # Every LayerNorm (auto-named LayerNorm_0..2) runs in float32: its ops see float32.
    closed = jax.make_jaxpr(apply)(params, x)
    rsqrts = [e for e in _eqns(closed) if e.primitive.name == "rsqrt"]
    assert len(rsqrts) == 3 and all(e.invars[0].aval.dtype == F32 for e in rsqrts)
    assert _rel_err(apply(params, x), model.apply(params, x)) < 1e-2


@pytest.mark.skipif(
    not hasattr(jax, "shard_map"),
    reason="JAX 0.5 writes pmap as xla_pmap, which autocast runs as written (warned)",
)
def test_autocast_of_pmap_enters_it():
    f = jax.pmap(lambda x, w: x @ w)
    x, w = jnp.ones((1, 2, 3)), jnp.ones((1, 3, 3))
    closed = jax.make_jaxpr(jaxamp.autocast(f, dtype=F16))(x, w)
    dots = [e for e in _eqns(closed) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == F16 for e in dots for v in e.invars)


def test_a_librarys_own_accumulation_type_is_not_user_intent():
    """Flax's attention hands jnp.einsum lax.dot_general, and jnp.einsum passes its
    default preferred_element_type on: that is not the user asking for float32
    accumulation, so the attention logits stay in the compute dtype."""
    m = nn.MultiHeadDotProductAttention(num_heads=2)
    x = jnp.ones((2, 8, 16))
    v = m.init(jax.random.key(0), x, x)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(lambda v, x: m.apply(v, x, x), dtype=jnp.bfloat16))(v, x)

    def dots(j):
        for e in j.eqns:
            if e.primitive.name == "dot_general":
                yield e.outvars[0].aval.dtype
            for p in e.params.values():
                sub = getattr(p, "jaxpr", p)
                if hasattr(sub, "eqns"):
                    yield from dots(sub)

    assert set(dots(jaxpr.jaxpr)) == {jnp.dtype(jnp.bfloat16)}
