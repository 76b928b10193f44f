"""Per-module autocast rules: keep every LayerNorm and the output head in float32.

``jaxamp.autocast(f, dtype=jnp.float16, modules={...})`` selects rules by Flax
module path without editing the model (like Haiku's per-module policies or
Keras' ``DTypePolicyMap``): here every ``LayerNorm`` (matched by class: linen
auto-names them ``LayerNorm_0``, ``LayerNorm_1``, ...) and the module named
``head`` run in full precision, the rest in float16. The script prints the
dtype of every matmul per module path, trains a few steps with dynamic loss
scaling and prints the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(64)(nn.gelu(nn.Dense(128)(h)))
        return nn.Dense(10, name="head")(nn.LayerNorm()(x))


RULES = {"LayerNorm": "float32", "head": "float32"}


def matmul_dtypes(model: nn.Module, apply, *args) -> list[tuple[str, str]]:
    """(module path, operand dtype) of each matmul: paths from the model's own
    jaxpr, dtypes from the autocast one (the matmuls come in the same order)."""

    def dots(fn):
        return [
            e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "dot_general"
        ]

    return [
        (str(a.source_info.name_stack), str(b.invars[0].aval.dtype))
        for a, b in zip(dots(model.apply), dots(apply), strict=True)
    ]


def main() -> None:
    model = Classifier()
    x = jax.random.normal(jax.random.key(0), (32, 64))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 10)
    params = model.init(jax.random.key(2), x)
    apply = jaxamp.autocast(model.apply, dtype=jnp.float16, modules=RULES)

    for path, dtype in matmul_dtypes(model, apply, params, x):
        print(f"matmul in {path:20s} {dtype}")

    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    opt_state = tx.init(params)

    def loss_fn(p: dict) -> jax.Array:
        logits = apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params: dict, opt_state: optax.OptState):
        loss_scale = jaxamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jaxamp.scale(loss_scale, loss_fn(p)))(params)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)  # unscales, skips inf
        return params, opt_state, loss / loss_scale.scale

    for i in range(20):
        params, opt_state, loss = train_step(params, opt_state)
        if i % 5 == 0 or i == 19:
            print(f"step {i:2d} loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
