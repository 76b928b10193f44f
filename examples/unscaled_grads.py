"""Working with unscaled gradients: unscale once, inspect and clip them, then step.

PyTorch::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # grads are now true gradients
    norm = clip_grad_norm_(model.parameters(), max_norm)   # returns the pre-clip norm
    scaler.step(optimizer)                      # does not unscale again; skips on inf/NaN
    scaler.update()

jaxamp::

    ls = jaxamp.get_loss_scale(opt_state)
    grads, finite = jaxamp.unscale_and_check(ls, grads)    # scaler.unscale_
    norm = optax.tree.norm(grads)                        # the pre-clip norm, to log
    grads = clip(grads, norm)                              # any edit of true gradients
    params, opt_state = jaxamp.step(tx, grads, opt_state, params, finite=finite)

``finite=`` tells ``jaxamp.step`` that the gradients are already unscaled and
checked: it neither unscales nor checks them again, skips the step where
``finite`` is False and updates the scale with it. The norm is computed once, from
the one unscale, and reused for the clipping.

``tests/repo/test_examples.py`` runs this loop with float32 compute and an inf batch at
step 2, and checks that the returned norms equal ``optax.global_norm`` of the plain
float32 gradients (bit for bit) and that the parameters equal, to float32 rounding,
those of the plain
``optax.chain(clip_by_global_norm, sgd)`` loop that leaves that batch out (a
second unscale would have divided the gradients by the scale twice).
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


def clip(grads, norm):
    """``optax.clip_by_global_norm(MAX_NORM)``'s formula, with the norm already known."""
    return jax.tree.map(
        lambda g: jax.lax.select(norm < MAX_NORM, g, (g / norm.astype(g.dtype)) * MAX_NORM),
        grads,
    )


def make_tx() -> optax.GradientTransformation:
    # No clipping inside: this loop clips the unscaled gradients itself.
    return jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(growth_interval=100))


def make_train_step(tx: optax.GradientTransformation, amp: bool = True):
    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y, amp)
        ls = jaxamp.get_loss_scale(opt_state)
        grads, finite = jaxamp.unscale_and_check(ls, grads)  # scaler.unscale_(optimizer)
        norm = optax.tree.norm(grads)  # the true, pre-clip norm (inf/NaN on a bad step)
        grads = clip(grads, norm)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params, finite=finite)
        return params, opt_state, loss, norm

    return train_step


def main() -> None:
    """Trains 200 steps, logging the pre-clip gradient norm."""
    xs, ys = make_data(1)
    params = model.init(jax.random.key(1), xs[0])
    tx = make_tx()
    opt_state = tx.init(params)
    train_step = make_train_step(tx)
    for i in range(201):
        params, opt_state, loss, norm = train_step(params, opt_state, xs[0], ys[0])
        if i % 50 == 0:
            m = jaxamp.metrics(opt_state)
            print(
                f"step {i:3d}  loss {loss:.4f}  pre-clip grad norm {norm:.3g} "
                f"(clipped to {MAX_NORM})  scale {m['loss_scale']:g}  skipped {m['skipped_steps']}"
            )


if __name__ == "__main__":
    main()
