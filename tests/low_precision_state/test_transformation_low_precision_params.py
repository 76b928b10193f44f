"""``low_precision_state`` with jaxamp's low-precision params: bfloat16 params updated with
stochastic rounding, bfloat16 (or 8-bit) moments, under the guard. The run holds 2 bytes
per param for the params and 2 per moment (2 + 2 + 2 = 6, where float32 AdamW holds
4 + 4 + 4 = 12, and 16 with its float32 master copy), measured on the arrays the run
holds; and it trains as the float32 run does."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.types import Quantized8, Rounded16

D_IN, H, D_OUT = 64, 128, 64
LR = 3e-3
STEPS = 60


def _init(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "l1": {"w": jax.random.normal(k1, (D_IN, H)) / np.sqrt(D_IN), "b": jnp.zeros(H)},
        "l2": {"w": jax.random.normal(k2, (H, D_OUT)) / np.sqrt(H), "b": jnp.zeros(D_OUT)},
    }
    return jax.tree.map(lambda x: x.astype(dtype), params)


def _loss(params, x, y):
    h = jnp.tanh(x @ params["l1"]["w"].astype(jnp.float32) + params["l1"]["b"])
    out = h @ params["l2"]["w"].astype(jnp.float32) + params["l2"]["b"]
    return jnp.mean((out - y) ** 2)


def _data():
    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, D_IN))
    teacher = jax.random.normal(kt, (D_IN, D_OUT)) / np.sqrt(D_IN)
    return x, jnp.tanh(x @ teacher)


def _tx(moments):
    if moments is None:  # the float32 run
        return jaxamp.skip_nonfinite(optax.adamw(LR))
    inner = optax.chain(optax.adamw(LR), jaxamp.apply_with_stochastic_rounding(jax.random.key(2)))
    return jaxamp.skip_nonfinite(jaxamp.low_precision_state(inner, moments, min_size=0))


@functools.cache  # the float32 run is the reference of both parametrizations
def _train(moments):
    params = _init(jnp.float32 if moments is None else jnp.bfloat16)
    tx = _tx(moments)
    state = jax.jit(tx.init)(params)  # one program, not one per operation and shape
    x, y = _data()

    @jax.jit
    def steps(params, state):
        def body(carry, _):
            params, state = carry
            loss, grads = jax.value_and_grad(_loss)(params, x, y)
            return jaxamp.step(tx, grads, state, params), loss

        return jax.lax.scan(body, (params, state), None, length=STEPS)

    (params, state), losses = steps(params, state)
    return params, state, np.asarray(losses)


def _bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("moments", [jnp.bfloat16, "8bit"], ids=["bf16", "8bit"])
def test_bytes_per_param_and_training(moments) -> None:
    params, state, losses = _train(moments)
    _, _, reference = _train(None)
    n = sum(x.size for x in jax.tree.leaves(params))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    # Each moment: bfloat16, or a byte and a float32 scale per block of 256 of a row.
    leaves = jax.tree.leaves(params)
    blocks = sum(int(np.prod(x.shape[:-1])) * -(-x.shape[-1] // 256) for x in leaves)
    per_moment = 2 * n if moments == jnp.bfloat16 else n + 4 * blocks
    is_s = lambda x: isinstance(x, (Quantized8, Rounded16))  # noqa: E731
    stored = [x for x in jax.tree.leaves(state, is_leaf=is_s) if is_s(x)]
    assert len(stored) == 2 * len(jax.tree.leaves(params))  # mu and nu of every param
    assert _bytes(stored) == 2 * per_moment
    # The rest of what the run holds: scalars (the count, the key, the loss scale's
    # counters, a record per leaf), not per param.
    held = _bytes((params, state))
    scalars = held - 2 * n - 2 * per_moment
    assert 0 < scalars < 200, scalars
    want = 6.0 if moments == jnp.bfloat16 else 2 + 2 * (n + 4 * blocks) / n
    print(f"{moments}: {held / n:.4f} bytes/param held ({n} params; {want:.4f} + scalars)")
    assert want <= held / n <= want + 200 / n
    # It trains as the float32 run does (bfloat16 params take the update with
    # stochastic rounding; its moments are unbiased).
    assert reference[-1] < reference[0] / 10
    assert losses[-1] < 1.1 * reference[-1], (losses[-1], reference[-1])
    assert np.isfinite(losses).all()
