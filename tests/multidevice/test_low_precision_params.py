"""bfloat16 params with stochastic rounding / Kahan on 8 devices.

Replicated params under pmap and shard_map: every device holds the same key and
draws the same bits, so the replicas stay identical, and equal to one device's
run. Params sharded over a mesh under jit: the draws depend on the key and the
global shape only, so the result is the same as unsharded, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.helpers import N_DEV

STEPS = 4
LASTS = {
    "sr": lambda: jaxamp.apply_with_stochastic_rounding(jax.random.key(11)),
    "kahan": jaxamp.apply_with_kahan_summation,
}


def _tx(last: str, axis_name=None, first=None):
    first = first or optax.adamw(1e-3, mu_dtype=jnp.bfloat16)
    inner = optax.chain(first, LASTS[last]())
    return jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale(2.0**4), axis_name=axis_name)


def _params():
    w = jax.random.normal(jax.random.key(0), (16, 24)).astype(jnp.bfloat16)
    return {"w": w, "b": jnp.linspace(0.0, 1.0, 24)}


def _one_grads(i: int):
    return jax.tree.map(
        lambda p: (1e-2 * jax.random.normal(jax.random.key(100 + i), p.shape)).astype(p.dtype),
        _params(),
    )


def _grads(i: int):
    """Per-device gradients (leading axis), the same on every device (so their
    mean is exact and the single-device run can match bit for bit) but on step 2,
    when device 3's overflow."""
    g = jax.tree.map(lambda x: jnp.broadcast_to(x, (N_DEV, *x.shape)), _one_grads(i))
    if i == 2:
        g["w"] = g["w"].at[3, 0, 0].set(jnp.inf)
    return g


def _reference(last: str):
    """One device, the same gradients (scaled as the mapped runs scale them)."""
    tx = _tx(last)
    params, state = _params(), tx.init(_params())
    step = jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))
    for i in range(STEPS):
        g = _one_grads(i)
        if i == 2:
            g["w"] = g["w"].at[0, 0].set(jnp.inf)
        g = jax.tree.map(lambda x, s=state.loss_scale.scale: x * s.astype(x.dtype), g)
        params, state = step(params, state, g)
    return params, state


def _mapped_step(tx):
    def one(params, state, grads):
        grads = jax.tree.map(lambda x: x * state.loss_scale.scale.astype(x.dtype), grads)
        # The data-parallel mean, taken in float32 as the reference takes it.
        grads = jax.tree.map(
            lambda x: jax.lax.pmean(x.astype(jnp.float32), "d").astype(x.dtype), grads
        )
        return jaxamp.step(tx, grads, state, params)

    return one


def _assert_replicas_identical(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        for d in range(1, N_DEV):
            np.testing.assert_array_equal(leaf[d], leaf[0])


@pytest.mark.parametrize("last", sorted(LASTS))
def test_pmap_replicas_stay_identical(last: str) -> None:
    tx = _tx(last, axis_name="d")
    rep = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (N_DEV, *jnp.shape(x))), t)
    params, state = rep(_params()), rep(tx.init(_params()))
    step = jax.pmap(_mapped_step(tx), axis_name="d")
    for i in range(STEPS):
        params, state = step(params, state, _grads(i))
    _assert_replicas_identical((params, state))
    assert int(jaxamp.metrics(jax.tree.map(lambda x: x[0], state))["skipped_steps"]) == 1
    ref_params, _ = _reference(last)
    assert params["w"].dtype == jnp.bfloat16
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want))


@pytest.mark.parametrize("last", sorted(LASTS))
def test_shard_map_replicas_stay_identical(last: str) -> None:
    mesh = jax.make_mesh((N_DEV,), ("d",))
    tx = _tx(last, axis_name="d")
    inner = _mapped_step(tx)

    def one(params, state, grads):
        grads = jax.tree.map(lambda x: x[0], grads)  # this device's share
        params, state = inner(params, state, grads)
        # Each device's copy, stacked along the axis, to compare them outside.
        return jax.tree.map(lambda x: x[None], (params, state))

    mapped = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P("d")))
    params, state = _params(), tx.init(_params())
    for i in range(STEPS):
        grads = jax.device_put(_grads(i), NamedSharding(mesh, P("d")))
        stacked = mapped(params, state, grads)
        _assert_replicas_identical(stacked)
        params, state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[0]), stacked)
    ref_params, _ = _reference(last)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("last", sorted(LASTS))
def test_mesh_jit_sharded_equals_unsharded(last: str) -> None:
    mesh = jax.make_mesh((N_DEV,), ("d",))
    # SGD with momentum, not AdamW: XLA:CPU compiles AdamW's float32 division and
    # square root differently for a shard's shape than for the whole array, which
    # would differ in the last bits before any rounding happened here.
    tx = _tx(last, first=optax.sgd(0.5, momentum=0.9))
    step = jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))

    def run(shard: bool):
        params, state = _params(), tx.init(_params())
        if shard:
            spec = {"w": P("d", None), "b": P("d")}
            put = lambda t: jax.tree.map(
                lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, spec
            )
            params = put(params)
            state = tx.init(params)  # moments and compensation sharded like the params
        for i in range(STEPS):
            g = jax.tree.map(lambda x: x[3], _grads(i))
            g = jax.tree.map(lambda x, s=state.loss_scale.scale: x * s.astype(x.dtype), g)
            if shard:
                g = put(g)
            params, state = step(params, state, g)
        return params, state

    sharded, unsharded = run(True), run(False)
    assert sharded[0]["w"].sharding.spec == P("d", None)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if last == "sr":  # the draws did something: not round-to-nearest everywhere
        plain = optax.sgd(0.5, momentum=0.9)
        p, s = _params(), plain.init(_params())
        for i in range(STEPS):
            if i == 2:
                continue  # the step the guarded runs skipped
            u, s = plain.update(_one_grads(i), s, p)
            p = optax.apply_updates(p, u)
        assert not np.array_equal(np.asarray(p["w"]), np.asarray(sharded[0]["w"]))
