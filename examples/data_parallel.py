"""Data-parallel mixed-precision training with jaxamp, two ways.

1. ``jax.shard_map`` (per-device code, explicit ``pmean``): give
   ``skip_nonfinite`` the ``axis_name``, so that a non-finite gradient on *any*
   device skips the step on *every* device and the loss-scale state stays
   identical everywhere.
2. ``jax.jit`` over a ``Mesh`` (global arrays, sharded batch; params replicated
   or FSDP-sharded): no ``axis_name``; the finiteness check of a sharded array is
   a global reduction that XLA compiles.

At step 3 one device's gradients get an inf; every device skips that step.
Runs on any number of devices; on CPU it asks XLA for 8 simulated ones.
``tests/repo/test_examples.py`` checks all three runs against single-device plain optax
on the whole batch that leaves step 3 out (to float32 rounding: the per-device
means are summed in another order than the whole batch's mean).

    python examples/data_parallel.py
"""

from __future__ import annotations

import os

# Must happen before JAX starts: simulate 8 CPU devices (no effect on GPUs/TPUs).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402

N = jax.device_count()
BATCH, STEPS, BAD_STEP, BAD_DEVICE = 8 * N, 6, 3, N - 1
# Auto axes: XLA propagates shardings (jaxamp works the same with AxisType.Explicit).
mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(16, 8 * N)) / 4, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8 * N, 1)) / np.sqrt(8 * N), jnp.float32),
    }


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(STEPS, BATCH, 16)).astype(np.float32)
    return x, np.sin(x.sum(-1, keepdims=True))


def make_tx(axis_name=None):
    return jaxamp.skip_nonfinite(
        optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**10), axis_name=axis_name
    )


def shard_map_training():
    """Trains STEPS steps with shard_map; returns the final params."""
    tx = make_tx(axis_name="data")

    def step(params, opt_state, x, y, bad):
        _, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)
        grads = jax.lax.pmean(grads, "data")
        # Simulate a fault on one device only (its copy of the reduced gradients).
        hit = bad & (jax.lax.axis_index("data") == BAD_DEVICE)
        grads = dict(grads, w1=jnp.where(hit, jnp.inf, grads["w1"]))
        return jaxamp.step(tx, grads, opt_state, params)

    # check_vma=False: params are replicated (P()) although the fault makes one
    # device's gradients differ; the agreed check keeps every replica identical.
    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data"), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    params = init_params()
    opt_state = tx.init(params)
    xs, ys = data()
    for i in range(STEPS):
        params, opt_state = step(params, opt_state, xs[i], ys[i], jnp.array(i == BAD_STEP))
        m = jaxamp.metrics(opt_state)
        skipped, scale = int(m["skipped_steps"]), float(m["loss_scale"])
        print(f"  shard_map step {i}: skipped={skipped} scale={scale:g}")
    assert int(jaxamp.metrics(opt_state)["skipped_steps"]) == 1
    return params


def mesh_jit_training(fsdp: bool):
    """Trains STEPS steps with jit over the mesh; returns the final params."""
    tx = make_tx()  # no axis_name under jit

    @jax.jit
    def step(params, opt_state, x, y, bad):
        row = BAD_DEVICE * (BATCH // N)  # the first row of the last device's shard
        x = x.at[row, 0].set(jnp.where(bad, jnp.inf, x[row, 0]))
        _, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)
        return jaxamp.step(tx, grads, opt_state, params)

    with jax.set_mesh(mesh):
        spec = P("data") if fsdp else P()  # FSDP: split each weight's first dimension
        params = jax.device_put(init_params(), NamedSharding(mesh, spec))
        opt_state = tx.init(params)  # zeros_like keeps the params' sharding
        xs, ys = data()
        for i in range(STEPS):
            x = jax.device_put(xs[i], NamedSharding(mesh, P("data")))
            y = jax.device_put(ys[i], NamedSharding(mesh, P("data")))
            params, opt_state = step(params, opt_state, x, y, jnp.array(i == BAD_STEP))
        ls = jaxamp.get_loss_scale(opt_state)
        # The loss-scale state is replicated: one identical copy on every device.
        copies = {float(s.data) for s in ls.scale.addressable_shards}
        print(
            f"  jit over a mesh ({'FSDP' if fsdp else 'replicated params'}): "
            f"skipped={int(ls.skipped_steps)}, scale on every device={copies}, "
            f"w1 sharding={params['w1'].sharding.spec}"
        )
        assert int(ls.skipped_steps) == 1 and len(copies) == 1
    return params


if __name__ == "__main__":
    print(f"{N} devices: {jax.devices()[0].platform}")
    shard_map_training()
    mesh_jit_training(fsdp=False)
    mesh_jit_training(fsdp=True)
