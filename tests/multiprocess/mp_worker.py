"""One process of a multi-process jaxamp run; ``mp_harness.launch`` starts N of them.

    python mp_worker.py --out DIR [--ckpt DIR] [--schedule-procs N] SCENARIO [SCENARIO ...]
        --coordinator 127.0.0.1:PORT --num-processes N --process-id I

Each process calls ``jax.distributed.initialize`` (CPU collectives: gloo), builds
one 1-D mesh ``("data",)`` over the devices of all processes and runs the named
scenarios in order. A scenario is one small function below; it writes
``DIR/<scenario>/p<I>.npz`` (this process's view: per-step flags and loss-scale
copies, the final state) and the test compares the processes' files.

Faults are given in global coordinates (a row of the global batch, a row of
``w1``, a position on the mesh) chosen to fall in the data of one process; the
process that owns that place injects the inf / NaN into its *own* local data, and
records that it did.

Importing this module starts nothing: the test imports it for the constants and
the fault schedule.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IN, HIDDEN, OUT = 16, 64, 8  # first dimensions divide by 1, 2, 4 and 8 devices: FSDP-shardable
BATCH = 64  # global batch, split over every device of every process
STEPS = 16  # fault-injected runs
FAULT_SEED = 9
GROWTH_INTERVAL, HYSTERESIS, INIT_SCALE = 2, 2, 2.0**8
LS_FIELDS = ("scale", "growth_tracker", "hysteresis_tracker", "nonfinite_streak", "skipped_steps")

# The checkpoint runs: faults at 2, 5 and 6; saved before step 6, i.e. one overflow
# into a hysteresis window of 2 (hysteresis_tracker 1, nonfinite_streak 1): the
# resumed run backs off at step 6 only if the window survived the round trip.
CK_STEPS, CK_SAVE = 10, 6
# (step, kind, global position, value): x = a row of the global batch, grad = a row
# of grads["w1"]. Row 40 of 64 / row 13 of 16 lie in one process for 1, 2 and 4
# processes; the restoring process that owns them injects.
CK_FAULTS = ((2, "x", 40, np.inf), (5, "grad", 13, np.nan), (6, "x", 5, np.inf))

SCENARIOS: dict[str, Callable[[Ctx], None]] = {}


def scenario(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str  # "x": the process's local batch; "grad": its shard / copy of the gradients
    value: float  # inf or nan
    process: int  # the process whose data holds the fault
    slot: int  # which of its rows / devices (modulo how many it has)


def fault_schedule(num_processes: int, steps: int = STEPS, seed: int = FAULT_SEED) -> list[Fault]:
    """Random faults (about one step in three), each in one random process's data.

    The draws do not depend on ``num_processes`` except for picking the process,
    so runs with 2 and 4 processes share the steps, kinds and values.
    """
    rng = np.random.default_rng(seed)
    faults = []
    for step in range(steps):
        u = rng.random(5)
        if u[0] < 0.35:
            kind = "x" if u[1] < 0.5 else "grad"
            value = np.inf if u[2] < 0.5 else np.nan
            faults.append(Fault(step, kind, value, int(u[3] * num_processes), int(u[4] * 64)))
    return faults


def simulate_loss_scale(skipped: list[bool], start: tuple | None = None) -> np.ndarray:
    """docs/semantics.md#update-rule for dynamic_scale(INIT_SCALE, growth_interval=2, hysteresis=2).

    ``start``: the state to begin from (LS_FIELDS order); default the initial state.
    Returns (steps, 5): the state after each step, in LS_FIELDS order (as float64).
    """
    scale, growth, hyst, streak, total = start or (INIT_SCALE, 0, HYSTERESIS, 0, 0)
    scale, growth, hyst, streak, total = np.float32(scale), *map(int, (growth, hyst, streak, total))
    out = []
    for bad in skipped:
        if not bad:
            growth, streak, hyst = growth + 1, 0, HYSTERESIS
            if growth == GROWTH_INTERVAL:
                grown = scale * np.float32(2.0)
                if np.isfinite(grown):
                    scale = min(grown, np.float32(2.0**24))
                growth = 0
        else:
            total, streak, growth, hyst = total + 1, streak + 1, 0, hyst - 1
            if hyst == 0:
                scale, hyst = max(scale * np.float32(0.5), np.float32(1.0)), HYSTERESIS
        out.append((scale, growth, hyst, streak, total))
    return np.asarray(out, np.float64)


@dataclass
class Ctx:
    out: Path
    process: int
    num_processes: int
    schedule_procs: int  # the process count the fault positions are laid out for
    ckpt: Path | None
    mesh: Any

    def path(self, name: str) -> Path:
        d = self.out / name
        d.mkdir(parents=True, exist_ok=True)
        return d / f"p{self.process}.npz"


# --------------------------------------------------------------------------- model


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }


def batches(steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(steps, BATCH, IN)).astype(np.float32)
    w = rng.normal(size=(IN, OUT)).astype(np.float32)
    return x, np.tanh(x @ w).astype(np.float32)


def loss_fn(params, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def make_tx(axis_name=None, **kwargs):
    import optax

    import jaxamp

    return jaxamp.skip_nonfinite(
        optax.adam(1e-2),
        jaxamp.dynamic_scale(
            init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, hysteresis=HYSTERESIS
        ),
        axis_name=axis_name,
        **kwargs,
    )


def _unchanged(old, new):
    import jax
    import jax.numpy as jnp

    same = jax.tree.map(lambda a, b: jnp.all(a == b), old, new)
    return jnp.all(jnp.stack(jax.tree.leaves(same)))


def jit_step(tx, params, opt_state, x, y, grad_row, grad_value):
    """Global arrays, jit over the mesh: no axis_name. ``grad_row`` >= 0 puts
    ``grad_value`` into that row of grads["w1"] (under FSDP: one device's shard).
    Returns the new params and state, whether the params are unchanged, and the same
    per parameter (sorted by name)."""
    import jax
    import jax.numpy as jnp

    import jaxamp

    ls = jaxamp.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: jaxamp.scale(ls, loss_fn(p, x, y)))(params)
    hit = (jnp.arange(IN)[:, None] == grad_row) & (jnp.arange(HIDDEN) == 0)
    grads = dict(grads, w1=jnp.where(hit, grad_value, grads["w1"]))
    new_params, new_state = jaxamp.step(tx, grads, opt_state, params)
    per_leaf = jnp.stack([_unchanged(params[k], new_params[k]) for k in sorted(params)])
    return new_params, new_state, _unchanged(params, new_params), per_leaf


# ------------------------------------------------------------------ global arrays


def replicated(ctx: Ctx, value) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    value = np.asarray(value)
    sharding = NamedSharding(ctx.mesh, PartitionSpec())
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def sharded(ctx: Ctx, value, spec) -> Any:
    import jax
    from jax.sharding import NamedSharding

    value = np.asarray(value)
    sharding = NamedSharding(ctx.mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def fsdp_spec(shape, path=()) -> Any:
    """First dimensions split over "data"; scalars and jaxamp's per-leaf record of
    non-finite gradients (``nonfinite_leaves``: one entry per leaf) replicated."""
    from jax.sharding import PartitionSpec

    record = any(getattr(k, "name", None) == "nonfinite_leaves" for k in path)
    return PartitionSpec("data") if len(shape) and not record else PartitionSpec()


def local_rows(ctx: Ctx, n_rows: int) -> tuple[int, int]:
    """The rows [lo, hi) of a P("data")-sharded dimension this process holds."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(ctx.mesh, PartitionSpec("data"))
    idx = sharding.addressable_devices_indices_map((n_rows,)).values()
    spans = sorted((s[0].start or 0, s[0].stop or n_rows) for s in idx)
    lo, hi = spans[0][0], spans[-1][1]
    assert sum(b - a for a, b in spans) == hi - lo, f"process rows not contiguous: {spans}"
    return lo, hi


def local_batch(ctx: Ctx, x: np.ndarray, fault_row: int | None, value: float) -> tuple[Any, bool]:
    """The global batch built from this process's rows, with the fault if it owns the row."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    lo, hi = local_rows(ctx, x.shape[0])
    mine = x[lo:hi].copy()
    injected = fault_row is not None and lo <= fault_row < hi
    if injected:
        mine[fault_row - lo, 0] = value  # only this process's data ever holds it
    sharding = NamedSharding(ctx.mesh, PartitionSpec("data"))
    return jax.make_array_from_process_local_data(sharding, mine, x.shape), injected


def owner_of_position(ctx: Ctx, pos: int) -> int:
    return int(ctx.mesh.devices.reshape(-1)[pos].process_index)


def fault_position(ctx: Ctx, f: Fault, kind_size: int) -> int:
    """The global index (row / mesh position) of ``f`` in a dimension of ``kind_size``,
    laid out for ``ctx.schedule_procs`` processes; checks it lies in that process."""
    per = kind_size // ctx.schedule_procs
    pos = f.process * per + f.slot % per
    if ctx.num_processes == ctx.schedule_procs:
        n_dev = ctx.mesh.devices.size
        owner = owner_of_position(ctx, pos * n_dev // kind_size)
        assert owner == f.process, f"fault {f} at {pos} lies in process {owner}"
    return pos


def local_copies(a) -> np.ndarray:
    """This process's copies of a global array: one per addressable shard, stacked."""
    return np.stack([np.asarray(s.data) for s in a.addressable_shards])


def gather(tree) -> list[np.ndarray]:
    """Every leaf's global value, on every process."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [np.asarray(a) for a in jax.tree.leaves(tree)]
    return [np.asarray(a) for a in jax.tree.leaves(multihost_utils.process_allgather(tree, True))]


def state_record(prefix: str, state) -> dict[str, np.ndarray]:
    """The final state as this process sees it: global values, and its local copies of
    every replicated leaf (one per local device)."""
    import jax

    rec = {}
    for i, (a, full) in enumerate(zip(jax.tree.leaves(state), gather(state), strict=True)):
        rec[f"{prefix}_full_{i}"] = full
        if a.sharding.is_fully_replicated:
            rec[f"{prefix}_copies_{i}"] = local_copies(a)
    return rec


def trajectory(log) -> dict[str, np.ndarray]:
    """Per-step local copies of the skip flag and of the loss-scale fields."""
    unchanged = np.stack([local_copies(u) for u, _ in log])
    ls = np.stack([np.stack([local_copies(a) for a in fields], -1) for _, fields in log])
    return {"unchanged": unchanged, "ls": ls.astype(np.float64)}


def ls_fields(opt_state) -> tuple:
    import jaxamp

    ls = jaxamp.get_loss_scale(opt_state)
    return tuple(getattr(ls, f) for f in LS_FIELDS)


# ---------------------------------------------------------------------- scenarios


def _jit_run(ctx: Ctx, name: str, fsdp: bool, tx=None, faults=None, steps=STEPS) -> None:
    import jax
    from jax.sharding import PartitionSpec

    tx = tx if tx is not None else make_tx()
    faults = faults if faults is not None else fault_schedule(ctx.schedule_procs, steps)
    by_step = {f.step: f for f in faults}
    xs, ys = batches(steps)
    p0 = init_params()
    spec = fsdp_spec if fsdp else (lambda shape, path=(): PartitionSpec())
    params = {k: sharded(ctx, v, spec(v.shape)) for k, v in p0.items()}
    abstract = jax.eval_shape(tx.init, p0)
    out_shardings = jax.tree_util.tree_map_with_path(
        lambda path, s: jax.sharding.NamedSharding(ctx.mesh, spec(s.shape, path)), abstract
    )
    opt_state = jax.jit(tx.init, out_shardings=out_shardings)(params)
    step = jax.jit(functools.partial(jit_step, tx))

    inputs, injected = [], []
    for i in range(steps):
        f = by_step.get(i)
        row = fault_position(ctx, f, BATCH) if f and (f.kind == "x" or not fsdp) else None
        x, mine = local_batch(ctx, xs[i], row, f.value if f else 0.0)
        y, _ = local_batch(ctx, ys[i], None, 0.0)
        grad_row = fault_position(ctx, f, IN) if f and f.kind == "grad" and fsdp else -1
        if grad_row >= 0:  # the row lives in the shards of the fault's process
            lo, hi = local_rows(ctx, IN)
            mine = lo <= grad_row < hi
        inputs.append(
            (
                x,
                y,
                replicated(ctx, np.int32(grad_row)),
                replicated(ctx, np.float32(f.value if f else 0)),
            )
        )
        if mine:
            injected.append(i)

    log, per_leaf = [], []
    with jax.transfer_guard("disallow"):  # no host sync inside the training loop
        for i in range(steps):
            params, opt_state, unchanged, leaves = step(params, opt_state, *inputs[i])
            log.append((unchanged, ls_fields(opt_state)))
            per_leaf.append(leaves)
    rec = trajectory(log)
    rec["unchanged_per_param"] = np.stack([local_copies(u) for u in per_leaf])
    rec.update(state_record("state", {"params": params, "opt_state": opt_state}))
    rec["injected"] = np.asarray(injected, np.int64)
    np.savez(ctx.path(name), **rec)


@scenario
def dp_jit(ctx: Ctx) -> None:
    """jit over the global mesh, params replicated, batch sharded; faults in one process's batch."""
    _jit_run(ctx, "dp_jit", fsdp=False)


@scenario
def fsdp_jit(ctx: Ctx) -> None:
    """jit over the global mesh, params and moments sharded over all devices (FSDP)."""
    _jit_run(ctx, "fsdp_jit", fsdp=True)


def _shard_map_run(ctx: Ctx, name: str, axis_name: str | None) -> Any:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxamp

    n_dev = ctx.mesh.devices.size
    tx = make_tx(axis_name=axis_name)
    faults = {f.step: f for f in fault_schedule(ctx.schedule_procs)}
    xs, ys = batches(STEPS)

    def per_device(params, opt_state, x, y, bad_pos, value):
        # Each device holds a (1, ...) slice of the stacked state: its own replica.
        params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
        ls = jaxamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jaxamp.scale(ls, loss_fn(p, x, y)))(params)
        grads = lax.pmean(grads, "data")
        # A fault in one device's copy of the averaged gradients (a bad device or link).
        hit = (lax.axis_index("data") == bad_pos) & (jnp.arange(IN)[:, None] == 0)
        grads = dict(grads, w1=jnp.where(hit & (jnp.arange(HIDDEN) == 0), value, grads["w1"]))
        new_params, new_state = jaxamp.step(tx, grads, opt_state, params)
        out = (new_params, new_state, _unchanged(params, new_params))
        return jax.tree.map(lambda a: a[None], out)

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=ctx.mesh,
            in_specs=(P("data"), P("data"), P("data"), P("data"), P(), P()),
            out_specs=P("data"),
        )
    )
    stack = lambda t: jax.tree.map(  # noqa: E731
        lambda a: sharded(ctx, np.broadcast_to(a, (n_dev, *np.shape(a))), P("data")), t
    )
    p0 = init_params()
    params = stack(p0)
    opt_state = stack(jax.device_get(tx.init(jax.tree.map(jnp.asarray, p0))))

    inputs, injected = [], []
    for i in range(STEPS):
        f = faults.get(i)
        row = fault_position(ctx, f, BATCH) if f and f.kind == "x" else None
        x, mine = local_batch(ctx, xs[i], row, f.value if f else 0.0)
        y, _ = local_batch(ctx, ys[i], None, 0.0)
        pos = fault_position(ctx, f, n_dev) if f and f.kind == "grad" else -1
        if pos >= 0:
            mine = owner_of_position(ctx, pos) == ctx.process
        inputs.append(
            (x, y, replicated(ctx, np.int32(pos)), replicated(ctx, np.float32(f.value if f else 0)))
        )
        if mine:
            injected.append(i)

    log = []
    with jax.transfer_guard("disallow"):
        for i in range(STEPS):
            params, opt_state, unchanged = step(params, opt_state, *inputs[i])
            log.append((unchanged, ls_fields(opt_state)))
    rec = trajectory(log)
    rec.update(state_record("state", {"params": params, "opt_state": opt_state}))
    rec["injected"] = np.asarray(injected, np.int64)
    np.savez(ctx.path(name), **rec)
    return opt_state


