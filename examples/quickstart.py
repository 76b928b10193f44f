"""Quick start: a jitted float16 train step with loss scaling and skipped overflow steps."""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])
x = jax.random.normal(jax.random.key(0), (256, 8))
y = jnp.sin(x.sum(axis=1, keepdims=True))
params = model.init(jax.random.key(1), x)  # float32 master weights

# AdamW that unscales the gradients, skips non-finite steps and adapts the loss scale.
tx = jaxamp.skip_nonfinite(optax.adamw(1e-2), jaxamp.dynamic_scale())
opt_state = tx.init(params)
loss_fn = jaxamp.autocast(lambda p: jnp.mean((model.apply(p, x) - y) ** 2), dtype=jnp.float16)


@jax.jit
def train_step(params, opt_state):
    # The unscaled loss, and the gradients of the loss times the current loss scale.
    loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params)
    params, opt_state = jaxamp.step(tx, grads, opt_state, params)  # skipped if not finite
    return params, opt_state, loss


for i in range(201):
    params, opt_state, loss = train_step(params, opt_state)
    if i % 50 == 0:  # fetch metrics only when logging: no host sync per step
        m = jaxamp.metrics(opt_state)
        print(
            f"step {i:3d}  loss {loss:.4f}  scale {m['loss_scale']:g}  skipped {m['skipped_steps']}"
        )
