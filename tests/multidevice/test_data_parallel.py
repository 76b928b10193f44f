"""One device sees an inf at step k: every device skips step k, and all agree.

Four ways to run data parallel on 8 simulated devices (pmap, shard_map, jit over
a Mesh with replicated params, jit over a Mesh with FSDP-sharded params), each
checked against one single-device run that skipped step k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from md_harness import (
    BATCH,
    N_DEV,
    NO_FAULT,
    batches,
    fsdp_init,
    global_step,
    init_params,
    leaves_np,
    make_tx,
    replica_step,
)

import jaxamp

STEPS = 8
FAULT_STEP = 3
BAD_DEVICE = 5


@pytest.fixture(scope="module")
def data():
    return batches(STEPS)


@pytest.fixture(scope="module")
def reference(data):
    """A single-device run (device 0) whose step FAULT_STEP is skipped."""
    xs, ys = data
    tx = make_tx()
    step = jax.jit(functools.partial(global_step, tx))
    params = jax.tree.map(jnp.asarray, init_params())
    opt_state = tx.init(params)
    for i in range(STEPS):
        fault = {"x_row": NO_FAULT, "w1_row": 0 if i == FAULT_STEP else NO_FAULT}
        params, opt_state, _ = step(params, opt_state, xs[i], ys[i], fault)
    ls = jaxamp.get_loss_scale(opt_state)
    assert int(ls.skipped_steps) == 1
    return params, opt_state


def _matches_reference(params, opt_state, reference) -> None:
    ref_params, ref_state = reference
    # The loss-scale state depends only on which steps were skipped: bit for bit.
    for a, b in zip(
        leaves_np(jaxamp.get_loss_scale(opt_state)),
        leaves_np(jaxamp.get_loss_scale(ref_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # Params and moments: equal up to the order of the cross-device reductions.
    for a, b in zip(
        leaves_np((params, opt_state.inner_state)),
        leaves_np((ref_params, ref_state.inner_state)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def _assert_replicas_identical(stacked) -> None:
    """Every leaf with a leading device axis holds the same value on every device."""
    for leaf in leaves_np(stacked):
        assert leaf.shape[0] == N_DEV
        for d in range(1, N_DEV):
            np.testing.assert_array_equal(leaf[d], leaf[0])


def _stack(tree):
    return jax.tree.map(lambda a: np.broadcast_to(a, (N_DEV, *np.shape(a))), tree)


def _run_replicated(step, put, xs, ys):
    """Drives a per-replica step (pmap or shard_map) with stacked state; returns state and log."""
    tx = make_tx()
    params = _stack(init_params())
    opt_state = _stack(jax.device_get(tx.init(jax.tree.map(jnp.asarray, init_params()))))
    params, opt_state = put((params, opt_state))
    shape = (STEPS, N_DEV, BATCH // N_DEV)
    xs, ys = put(xs.reshape(*shape, -1)), put(ys.reshape(*shape, -1))
    bad = [
        put(np.full(N_DEV, BAD_DEVICE if i == FAULT_STEP else NO_FAULT, np.int32))
        for i in range(STEPS)
    ]
    xs, ys = [put(x) for x in np.asarray(xs)], [put(y) for y in np.asarray(ys)]
    log = []
    with jax.transfer_guard("disallow"):
        for i in range(STEPS):
            params, opt_state, unchanged = step(params, opt_state, xs[i], ys[i], bad[i])
            log.append((unchanged, jaxamp.metrics(opt_state)["skipped_steps"]))
    unchanged, skipped = (np.stack(v) for v in zip(*jax.device_get(log), strict=True))
    return params, opt_state, unchanged, skipped


def _assert_every_device_skipped_only_the_fault_step(unchanged, skipped) -> None:
    expected = np.zeros((STEPS, N_DEV), bool)
    expected[FAULT_STEP] = True
    np.testing.assert_array_equal(unchanged.reshape(STEPS, N_DEV), expected)
    np.testing.assert_array_equal(
        skipped.reshape(STEPS, N_DEV), np.cumsum(expected, 0).astype(np.int32)
    )


def _unstack(tree):
    """Replica 0 of a stacked tree, as numpy (0-d arrays stay arrays)."""
    return jax.tree.map(lambda a: np.asarray(a)[0, ...], tree)


def test_pmap(data, reference) -> None:
    tx = make_tx(axis_name="data")
    step = jax.pmap(functools.partial(replica_step, tx, axis="data"), axis_name="data")
    put = jax.pmap(lambda t: t)  # puts a stacked tree on the devices, one slice each
    params, opt_state, unchanged, skipped = _run_replicated(step, put, *data)
    _assert_every_device_skipped_only_the_fault_step(unchanged, skipped)
    _assert_replicas_identical((params, opt_state))
    _matches_reference(_unstack(params), _unstack(opt_state), reference)


def test_pmap_without_axis_name_the_replicas_diverge(data) -> None:
    # The control: checked per device, only the bad device skips.
    tx = make_tx(axis_name=None)
    step = jax.pmap(functools.partial(replica_step, tx, axis="data"), axis_name="data")
    params, _, unchanged, skipped = _run_replicated(step, jax.pmap(lambda t: t), *data)
    only_bad = [d == BAD_DEVICE for d in range(N_DEV)]
    assert unchanged[FAULT_STEP].tolist() == only_bad
    assert skipped[-1].tolist() == [int(b) for b in only_bad]
    w1 = np.asarray(params["w1"])
    assert not np.array_equal(w1[BAD_DEVICE], w1[0])


def test_shard_map(data, reference) -> None:
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tx = make_tx(axis_name="data")

    def per_device(params, opt_state, x, y, bad):
        # Each device holds a (1, ...) slice of the stacked state: its own replica.
        one = functools.partial(jax.tree.map, lambda a: a[0])
        new = replica_step(tx, *one((params, opt_state, x, y, bad)), axis="data")
        return jax.tree.map(lambda a: a[None], new)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("data")))
    params, opt_state, unchanged, skipped = _run_replicated(step, put, *data)
    _assert_every_device_skipped_only_the_fault_step(unchanged, skipped)
    _assert_replicas_identical((params, opt_state))
    _matches_reference(_unstack(params), _unstack(opt_state), reference)


def _assert_same_on_every_device(tree) -> None:
    """Each device's copy of each replicated leaf is the same, bit for bit."""
    for leaf in jax.tree.leaves(tree):
        assert leaf.sharding.is_fully_replicated
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == N_DEV
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_jit_over_a_mesh(data, reference, layout: str, axis_type: AxisType) -> None:
    # No axis_name: under jit the finiteness check of a sharded array is a global
    # reduction that XLA compiles, so every device gets the same answer.
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        _jit_over_a_mesh(mesh, data, reference, layout)


