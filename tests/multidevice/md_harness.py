"""Shared parts of the multi-device tests: a small MLP, its data, faults and train steps.

Also imported by ``resume_worker.py``, which runs in a fresh process, so all data
comes from seeded numpy (identical in every process).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import jaxamp

N_DEV = 8
IN, HIDDEN, OUT = 16, 64, 8  # every dimension divides by 8 and by 4: FSDP-shardable
BATCH = 64  # global batch
NO_FAULT = -1


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }


def batches(n_steps: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_steps, BATCH, IN)).astype(np.float32)
    w = rng.normal(size=(IN, OUT)).astype(np.float32)
    return x, np.tanh(x @ w).astype(np.float32)


def make_tx(axis_name: Any = None) -> optax.GradientTransformation:
    return jaxamp.skip_nonfinite(
        optax.adam(1e-2),
        jaxamp.dynamic_scale(init_scale=2.0**8, growth_interval=3, hysteresis=2),
        axis_name=axis_name,
    )


def _gathered(params: Any) -> Any:
    """Under a mesh with Explicit axes, FSDP-sharded weights are all-gathered by hand."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return params
    return jax.tree.map(lambda a: jax.sharding.reshard(a, PartitionSpec()), params)


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    params = _gathered(params)
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def _unchanged(old: Any, new: Any) -> jax.Array:
    same = jax.tree.map(lambda a, b: jnp.all(a == b), old, new)
    return jnp.all(jnp.stack(jax.tree.leaves(same)))


def global_step(tx, params, opt_state, x, y, fault):
    """One step on global (possibly sharded) arrays: single device, or jit over a Mesh.

    ``fault["x_row"]`` puts an inf into that example of the batch (under a mesh, the
    shard of the device that holds it); ``fault["w1_row"]`` puts one into that row
    of ``grads["w1"]`` (under FSDP, in the shard of one device). -1: no fault.
    """
    rows = jnp.arange(BATCH)[:, None]
    x = jnp.where((rows == fault["x_row"]) & (jnp.arange(IN) == 0), jnp.inf, x)
    ls = jaxamp.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: jaxamp.scale(ls, loss_fn(p, x, y)))(params)
    w1_hit = (jnp.arange(IN)[:, None] == fault["w1_row"]) & (jnp.arange(HIDDEN) == 0)
    grads = dict(grads, w1=jnp.where(w1_hit, jnp.inf, grads["w1"]))
    new_params, new_state = jaxamp.step(tx, grads, opt_state, params)
    return new_params, new_state, _unchanged(params, new_params)


def replica_step(tx, params, opt_state, x, y, bad_device, *, axis: str):
    """One data-parallel step on one replica (inside ``pmap`` / ``shard_map``).

    Gradients are averaged over ``axis``; then the replica whose index is
    ``bad_device`` corrupts its own copy (an inf in ``w1[0, 0]``), as a faulty device
    or a bad reduction would. Only the agreed check (``axis_name``) makes every
    replica skip.
    """
    ls = jaxamp.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: jaxamp.scale(ls, loss_fn(p, x, y)))(params)
    grads = lax.pmean(grads, axis)
    hit = lax.axis_index(axis) == bad_device
    w1_hit = hit & (jnp.arange(IN)[:, None] == 0) & (jnp.arange(HIDDEN) == 0)
    grads = dict(grads, w1=jnp.where(w1_hit, jnp.inf, grads["w1"]))
    new_params, new_state = jaxamp.step(tx, grads, opt_state, params)
    return new_params, new_state, _unchanged(params, new_params)


# The resumed runs (test_resume.py, resume_worker.py): faults at 3, then 6 and 7 in a
# row (hysteresis 2: the second backs off). Checkpoints after 2 steps (growth_tracker
# 2) and after 7 steps (mid-hysteresis: hysteresis_tracker 1, nonfinite_streak 1).
RESUME_STEPS = 10
RESUME_FAULTS = (3, 6, 7)
RESUME_SAVES = (2, 7)


def resume_fault(i: int) -> dict[str, np.ndarray]:
    """The fault of step ``i``: an inf in row 11 of grads["w1"], which one device owns."""
    return {"x_row": np.int32(NO_FAULT), "w1_row": np.int32(11 if i in RESUME_FAULTS else -1)}


def fsdp_shardings(mesh: jax.sharding.Mesh, tree: Any) -> Any:
    """FSDP layout: every array's first dimension split over "data"; scalars replicated.

    So are arrays whose first dimension does not divide over the mesh: jaxamp's own
    bookkeeping vectors (one entry per gradient leaf, a spike history), as a user's
    rule "shard what divides, replicate the rest" would place them.
    """
    size = mesh.shape["data"]

    def spec(a: Any) -> PartitionSpec:
        shape = np.shape(a)
        return PartitionSpec("data") if shape and shape[0] % size == 0 else PartitionSpec()

    return jax.tree.map(lambda a: NamedSharding(mesh, spec(a)), tree)


def fsdp_init(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh) -> Any:
    """``tx.init`` with the moments sharded like the params (not left to propagation)."""
    shardings = fsdp_shardings(mesh, jax.eval_shape(tx.init, params))
    return jax.jit(tx.init, out_shardings=shardings)(params)


def leaves_np(tree: Any) -> list[np.ndarray]:
    """Every leaf as a numpy array (gathered from all its shards)."""
    return [np.asarray(jax.device_get(a)) for a in jax.tree.leaves(tree)]
