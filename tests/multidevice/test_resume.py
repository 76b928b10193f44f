"""Save an FSDP run mid-hysteresis, resume it in fresh processes on 8 and on 4 devices.

This process trains on 8 devices with params and moments sharded FSDP-style,
saves with a ``CheckpointManager`` after 2 steps (``growth_tracker > 0``) and
after 7 (in a hysteresis window), and trains on uninterrupted. Two fresh
processes (``resume_worker.py``), one with 8 devices and one with 4, restore
each checkpoint into a sharded abstract target and train to the end.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from md_harness import (
    HIDDEN,
    RESUME_FAULTS,
    RESUME_SAVES,
    RESUME_STEPS,
    batches,
    fsdp_init,
    global_step,
    init_params,
    leaves_np,
    make_tx,
    resume_fault,
)

import jaxamp

WORKER = Path(__file__).with_name("resume_worker.py")
N_LOSS_SCALE_LEAVES = len(jax.tree.leaves(jaxamp.dynamic_scale()))


def _spawn(n_devices: int, ckpt: Path, out: Path) -> subprocess.Popen:
    out.mkdir()
    env = dict(
        os.environ,
        # This process's other flags too (make test's LLVM level): "the same program"
        # below means the same code, bit for bit.
        XLA_FLAGS=" ".join(
            [f"--xla_force_host_platform_device_count={n_devices}"]
            + [
                f
                for f in os.environ.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")
            ]
        ),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    )
    steps = [str(s) for s in RESUME_SAVES]
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(ckpt), str(out), *steps],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _load(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _loss_scale_slice(state) -> slice:
    """Where the loss-scale leaves sit in the flattened {"params", "opt_state"} tree."""
    leaves = jax.tree.leaves(state)
    ls_leaves = jax.tree.leaves(jaxamp.get_loss_scale(state["opt_state"]))
    start = next(i for i, a in enumerate(leaves) if a is ls_leaves[0])
    assert len(ls_leaves) == N_LOSS_SCALE_LEAVES
    return slice(start, start + N_LOSS_SCALE_LEAVES)


def test_resume_in_a_fresh_process_on_8_and_on_4_devices(tmp_path: Path) -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tx = make_tx()
    step = jax.jit(functools.partial(global_step, tx))
    xs, ys = batches(RESUME_STEPS)
    xs = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in xs]
    ys = [jax.device_put(y, NamedSharding(mesh, P("data"))) for y in ys]
    faults = [
        jax.device_put(resume_fault(i), NamedSharding(mesh, P())) for i in range(RESUME_STEPS)
    ]
    params = jax.device_put(init_params(), NamedSharding(mesh, P("data")))
    opt_state = fsdp_init(tx, params, mesh)
    assert opt_state.inner_state[0].mu["w1"].sharding.is_equivalent_to(params["w1"].sharding, 2)

    saved = {}
    ckpt = tmp_path / "ckpt"
    with ocp.CheckpointManager(ckpt) as mngr:
        for i in range(RESUME_STEPS):
            if i in RESUME_SAVES:
                state = {"params": params, "opt_state": opt_state}
                mngr.save(i, args=ocp.args.StandardSave(state))
                saved[i] = leaves_np(state)
            with jax.transfer_guard("disallow"):
                params, opt_state, _ = step(params, opt_state, xs[i], ys[i], faults[i])
        mngr.wait_until_finished()
    final_state = {"params": params, "opt_state": opt_state}
    final = leaves_np(final_state)
    ls_at = _loss_scale_slice(final_state)

    ls = jaxamp.metrics(opt_state)
    assert int(ls["skipped_steps"]) == len(RESUME_FAULTS)
    # What the two checkpoints hold: mid growth interval, and mid hysteresis window.
    ls_paths = jax.tree_util.tree_flatten_with_path(jaxamp.get_loss_scale(opt_state))[0]
    names = [path[-1].name for path, _ in ls_paths]  # in leaf order
    at_2 = dict(zip(names, saved[2][ls_at], strict=True))
    at_7 = dict(zip(names, saved[7][ls_at], strict=True))
    assert at_2["growth_tracker"] == 2 and at_2["hysteresis_tracker"] == 2
    assert at_7["hysteresis_tracker"] == 1 and at_7["nonfinite_streak"] == 1

    workers = {n: _spawn(n, ckpt, tmp_path / f"out{n}") for n in (8, 4)}
    for n, proc in workers.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"worker on {n} devices failed:\n{out[-4000:]}"

    for n_saved in RESUME_SAVES:
        for n in (8, 4):
            restored = _load(tmp_path / f"out{n}" / f"restored_{n_saved}.npz")
            for a, b in zip(restored, saved[n_saved], strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)  # the restore itself is exact
        # Same device count, same program: the resumed run is bit-identical.
        for a, b in zip(_load(tmp_path / "out8" / f"final_{n_saved}.npz"), final, strict=True):
            np.testing.assert_array_equal(a, b)
        # On 4 devices the reductions split differently: the loss-scale state (which
        # only depends on which steps were skipped) is still exact, the rest is close.
        on_4 = _load(tmp_path / "out4" / f"final_{n_saved}.npz")
        for a, b in zip(on_4[ls_at], final[ls_at], strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(on_4, final, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert HIDDEN % 8 == 0 and HIDDEN % 4 == 0
