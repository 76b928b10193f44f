"""Gradient accumulation with ``optax.MultiSteps`` around ``jaxamp.skip_nonfinite``.

Each micro-batch's gradient is computed from the *scaled* loss and handed to
``MultiSteps``, which averages ``every_k`` of them before the wrapped optimizer
runs once. ``skip_nonfinite`` sits inside, so it sees the averaged gradient: it
unscales it, and if any micro-batch overflowed (an inf in the average) the whole
accumulated step is skipped and the loss scale backs off. The loss scale only
changes on those real steps, so all micro-batches of one step share one scale.
(The other nesting, ``skip_nonfinite(optax.MultiSteps(...))``, also works: it
then checks every micro-batch on its own.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

EVERY_K = 4  # micro-batches per optimizer step


def main() -> None:
    """Trains a small MLP with 4 micro-batches per step and prints what happens."""
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])
    x = jax.random.normal(jax.random.key(0), (EVERY_K * 64, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    micro_x, micro_y = x.reshape(EVERY_K, 64, 8), y.reshape(EVERY_K, 64, 1)
    params = model.init(jax.random.key(1), x)
    inner = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(growth_interval=50))
    tx = optax.MultiSteps(inner, every_k_schedule=EVERY_K)
    opt_state = tx.init(params)
    amp_apply = jaxamp.autocast(model.apply, dtype=jnp.float16)

    @jax.jit
    def micro_step(params, opt_state, xb, yb):
        loss_scale = jaxamp.get_loss_scale(opt_state)  # found inside MultiSteps' state

        def loss_fn(p):
            loss = jnp.mean((amp_apply(p, xb) - yb) ** 2)
            return jaxamp.scale(loss_scale, loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        # Params change only on every EVERY_K-th call; the others accumulate.
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    for step in range(151):
        for k in range(EVERY_K):
            params, opt_state, loss = micro_step(params, opt_state, micro_x[k], micro_y[k])
        if step % 50 == 0:
            m = jaxamp.metrics(opt_state)
            print(
                f"step {step:3d} ({EVERY_K} micro-batches)  loss {loss:.4f}  "
                f"scale {m['loss_scale']:g}  skipped {m['skipped_steps']}"
            )


if __name__ == "__main__":
    main()