@scenario
def shard_map(ctx: Ctx) -> None:
    """shard_map with axis_name: every device holds its own replica of the state."""
    opt_state = _shard_map_run(ctx, "shard_map", axis_name="data")
    _record_check(ctx, "shard_map_check", opt_state)  # the replicas agree: quiet


@scenario
def shard_map_no_axis(ctx: Ctx) -> None:
    """The control: the same run without axis_name, where the replicas drift apart;
    jaxamp.check_in_sync must say so on every process."""
    opt_state = _shard_map_run(ctx, "shard_map_no_axis", axis_name=None)
    _record_check(ctx, "shard_map_no_axis_check", opt_state)


def _record_check(ctx: Ctx, name: str, state) -> None:
    import jaxamp

    try:
        jaxamp.check_in_sync(state)
        message = ""
    except RuntimeError as e:
        message = str(e)
    (ctx.out / name).mkdir(parents=True, exist_ok=True)
    (ctx.out / name / f"p{ctx.process}.txt").write_text(message)


@scenario
def desync(ctx: Ctx) -> None:
    """Processes that restored different loss-scale states (simulated: each process
    provides its own copy of a "replicated" state): check_in_sync catches it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxamp

    tx = make_tx()
    state = jax.device_get(tx.init(jax.tree.map(jnp.asarray, init_params())))
    same = jax.tree.map(lambda a: replicated(ctx, a), state)
    _record_check(ctx, "desync_same", same)

    rep = NamedSharding(ctx.mesh, PartitionSpec())
    ls = jaxamp.get_loss_scale(same)
    mine = np.float32(INIT_SCALE * 2**ctx.process)  # process p "restored" 256 * 2**p
    skipped = np.int32(3 if ctx.process == ctx.num_processes - 1 else 0)
    diverged = ls.replace(
        scale=jax.make_array_from_process_local_data(rep, mine, ()),
        skipped_steps=jax.make_array_from_process_local_data(rep, skipped, ()),
    )
    _record_check(ctx, "desync_differ", diverged)


def _every_k_available() -> bool:
    import jaxamp

    return "every_k" in inspect.signature(jaxamp.skip_nonfinite).parameters


def _skip(ctx: Ctx, name: str, reason: str) -> None:
    (ctx.out / name).mkdir(parents=True, exist_ok=True)
    (ctx.out / name / f"p{ctx.process}.skipped").write_text(reason)


EVERY_K, EK_STEPS = 2, 8
# Micro-step 3 (2nd micro-batch of window 1) in process 1's batch, micro-step 4 (1st of
# window 2) in process 0's: windows 1 and 2 are skipped whole, windows 0 and 3 apply.
EK_FAULTS = (Fault(3, "x", np.inf, 1, 2), Fault(4, "x", np.nan, 0, 7))


@scenario
def every_k(ctx: Ctx) -> None:
    """skip_nonfinite(..., every_k=2) under jit over the global mesh
    (docs/semantics.md#accumulation)."""
    if not _every_k_available():
        return _skip(ctx, "every_k", "jaxamp.skip_nonfinite has no every_k argument")
    _jit_run(
        ctx, "every_k", fsdp=False, tx=make_tx(every_k=EVERY_K), faults=EK_FAULTS, steps=EK_STEPS
    )


MT_STEPS = 8
# Step 2: a NaN in grads["w1"] in a shard of process 1 (partition "a" only);
# step 5: a NaN in process 0's batch, which reaches every gradient. (An inf there
# would not: tanh saturates, so only grads["w1"] would see inf * 0.)
MT_FAULTS = (Fault(2, "grad", np.nan, 1, 3), Fault(5, "x", np.nan, 0, 9))
MT_LABELS = {"w1": "a", "b1": "a", "w2": "b", "b2": "b"}


def make_mt_tx():
    """jaxamp.multi_transform (docs/semantics.md#several-optimizers): Adam for "a", SGD for
    "b", one scale."""
    import optax

    import jaxamp

    return jaxamp.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(1e-2)},
        MT_LABELS,
        jaxamp.dynamic_scale(
            init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, hysteresis=HYSTERESIS
        ),
    )


