"""Multiple models, losses and optimizers, one loss scale: ``jaxamp.multi_transform``.

PyTorch::

    scaler = torch.amp.GradScaler()
    with autocast(...):
        output0, output1 = model0(input), model1(input)
        loss0 = loss_fn(2 * output0 + 3 * output1, target)
        loss1 = loss_fn(3 * output0 - 5 * output1, target)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()        # .grad holds d(loss0 + loss1), scaled
    scaler.step(optimizer0)               # each optimizer checks its own params'
    scaler.step(optimizer1)               #   gradients and skips on its own
    scaler.update()                       # once, with "any optimizer saw an inf"

jaxamp: both models' params in one tree, one labelled optimizer per model, one
shared scale. Gradients are values, so the two backward passes are one gradient
of ``loss0 + loss1``. A non-finite gradient in model1's partition skips
optimizer1's step (model1's params unchanged bit for bit, its Adam count not advanced) while
optimizer0 steps as usual, and the scale backs off once.

``tests/repo/test_examples.py`` runs this loop with float32 compute, overflows model1's
gradients at step 2, and checks the parameters against the plain float32 loop of
two optax optimizers in which only optimizer1 leaves out step 2 (to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

model0 = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(1)])
model1 = nn.Sequential([nn.Dense(16), nn.tanh, nn.Dense(1)])


def make_data(steps: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (steps, 64, 8))
    return x, jnp.sin(x.sum(axis=-1, keepdims=True))


def init_params(x: jax.Array) -> dict:
    return {
        "model0": model0.init(jax.random.key(1), x),
        "model1": model1.init(jax.random.key(2), x),
    }


def losses(params, input, target, amp: bool = True):
    """``(loss0 + loss1, (loss0, loss1))``: PyTorch's two losses of the two models' outputs."""
    amp0 = jaxamp.autocast(model0.apply, dtype=jnp.float16, enabled=amp)
    amp1 = jaxamp.autocast(model1.apply, dtype=jnp.float16, enabled=amp)
    output0, output1 = amp0(params["model0"], input), amp1(params["model1"], input)
    loss0 = jnp.mean((2 * output0 + 3 * output1 - target) ** 2)
    loss1 = jnp.mean((3 * output0 - 5 * output1 - target) ** 2)
    return loss0 + loss1, (loss0, loss1)


def make_tx() -> optax.GradientTransformation:
    return jaxamp.multi_transform(
        {"opt0": optax.sgd(1e-2, momentum=0.9), "opt1": optax.adam(1e-3)},
        {"model0": "opt0", "model1": "opt1"},  # a label per model (a prefix of the params)
        jaxamp.dynamic_scale(init_scale=2.0**10, growth_interval=100),
    )


def make_train_step(tx: optax.GradientTransformation, amp: bool = True):
    @jax.jit
    def train_step(params, opt_state, input, target, fault):
        (_, (loss0, loss1)), grads = jaxamp.value_and_grad(losses, has_aux=True)(
            opt_state, params, input, target, amp
        )
        # Simulated overflow in model1's backward pass when `fault` is set.
        grads["model1"] = jax.tree.map(lambda g: jnp.where(fault, jnp.inf, g), grads["model1"])
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, (loss0, loss1)

    return train_step


def main() -> None:
    """Trains 200 steps; model1's gradients overflow at step 100."""
    xs, ys = make_data(1)
    params = init_params(xs[0])
    tx = make_tx()
    opt_state = tx.init(params)
    train_step = make_train_step(tx)
    for i in range(201):
        before = params["model0"]
        fault = jnp.array(i == 100)
        params, opt_state, (loss0, loss1) = train_step(params, opt_state, xs[0], ys[0], fault)
        if i % 50 == 0:
            m = jaxamp.metrics(opt_state)
            moved = any(
                bool(jnp.any(a != b))
                for a, b in zip(
                    jax.tree.leaves(before), jax.tree.leaves(params["model0"]), strict=True
                )
            )
            print(
                f"step {i:3d}  loss0 {loss0:.4f}  loss1 {loss1:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']}  model0 stepped: {moved}"
            )


if __name__ == "__main__":
    main()
