"""Flax linen + ``jaxamp.TrainState``: float16 training with a dynamic loss scale.

``jaxamp.TrainState`` is a ``flax.training.train_state.TrainState`` whose
``apply_gradients`` skips a non-finite step as a whole and whose ``loss_scale``
property is the current loss-scale state. The model keeps float32 parameters;
``jaxamp.autocast`` runs its matmuls in float16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp


class MLP(nn.Module):
    """A two-layer classifier."""

    hidden: int = 128
    classes: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(self.classes)(nn.gelu(nn.Dense(self.hidden)(x)))


def make_data(n: int = 512) -> tuple[jax.Array, jax.Array]:
    """Points labelled by the quadrant their first two coordinates fall in."""
    x = jax.random.normal(jax.random.key(0), (n, 16))
    y = (x[:, 0] > 0).astype(jnp.int32) * 2 + (x[:, 1] > 0).astype(jnp.int32)
    return x, y


@jax.jit
def train_step(state: jaxamp.TrainState, x: jax.Array, y: jax.Array):
    """One step: scaled loss, gradients, and a step that is skipped on overflow."""

    def loss_fn(params):
        logits = jaxamp.autocast(state.apply_fn, dtype=jnp.float16)(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # The state holds the loss scale: the loss comes back unscaled, the grads scaled.
    loss, grads = jaxamp.value_and_grad(loss_fn)(state, state.params)
    return state.apply_gradients(grads=grads), loss


def main() -> None:
    """Trains for 300 steps and prints the loss, the loss scale and the skipped steps."""
    x, y = make_data()
    model = MLP()
    state = jaxamp.TrainState.create(
        apply_fn=model.apply,
        params=model.init(jax.random.key(1), x),
        tx=jaxamp.skip_nonfinite(optax.adamw(3e-3), jaxamp.dynamic_scale(growth_interval=100)),
    )
    for i in range(301):
        state, loss = train_step(state, x, y)
        if i % 100 == 0:
            m = jaxamp.metrics(state)
            print(
                f"step {i:3d}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']}"
            )
    accuracy = jnp.mean(jnp.argmax(model.apply(state.params, x), -1) == y)
    print(f"train accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