@scenario
def multi_transform(ctx: Ctx) -> None:
    """jaxamp.multi_transform (docs/semantics.md#several-optimizers), FSDP under jit over the
    global mesh."""
    import jaxamp

    if not hasattr(jaxamp, "multi_transform"):
        return _skip(ctx, "multi_transform", "jaxamp.multi_transform not available")
    _jit_run(ctx, "multi_transform", fsdp=True, tx=make_mt_tx(), faults=MT_FAULTS, steps=MT_STEPS)


def _ck_inputs(ctx: Ctx, start: int) -> list[tuple]:
    xs, ys = batches(CK_STEPS)
    faults = {s: (kind, pos, v) for s, kind, pos, v in CK_FAULTS}
    inputs = []
    for i in range(start, CK_STEPS):
        kind, pos, value = faults.get(i, (None, -1, 0.0))
        x, _ = local_batch(ctx, xs[i], pos if kind == "x" else None, value)
        y, _ = local_batch(ctx, ys[i], None, 0.0)
        grad_row = pos if kind == "grad" else -1
        inputs.append(
            (x, y, replicated(ctx, np.int32(grad_row)), replicated(ctx, np.float32(value)))
        )
    return inputs


def _ck_target(ctx: Ctx, tx) -> Any:
    """The abstract {"params", "opt_state"}: FSDP shardings on *this* process's mesh."""
    import jax
    from jax.sharding import NamedSharding

    p0 = init_params()
    abstract = jax.eval_shape(lambda: {"params": p0, "opt_state": tx.init(p0)})
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(ctx.mesh, fsdp_spec(s.shape, path))
        ),
        abstract,
    )


