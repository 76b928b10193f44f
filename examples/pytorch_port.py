"""PyTorch AMP's "typical mixed precision training" loop, ported to jaxamp line by line.

Each PyTorch line is in a comment (``# torch:``) right above its jaxamp
counterpart. The differences come from JAX being functional: gradients are
values (nothing to zero), the optimizer and the scaler are one optax
transformation whose state holds the loss scale, and ``scaler.step`` +
``scaler.update`` are one call, ``jaxamp.step``, inside a jitted function.
``jaxamp.compat.torch_grad_scaler()`` has ``GradScaler``'s defaults and scale
trajectory (init 2**16, x2 after 2000 clean steps, x0.5 on overflow).
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


def loss_fn(output: jax.Array, target: jax.Array) -> jax.Array:
    """Cross-entropy, like ``torch.nn.CrossEntropyLoss()``."""
    return optax.softmax_cross_entropy_with_integer_labels(output, target).mean()


def main() -> None:
    """Runs 3 epochs of 8 batches and prints the loss and the scaler's state."""
    key_x, key_w = jax.random.split(jax.random.key(0))
    inputs = jax.random.normal(key_x, (8, 32, 20))  # 8 batches of 32
    targets = jnp.argmax(inputs[..., :10] @ jax.random.normal(key_w, (10, 10)), axis=-1)
    data = list(zip(inputs, targets, strict=True))
    epochs = range(3)

    # torch: model = Net().cuda()                      # parameters in default precision
    model = Net()
    params = model.init(jax.random.key(1), inputs[0])  # float32 master weights
    # torch: optimizer = optim.SGD(model.parameters(), lr=0.1)
    # torch: scaler = torch.amp.GradScaler()           # created once, before training
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.compat.torch_grad_scaler())
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, input, target):
        # torch: optimizer.zero_grad()                 # nothing to do: grads are values
        def scaled_loss(params):
            # torch: with torch.autocast(device_type="cuda", dtype=torch.float16):
            # torch:     output = model(input)
            output = jaxamp.autocast(model.apply, dtype=jnp.float16)(params, input)
            # torch:     loss = loss_fn(output, target)   # autocast runs it in float32
            loss = jaxamp.autocast(loss_fn, dtype=jnp.float16)(output, target)
            # torch: scaler.scale(loss).backward()       # (the backward is jax.grad below)
            return jaxamp.scale(jaxamp.get_loss_scale(opt_state), loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        # torch: scaler.step(optimizer)                # unscale; skip if inf/NaN
        # torch: scaler.update()                       # grow or back off the scale
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    # torch: for epoch in epochs:
    # torch:     for input, target in data:
    for epoch in epochs:
        for input, target in data:
            params, opt_state, loss = train_step(params, opt_state, input, target)
        # torch: print(loss.item(), scaler.get_scale())  # once per epoch: one host sync
        m = jaxamp.metrics(opt_state)
        print(
            f"epoch {epoch}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
            f"skipped {m['skipped_steps']}"
        )
    # For clipping, PyTorch calls scaler.unscale_(optimizer) then clip_grad_norm_;
    # with jaxamp put optax.clip_by_global_norm inside skip_nonfinite (grad_clipping.py).


if __name__ == "__main__":
    main()
