"""Gradient accumulation with loss scaling: ``jaxamp.skip_nonfinite(..., every_k=K)``.

PyTorch::

    for i, (input, target) in enumerate(data):
        with autocast(...):
            loss = loss_fn(model(input), target) / K
        scaler.scale(loss).backward()           # scaled grads add up in .grad
        if (i + 1) % K == 0:
            scaler.step(optimizer)              # unscale the sum, skip it if inf/NaN
            scaler.update()                     # the scale moves once per window
            optimizer.zero_grad()

jaxamp: ``every_k=K`` does the same inside the optimizer state. Calls 1..K-1 of a
window add the scaled gradients to an accumulator and change nothing else (the
params stay, the scale stays, so every micro-batch of a window uses one scale);
call K averages the window (so drop PyTorch's ``/ K``), unscales, checks, applies
or skips the whole window, updates the scale once, and resets the accumulator by
replacement. An overflowing micro-batch costs exactly its window: the next window
trains normally.

Do not nest ``optax.MultiSteps(jaxamp.skip_nonfinite(...))`` for this: MultiSteps
resets its accumulator by multiplying it by 0, and ``inf * 0`` is NaN, so after one
overflowing micro-batch every later step would be skipped.

``tests/repo/test_examples.py`` runs this loop with float32 compute and an inf in one
micro-batch of window 2, and checks that micro-batches 1..K-1 leave the params
unchanged bit for bit, that the scale moves once, at the end of window 2, and the
parameters after every window against PyTorch's loop written in plain JAX + optax
(grads of ``loss / K`` summed, one Adam step per window) that leaves window 2 out
(to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

EVERY_K = 4  # micro-batches per optimizer step
model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])


def make_data(windows: int) -> tuple[jax.Array, jax.Array]:
    """``windows`` x ``EVERY_K`` micro-batches of 32 points each."""
    x = jax.random.normal(jax.random.key(0), (windows, EVERY_K, 32, 8))
    return x, jnp.sin(x.sum(axis=-1, keepdims=True))


def loss_fn(params, x, y, amp: bool = True):
    pred = jaxamp.autocast(model.apply, dtype=jnp.float16, enabled=amp)(params, x)
    return jnp.mean((pred - y) ** 2)  # no "/ EVERY_K": the window is averaged for you


def make_tx() -> optax.GradientTransformation:
    ls = jaxamp.dynamic_scale(init_scale=2.0**12, growth_interval=10)
    return jaxamp.skip_nonfinite(optax.adam(1e-2), ls, every_k=EVERY_K)


def make_micro_step(tx: optax.GradientTransformation, amp: bool = True):
    @jax.jit
    def micro_step(params, opt_state, x, y):
        loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y, amp)
        # Micro-batches 1..K-1: params unchanged. Micro-batch K: one step for the window.
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    return micro_step


def main() -> None:
    """Trains 100 windows of 4 micro-batches; one micro-batch of window 30 overflows."""
    xs, ys = make_data(100)
    xs = xs.at[30, 1, 0, 0].set(jnp.inf)  # a bad micro-batch: costs window 30 only
    params = model.init(jax.random.key(1), xs[0, 0])
    tx = make_tx()
    opt_state = tx.init(params)
    micro_step = make_micro_step(tx)
    for w in range(100):
        for k in range(EVERY_K):
            params, opt_state, loss = micro_step(params, opt_state, xs[w, k], ys[w, k])
        if w % 20 == 0 or w in (30, 31):
            m = jaxamp.metrics(opt_state)
            print(
                f"window {w:3d}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']} window(s)"
            )


if __name__ == "__main__":
    main()
