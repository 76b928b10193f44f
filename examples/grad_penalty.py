"""Gradient penalty with loss scaling: the inner gradients are scaled, then unscaled.

PyTorch::

    scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(),
                                       create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]          # unscale by hand
    with autocast(...):
        loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

The penalty's own gradients are computed in float16 too, so they are taken of the
*scaled* loss (or they underflow) and unscaled before the penalty is formed; the
outer loss (loss + penalty) is then scaled as usual. In JAX the "create_graph" is
free: ``jax.grad`` inside the loss is differentiable. ``jaxamp.unscale_and_check``
is differentiable too; its ``finite`` flag is not needed here because
``jaxamp.step`` checks the final gradients (an inf anywhere makes them non-finite).

``tests/repo/test_examples.py`` runs this loop with float32 compute and an inf batch at
step 2, and checks that the parameters equal, to float32 rounding, those of the plain
float32 optax loop on ``loss + ||grad loss||`` that leaves that batch out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

model = nn.Sequential([nn.Dense(32), nn.tanh, nn.Dense(1)])


def make_data(steps: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (steps, 64, 8))
    return x, jnp.sin(x.sum(axis=-1, keepdims=True))


def loss_fn(params, x, y, amp: bool = True):
    pred = jaxamp.autocast(model.apply, dtype=jnp.float16, enabled=amp)(params, x)
    return jnp.mean((pred - y) ** 2)


def penalized_loss(params, ls, x, y, amp: bool = True):
    """``loss + ||d loss / d params||``, the inner gradients taken of the scaled loss."""
    scaled_grads = jax.grad(lambda p: jaxamp.scale(ls, loss_fn(p, x, y, amp)))(params)
    grads, _ = jaxamp.unscale_and_check(ls, scaled_grads)  # inv_scale, as in PyTorch
    penalty = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return loss_fn(params, x, y, amp) + penalty


def make_tx() -> optax.GradientTransformation:
    return jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(growth_interval=50))


def make_train_step(tx: optax.GradientTransformation, amp: bool = True):
    @jax.jit
    def train_step(params, opt_state, x, y):
        ls = jaxamp.get_loss_scale(opt_state)
        loss, grads = jaxamp.value_and_grad(penalized_loss)(ls, params, ls, x, y, amp)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    return train_step


def main() -> None:
    """Trains 200 steps on ``loss + gradient norm``."""
    xs, ys = make_data(1)
    params = model.init(jax.random.key(1), xs[0])
    tx = make_tx()
    opt_state = tx.init(params)
    train_step = make_train_step(tx)
    for i in range(201):
        params, opt_state, loss = train_step(params, opt_state, xs[0], ys[0])
        if i % 50 == 0:
            m = jaxamp.metrics(opt_state)
            print(
                f"step {i:3d}  loss + penalty {loss:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']}"
            )


if __name__ == "__main__":
    main()
