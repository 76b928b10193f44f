"""Checkpoint a jaxamp training run with orbax and resume it, bit for bit.

The loss-scale state (scale, counters and its configuration) lives inside the
optimizer state as array leaves, so orbax saves it with everything else. This
example trains a small MLP with float16 compute and dynamic loss scaling, saves
with a ``CheckpointManager`` mid-run, restores into an *abstract* target, resumes,
and checks that the result equals an uninterrupted run.

    python examples/checkpointing.py
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxamp

STEPS, SAVE_AT = 30, 12


def init_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(8, 32)) / np.sqrt(8), jnp.float32),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.normal(size=(32, 1)) / np.sqrt(32), jnp.float32),
    }


def loss_fn(params, x, y):
    p = jax.tree.map(lambda a: a.astype(jnp.float16), params)  # float16 compute
    pred = jnp.tanh(x.astype(jnp.float16) @ p["w1"] + p["b1"]) @ p["w2"]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


tx = jaxamp.skip_nonfinite(
    optax.adam(3e-3), jaxamp.dynamic_scale(init_scale=2.0**12, growth_interval=5, hysteresis=2)
)


@jax.jit
def train_step(params, opt_state, x, y):
    loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)
    params, opt_state = jaxamp.step(tx, grads, opt_state, params)
    return params, opt_state, loss


def batches():
    rng = np.random.default_rng(1)
    for i in range(STEPS):
        x = rng.normal(size=(64, 8)).astype(np.float32)
        y = np.sin(x.sum(-1, keepdims=True))
        if i == SAVE_AT - 1:
            x[0, 0] = np.inf  # an overflow just before the save: it lands mid-hysteresis
        yield jnp.asarray(x), jnp.asarray(y)


def train(state, data, start, stop, mngr=None):
    for i, (x, y) in enumerate(data):
        if i < start:
            continue
        if mngr is not None and i == SAVE_AT:
            mngr.save(i, args=ocp.args.StandardSave(state))
        if i == stop:
            break
        params, opt_state, _ = train_step(state["params"], state["opt_state"], x, y)
        state = {"params": params, "opt_state": opt_state}
    return state


def main() -> None:
    params = init_params()
    fresh = {"params": params, "opt_state": tx.init(params)}

    with tempfile.TemporaryDirectory() as tmp:
        # 1. Train, saving at step SAVE_AT (orbax saves asynchronously).
        with ocp.CheckpointManager(tmp, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
            uninterrupted = train(fresh, batches(), 0, STEPS, mngr=m)
            m.wait_until_finished()

        # 2. "Restart": restore into an abstract target (shapes, dtypes, shardings only).
        target = jax.eval_shape(lambda: {"params": init_params(), "opt_state": tx.init(params)})
        with ocp.CheckpointManager(tmp) as m:
            restored = jaxamp.checkpoint.restore(m, target)  # the latest step
        ls = jaxamp.get_loss_scale(restored["opt_state"])
        print(
            f"restored step {SAVE_AT}: scale={float(ls.scale):g} "
            f"hysteresis_tracker={int(ls.hysteresis_tracker)} "
            f"nonfinite_streak={int(ls.nonfinite_streak)} skipped={int(ls.skipped_steps)}"
        )

        # 3. Resume and compare with the run that never stopped.
        resumed = train(restored, batches(), SAVE_AT, STEPS)
    same = all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True)
    )
    print(f"resumed run equals the uninterrupted one bit for bit: {same}")
    print("final metrics:", {k: float(v) for k, v in jaxamp.metrics(resumed["opt_state"]).items()})
    assert same

    # 4. A checkpoint without a loss-scale state fails clearly.
    with tempfile.TemporaryDirectory() as tmp:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(f"{tmp}/plain", {"params": params, "opt_state": optax.adam(3e-3).init(params)})
        ckptr.wait_until_finished()
        try:
            jaxamp.checkpoint.restore(ckptr, target, directory=f"{tmp}/plain")
        except ValueError as e:
            print("plain optax checkpoint:", str(e)[:120], "...")


if __name__ == "__main__":
    main()
