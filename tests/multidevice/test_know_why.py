"""The per-leaf record and spike decisions agree across 8 devices.

An inf planted in one leaf's gradient on one device only: under pmap, shard_map
and jit over a mesh, every device's record names exactly that leaf, and
``explain`` says so. Per-device losses that differ: the spike rule averages them
over the axis, so every device decides, and remembers, the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.helpers import N_DEV

BAD_DEVICE = 5
RULE = jaxamp.spike_rule(window=4, warmup=2)


def _params():
    # A large leaf and small ones: every leaf's flag comes from the finite check itself
    # (one reduction per leaf, agreed over the devices).
    return {"a": jnp.ones((N_DEV, 2)), "b": jnp.ones(3), "c": jnp.ones((N_DEV * 2560,))}


def _per_device_grads(planted: str | None):
    """Gradients with a leading device axis; ``planted`` is inf on BAD_DEVICE only."""
    g = jax.tree.map(lambda p: jnp.ones((N_DEV, *p.shape)), _params())
    if planted is not None:
        g[planted] = g[planted].at[BAD_DEVICE].set(jnp.inf)
    return g


def _replicate(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N_DEV, *jnp.shape(x))), tree)


def _check(state, params, steps) -> None:
    last = np.asarray(state.nonfinite_leaves.last)
    assert (last == last[0]).all(), "every device holds the same record"
    why = jaxamp.explain(state, params)
    assert why.last == ("b",) and why.counts == {"b": 1, "c": 1}
    spikes = jax.tree.map(np.asarray, state.spikes)
    for leaf in (spikes.losses, spikes.grad_norms, spikes.count, spikes.skipped):
        assert (leaf == leaf[0]).all()
    # Losses per device: 1 + device / 100 (+ 50 on the spike); recorded as their mean
    # over the axis, the spike too.
    mean = 1.0 + np.mean(np.arange(N_DEV)) / 100
    np.testing.assert_allclose(spikes.losses[0][:3], [mean, mean, mean + 50], rtol=1e-6)
    assert int(spikes.count[0]) == 3
    assert [bool(s) for s in steps] == [False, False, False, False, True]


def _plan():
    # (planted leaf, loss bump): c on step 0, b on step 2, a loss spike on step 4.
    return [("c", 0.0), (None, 0.0), ("b", 0.0), (None, 0.0), (None, 50.0)]


def _losses(bump):
    return jnp.float32(1.0 + bump) + jnp.arange(N_DEV, dtype=jnp.float32) / 100


def test_pmap() -> None:
    tx = jaxamp.skip_nonfinite(
        optax.sgd(0.1), jaxamp.dynamic_scale(2.0), axis_name="d", spikes=RULE
    )
    step = jax.pmap(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v), axis_name="d")
    params = _replicate(_params())
    state = _replicate(tx.init(_params()))
    flags = []
    for leaf, bump in _plan():
        params, state = step(_per_device_grads(leaf), state, params, _losses(bump))
        flags.append(np.asarray(state.spikes.skipped)[0])
    _check(state, _params(), flags)


def test_shard_map() -> None:
    # Every device holds its own copy of params and state and its own gradients (as
    # under ZeRO-style sharding, nothing reduced before the step): the verdict, the
    # record and the spike history are agreed over the axis.
    mesh = jax.make_mesh((N_DEV,), ("d",))
    tx = jaxamp.skip_nonfinite(
        optax.sgd(0.1), jaxamp.dynamic_scale(2.0), axis_name="d", spikes=RULE
    )

    def local(g, s, p, v):
        first = lambda t: jax.tree.map(lambda x: x[0], t)
        p, s = jaxamp.step(tx, first(g), first(s), first(p), value=v[0])
        return jax.tree.map(lambda x: x[None], (p, s))

    spec = P("d")
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))
    on_devices = NamedSharding(mesh, spec)
    params, state = jax.device_put(
        (_replicate(_params()), _replicate(tx.init(_params()))), on_devices
    )
    flags = []
    for leaf, bump in _plan():
        g, v = jax.device_put((_per_device_grads(leaf), _losses(bump)), on_devices)
        params, state = step(g, state, params, v)
        flags.append(np.asarray(state.spikes.skipped)[0])
    _check(state, _params(), flags)


def test_jit_over_a_mesh() -> None:
    mesh = jax.make_mesh((N_DEV,), ("d",))
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(2.0), spikes=RULE)
    sharded = NamedSharding(mesh, P("d"))
    step = jax.jit(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v.mean()))
    params = _params()
    state = tx.init(params)
    flags = []
    for leaf, bump in _plan():
        # a and c are sharded over the devices: c's inf lives in one device's shard.
        g = jax.tree.map(jnp.ones_like, _params())
        if leaf == "c":
            g["c"] = g["c"].at[BAD_DEVICE].set(jnp.inf)
        elif leaf == "b":
            g["b"] = g["b"].at[1].set(jnp.inf)
        # b replicated on this mesh: created eagerly, it could otherwise carry the mesh of
        # a cached jit from an earlier test (JAX 0.10 reuses those across meshes).
        g = {
            k: jax.device_put(v, sharded if k != "b" else NamedSharding(mesh, P()))
            for k, v in g.items()
        }
        params, state = step(g, state, params, jax.device_put(_losses(bump), sharded))
        flags.append(np.asarray(state.spikes.skipped))
    _check(
        jax.tree.map(lambda x: np.broadcast_to(x, (N_DEV, *np.shape(x))), state), _params(), flags
    )
    assert jaxamp.explain(state, params).last == ("b",)
