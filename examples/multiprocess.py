"""Multi-process (multi-host) mixed-precision training with jaxamp, run locally.

On a cluster you start one process per host and each calls
``jax.distributed.initialize``; here the launcher starts N processes on this
machine the same way (a coordinator on 127.0.0.1, K simulated CPU devices each,
gloo collectives between them). Together they train a small MLP with float16
compute and dynamic loss scaling under ``jax.jit`` over one global mesh, params
and Adam moments sharded FSDP-style over all N*K devices:

- at step 3 one process's *local* batch holds an inf: every process skips the step;
- after step 5 every process saves one orbax checkpoint (``CheckpointManager``
  over the global arrays), restores it and checks with ``jaxamp.check_in_sync``
  that every device holds the same loss-scale state.

    python examples/multiprocess.py                       # 2 processes x 2 devices
    python examples/multiprocess.py --processes 4 --devices 2

One process of the run (what a cluster launcher starts on each host; with SLURM,
Open MPI or on Cloud TPU, ``jax.distributed.initialize()`` needs no arguments):

    python examples/multiprocess.py --worker --ckpt SHARED_DIR \
        --coordinator HOST:PORT --num-processes N --process-id I
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

STEPS, BAD_STEP, SAVE_AFTER = 8, 3, 5
IN, HIDDEN, PER_DEVICE_BATCH = 16, 64, 8


def worker(coordinator: str | None, num_processes: int | None, process_id: int | None, ckpt: str):
    import jax

    jax.distributed.initialize(coordinator, num_processes, process_id)  # before any JAX work

    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    me, n_dev = jax.process_index(), jax.device_count()
    # Every device of every process; Auto axes: XLA propagates the shardings.
    mesh = jax.make_mesh((n_dev,), ("data",), axis_types=(AxisType.Auto,))
    # FSDP: split first dimensions that divide over the devices, replicate the rest
    # (scalars, and jaxamp's small per-leaf record in the optimizer state).
    fsdp = lambda a: NamedSharding(  # noqa: E731
        mesh, P("data") if a.ndim and a.shape[0] % n_dev == 0 else P()
    )
    batch_sharding = NamedSharding(mesh, P("data"))

    def loss_fn(params, x, y):
        p = jax.tree.map(lambda a: a.astype(jnp.float16), params)  # float16 compute
        h = jnp.tanh(x.astype(jnp.float16) @ p["w1"] + p["b1"])
        return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)

    tx = jaxamp.skip_nonfinite(
        optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**10, growth_interval=2)
    )

    @jax.jit
    def train_step(params, opt_state, x, y):  # no axis_name: the check is a global reduction
        ls = jaxamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jaxamp.scale(ls, loss_fn(p, x, y)))(params)
        return jaxamp.step(tx, grads, opt_state, params)

    # Every process builds the same initial params (same seed) and puts its shards.
    rng = np.random.default_rng(0)
    init = {
        "w1": (rng.normal(size=(IN, HIDDEN)) / 4).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, 1)) / 8).astype(np.float32),
    }
    params = {
        k: jax.make_array_from_callback(v.shape, fsdp(v), lambda i, v=v: v[i])
        for k, v in init.items()
    }
    abstract = jax.eval_shape(tx.init, init)
    opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(fsdp, abstract))(params)

    # Each process loads only its own part of the global batch, as a data loader would.
    local_rows = PER_DEVICE_BATCH * jax.local_device_count()
    global_shape = (local_rows * jax.process_count(), IN)
    data = np.random.default_rng(1 + me)
    for i in range(STEPS):
        x = data.normal(size=(local_rows, IN)).astype(np.float32)
        y = np.sin(x.sum(-1, keepdims=True))
        if i == BAD_STEP and me == jax.process_count() - 1:
            x[0, 0] = np.inf  # a bad sample in the last process's data only
        x = jax.make_array_from_process_local_data(batch_sharding, x, global_shape)
        y = jax.make_array_from_process_local_data(batch_sharding, y, (global_shape[0], 1))
        params, opt_state = train_step(params, opt_state, x, y)
        if i + 1 == SAVE_AFTER:
            with ocp.CheckpointManager(ckpt) as mngr:  # every process calls save
                mngr.save(i + 1, args=ocp.args.StandardSave({"p": params, "o": opt_state}))
                mngr.wait_until_finished()
        m = jaxamp.metrics(opt_state)  # replicated scalars: each process reads its copy
        if me == 0:
            print(
                f"step {i}: loss scale {float(m['loss_scale']):g}, "
                f"skipped {int(m['skipped_steps'])}",
                flush=True,
            )
    assert int(jaxamp.metrics(opt_state)["skipped_steps"]) == 1  # on every process

    # Restore (e.g. after a preemption) into an abstract target sharded over this mesh.
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"p": params, "o": opt_state},
    )
    with ocp.CheckpointManager(ckpt) as mngr:
        restored = jaxamp.checkpoint.restore(mngr, target, step=SAVE_AFTER)
    jaxamp.check_in_sync(restored["o"])  # collective: every process calls it
    if me == 0:
        ls = jaxamp.get_loss_scale(restored["o"])
        print(
            f"{jax.process_count()} processes, {n_dev} devices: every process skipped step "
            f"{BAD_STEP}; restored step {SAVE_AFTER}: loss scale {float(ls.scale):g}, "
            f"in sync on every device",
            flush=True,
        )
    jax.distributed.shutdown()


def launch(n: int, devices: int, timeout: float) -> int:
    """Starts ``n`` local worker processes and waits; kills them all if one fails."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",  # before JAX starts
    )
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint: one directory, shared
        ckpt = os.path.join(tmp, "ckpt")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--coordinator", f"127.0.0.1:{port}"]
                + ["--num-processes", str(n), "--process-id", str(i), "--ckpt", ckpt],
                env=env,
                start_new_session=True,  # its own process group, killed as a whole
            )
            for i in range(n)
        ]
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    print(
                        f"a process failed (exit codes {codes}); stopping the others",
                        file=sys.stderr,
                    )
                    return 1
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    print(f"timed out after {timeout:g}s; stopping all processes", file=sys.stderr)
                    return 1
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="local processes to launch")
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true", help="run one process of the job")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "jaxamp_mp_ckpt"))
    args = parser.parse_args()
    if args.worker:
        worker(args.coordinator, args.num_processes, args.process_id, args.ckpt)
    else:
        sys.exit(launch(args.processes, args.devices, args.timeout))