def _ck_train(ctx: Ctx, tx, state, start: int, mngr=None) -> tuple[Any, list]:
    import jax
    import orbax.checkpoint as ocp

    step = jax.jit(functools.partial(jit_step, tx))
    inputs = _ck_inputs(ctx, start)
    params, opt_state = state["params"], state["opt_state"]
    log, saved = [], None
    for i in range(start, CK_STEPS):
        if mngr is not None and i == CK_SAVE:
            saved = {"params": params, "opt_state": opt_state}
            mngr.save(i, args=ocp.args.StandardSave(saved))
        with jax.transfer_guard("disallow"):
            params, opt_state, unchanged, _ = step(params, opt_state, *inputs[i - start])
        log.append((unchanged, ls_fields(opt_state)))
    return {"params": params, "opt_state": opt_state}, log, saved


@scenario
def ckpt_save(ctx: Ctx) -> None:
    """FSDP run over all devices, saved mid-hysteresis with a CheckpointManager from every
    process, trained on uninterrupted."""
    import jax
    import orbax.checkpoint as ocp

    tx = make_tx()
    target = _ck_target(ctx, tx)
    params = {k: sharded(ctx, v, fsdp_spec(v.shape)) for k, v in init_params().items()}
    shardings = jax.tree.map(lambda s: s.sharding, target["opt_state"])
    state = {"params": params, "opt_state": jax.jit(tx.init, out_shardings=shardings)(params)}
    with ocp.CheckpointManager(ctx.ckpt) as mngr:
        final, log, saved = _ck_train(ctx, tx, state, 0, mngr)
        mngr.wait_until_finished()
    rec = trajectory(log)
    rec.update(state_record("saved", saved))
    rec.update(state_record("final", final))
    np.savez(ctx.path("ckpt_save"), **rec)


