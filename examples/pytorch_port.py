"""PyTorch AMP's "typical mixed precision training" loop, ported to jaxamp line by line.

Each PyTorch line is in a comment (``# torch:``) right above its jaxamp
counterpart. The differences come from JAX being functional: gradients are
values (nothing to zero), the optimizer and the scaler are one optax
transformation whose state holds the loss scale, and ``scaler.step`` +
``scaler.update`` are one call, ``jaxamp.step``, inside a jitted function.
``jaxamp.compat.torch_grad_scaler()`` has ``GradScaler``'s defaults and scale
trajectory (init 2**16, x2 after 2000 clean steps, x0.5 on overflow).

An overflowing step is skipped as a whole: ``tests/repo/test_examples.py`` feeds this
loop (with float32 compute) an inf batch and checks that the skipped step leaves the
parameters unchanged bit for bit and that every step equals the plain float32 optax
loop that leaves that batch out (to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp


class Net(nn.Module):
    """A small classifier standing in for PyTorch's ``Net``."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


model = Net()


def loss_fn(output: jax.Array, target: jax.Array) -> jax.Array:
    """Cross-entropy, like ``torch.nn.CrossEntropyLoss()``."""
    return optax.softmax_cross_entropy_with_integer_labels(output, target).mean()


def make_data(batches: int = 8) -> tuple[jax.Array, jax.Array]:
    """``batches`` batches of 32 inputs of 20 features, labelled by a fixed linear map."""
    key_x, key_w = jax.random.split(jax.random.key(0))
    inputs = jax.random.normal(key_x, (batches, 32, 20))
    targets = jnp.argmax(inputs[..., :10] @ jax.random.normal(key_w, (10, 10)), axis=-1)
    return inputs, targets


def make_train_step(tx: optax.GradientTransformation, amp: bool = True):
    """The jitted step; ``amp=False`` turns autocast off (float32 compute, same scaling)."""

    def forward(params, input, target):
        # torch: with torch.autocast(device_type="cuda", dtype=torch.float16):
        # torch:     output = model(input)
        # torch:     loss = loss_fn(output, target)       # autocast runs it in float32
        output = jaxamp.autocast(model.apply, dtype=jnp.float16, enabled=amp)(params, input)
        return jaxamp.autocast(loss_fn, dtype=jnp.float16, enabled=amp)(output, target)

    @jax.jit
    def train_step(params, opt_state, input, target):
        # torch: optimizer.zero_grad()                 # nothing to do: grads are values
        # torch: scaler.scale(loss).backward()         # gradients of the scaled loss
        loss, grads = jaxamp.value_and_grad(forward)(opt_state, params, input, target)
        # torch: scaler.step(optimizer)                # unscale; skip if inf/NaN
        # torch: scaler.update()                       # grow or back off the scale
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    return train_step


def main() -> None:
    """Runs 3 epochs of 8 batches and prints the loss and the scaler's state."""
    inputs, targets = make_data()
    epochs = range(3)

    # torch: model = Net().cuda()                      # parameters in default precision
    params = model.init(jax.random.key(1), inputs[0])  # float32 master weights
    # torch: optimizer = optim.SGD(model.parameters(), lr=0.1)
    # torch: scaler = torch.amp.GradScaler()           # created once, before training
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.compat.torch_grad_scaler())
    opt_state = tx.init(params)
    train_step = make_train_step(tx)

    # torch: for epoch in epochs:
    # torch:     for input, target in data:
    for epoch in epochs:
        for input, target in zip(inputs, targets, strict=True):
            params, opt_state, loss = train_step(params, opt_state, input, target)
        # torch: print(loss.item(), scaler.get_scale())  # once per epoch: one host sync
        m = jaxamp.metrics(opt_state)
        print(
            f"epoch {epoch}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
            f"skipped {m['skipped_steps']}"
        )
    # Clipping and other edits of the unscaled gradients: grad_clipping.py, unscaled_grads.py.


if __name__ == "__main__":
    main()
