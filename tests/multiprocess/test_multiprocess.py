"""jaxamp across real JAX processes: one non-finite value anywhere skips the step everywhere.

Each launch starts N processes (``mp_harness``), each with K simulated CPU devices,
joined by ``jax.distributed.initialize`` and gloo collectives into one mesh of N*K
devices; the processes run several scenarios of ``mp_worker.py`` in turn and each
writes what it sees. The tests compare the processes' files:

- 2 processes x 2 devices: data parallel and FSDP under ``jit`` over the mesh, and
  ``shard_map`` with ``axis_name`` (plus the control without it), each over 16
  steps with 6 injected faults (infs and NaNs, each in one process's data);
  processes disagreeing on a restored loss-scale state; ``every_k`` and
  ``jaxamp.multi_transform`` (docs/semantics.md#several-optimizers, skipped until they
  exist); an FSDP run saved mid-hysteresis with one ``CheckpointManager`` from both processes.
- 4 processes x 2 devices: the three fault-injected runs again; restore onto 8 devices.
- restore onto 2 x 2, 4 x 1 and 1 x 4 devices (the saving run's layout: bit for bit).
- 1 process x 4 devices: the single-process reference of the 2 x 2 runs.
- 3 processes x 1 device: a restore onto a mesh the FSDP dimensions do not divide
  by fails at once, in every process, with JAX's error.
- a process that dies, and one that hangs: the harness fails fast and kills the rest.
- ``examples/multiprocess.py`` with 2 processes x 2 devices.

Launching tests skip (with the reason) only if this jaxlib has no CPU collectives
between processes (gloo).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
import pytest
from mp_harness import LaunchError, cpu_collectives_missing, launch, run_scenarios
from mp_worker import (
    CK_FAULTS,
    CK_SAVE,
    CK_STEPS,
    EK_FAULTS,
    EK_STEPS,
    EVERY_K,
    LS_FIELDS,
    MT_FAULTS,
    MT_LABELS,
    MT_STEPS,
    STEPS,
    fault_schedule,
    init_params,
    make_mt_tx,
    make_tx,
    simulate_loss_scale,
)

import jaxamp

MAIN = [
    "dp_jit",
    "fsdp_jit",
    "shard_map",
    "shard_map_no_axis",
    "desync",
    "every_k",
    "multi_transform",
    "ckpt_save",
]
FAULT_RUNS = ["dp_jit", "fsdp_jit", "shard_map"]
PARAMS = sorted(init_params())  # the order of jit_step's per-parameter flags


# ----------------------------------------------------------------------- launches


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """A compilation cache shared by all launches (the same programs recur).

    Every test that launches processes asks for it: they skip, with the reason, if
    this jaxlib cannot run collectives between CPU processes.
    """
    missing = cpu_collectives_missing()
    if missing is not None:
        pytest.skip(f"no CPU collectives between processes: {missing}")
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt") / "run"


@pytest.fixture(scope="session")
def two(tmp_path_factory, cache, ckpt) -> Path:
    out = tmp_path_factory.mktemp("two")
    run_scenarios(MAIN, 2, 2, out, cache=cache, extra=["--ckpt", str(ckpt)])
    return out


@pytest.fixture(scope="session")
def four(tmp_path_factory, cache, ckpt, two) -> Path:
    out = tmp_path_factory.mktemp("four")
    run_scenarios(
        [*FAULT_RUNS, "ckpt_restore"], 4, 2, out, cache=cache, extra=["--ckpt", str(ckpt)]
    )
    return out


@pytest.fixture(scope="session")
def single(tmp_path_factory, cache, ckpt, two) -> Path:
    """One process with the 2 x 2 runs' 4 devices and fault positions."""
    out = tmp_path_factory.mktemp("single")
    extra = ["--ckpt", str(ckpt), "--schedule-procs", "2"]
    run_scenarios(["ckpt_restore", *FAULT_RUNS], 1, 4, out, cache=cache, extra=extra)
    return out


@pytest.fixture(scope="session")
def restored(tmp_path_factory, cache, ckpt, two, four, single) -> dict[str, Path]:
    """Where each restore wrote, by layout ("2x2", ...)."""
    outs = {"4x2": four, "1x4": single}
    for n, k in ((2, 2), (4, 1)):
        outs[f"{n}x{k}"] = out = tmp_path_factory.mktemp(f"restore{n}x{k}")
        run_scenarios(["ckpt_restore"], n, k, out, cache=cache, extra=["--ckpt", str(ckpt)])
    return outs


