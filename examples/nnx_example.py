"""Flax nnx: float16 compute with ``jaxamp.autocast`` and a dynamic loss scale.

The nnx module is split into a static graph and its float32 parameters; the
jitted step merges them, runs the module under ``autocast`` (matmuls in float16,
the loss in float32), and updates the parameters with ``jaxamp.step``, which
skips the whole update when the scaled gradients overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxamp


class MLP(nnx.Module):
    """A two-layer regressor."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(8, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.l1(x)))


def main() -> None:
    """Fits ``sin(sum(x))`` for 300 steps and prints the loss and the loss scale."""
    x = jax.random.normal(jax.random.key(0), (256, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    graphdef, params = nnx.split(MLP(nnx.Rngs(1)), nnx.Param)
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(growth_interval=100))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            pred = jaxamp.autocast(model, dtype=jnp.float16)(x)  # float16 matmuls
            return jnp.mean((pred - y) ** 2)

        loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    for i in range(301):
        params, opt_state, loss = train_step(params, opt_state)
        if i % 100 == 0:
            m = jaxamp.metrics(opt_state)
            print(
                f"step {i:3d}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']}"
            )
    model = nnx.merge(graphdef, params)  # back to a stateful module for inference
    print(f"final loss in float32: {jnp.mean((model(x) - y) ** 2):.4f}")


if __name__ == "__main__":
    main()
