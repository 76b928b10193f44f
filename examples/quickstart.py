"""Quick start: a jitted float16 train step with loss scaling and skipped overflow steps.

Run it with ``python examples/quickstart.py``. It prints (the losses' last digits vary
with the platform):

    step   0  loss 1.3797  loss scale 32768  skipped steps 0
    step  50  loss 0.3597  loss scale 32768  skipped steps 0
    step 100  loss nan     loss scale 16384  skipped steps 1  <- the batch with an inf: skipped
    step 150  loss 0.1143  loss scale 16384  skipped steps 1
    step 200  loss 0.0496  loss scale 16384  skipped steps 1
    the skipped step left the params as they were: True

The loss falls; the loss scale starts at 2**15 and halves on the one step whose
gradients are not finite, which changes nothing else. Without an overflow the scale
doubles every 2000 clean steps (``jaxamp.dynamic_scale``'s ``growth_interval``).
"""

import jax
import jax.numpy as jnp
import numpy as np
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
loss_fn = jaxamp.autocast(lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2), dtype=jnp.float16)


@jax.jit
def train_step(params, opt_state, x, y):
    # The loss as loss_fn computed it, and the gradients of the loss times the scale.
    loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)
    params, opt_state = jaxamp.step(tx, grads, opt_state, params)  # skipped if not finite
    return params, opt_state, loss, jaxamp.metrics(opt_state)


BAD_STEP = 100  # this step's batch holds an inf, as a corrupt record would
for i in range(201):
    batch_x = x.at[0, 0].set(jnp.inf) if i == BAD_STEP else x
    before = params
    params, opt_state, loss, m = train_step(params, opt_state, batch_x, y)
    if i == BAD_STEP:
        same = jax.tree.map(np.array_equal, before, params)
        kept = all(jax.tree.leaves(same))
    if i % 50 == 0:  # fetch the values only when logging: no host sync per step
        loss, m = jax.device_get((loss, m))
        print(
            f"step {i:3d}  loss {loss:<6.4f}  loss scale {m['loss_scale']:g}  "
            f"skipped steps {m['skipped_steps']}" + ("  <- the batch with an inf: skipped"
            if m["skipped"] else "")
        )  # fmt: skip
print(f"the skipped step left the params as they were: {kept}")
