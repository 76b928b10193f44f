"""``jaxamp.audit`` of a step partitioned over a 2x4 mesh (issue 46, item 2).

XLA's partitioner gives each device a shard of every product, so the compiled
program's products have other shapes than the ones autocast asked for. The
audit of a sharded FP8 training step must still give each product its request:
the same rows (pass, module, request, line, flags) as the audit of the step on
one device, each row's shape a shard of the shape of the one-device product
with its request (a layer's input gradient is not given its weight gradient's
request, which has the same module and line). An nnx model stepped by
``nnx.jit`` on an Explicit mesh has its modules' paths and autocast's choices.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp.casting._audit._audit import MatmulRow
from tests.casting.test_audit import BF16, _setup


def _step():
    model, params, x = _setup()  # a linen MLP: 32 -> 48 -> 64 -> 80 -> 16, batch 32
    fwd = jaxamp.autocast(model.apply, dtype=BF16, fp8=jaxamp.fp8())

    def loss(params, x):
        return jnp.mean(fwd(params, x).astype(jnp.float32) ** 2)

    return jax.grad(loss), params, x


def _what(r: MatmulRow) -> tuple[str, ...]:
    return (r.pass_, r.module, r.requested, r.source, *r.flags)


@functools.cache
def _one_device() -> jaxamp.types.AuditReport:
    step, params, x = _step()
    return jaxamp.audit(jax.jit(step))(params, x)


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(int(d) for d in shape.partition("[")[2].rstrip("]").split(","))


def _sharded(how: str) -> jaxamp.types.AuditReport:
    step, params, x = _step()
    kind = AxisType.Explicit if how == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
    if how == "explicit":  # data parallel: the batch over both axes, as the types say
        with jax.set_mesh(mesh):
            x = jax.device_put(x, P(("data", "model"), None))
            params = jax.device_put(params, P())
            return jaxamp.audit(jax.jit(step))(params, x)
    # Auto: kernels split by output features over "model", the batch over "data"
    specs = jax.tree.map(lambda p: P(None, "model") if p.ndim == 2 else P(), params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    batch = NamedSharding(mesh, P("data", None))
    if how == "in_shardings":
        return jaxamp.audit(jax.jit(step, in_shardings=(shardings, batch)))(params, x)
    params, x = jax.device_put(params, shardings), jax.device_put(x, batch)
    return jaxamp.audit(jax.jit(step))(params, x)


@pytest.mark.parametrize("how", ["in_shardings", "committed", "explicit"])
def test_a_sharded_fp8_step_shows_each_product_with_its_request(how):
    got, ref = _sharded(how), _one_device()
    assert [r for r in got.matmuls if r.requested == "?"] == []
    assert collections.Counter(map(_what, got.matmuls)) == collections.Counter(
        map(_what, ref.matmuls)
    )
    fp8 = [r for r in got.matmuls if r.requested.startswith("f8")]
    assert len(fp8) == 6 and all("FP8 requested" in " ".join(r.flags) for r in fp8)
    shards = 0
    for r in got.matmuls:
        same = [_dims(o.shape) for o in ref.matmuls if _what(o) == _what(r)]
        dims = _dims(r.shape)
        assert any(all(g % d == 0 for g, d in zip(w, dims, strict=True)) for w in same), r
        shards += dims not in same
    assert shards > 0  # partitioned: some products run on a shard


def test_an_nnx_step_on_an_explicit_mesh_names_its_modules_and_requests():
    # nnx.jit of a model built with nnx.with_partitioning on an Explicit mesh, as
    # in Flax's nnx trainers: each product has its module's path and the dtype
    # autocast chose for it (report.ops, before XLA): up in FP8, down in bfloat16
    # (N = 4 is not a multiple of 16).
    from flax import nnx

    from tests.multidevice.test_nnx_mesh import _Sharded

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    fp8 = jaxamp.fp8(first_last_bf16=False)

    @nnx.jit
    def step(model, x):
        def loss(model):
            return jnp.mean(jaxamp.autocast(model, dtype=BF16, fp8=fp8)(x).astype(jnp.float32) ** 2)

        return nnx.grad(loss)(model)

    with jax.set_mesh(mesh):
        model = _Sharded(nnx.Rngs(0))
        report = jaxamp.audit(step)(model, jax.device_put(jnp.ones((32, 16)), P("fsdp", None)))
    chose = {r.module: r.dtype for r in report.ops if r.primitive == "dot_general"}
    assert chose == {"up": "float8_e4m3fn", "down": "bfloat16"}
    assert sorted((r.module, r.pass_) for r in report.matmuls) == [
        ("down", "backward"), ("down", "backward"), ("down", "forward"),
        ("up", "backward"), ("up", "forward"),
    ]  # fmt: skip
    for r in report.matmuls:
        want = "f8" if chose[r.module] == "float8_e4m3fn" else "bf16 x bf16"
        assert r.requested.startswith(want), r
