"""Gradient clipping with loss scaling: clip *inside* ``skip_nonfinite``.

The gradients of a scaled loss are ``scale`` times too large, so clipping them
directly would clip against the wrong norm (PyTorch asks for
``scaler.unscale_(optimizer)`` before ``clip_grad_norm_`` for this reason).
With jaxamp, put the clipping in the inner chain: ``skip_nonfinite`` unscales
before ``inner`` runs, so ``clip_by_global_norm`` sees the true gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

MAX_NORM = 0.5


def main() -> None:
    """Trains with clipping inside; shows the scaled vs the true gradient norm."""
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])
    x = jax.random.normal(jax.random.key(0), (256, 8))
    y = 3.0 * jnp.sin(x.sum(axis=1, keepdims=True))
    params = model.init(jax.random.key(1), x)
    inner = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(1e-2))
    tx = jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale(growth_interval=100))
    opt_state = tx.init(params)
    amp_apply = jaxamp.autocast(model.apply, dtype=jnp.float16)

    @jax.jit
    def train_step(params, opt_state):
        loss_scale = jaxamp.get_loss_scale(opt_state)

        def loss_fn(p):
            loss = jnp.mean((amp_apply(p, x) - y) ** 2)
            return jaxamp.scale(loss_scale, loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        true_grads, _ = jaxamp.unscale_and_check(loss_scale, grads)  # only for printing
        norms = optax.global_norm(grads), optax.global_norm(true_grads)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss, norms

    for i in range(301):
        params, opt_state, loss, (scaled_norm, true_norm) = train_step(params, opt_state)
        if i % 100 == 0:
            print(
                f"step {i:3d}  loss {loss:.4f}  grad norm: scaled {scaled_norm:.3g}, "
                f"true {true_norm:.3g} (clipped to {MAX_NORM} inside skip_nonfinite)"
            )


if __name__ == "__main__":
    main()