def _jit_over_a_mesh(mesh, data, reference, layout: str) -> None:
    batch_sharding = NamedSharding(mesh, P("data"))
    param_sharding = NamedSharding(mesh, P("data") if layout == "fsdp" else P())
    tx = make_tx()
    xs, ys = data
    params = jax.device_put(init_params(), param_sharding)
    if layout == "fsdp":
        opt_state = fsdp_init(tx, params, mesh)
        assert opt_state.inner_state[0].nu["w2"].sharding.is_equivalent_to(param_sharding, 2)
    else:
        opt_state = jax.jit(tx.init)(params)
    step = jax.jit(functools.partial(global_step, tx))
    # The fault lands on one device only: in its slice of the batch (data parallel),
    # or in the rows of grads["w1"] it owns (FSDP: 2 rows per device).
    rows_per_device = params["w1"].shape[0] // N_DEV
    faults = [
        {"x_row": NO_FAULT, "w1_row": NO_FAULT}
        if i != FAULT_STEP
        else (
            {"x_row": BAD_DEVICE * (BATCH // N_DEV) + 1, "w1_row": NO_FAULT}
            if layout == "data_parallel"
            else {"x_row": NO_FAULT, "w1_row": BAD_DEVICE * rows_per_device + 1}
        )
        for i in range(STEPS)
    ]
    replicated = NamedSharding(mesh, P())
    faults = [jax.device_put(jax.tree.map(np.int32, f), replicated) for f in faults]
    xs = [jax.device_put(x, batch_sharding) for x in xs]
    ys = [jax.device_put(y, batch_sharding) for y in ys]
    if layout == "fsdp":
        owner = {s.device.id for s in params["w1"].addressable_shards if s.index[0].start == 10}
        assert len(owner) == 1  # row 11 of w1 lives on one device only

    log = []
    with jax.transfer_guard("disallow"):
        for i in range(STEPS):
            params, opt_state, unchanged = step(params, opt_state, xs[i], ys[i], faults[i])
            log.append(unchanged)
            _assert_same_on_every_device(jaxamp.get_loss_scale(opt_state))
    assert [bool(u) for u in jax.device_get(log)] == [i == FAULT_STEP for i in range(STEPS)]
    if layout == "fsdp":
        assert params["w1"].sharding.is_equivalent_to(param_sharding, 2)  # still sharded
        assert not params["w1"].sharding.is_fully_replicated
    else:
        _assert_same_on_every_device(params)
    _matches_reference(params, opt_state, reference)


def test_all_finite_on_sharded_arrays_is_one_global_reduction() -> None:
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    w = np.ones((N_DEV * 2, 3), np.float32)
    tree = {"w": jax.device_put(w, sharding)}
    check = jax.jit(jaxamp.all_finite)
    assert "all-reduce" in check.lower(tree).compile().as_text()
    assert bool(check(tree))
    w[13, 2] = np.nan  # on device 6 only
    out = check({"w": jax.device_put(w, sharding)})
    assert out.sharding.is_fully_replicated and not bool(out)
    _assert_same_on_every_device(out)
