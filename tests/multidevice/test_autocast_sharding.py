"""``jaxamp.autocast`` under every JAX sharding mode, on 8 simulated CPU devices.

Each test runs a function ``f`` in float32 and ``jaxamp.autocast(f, dtype=...)``
(float16 and bfloat16) on the same sharded inputs, and checks that the autocast
outputs are finite, close to float32's, have float32's dtypes, and are laid out
exactly as float32's: the same ``out.sharding`` (and ``.spec``), and on Explicit
meshes the same sharding in the type (``jax.typeof(out).sharding``). It also
checks that autocast actually lowered the matmuls (a ``dot_general`` on
float16 / bfloat16 inputs in the autocast program), so a test cannot pass by
autocast silently running ``f`` as written.

Modes: an Auto mesh with ``jax.jit`` in/out shardings and
``with_sharding_constraint``; an Explicit mesh under ``jax.set_mesh`` with
matmuls, ``einsum(out_sharding=)``, ``reshard``, ``auto_axes`` and
``explicit_axes``; Flax nnx models with sharded parameters and ``out_sharding=``
(the pattern of Flax's nnx gemma example); ``jax.shard_map`` inside ``f`` and
autocast inside a ``shard_map`` body; gradients under an Explicit mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.helpers import dot_input_dtypes

DTYPES = [jnp.float16, jnp.bfloat16]
# Relative to the largest float32 output: bfloat16 keeps 8 mantissa bits.
TOL = {np.dtype(jnp.float16): 1e-2, np.dtype(jnp.bfloat16): 4e-2}


def _auto_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _explicit_mesh(shape=(8,), names=("data",)):
    mesh = jax.make_mesh(shape, names)  # default axis types: Explicit in this JAX
    assert all(t == AxisType.Explicit for t in mesh.axis_types), mesh.axis_types
    return mesh


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _assert_lowered(fn, args, dtype):
    """The autocast program has a dot_general whose inputs are all in `dtype`."""
    dots = dot_input_dtypes(jax.make_jaxpr(fn)(*args))
    want = np.dtype(dtype)
    assert any(all(d == want for d in ins) for ins in dots), (
        f"no dot_general on {want} inputs in the autocast program: {dots}"
    )


def _assert_like_f32(out, ref, dtype, explicit):
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    tol = TOL[np.dtype(dtype)]
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        assert o.shape == r.shape
        on, rn = np.asarray(o, np.float32), np.asarray(r, np.float32)
        assert np.isfinite(on).all()
        scale = max(1.0, float(np.abs(rn).max()))
        np.testing.assert_allclose(on, rn, rtol=tol, atol=tol * scale)
        assert o.sharding.is_equivalent_to(r.sharding, o.ndim), (o.sharding, r.sharding)
        if isinstance(r.sharding, NamedSharding):
            assert isinstance(o.sharding, NamedSharding), o.sharding
            assert o.sharding.spec == r.sharding.spec, (o.sharding.spec, r.sharding.spec)
        if explicit:
            to, tr = jax.typeof(o).sharding, jax.typeof(r).sharding
            assert to.spec == tr.spec, (to, tr)
            assert to.mesh.axis_types == tr.mesh.axis_types, (to.mesh, tr.mesh)


def _check(f, args, dtype, explicit, lowered=True):
    """autocast(f) vs f on `args`: outputs, dtypes, shardings; returns both."""
    ref = f(*args)
    fast = jaxamp.autocast(f, dtype=dtype)
    out = fast(*args)
    _assert_like_f32(out, ref, dtype, explicit)
    if lowered:
        _assert_lowered(fast, args, dtype)
    return out, ref


# --------------------------------------------------------------------------
# 1. Auto mesh: jit in/out shardings, with_sharding_constraint.
# --------------------------------------------------------------------------


def _auto_mlp(mesh):
    def f(x, w1, w2):
        h = jnp.tanh(x @ w1)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
        y = h @ w2 + 1.0
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, "data")))

    return f


def _auto_args(mesh):
    x = jax.device_put(_rand(0, (16, 32)), NamedSharding(mesh, P("data", None)))
    w1 = jax.device_put(_rand(1, (32, 64), 0.2), NamedSharding(mesh, P(None, "data")))
    w2 = jax.device_put(_rand(2, (64, 16), 0.2), NamedSharding(mesh, P()))
    return x, w1, w2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_shardings", [True, False], ids=["out_shardings", "constraint_only"])
def test_auto_mesh_autocast_of_sharded_jit(dtype, out_shardings):
    """autocast(jax.jit(f, in_shardings=..., out_shardings=...)) keeps the layout."""
    mesh = _auto_mesh()
    kw = {"in_shardings": tuple(a.sharding for a in _auto_args(mesh))}
    if out_shardings:
        kw["out_shardings"] = NamedSharding(mesh, P("data", None))
    f = jax.jit(_auto_mlp(mesh), **kw)
    out, ref = _check(f, _auto_args(mesh), dtype, explicit=False)
    want = P("data", None) if out_shardings else P(None, "data")
    assert ref.sharding.spec == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_mesh_sharded_jit_of_autocast(dtype):
    """jax.jit(autocast(f), in_shardings=..., out_shardings=...): the constraints in f hold."""
    mesh = _auto_mesh()
    f = _auto_mlp(mesh)
    kw = {
        "in_shardings": (
            NamedSharding(mesh, P("data", None)),
            NamedSharding(mesh, P(None, "data")),
            None,
        ),
        "out_shardings": NamedSharding(mesh, P(None, "data")),
    }
    args = _auto_args(mesh)
    ref = jax.jit(f, **kw)(*args)
    fast = jax.jit(jaxamp.autocast(f, dtype=dtype), **kw)
    _assert_like_f32(fast(*args), ref, dtype, explicit=False)
    _assert_lowered(fast, args, dtype)
    # The constraints inside f are still in the autocast program.
    text = str(jax.make_jaxpr(fast)(*args))
    assert text.count("sharding_constraint") >= 2, text


# --------------------------------------------------------------------------
# 2. Explicit mesh under jax.set_mesh.
# --------------------------------------------------------------------------


@pytest.fixture
def explicit():
    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(_rand(0, (16, 32)), NamedSharding(mesh, P("data")))
        w1 = jax.device_put(_rand(1, (32, 64), 0.2), NamedSharding(mesh, P()))
        b1 = jax.device_put(jnp.full((64,), 0.1), NamedSharding(mesh, P()))
        w2 = jax.device_put(_rand(2, (64, 16), 0.2), NamedSharding(mesh, P()))
        yield mesh, (x, w1, b1, w2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_mlp(explicit, dtype):
    _, args = explicit

    def f(x, w1, b1, w2):
        h = jax.nn.gelu(x @ w1 + b1)
        return h @ w2

    out, ref = _check(f, args, dtype, explicit=True)
    assert jax.typeof(ref).sharding.spec == P("data", None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_einsum_out_sharding(explicit, dtype):
    _, args = explicit

    def f(x, w1, b1, w2):
        h = jnp.einsum("bi,ij->bj", x, w1, out_sharding=P("data", None)) + b1
        h = jax.nn.relu(h)
        return jnp.einsum("bj,jk->bk", h, w2, out_sharding=P("data", None))

    _check(f, args, dtype, explicit=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_reshard(explicit, dtype):
    _, args = explicit

    def f(x, w1, b1, w2):
        h = jnp.tanh(x @ w1 + b1)
        h = jax.sharding.reshard(h, P(None, "data"))  # batch replicated, features split
        return jax.sharding.reshard(h @ w2, P(None, "data"))

    out, ref = _check(f, args, dtype, explicit=True)
    assert jax.typeof(ref).sharding.spec == P(None, "data")


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_auto_axes(explicit, dtype):
    """A region under auto_axes: its ops are typed on an Auto mesh inside an Explicit one."""
    _, args = explicit

    def f(x, w1, b1, w2):
        @functools.partial(jax.sharding.auto_axes, out_sharding=P("data", None))
        def hidden(x, w1, b1):
            h = x @ w1 + b1
            return jnp.where(h < 0.0, 0.1 * h, h)  # a comparison (`lt`) in the Auto region

        return hidden(x, w1, b1) @ w2

    _check(f, args, dtype, explicit=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_axes_inside_auto_axes(explicit, dtype):
    """explicit_axes nested in auto_axes, as a model mixing the two modes does."""
    _, args = explicit

    def f(x, w1, b1, w2):
        @functools.partial(jax.sharding.explicit_axes, in_sharding=(P("data"), P()))
        def layer(h, w):
            return jnp.tanh(h @ w)

        @functools.partial(jax.sharding.auto_axes, out_sharding=P("data", None))
        def body(x, w1, b1, w2):
            h = jax.lax.with_sharding_constraint(x @ w1 + b1, P("data", None))
            return layer(h, w2)

        return body(x, w1, b1, w2)

    _check(f, args, dtype, explicit=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_axes_on_auto_mesh(dtype):
    """explicit_axes inside f on a mesh whose axes are Auto (set with jax.set_mesh)."""
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(_rand(0, (16, 32)), NamedSharding(mesh, P("data")))
        w = jax.device_put(_rand(1, (32, 16), 0.2), NamedSharding(mesh, P()))

        def f(x, w):
            @functools.partial(jax.sharding.explicit_axes, in_sharding=(P("data"), P()))
            def layer(x, w):
                h = x @ w
                assert jax.typeof(h).sharding.spec == P("data", None)
                return jax.nn.silu(h)

            return layer(x, w) * 2.0

        f = jax.jit(f)
        _check(f, (x, w), dtype, explicit=False)


# --------------------------------------------------------------------------
# 3. Flax nnx on an Explicit mesh (Flax's nnx gemma example's pattern).
# --------------------------------------------------------------------------


class _ShardedLM(nnx.Module):
    """Embed -> MLP -> logits, parameters sharded over ('fsdp', 'tensor')."""

    def __init__(self, *, embed_out_sharding: bool, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.5)
        self.embed_out_sharding = embed_out_sharding
        self.embed = nnx.Embed(
            64, 32, embedding_init=nnx.with_partitioning(init, ("tensor", "fsdp")), rngs=rngs
        )
        self.up = nnx.Linear(
            32,
            64,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", "tensor")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("tensor",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            64,
            32,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("tensor", "fsdp")),
            rngs=rngs,
        )
        self.norm = nnx.RMSNorm(32, rngs=rngs)

    def __call__(self, ids):
        if self.embed_out_sharding:
            x = self.embed(ids, out_sharding=P("fsdp", None, None))
        else:  # a one-hot matmul: no auto_axes region in the program
            one_hot = jax.nn.one_hot(ids, 64)
            x = jnp.einsum(
                "btv,vd->btd",
                one_hot,
                self.embed.embedding[...],
                out_sharding=P("fsdp", None, None),
            )
        h = self.up(x, out_sharding=P("fsdp", None, "tensor"))
        h = jax.nn.gelu(h)
        x = x + self.down(h, out_sharding=P("fsdp", None, None))
        x = self.norm(x)
        return self.embed.attend(x, out_sharding=P("fsdp", None, "tensor"))


@pytest.fixture
def gemma_mesh():
    mesh = _explicit_mesh((2, 4), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):
        ids = jax.random.randint(jax.random.key(3), (4, 8), 0, 64)
        ids = jax.device_put(ids, NamedSharding(mesh, P("fsdp", None)))
        yield mesh, ids


def _nnx_forward(model, ids):
    return model(ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("embed_out_sharding", [True, False], ids=["embed_auto_axes", "one_hot"])
def test_nnx_sharded_lm(gemma_mesh, dtype, embed_out_sharding):
    """nnx.Embed(...)(ids, out_sharding=) runs its lookup under auto_axes (the 0.2 failure)."""
    _, ids = gemma_mesh
    model = _ShardedLM(embed_out_sharding=embed_out_sharding, rngs=nnx.Rngs(0))
    assert jax.typeof(model.up.kernel[...]).sharding.spec == P("fsdp", "tensor")
    assert jax.typeof(model.embed.embedding[...]).sharding.spec == P("tensor", "fsdp")
    out, ref = _check(_nnx_forward, (model, ids), dtype, explicit=True)
    assert jax.typeof(ref).sharding.spec == P("fsdp", None, "tensor")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_sharded_lm_bound_method(gemma_mesh, dtype):
    """autocast(model) (a module as f) under nnx.jit, as a train step calls it."""
    _, ids = gemma_mesh
    model = _ShardedLM(embed_out_sharding=True, rngs=nnx.Rngs(0))
    ref = nnx.jit(lambda m, i: m(i))(model, ids)
    out = nnx.jit(lambda m, i: jaxamp.autocast(m, dtype=dtype)(i))(model, ids)
    _assert_like_f32(out, ref, dtype, explicit=True)


# --------------------------------------------------------------------------
# 4. shard_map.
# --------------------------------------------------------------------------


def _local_mlp(x, w1, w2):
    h = jnp.tanh(x @ w1)
    return jax.lax.psum(h @ w2, "data")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_shard_map_inside_f(dtype, mode):
    mesh = _auto_mesh() if mode == "auto" else _explicit_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(_rand(0, (16, 32)), NamedSharding(mesh, P("data")))
        w1 = jax.device_put(_rand(1, (32, 64), 0.2), NamedSharding(mesh, P()))
        w2 = jax.device_put(_rand(2, (64, 8), 0.2), NamedSharding(mesh, P()))

        def f(x, w1, w2):
            y = jax.shard_map(_local_mlp, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P())(
                x, w1, w2
            )
            return y / 16.0

        out, ref = _check(jax.jit(f), (x, w1, w2), dtype, explicit=mode == "explicit")
        np.testing.assert_allclose(
            np.asarray(ref), np.asarray(_local_mlp_global(x, w1, w2)) / 16.0, rtol=1e-5, atol=1e-5
        )


def _local_mlp_global(x, w1, w2):
    h = jnp.tanh(np.asarray(x) @ np.asarray(w1))
    return (h @ np.asarray(w2)).reshape(8, 2, -1).sum(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_autocast_inside_shard_map_body(dtype, mode):
    mesh = _auto_mesh() if mode == "auto" else _explicit_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(_rand(0, (16, 32)), NamedSharding(mesh, P("data")))
        w1 = jax.device_put(_rand(1, (32, 64), 0.2), NamedSharding(mesh, P()))
        w2 = jax.device_put(_rand(2, (64, 8), 0.2), NamedSharding(mesh, P()))

        def outer(body):
            return jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P())
            )

        ref = outer(_local_mlp)(x, w1, w2)
        fast = outer(jaxamp.autocast(_local_mlp, dtype=dtype))
        out = fast(x, w1, w2)
        _assert_like_f32(out, ref, dtype, explicit=mode == "explicit")
        _assert_lowered(fast, (x, w1, w2), dtype)


# --------------------------------------------------------------------------
# 5. Gradients under an Explicit mesh.
# --------------------------------------------------------------------------


@pytest.fixture
def fsdp():
    mesh = _explicit_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        params = {
            "w1": jax.device_put(_rand(1, (32, 64), 0.2), NamedSharding(mesh, P(None, "model"))),
            "b1": jax.device_put(jnp.zeros((64,)), NamedSharding(mesh, P("model"))),
            "w2": jax.device_put(_rand(2, (64, 8), 0.2), NamedSharding(mesh, P("model", None))),
        }
        x = jax.device_put(_rand(0, (16, 32)), NamedSharding(mesh, P("data")))
        y = jax.device_put(_rand(4, (16, 8)), NamedSharding(mesh, P("data")))
        yield mesh, params, x, y


def _mse(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    out = jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=P("data", None))
    return jnp.mean((out - y) ** 2)


def _mse_auto_axes(params, x, y):
    h = jax.sharding.auto_axes(lambda a, w: a @ w, out_sharding=P("data", "model"))(x, params["w1"])
    h = jax.nn.relu(h + params["b1"])
    out = jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=P("data", None))
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss", [_mse, _mse_auto_axes], ids=["einsum", "auto_axes"])
def test_value_and_grad_explicit_mesh(fsdp, dtype, loss):
    _, params, x, y = fsdp
    vg = jax.jit(jax.value_and_grad(loss))
    ref = vg(params, x, y)
    fast = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, dtype=dtype)))
    out = fast(params, x, y)
    _assert_like_f32(out, ref, dtype, explicit=True)
    # The gradients are laid out as the parameters are (and as float32's).
    for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(params), strict=True):
        assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec
    _assert_lowered(fast, (params, x, y), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_value_and_grad_explicit_mesh(gemma_mesh, dtype):
    """nnx.value_and_grad of an autocast loss on the sharded nnx LM."""
    _, ids = gemma_mesh
    model = _ShardedLM(embed_out_sharding=False, rngs=nnx.Rngs(0))

    def loss(m, ids):
        logits = m(ids)
        return -jnp.mean(jax.nn.log_softmax(logits))

    def step(fn):
        return nnx.jit(lambda m, ids: nnx.value_and_grad(fn)(m, ids))

    ref_l, ref_g = step(loss)(model, ids)
    out_l, out_g = step(jaxamp.autocast(loss, dtype=dtype))(model, ids)
    _assert_like_f32(out_l, ref_l, dtype, explicit=True)
    _assert_like_f32(nnx.to_pure_dict(out_g), nnx.to_pure_dict(ref_g), dtype, explicit=True)
