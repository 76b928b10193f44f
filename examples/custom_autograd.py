"""Custom derivatives under autocast: PyTorch's ``custom_fwd`` / ``custom_bwd``.

PyTorch's AMP examples show two cases for ``torch.autograd.Function``:

1. *Functions with autocastable ops* (``MyMM`` below): decorate ``forward`` with
   ``@custom_fwd`` and ``backward`` with ``@custom_bwd`` so that both run under the
   surrounding autocast state. In jaxamp a ``jax.custom_vjp`` function inside
   ``jaxamp.autocast`` does this by default: its forward and backward rules run
   under the surrounding autocast (here: float16 matmuls, forward and backward).
2. *Functions that need a particular dtype* (``l2_norm`` below): PyTorch uses
   ``@custom_fwd(cast_inputs=torch.float32)``: float32 inputs, autocast off inside.
   In jaxamp wrap the call in ``jaxamp.full_precision``: float32 inputs, autocast
   off inside, for the forward and for the backward rule.

``tests/repo/test_examples.py`` checks, against hand-written JAX without jaxamp, that
``mymm`` under autocast computes what float16 inputs give, that its backward rule's
matmuls are float16, that ``full_precision(l2_norm)`` gives the float32 value and
gradient exactly, and that the loop (float32 compute) with an inf batch at step 2
equals the plain optax loop that leaves that batch out (to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import jaxamp

WEIGHT_DECAY = 1e-3


@jax.custom_vjp
def mymm(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` with a hand-written backward (PyTorch's ``MyMM``)."""
    return a @ b


def _mymm_fwd(a, b):
    return a @ b, (a, b)


def _mymm_bwd(res, g):
    a, b = res
    return g @ b.T, a.T @ g  # runs under the surrounding autocast: float16 matmuls


mymm.defvjp(_mymm_fwd, _mymm_bwd)


@jax.custom_vjp
def l2_norm(x: jax.Array) -> jax.Array:
    """``||x||``, a sum of squares that needs float32 (it overflows float16 for |x| > 256)."""
    return jnp.sqrt(jnp.sum(x * x))


def _l2_norm_fwd(x):
    y = jnp.sqrt(jnp.sum(x * x))
    return y, (x, y)


def _l2_norm_bwd(res, g):
    x, y = res
    return (g * x / y,)


l2_norm.defvjp(_l2_norm_fwd, _l2_norm_bwd)


def init_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "w1": jax.random.normal(k1, (8, 32)) / jnp.sqrt(8.0),
        "w2": jax.random.normal(k2, (32, 1)) / jnp.sqrt(32.0),
    }


def make_data(steps: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (steps, 64, 8))
    return x, jnp.sin(x.sum(axis=-1, keepdims=True))


def loss_fn(params, x, y):
    h = jax.nn.relu(mymm(x, params["w1"]))  # float16 under autocast, forward and backward
    pred = mymm(h, params["w2"])
    # custom_fwd(cast_inputs=torch.float32): float32 inputs, autocast off inside.
    decay = jaxamp.full_precision(l2_norm)(params["w1"])
    return jnp.mean((pred - y) ** 2) + WEIGHT_DECAY * decay


def make_tx() -> optax.GradientTransformation:
    return jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(growth_interval=50))


def make_train_step(tx: optax.GradientTransformation, amp: bool = True):
    amp_loss = jaxamp.autocast(loss_fn, dtype=jnp.float16, enabled=amp)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jaxamp.value_and_grad(amp_loss)(opt_state, params, x, y)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    return train_step


def main() -> None:
    """Trains 200 steps with the custom-derivative matmul in float16."""
    xs, ys = make_data(1)
    params = init_params()
    tx = make_tx()
    opt_state = tx.init(params)
    train_step = make_train_step(tx)
    for i in range(201):
        params, opt_state, loss = train_step(params, opt_state, xs[0], ys[0])
        if i % 50 == 0:
            m = jaxamp.metrics(opt_state)
            print(
                f"step {i:3d}  loss {loss:.4f}  scale {m['loss_scale']:g}  "
                f"skipped {m['skipped_steps']}"
            )


if __name__ == "__main__":
    main()
