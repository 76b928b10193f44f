"""Every device makes the same decision, whatever reaches the tx per device.

With ``axis_name``, a tx agrees its verdict across the mapped axis. Two verdicts
used to be per device: a ``finite=`` given to ``jaxamp.step`` (the PyTorch
``unscale_`` recipe: each device checks its own gradients), and the mid-window
verdict of ``every_k`` (read off each device's own sum), which decides whether
model state is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

N = 8


def _stack(tree):
    return jax.tree.map(lambda a: jnp.stack([a] * N), tree)


def test_a_finite_computed_per_device_is_agreed_by_the_tx() -> None:
    # Before: device 2 skipped alone and waited in its skip branch's collective for
    # devices that never reached it; XLA aborted the process.
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(4.0), axis_name="d")
    params = {"w": jnp.ones(3)}
    state, p = _stack(tx.init(params)), _stack(params)

    @functools.partial(jax.pmap, axis_name="d")
    def step(g, state, p):
        g, finite = jaxamp.unscale_and_check(jaxamp.get_loss_scale(state), g)
        g = jax.tree.map(lambda x: jnp.clip(x, -1.0, 1.0), g)
        return jaxamp.step(tx, g, state, p, finite=finite)

    g = {"w": (jnp.ones((N, 3)) * 4.0).at[2, 0].set(jnp.inf)}
    p, state = step(g, state, p)
    assert not np.asarray(jax.vmap(jaxamp.stepped)(state)).any()
    np.testing.assert_array_equal(np.asarray(p["w"]), np.ones((N, 3)))
    np.testing.assert_array_equal(np.asarray(jaxamp.get_loss_scale(state).scale), [2.0] * N)
    p, state = step({"w": jnp.ones((N, 3)) * 2.0}, state, p)  # finite: all step alike
    np.testing.assert_allclose(np.asarray(p["w"]), np.full((N, 3), 0.9), rtol=1e-6)


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_every_k_mid_window_overflow_on_one_device_writes_no_replica(mapping: str) -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(4.0), every_k=2, axis_name="b")
    params = {"w": jnp.ones(3)}
    state, p = _stack(tx.init(params)), _stack(params)
    stats = jnp.zeros((N, 3))

    def call(g, state, p, stats):
        new_p, new_state = jaxamp.step(tx, g, state, p)
        # A synced statistic (BatchNorm(axis_name=...)) of this micro-batch.
        fresh = jax.lax.pmean(g["w"], "b")
        return new_p, new_state, jaxamp.where_stepped(new_state, fresh, stats)

    if mapping == "pmap":
        run = jax.pmap(call, axis_name="b")
    else:
        mesh = jax.make_mesh((N,), ("b",))
        spec = P("b")

        def local(g, state, p, stats):
            squeeze = lambda t: jax.tree.map(lambda a: a[0], t)
            out = call(squeeze(g), squeeze(state), squeeze(p), stats[0])
            return jax.tree.map(lambda a: a[None], out)

        mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))
        place = functools.partial(jax.device_put, device=NamedSharding(mesh, spec))
        run = lambda *args: mapped(*jax.tree.map(place, args))
    ok = {"w": jnp.ones((N, 3))}
    p, state, stats = run(ok, state, p, stats)  # window 1, call 1
    p, state, stats = run(ok, state, p, stats)  # window 1 applied
    bad = {"w": ok["w"].at[3, 0].set(jnp.inf)}  # device 3 overflows, mid-window
    p, state, stats = run(bad, state, p, stats)
    assert not np.asarray(jax.vmap(jaxamp.stepped)(state)).any()
    np.testing.assert_array_equal(np.asarray(stats), np.ones((N, 3)))  # no replica wrote
    p, state, stats = run(ok, state, p, stats)  # the window ends skipped everywhere
    assert not np.asarray(jax.vmap(jaxamp.stepped)(state)).any()
    np.testing.assert_array_equal(np.asarray(stats), np.ones((N, 3)))
    assert np.isfinite(np.asarray(p["w"])).all()
    assert (np.asarray(p["w"]) == np.asarray(p["w"])[0]).all()
    p, state, stats = run(ok, state, p, stats)  # a finite window: every replica writes
    assert np.asarray(jax.vmap(jaxamp.stepped)(state)).all()
    np.testing.assert_array_equal(np.asarray(stats), np.ones((N, 3)))


def test_every_k_names_only_the_leaf_that_overflowed_on_one_device() -> None:
    # The agreed window marks the leaves that overflowed somewhere, and no other:
    # explain names the same leaves as with every_k=1.
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(8.0), every_k=2, axis_name="d")
    params = {"a": jnp.ones(3), "b": jnp.ones(3)}
    state, p = _stack(tx.init(params)), _stack(params)
    run = jax.pmap(lambda g, s, p: jaxamp.step(tx, g, s, p), axis_name="d")
    ok = {"a": jnp.ones((N, 3)), "b": jnp.ones((N, 3))}
    p, state = run({"a": ok["a"], "b": ok["b"].at[1, 2].set(jnp.inf)}, state, p)
    p, state = run(ok, state, p)  # the window ends, skipped everywhere
    for i in range(N):
        text = str(jaxamp.explain(jax.tree.map(lambda x, i=i: x[i], state), params))
        assert "1 of 2 gradient leaves held inf or NaN: b." in text, text