@scenario
def ckpt_restore(ctx: Ctx) -> None:
    """Restores the mid-hysteresis checkpoint onto this launch's mesh and trains to the end."""
    import orbax.checkpoint as ocp

    import jaxamp

    tx = make_tx()
    with ocp.CheckpointManager(ctx.ckpt) as mngr:
        state = jaxamp.checkpoint.restore(mngr, _ck_target(ctx, tx), step=CK_SAVE)
    jaxamp.check_in_sync(state["opt_state"])  # every process restored the same state
    rec = state_record("restored", state)
    w1 = state["params"]["w1"]
    rec["w1_shards"] = np.int64(len(w1.sharding.device_set))
    final, log, _ = _ck_train(ctx, tx, state, CK_SAVE)
    rec.update(trajectory(log))
    rec.update(state_record("final", final))
    np.savez(ctx.path(f"ckpt_restore_{ctx.num_processes}x{len(ctx.mesh.local_devices)}"), **rec)


@scenario
def ckpt_restore_indivisible(ctx: Ctx) -> None:
    """Restoring onto a mesh the FSDP dimensions do not divide by (3 devices): it must
    fail at once, in every process, with an error that says why (not hang)."""
    import orbax.checkpoint as ocp

    import jaxamp

    with ocp.CheckpointManager(ctx.ckpt) as mngr:
        try:
            jaxamp.checkpoint.restore(mngr, _ck_target(ctx, make_tx()), step=CK_SAVE)
            message = "restored"
        except Exception as e:  # recorded for the test to judge
            message = f"{type(e).__name__}: {e}"
    (ctx.out / "ckpt_restore_indivisible").mkdir(parents=True, exist_ok=True)
    (ctx.out / "ckpt_restore_indivisible" / f"p{ctx.process}.txt").write_text(message)


