"""jaxamp.nnx.Optimizer on an Explicit 8-device mesh with nnx sharding metadata.

The model's params carry ``nnx.with_partitioning`` annotations over a
``jax.make_mesh`` (Explicit axes) set with ``jax.set_mesh``, as in Flax's nnx
gemma trainer. One inf planted in the shard of one device skips the step on
every device; params, optimizer state and BatchStat keep their values and their
shardings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp


class _Sharded(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        lecun = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16, 32, kernel_init=nnx.with_partitioning(lecun, ("fsdp", "tensor")), rngs=rngs
        )
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.down = nnx.Linear(
            32, 4, kernel_init=nnx.with_partitioning(lecun, ("tensor", "fsdp")), rngs=rngs
        )

    def __call__(self, x):
        h = self.up(x, out_sharding=P("fsdp", "tensor"))
        return self.down(nnx.relu(self.bn(h)), out_sharding=P("fsdp", None))


def _host(tree):
    return jax.tree.map(np.asarray, nnx.state(tree))


def test_one_inf_on_one_device_skips_on_all_and_keeps_shardings() -> None:
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    with jax.set_mesh(mesh):
        model = _Sharded(nnx.Rngs(0))
        tx = jaxamp.skip_nonfinite(optax.adamw(1e-2), jaxamp.dynamic_scale(2.0**10))
        optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (8, 16)), NamedSharding(mesh, P("fsdp", None))
        )

        @nnx.jit
        def step(model, optimizer, x, poison):
            def loss_fn(m):
                return jnp.mean(jaxamp.autocast(m, dtype=jnp.float16)(x) ** 2)

            loss, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model)
            # kernel[0, 0] lives on one device only (sharded over both axes)
            k = grads["up"]["kernel"]
            bump = jnp.where(poison, jnp.inf, 0.0)
            k[...] = k[...].at[0, 0].add(bump, out_sharding=P("fsdp", "tensor"))
            optimizer.update(model, grads)
            return jaxamp.metrics(optimizer.opt_state)

        kernel = model.up.kernel[...]
        owners = [s.device for s in kernel.addressable_shards if s.index[0].start in (0, None)
                  and s.index[1].start in (0, None)]  # fmt: skip
        assert len(owners) == 1, owners  # the poisoned element has one owner
        step(model, optimizer, x, jnp.array(False))
        before = (_host(model), _host(optimizer)["opt_state"]["inner_state"])
        m = step(model, optimizer, x, jnp.array(True))
        assert bool(m["skipped"])
        after = (_host(model), _host(optimizer)["opt_state"]["inner_state"])
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))
        assert int(optimizer.step) == 1
        assert jax.typeof(model.up.kernel[...]).sharding.spec == P("fsdp", "tensor")
        assert jax.typeof(model.down.kernel[...]).sharding.spec == P("tensor", "fsdp")
        mu = optimizer.opt_state.inner_state[0].mu["up"]["kernel"][...]
        assert jax.typeof(mu).sharding.spec == P("fsdp", "tensor")
        jaxamp.check_in_sync(optimizer.loss_scale)
        m = step(model, optimizer, x, jnp.array(False))
        assert not bool(m["skipped"]) and int(optimizer.step) == 2
