"""bfloat16 params without a float32 master copy: stochastic rounding and Kahan summation.

A linear regression trained with AdamW and a learning rate that decays to small
values, four ways: float32 params (the reference), bfloat16 params with
``jaxamp.apply_with_stochastic_rounding``, bfloat16 params with
``jaxamp.apply_with_kahan_summation``, and plain bfloat16 params. Late updates are
smaller than half a bfloat16 ulp of the weights: plain bfloat16 drops them, the
other two keep them. Then one overflowed step: skipped, with params, key and
compensation kept bit for bit.

Run: ``python examples/bf16_params.py``. The last line is a JSON summary.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

STEPS = 400
DIM = 64


def optimizer(kind: str) -> optax.GradientTransformation:
    lr = optax.cosine_decay_schedule(3e-2, STEPS, alpha=0.0)
    chain = [optax.adamw(lr, weight_decay=0.0, mu_dtype=jnp.bfloat16)]
    if kind == "stochastic rounding":
        # The key lives in the state.
        chain.append(jaxamp.apply_with_stochastic_rounding(jax.random.key(0)))
    elif kind == "kahan":
        chain.append(jaxamp.apply_with_kahan_summation())  # a bfloat16 buffer per bfloat16 param
    # No loss scale for bfloat16: skip_nonfinite only checks and skips.
    return jaxamp.skip_nonfinite(optax.chain(*chain))


def data() -> tuple[jax.Array, jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, DIM))
    true_w = 1.0 + jax.random.uniform(kw, (DIM,))  # weights in [1, 2): ulp 2**-7
    noise = 0.1 * jax.random.normal(jax.random.key(2), (256,))
    return x, x @ true_w + noise, true_w


def train(kind: str) -> tuple[dict[str, jax.Array], float, optax.GradientTransformation, object]:
    """``STEPS`` steps from w = 1.5; returns params, final loss, optimizer and its state."""
    x, y, _ = data()
    dtype = jnp.float32 if kind == "float32" else jnp.bfloat16
    params = {"w": jnp.full((DIM,), 1.5, dtype)}
    tx = optimizer(kind)
    opt_state = tx.init(params)

    def loss_fn(p: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((x @ p["w"].astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    for _ in range(STEPS):
        params, opt_state, _ = step(params, opt_state)
    return params, float(loss_fn(params)), tx, opt_state


def main() -> dict[str, object]:
    losses, ulps = {}, {}
    w32 = train("float32")[0]["w"]  # the float32 optimum, as close as float32 gets
    ulp = jnp.spacing(w32.astype(jnp.bfloat16)).astype(jnp.float32)
    for kind in ("float32", "stochastic rounding", "kahan", "plain bfloat16"):
        params, loss, tx, opt_state = train(kind)
        losses[kind] = loss
        # How far the weights ended from the float32 run's, in bfloat16 ulps: the
        # nearest bfloat16 values are at most half an ulp away.
        ulps[kind] = float(jnp.mean(jnp.abs(params["w"].astype(jnp.float32) - w32) / ulp))
        print(
            f"{kind:<20} final loss {loss:.5f}, weights {ulps[kind]:.2f} bfloat16 ulps "
            f"from the float32 run's (params {params['w'].dtype})"
        )

    # An overflowed step is skipped whole: the bfloat16 params, the rounding key
    # and the Kahan buffer stay as they were, bit for bit.
    kept = {}
    for kind in ("stochastic rounding", "kahan"):
        params, _, tx, opt_state = train(kind)
        bad = {"w": jnp.full((DIM,), jnp.inf, jnp.bfloat16)}
        new_params, new_state = jax.jit(lambda p, s, g, tx=tx: jaxamp.step(tx, g, s, p))(
            params, opt_state, bad
        )
        same = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(
                jax.tree.leaves((params, opt_state.inner_state)),
                jax.tree.leaves((new_params, new_state.inner_state)),
                strict=True,
            )
        )
        kept[kind] = same
        print(f"{kind}: inf step skipped, params and optimizer state kept bit for bit: {same}")

    ref = losses["float32"]
    print(
        "final loss vs float32: "
        + ", ".join(f"{k} {(v - ref) / ref * 100:+.2f} %" for k, v in losses.items())
    )
    summary = {"losses": losses, "ulps_from_float32": ulps, "skip_kept": kept}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