@scenario
def die(ctx: Ctx) -> None:
    """The last process dies after two training steps; the others go on into a collective."""
    import jax

    tx = make_tx()
    step = jax.jit(functools.partial(jit_step, tx))
    p0 = init_params()
    params = {k: replicated(ctx, v) for k, v in p0.items()}
    opt_state = jax.jit(tx.init)(params)
    xs, ys = batches(STEPS)
    for i in range(STEPS):
        if i == 2 and ctx.process == ctx.num_processes - 1:
            print(f"process {ctx.process}: dying at step {i}", flush=True)
            os._exit(17)
        x, _ = local_batch(ctx, xs[i], None, 0.0)
        y, _ = local_batch(ctx, ys[i], None, 0.0)
        params, opt_state, _, _ = step(
            params, opt_state, x, y, replicated(ctx, np.int32(-1)), replicated(ctx, np.float32(0))
        )
        jax.block_until_ready(params)
        print(f"process {ctx.process}: step {i} done", flush=True)


@scenario
def hang(ctx: Ctx) -> None:
    """The last process stops responding; the others wait in a collective."""
    from jax.experimental import multihost_utils

    if ctx.process == ctx.num_processes - 1:
        time.sleep(3600)
    multihost_utils.sync_global_devices("hang")


# --------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--schedule-procs", type=int)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    t0 = time.monotonic()
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    from jax.sharding import AxisType

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    ctx = Ctx(
        out=args.out,
        process=jax.process_index(),
        num_processes=jax.process_count(),
        schedule_procs=args.schedule_procs or jax.process_count(),
        ckpt=args.ckpt,
        mesh=mesh,
    )
    print(
        f"process {ctx.process}/{ctx.num_processes}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices, initialized in {time.monotonic() - t0:.1f}s",
        flush=True,
    )
    for name in args.scenarios:
        t = time.monotonic()
        SCENARIOS[name](ctx)
        print(f"process {ctx.process}: {name} done in {time.monotonic() - t:.1f}s", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # at once: do not wait in JAX's shutdown barrier for the others
