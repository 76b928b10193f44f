"""Gradient clipping with loss scaling: clip *inside* ``skip_nonfinite``.

PyTorch: ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``,
``clip_grad_norm_(model.parameters(), max_norm)``, ``scaler.step(optimizer)``,
``scaler.update()``. The gradients of a scaled loss are ``scale`` times too large,
so they must be unscaled before clipping. With jaxamp, put the clipping in the
inner chain: ``skip_nonfinite`` unscales before ``inner`` runs, so
``clip_by_global_norm`` sees the true gradients, and a step with an inf or NaN is
skipped before anything is clipped. (To *see* the norm, or edit the gradients
yourself, see ``unscaled_grads.py``.)

``tests/repo/test_examples.py`` runs this loop with float32 compute and an inf batch at
step 2, and checks that the parameters equal, to float32 rounding, those of the
plain float32 ``optax.chain(clip_by_global_norm, sgd)`` loop that leaves that batch out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

MAX_NORM = 0.5
model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])


def make_data(steps: int) -> tuple[jax.Array, jax.Array]:
    """``steps`` batches of 64 points; targets large enough that clipping is active."""
    x = jax.random.normal(jax.random.key(0), (steps, 64, 8))
    return x, 3.0 * jnp.sin(x.sum(axis=-1, keepdims=True))


def loss_fn(params, x, y, amp: bool = True):
    pred = jaxamp.autocast(model.apply, dtype=jnp.float16, enabled=amp)(params, x)
    return jnp.mean((pred - y) ** 2)


def make_inner() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.sgd(0.1))


def make_tx() -> optax.GradientTransformation:
    return jaxamp.skip_nonfinite(make_inner(), jaxamp.dynamic_scale(growth_interval=100))


def make_train_step(tx: optax.GradientTransformation, amp: bool = True):
    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y, amp)
        # Unscale, check, clip (inside), SGD, or skip the whole step; then update the scale.
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    return train_step


def main() -> None:
    """Trains 200 steps with clipping inside ``skip_nonfinite``."""
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
                f"step {i:3d}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']} (clipped to {MAX_NORM} inside skip_nonfinite)"
            )


if __name__ == "__main__":
    main()
