"""The conformance checks (tests/conformance/harness.py) under an Explicit 8-device mesh.

Two third-party-layer models with their own sharding annotations:

* ``flax-linen-transformer@data``: flax linen's attention transformer, the batch
  (8 rows) sharded along 'data', params replicated;
* ``flax-nnx-attention@tensor``: nnx ``MultiHeadAttention`` / ``Linear`` with
  ``kernel_init=nnx.with_partitioning(...)``: heads and the MLP hidden dim split
  over 'data' (tensor parallel), ``out_sharding=`` where a sharded dim is
  contracted, batch replicated.

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


def _linen_data_parallel(mesh: jax.sharding.Mesh) -> models.Built:
    built = harness.build("flax-linen-transformer")
    batch = {k: jnp.concatenate([v, v]) for k, v in built.batch.items()}  # 8 rows
    return dataclasses.replace(
        built,
        params=_put(built.params, P(), mesh),
        batch=_put(batch, P("data"), mesh),
        hand=None,
    )


def _nnx_tensor_parallel(mesh: jax.sharding.Mesh) -> models.Built:
    from flax import nnx

    built = models.nnx_attention_lm(sharded=True)
    specs = nnx.get_partition_spec(built.params)
    params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), built.params, specs
    )
    return dataclasses.replace(built, params=params, batch=_put(built.batch, P(), mesh), hand=None)


MESH_MODELS = {
    "flax-linen-transformer@data": _linen_data_parallel,
    "flax-nnx-attention@tensor": _nnx_tensor_parallel,
}


@pytest.mark.parametrize("dtype", sorted(harness.DTYPES))
@pytest.mark.parametrize("name", list(MESH_MODELS))
def test_conformance_explicit_mesh(name: str, dtype: str) -> None:
    mesh = _mesh()
    with jax.set_mesh(mesh):
        row = harness.evaluate(name, dtype, built=MESH_MODELS[name](mesh), measure=False)
    harness.check(row)
