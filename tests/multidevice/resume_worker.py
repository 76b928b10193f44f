"""Restores an FSDP training run in a fresh process and trains it to the end.

Run by ``test_resume.py`` as
``python resume_worker.py CKPT_DIR OUT_DIR STEP [STEP ...]`` with ``XLA_FLAGS``
choosing the device count (8, or 4 to restore onto fewer devices). For each STEP
it restores that checkpoint into an abstract target sharded over its own mesh,
trains to the end and writes ``restored_STEP.npz`` and ``final_STEP.npz``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(ckpt_dir: str, out_dir: str, steps: list[int]) -> None:
    import functools

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P
    from md_harness import (
        RESUME_STEPS,
        batches,
        fsdp_shardings,
        global_step,
        init_params,
        leaves_np,
        make_tx,
        resume_fault,
    )

    import jaxamp

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    tx = make_tx()
    step_fn = jax.jit(functools.partial(global_step, tx))
    xs, ys = batches(RESUME_STEPS)
    batch_sharding = NamedSharding(mesh, P("data"))
    xs = [jax.device_put(x, batch_sharding) for x in xs]
    ys = [jax.device_put(y, batch_sharding) for y in ys]
    faults = [
        jax.device_put(resume_fault(i), NamedSharding(mesh, P())) for i in range(RESUME_STEPS)
    ]

    # The abstract target: shapes from eval_shape, shardings for *this* mesh.
    params = init_params()
    abstract = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})

    target = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        abstract,
        fsdp_shardings(mesh, abstract),
    )

    with ocp.CheckpointManager(ckpt_dir) as mngr:
        for n in steps:
            state = jaxamp.checkpoint.restore(mngr, target, step=n)
            np.savez(os.path.join(out_dir, f"restored_{n}.npz"), *leaves_np(state))
            p, o = state["params"], state["opt_state"]
            assert p["w1"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
            with jax.transfer_guard("disallow"):
                for i in range(n, RESUME_STEPS):
                    p, o, _ = step_fn(p, o, xs[i], ys[i], faults[i])
            np.savez(
                os.path.join(out_dir, f"final_{n}.npz"), *leaves_np({"params": p, "opt_state": o})
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]])
