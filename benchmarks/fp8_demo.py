"""FP8 autocast on ``make demo``'s byte-level LM (examples/train_lm.py), measured on the CPU.

Two questions (issue 33):

1. Does FP8 with bfloat16 need a loss scale? The demo's loss is a token sum
   divided by 2**19 (a 0.5M-token global batch), so per-token gradients are
   small: float16 without a scale underflows. This prints, for the same
   parameters and batch, the share of gradient entries that are exactly zero
   (the underflow meter of the demo) and the gradient cosine against float32,
   for float32, float16 and bfloat16 autocast and FP8 (bfloat16) without and
   with a loss scale of 2**15, and whether FP8's unscaled gradients equal the
   unscaled loss's bit for bit.
2. Fidelity: the per-token loss after ``--steps`` AdamW steps from the same
   initialisation and batches, float32, bfloat16 autocast, FP8 tensorwise and
   rowwise.

On the CPU XLA computes FP8 products as float32 products of the FP8 values (the
numbers are those of a GPU's FP8 GEMM, up to float32 summation order; the
speed is not). Run: ``python benchmarks/fp8_demo.py [--steps 100]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_lm  # noqa: E402

import jaxamp  # noqa: E402


def _flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _cosine(a: Any, b: Any) -> float:
    a, b = _flat(a), _flat(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def configs() -> dict[str, dict[str, Any]]:
    return {
        "fp32": {},
        "fp16": {"dtype": jnp.float16},
        "bf16": {"dtype": jnp.bfloat16},
        "fp8": {"dtype": jnp.bfloat16, "fp8": jaxamp.fp8()},
        "fp8-rowwise": {"dtype": jnp.bfloat16, "fp8": jaxamp.fp8("rowwise")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    lm = train_lm.parse_args(["--steps", str(args.steps)])
    train, _, _ = train_lm.load_corpus(lm.corpus_bytes, lm.seq_len)
    train = jnp.asarray(train)
    model = train_lm.ByteLM(lm.model_dim, lm.layers, lm.heads, lm.seq_len)
    loss_fn, to_mean = train_lm.make_loss_fn(lm, model)
    key = jax.random.key(lm.seed)
    batch0 = train_lm.get_batch(train, key, lm.batch_size, lm.seq_len)
    params = model.init(jax.random.key(0), batch0[:, :-1])
    results: dict[str, Any] = {"model": vars(lm) | {"steps": args.steps}}

    # 1. Underflow and the loss scale, at the initial parameters.
    grads = {}
    for name, cfg in configs().items():
        f = loss_fn if not cfg else jaxamp.autocast(loss_fn, **cfg)
        grads[name] = jax.jit(jax.grad(f))(params, batch0)
    fp8 = jaxamp.autocast(loss_fn, dtype=jnp.bfloat16, fp8=jaxamp.fp8())
    state = jaxamp.static_scale(2.0**15)
    _, scaled = jax.jit(jaxamp.value_and_grad(fp8))(state, params, batch0)
    grads["fp8 + loss scale 2**15"] = jax.tree.map(lambda g: g / 2.0**15, scaled)
    under = {}
    for name, g in grads.items():
        under[name] = {
            "zero_grad_fraction": float(train_lm.zero_grad_fraction(g)),
            "cosine_vs_fp32": _cosine(g, grads["fp32"]),
        }
    same = all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(
            jax.tree.leaves(grads["fp8"]), jax.tree.leaves(grads["fp8 + loss scale 2**15"]),
            strict=True,
        )
    )  # fmt: skip
    results["underflow"] = under
    results["fp8_unscaled_grads_bitwise_equal_to_unscaled_loss"] = same

    # 2. Fidelity after training.
    data_key = jax.random.fold_in(key, 1)
    final = {}
    for name, cfg in configs().items():
        if name == "fp16":
            continue  # needs a loss scale: the demo's own fp16 / fp16-amp runs
        f = loss_fn if not cfg else jaxamp.autocast(loss_fn, **cfg)
        tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lm.lr, 5, args.steps))
        tx = jaxamp.skip_nonfinite(tx)

        @jax.jit
        def step(p, s, i, f=f, tx=tx):
            batch = train_lm.get_batch(
                train, jax.random.fold_in(data_key, i), lm.batch_size, lm.seq_len
            )
            loss, g = jax.value_and_grad(f)(p, batch)
            p, s = jaxamp.step(tx, g, s, p)
            return p, s, loss * to_mean

        p_, s_ = params, tx.init(params)
        t0, losses = time.perf_counter(), []
        for i in range(args.steps):
            p_, s_, loss = step(p_, s_, i)
            losses.append(float(loss))
        final[name] = {
            "final_loss_mean_last10": float(np.mean(losses[-10:])),
            "skipped": int(jaxamp.metrics(s_)["skipped_steps"]),
            "seconds": time.perf_counter() - t0,
        }
    ref = final["bf16"]["final_loss_mean_last10"]
    for row in final.values():
        row["vs_bf16_percent"] = 100 * (row["final_loss_mean_last10"] / ref - 1)
    results["training"] = final
    print(json.dumps(results, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