# ------------------------------------------------------------------------ helpers


def load(out: Path, name: str, n: int) -> list[dict[str, np.ndarray]]:
    """Each process's record of scenario ``name``."""
    recs = []
    for p in range(n):
        with np.load(out / name / f"p{p}.npz") as f:
            recs.append(dict(f))
    return recs


def leaf_names(tx=None) -> list[str]:
    """The key paths of {"params", "opt_state"}'s leaves, in the order the worker saves them."""
    p0 = init_params()
    tree = {"params": p0, "opt_state": (tx or make_tx()).init(p0)}
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def fulls(rec: dict, prefix: str) -> list[np.ndarray]:
    n = len([k for k in rec if k.startswith(f"{prefix}_full_")])
    return [rec[f"{prefix}_full_{i}"] for i in range(n)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_identical_everywhere(
    recs: list[dict], prefix: str, stacked: bool = False, tx=None
) -> None:
    """Every process sees the same global state, and every local copy of a replicated
    leaf (one per device) equals it bit for bit; with ``stacked`` (one replica per
    device along axis 0), all replicas are equal too. ``tx``: the run's optimizer."""
    names = leaf_names(tx)
    reference = fulls(recs[0], prefix)
    assert len(reference) == len(names)
    for p, rec in enumerate(recs):
        for i, (a, ref) in enumerate(zip(fulls(rec, prefix), reference, strict=True)):
            assert same_bits(a, ref), f"{names[i]}: process {p} differs from process 0"
            for d, copy in enumerate(rec.get(f"{prefix}_copies_{i}", [])):
                assert same_bits(copy, ref), f"{names[i]}: process {p}, device {d} differs"
            if stacked:
                for r in range(1, a.shape[0]):
                    assert same_bits(a[r], a[0]), f"{names[i]}: replica {r} differs from 0"


def expected_skips(n_procs: int, steps: int = STEPS) -> list[bool]:
    bad = {f.step for f in fault_schedule(n_procs, steps)}
    return [i in bad for i in range(steps)]


def check_fault_run(out: Path, name: str, n: int, devices: int) -> list[dict]:
    """Each fault was injected by exactly its one process; every device of every process
    skipped exactly the faulted steps; the loss-scale state followed the update rule
    (docs/semantics.md#update-rule) on every device; the final state is bit-identical everywhere."""
    recs = load(out, name, n)
    faults = fault_schedule(n)
    skips = expected_skips(n)
    sim = simulate_loss_scale(skips)
    for p, rec in enumerate(recs):
        assert rec["injected"].tolist() == [f.step for f in faults if f.process == p]
        unchanged = rec["unchanged"].reshape(STEPS, -1)
        ls = rec["ls"].reshape(STEPS, -1, len(LS_FIELDS))
        assert unchanged.shape[1] == ls.shape[1] == devices  # one copy per local device
        for d in range(devices):
            assert unchanged[:, d].tolist() == skips, f"process {p} device {d}"
            np.testing.assert_array_equal(ls[:, d], sim, err_msg=f"process {p} device {d}")
    assert_identical_everywhere(recs, "state", stacked=name.startswith("shard_map"))
    return recs


# -------------------------------------------------------------------------- tests


def test_the_fault_schedule_moves_the_scale_both_ways() -> None:
    for n in (2, 4):
        faults = fault_schedule(n)
        assert len(faults) == 6
        # Faults land in every one of 2 processes, in 4 of 4 (x and grad kinds mixed).
        assert len({f.process for f in faults}) == {2: 2, 4: 4}[n]
        assert {f.kind for f in faults} == {"x", "grad"}
        assert {bool(np.isnan(f.value)) for f in faults} == {True, False}
        scale = simulate_loss_scale(expected_skips(n))[:, 0]
        assert (np.diff(scale) > 0).sum() >= 3 and (np.diff(scale) < 0).sum() == 2


@pytest.mark.parametrize("name", FAULT_RUNS)
def test_two_processes_skip_together(two: Path, single: Path, name: str) -> None:
    recs = check_fault_run(two, name, 2, 2)
    # One process holding the same 4 devices and faults computes the same bits.
    ref = load(single, name, 1)[0]
    for a, b, leaf in zip(fulls(recs[0], "state"), fulls(ref, "state"), leaf_names(), strict=True):
        assert same_bits(a, b), f"{leaf}: 2 processes x 2 devices != 1 process x 4 devices"
    np.testing.assert_array_equal(
        recs[0]["ls"].reshape(STEPS, -1, 5)[:, 0], ref["ls"].reshape(STEPS, -1, 5)[:, 0]
    )


@pytest.mark.parametrize("name", FAULT_RUNS)
def test_four_processes_skip_together(four: Path, two: Path, name: str) -> None:
    recs = check_fault_run(four, name, 4, 2)
    # Same skips on 8 devices as on 4; XLA splits the reductions differently, so the
    # params and moments agree to float32 rounding (the loss-scale state exactly).
    stacked = name == "shard_map"  # one replica per device: compare replica 0
    for a, b in zip(fulls(recs[0], "state"), fulls(load(two, name, 1)[0], "state"), strict=True):
        np.testing.assert_allclose(
            a[0] if stacked else a, b[0] if stacked else b, rtol=2e-5, atol=1e-6
        )


def test_without_axis_name_shard_map_replicas_drift_and_check_in_sync_says_so(two: Path) -> None:
    recs = load(two, "shard_map_no_axis", 2)
    faults = fault_schedule(2)
    flags = np.concatenate([r["unchanged"].reshape(STEPS, -1) for r in recs], axis=1)
    # A fault in one device's copy of the averaged gradients: only that device skipped.
    for f in faults:
        expected = flags.shape[1] if f.kind == "x" else 1
        assert flags[f.step].sum() == expected, f
    with pytest.raises(AssertionError, match="replica"):
        assert_identical_everywhere(recs, "state", stacked=True)
    messages = [(two / "shard_map_no_axis_check" / f"p{p}.txt").read_text() for p in range(2)]
    assert messages[0] == messages[1]  # every process raised, with the same message
    assert "`scale` differs between processes" in messages[0]
    assert "`skipped_steps` differs between the copies of one process" in messages[0]
    assert "axis_name=" in messages[0]
    # With axis_name, the same check is quiet on every process.
    for p in range(2):
        assert (two / "shard_map_check" / f"p{p}.txt").read_text() == ""


def test_check_in_sync_catches_processes_that_restored_different_states(two: Path) -> None:
    for p in range(2):
        assert (two / "desync_same" / f"p{p}.txt").read_text() == ""
        message = (two / "desync_differ" / f"p{p}.txt").read_text()
        assert "`scale` differs between processes (process 0: 256.0, process 1: 512.0)" in message
        assert "`skipped_steps` differs between processes (process 0: 0, process 1: 3)" in message
        assert "growth_tracker" not in message
        assert "restore the same checkpoint" in message


def test_check_in_sync_in_one_process() -> None:
    import jax.numpy as jnp
    import optax

    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    state = tx.init({"w": jnp.ones(2)})
    jaxamp.check_in_sync(state)
    jaxamp.check_in_sync(jaxamp.get_loss_scale(state))
    stacked = jax.tree.map(lambda a: jnp.stack([a, a, a]), state)  # pmap-style replicas
    jaxamp.check_in_sync(stacked)
    # Replica 2's growth_tracker drifts (built leaf by leaf: replace() wants scalars).
    drifted = jax.tree_util.tree_map_with_path(
        lambda path, a: a.at[2].set(7) if "growth_tracker" in jax.tree_util.keystr(path) else a,
        jaxamp.get_loss_scale(stacked),
    )
    with pytest.raises(RuntimeError, match=r"`growth_tracker` differs .* holds 0 and 7"):
        jaxamp.check_in_sync(drifted)
    with pytest.raises(ValueError, match="LossScaleState"):
        jaxamp.check_in_sync({"w": jnp.ones(2)})


def _every_k_available() -> bool:
    import inspect

    return "every_k" in inspect.signature(jaxamp.skip_nonfinite).parameters


@pytest.mark.skipif(
    not _every_k_available(), reason="jaxamp.skip_nonfinite has no every_k argument yet"
)
def test_every_k_skips_the_whole_window_on_every_process(two: Path) -> None:
    recs = load(two, "every_k", 2)
    windows = EK_STEPS // EVERY_K
    bad_windows = {f.step // EVERY_K for f in EK_FAULTS}
    window_sim = simulate_loss_scale([w in bad_windows for w in range(windows)])
    # The scale and counters move once per window, on its last call.
    state, expected_ls = np.array([2.0**8, 0, 2, 0, 0]), []
    for i in range(EK_STEPS):
        if i % EVERY_K == EVERY_K - 1:
            state = window_sim[i // EVERY_K]
        expected_ls.append(state)
    # Params move only on the last call of a window that was finite everywhere.
    expected_unchanged = [
        i % EVERY_K != EVERY_K - 1 or i // EVERY_K in bad_windows for i in range(EK_STEPS)
    ]
    for p, rec in enumerate(recs):
        assert rec["injected"].tolist() == [f.step for f in EK_FAULTS if f.process == p]
        for d in range(2):
            assert rec["unchanged"].reshape(EK_STEPS, -1)[:, d].tolist() == expected_unchanged
            ls = rec["ls"].reshape(EK_STEPS, -1, 5)[:, d]
            np.testing.assert_array_equal(ls, np.asarray(expected_ls))
    assert_identical_everywhere(recs, "state", tx=make_tx(every_k=EVERY_K))


@pytest.mark.skipif(
    not hasattr(jaxamp, "multi_transform"), reason="jaxamp.multi_transform not available yet"
)
def test_multi_transform_skips_one_partition_on_every_process(two: Path) -> None:
    recs = load(two, "multi_transform", 2)
    bad = {f.step: f for f in MT_FAULTS}
    sim = simulate_loss_scale([i in bad for i in range(MT_STEPS)])
    for p, rec in enumerate(recs):
        assert rec["injected"].tolist() == [f.step for f in MT_FAULTS if f.process == p]
        per_param = rec["unchanged_per_param"].reshape(MT_STEPS, -1, len(PARAMS))
        for i in range(MT_STEPS):
            f = bad.get(i)
            for j, name in enumerate(PARAMS):
                # A NaN in grads["w1"] skips partition "a" (w1, b1) only; a NaN in the
                # batch skips everything.
                skipped = f is not None and (f.kind == "x" or MT_LABELS[name] == "a")
                assert per_param[i, :, j].tolist() == [skipped] * 2, (p, i, name)
        for d in range(2):
            np.testing.assert_array_equal(rec["ls"].reshape(MT_STEPS, -1, 5)[:, d], sim)
    assert_identical_everywhere(recs, "state", tx=make_mt_tx())


def _ls_at(values: list[np.ndarray], field: str) -> float:
    return float(values[leaf_names().index(f"['opt_state'].loss_scale.{field}")])


def test_checkpoint_saved_mid_hysteresis_by_two_processes(two: Path) -> None:
    recs = load(two, "ckpt_save", 2)
    skips = [i in {s for s, *_ in CK_FAULTS} for i in range(CK_STEPS)]
    sim = simulate_loss_scale(skips)
    for rec in recs:
        for d in range(2):
            np.testing.assert_array_equal(rec["ls"].reshape(CK_STEPS, -1, 5)[:, d], sim)
    assert_identical_everywhere(recs, "saved")
    assert_identical_everywhere(recs, "final")
    saved = fulls(recs[0], "saved")
    assert _ls_at(saved, "hysteresis_tracker") == 1 and _ls_at(saved, "nonfinite_streak") == 1
    at_save = tuple(_ls_at(saved, f) for f in LS_FIELDS)
    np.testing.assert_array_equal(at_save, sim[CK_SAVE - 1])
    # The step after the save overflows again: with the window kept, it backs off ...
    rest = skips[CK_SAVE:]
    np.testing.assert_array_equal(simulate_loss_scale(rest, at_save), sim[CK_SAVE:])
    assert sim[CK_SAVE, 0] == sim[CK_SAVE - 1, 0] / 2
    # ... and a restore that lost the window (hysteresis_tracker back to 2) would not, so
    # the restore tests below, which compare with `sim`, would catch it.
    lost = (*at_save[:2], 2, *at_save[3:])
    assert simulate_loss_scale(rest, lost)[0, 0] == sim[CK_SAVE - 1, 0] != sim[CK_SAVE, 0]


@pytest.mark.parametrize("layout", ["2x2", "4x1", "1x4", "4x2"])
def test_restore_into_another_process_count_and_continue(
    two: Path, restored: dict[str, Path], layout: str
) -> None:
    n, k = (int(v) for v in layout.split("x"))
    uninterrupted = load(two, "ckpt_save", 1)[0]
    recs = load(restored[layout], f"ckpt_restore_{n}x{k}", n)
    names = leaf_names()
    for rec in recs:
        assert int(rec["w1_shards"]) == n * k  # restored FSDP-sharded over this mesh
        for a, b, name in zip(
            fulls(rec, "restored"), fulls(uninterrupted, "saved"), names, strict=True
        ):
            assert same_bits(a, b), f"{layout}: restored {name} != saved"
        # The resumed steps skip and scale exactly as the uninterrupted run did.
        rest = CK_STEPS - CK_SAVE
        np.testing.assert_array_equal(
            rec["unchanged"].reshape(rest, -1),
            uninterrupted["unchanged"].reshape(CK_STEPS, -1)[CK_SAVE:, :1].repeat(k, 1),
        )
        for d in range(k):
            np.testing.assert_array_equal(
                rec["ls"].reshape(rest, -1, 5)[:, d],
                uninterrupted["ls"].reshape(CK_STEPS, -1, 5)[CK_SAVE:, 0],
            )
    assert_identical_everywhere(recs, "final")
    final, reference = fulls(recs[0], "final"), fulls(uninterrupted, "final")
    ls_leaves = [i for i, name in enumerate(names) if ".loss_scale." in name]
    assert len(ls_leaves) >= 5
    for i in ls_leaves:
        assert same_bits(final[i], reference[i]), names[i]
    if n * k == 4:
        # The saving run's layout (4 devices, w1 sharded in 4): the same program, bit
        # for bit, whether the 4 devices live in 2 processes, 4 or 1.
        for a, b, name in zip(final, reference, names, strict=True):
            assert same_bits(a, b), f"{layout}: resumed {name} != uninterrupted"
    else:
        # 8 devices: the reductions are split in 8, not 4: float32 rounding.
        for a, b in zip(final, reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_restore_onto_a_mesh_that_does_not_divide_fails_clearly(
    tmp_path: Path, cache: Path, ckpt: Path, two: Path
) -> None:
    # 3 processes x 1 device: w1's 16 rows (and b1's 64) do not split in 3.
    run_scenarios(
        ["ckpt_restore_indivisible"], 3, 1, tmp_path, cache=cache, extra=["--ckpt", str(ckpt)]
    )
    for p in range(3):
        message = (tmp_path / "ckpt_restore_indivisible" / f"p{p}.txt").read_text()
        assert message.startswith("IndivisibleError"), message
        assert "partitioned 3 times" in message and "evenly divide" in message, message


def test_a_process_that_dies_fails_the_launch_at_once(tmp_path: Path, cache: Path) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        run_scenarios(["die"], 2, 2, tmp_path, cache=cache, timeout=120)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert "process 1 exited with code 17" in message
    assert "process 1: dying at step 2" in message  # its output is shown
    assert elapsed < 60, f"took {elapsed:.0f}s to notice"


def test_a_hung_process_times_out_and_everything_is_killed(tmp_path: Path, cache: Path) -> None:
    import os

    with pytest.raises(LaunchError, match=r"timed out after 15s; processes \[0, 1\]"):
        launch(
            [str(Path(__file__).with_name("mp_worker.py")), "--out", str(tmp_path), "hang"],
            2,
            1,
            tmp_path,
            timeout=15,
        )
    time.sleep(0.5)
    for log in tmp_path.glob("process*.log"):
        assert "1 of 2 devices" in log.read_text(), "the processes did start"
    # No worker of this launch survives: none has this directory on its command line.
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert str(tmp_path).encode() not in cmd, f"process {pid} survived"


def test_the_multiprocess_example_runs(tmp_path: Path, cache: Path) -> None:
    import subprocess
    import sys

    from mp_harness import ROOT, worker_env

    env = worker_env(1, cache)  # the example sets each process's device count itself
    proc = subprocess.run(
        [sys.executable, "examples/multiprocess.py", "--processes", "2", "--devices", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes, 4 devices: every process skipped step 3" in proc.stdout
    assert "in sync on every device" in proc.stdout
