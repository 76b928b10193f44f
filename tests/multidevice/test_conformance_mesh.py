"""The conformance checks (tests/conformance/harness.py) under an Explicit 8-device mesh.

One model, two shardings, each with flax nnx's own sharding annotations:

* ``flax-nnx-attention@data``: nnx ``Embed`` / ``MultiHeadAttention``, batch
  sharded along 'data' (the embedding lookup with ``out_sharding=``);
* ``flax-nnx-attention@tensor``: the same model with
  ``kernel_init=nnx.with_partitioning(...)``: heads and the MLP hidden dim split
  over 'data' (tensor parallel), ``out_sharding=`` where a sharded dim is
  contracted, batch replicated.

Not here, because they fail under an Explicit mesh in float32 already, without
jaxamp: flax linen's ``nn.Embed`` (and so the linen LM and transformers' text
models) cannot look up batch-sharded ids (its gather takes no
``out_sharding``); transformers' FlaxViT concatenates a replicated CLS token
with batch-sharded patches ("All operands should have the same sharding").

Forward, gradient and training checks as on one device, float32 reference run
under the same mesh. The hand-cast comparison is the single-device tests' job.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.conformance import harness, models


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _put(tree: object, spec: P, mesh: jax.sharding.Mesh) -> object:
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


def _data_parallel(built: models.Built, mesh: jax.sharding.Mesh) -> models.Built:
    batch = {k: jnp.concatenate([v, v]) for k, v in built.batch.items()}  # 8 rows
    return dataclasses.replace(
        built,
        params=_put(built.params, P(), mesh),
        batch=_put(batch, P("data"), mesh),
        hand=None,
    )


def _nnx_tensor_parallel(mesh: jax.sharding.Mesh) -> models.Built:
    from flax import nnx

    built = models.nnx_attention_lm(parallel="tensor")
    specs = nnx.get_partition_spec(built.params)
    params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), built.params, specs
    )
    return dataclasses.replace(built, params=params, batch=_put(built.batch, P(), mesh), hand=None)


MESH_MODELS = {
    "flax-nnx-attention@data": lambda mesh: _data_parallel(
        models.nnx_attention_lm(parallel="data"), mesh
    ),
    "flax-nnx-attention@tensor": _nnx_tensor_parallel,
}


# CI's budget: each sharding in one dtype, each dtype once (make conformance: all four).
CI_ROWS = {("flax-nnx-attention@data", "float16"), ("flax-nnx-attention@tensor", "bfloat16")}


@pytest.mark.parametrize("dtype", sorted(harness.DTYPES))
@pytest.mark.parametrize("name", list(MESH_MODELS))
def test_conformance_explicit_mesh(name: str, dtype: str) -> None:
    if not harness.FULL and (name, dtype) not in CI_ROWS:
        pytest.skip(f"{name} in {dtype}: full suite only (make conformance)")
    mesh = _mesh()
    with jax.set_mesh(mesh):
        row = harness.evaluate(name, dtype, built=MESH_MODELS[name](mesh), measure=False)
    harness.check(row)
