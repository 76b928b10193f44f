"""GPU benchmark of FP8 autocast (issue 33): tokens/s and whether XLA made cuBLASLt FP8 GEMMs.

Trains ``models.py``'s GPT (``--size large``: ~124M params, GPT-2 small shape, every
dimension a multiple of 16) from one initialisation on one stream of byte batches,
interleaved rounds, medians, as ``gpu.py``'s payoff part does, in:

``f32``            float32 (JAX's default matmul precision)
``bf16_autocast``  ``jaxamp.autocast(dtype=bfloat16)`` + ``skip_nonfinite``
``f16_autocast``   ``jaxamp.autocast(dtype=float16)`` + dynamic loss scaling
``fp8_tensorwise`` ``jaxamp.autocast(dtype=bfloat16, fp8=jaxamp.fp8())`` + ``skip_nonfinite``
``fp8_rowwise``    the same with ``jaxamp.fp8("rowwise")``

For each variant it also counts, in the optimized HLO, the ``__cublas$lt$matmul$f8``
custom calls (an FP8 GEMM XLA really runs) and the products ``jaxamp.audit`` flags
(an FP8 request XLA ran otherwise). The step cost of ``jaxamp.step`` against plain
optax at 7M and 124M params is ``gpu.py``'s ``safety-large`` / ``cond-small`` parts
(``make bench-gpu``).

``--size xl`` is the ~0.9B GPT (``models.SIZES["xl"]``), where FP8's GEMMs are large
enough to pay: ``make bench-gpu-fp8-1b`` runs it for bfloat16 autocast and the two FP8
scalings (fewer rounds; not timed on a GPU yet, so apart from ``make bench-gpu``'s
8-minute budget).

Run with a Python whose jax sees a CUDA GPU:
``python3 benchmarks/gpu_fp8.py --out benchmarks/gpu_results/fp8.json``; about 5
minutes on an H200. ``--allow-cpu --size tiny`` is a (meaningless) smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# benchmarks/ (gpu.py, models.py), the repository (jaxamp) and examples/
# (train_lm's corpus): runnable as a script from any directory.
for _path in (HERE.parent / "examples", HERE.parent, HERE):
    sys.path.insert(0, str(_path))

VARIANTS = ("f32", "bf16_autocast", "f16_autocast", "fp8_tensorwise", "fp8_rowwise")


def variant(name: str, cfg: Any) -> tuple[Any, Any]:
    """``(init, step)`` as ``gpu.payoff_variant``; the FP8 ones added here."""
    import gpu
    import jax
    import jax.numpy as jnp
    import models

    import jaxamp

    if not name.startswith("fp8"):
        return gpu.payoff_variant(name, cfg)
    model = models.TransformerLM(cfg)
    fp8 = jaxamp.fp8(name.split("_")[1])

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        return models.loss_fn(model, params, (tokens[:, :-1], tokens[:, 1:]))

    loss = jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=fp8)
    tx = jaxamp.skip_nonfinite(gpu._optimizer())

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, tokens)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        m = jaxamp.metrics(opt_state)
        return params, opt_state, value, m["skipped_steps"], m["loss_scale"]

    return tx.init, step


def _machine() -> dict[str, Any]:
    """Platform, device, library versions: ``run.machine_info``'s, without its jmp
    (which a stock GPU Python lacks)."""
    import os
    import platform

    import flax
    import jax
    import optax

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="large", choices=["tiny", "default", "large", "xl"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import gpu
    import jax
    import models

    import jaxamp

    gpu._check_backend(args.allow_cpu)
    cfg = models.SIZES[args.size]
    total = args.warmup + args.rounds * args.steps
    batches = gpu._batches(cfg, total, args.seed)
    model = models.TransformerLM(cfg)
    params = model.init(jax.random.key(args.seed), batches[0][:, :-1])["params"]
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    entries = []
    for name in names:
        init, step = variant(name, cfg)
        p = jax.tree.map(lambda x: x.copy(), params)
        state = (p, init(p))
        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        text = compiled.as_text()
        report = jaxamp.audit(step)(*state, batches[0]) if name.startswith("fp8") else None
        entries.append({
            "name": name, "compiled": compiled, "state": state, "k": 0, "losses": [],
            "times": [], "compile_s": compile_s,
            "cublaslt_fp8_calls": text.count('custom_call_target="__cublas$lt$matmul$f8"'),
            "audit_fp8_requested": sum(
                r.requested.startswith("f8") for r in report.matmuls) if report else 0,
            "audit_flagged": [
                f"{r.pass_} {r.module}: {'; '.join(r.flags)}" for r in report.flagged
            ] if report else [],
        })  # fmt: skip
        print(f"compiled {name}: {entries[-1]['compile_s']:.1f} s, "
              f"{entries[-1]['cublaslt_fp8_calls']} cuBLASLt FP8 calls", flush=True)  # fmt: skip
    for e in entries:
        gpu._train(e, batches, max(1, args.warmup))
    for r in range(args.rounds):
        k = r % len(entries)
        for e in entries[k:] + entries[:k]:
            e["times"].append(gpu._train(e, batches, args.steps))
    tokens = cfg.batch * cfg.seq_len
    rows = []
    for e in entries:
        t = statistics.median(e["times"])
        losses = [float(x) for x in jax.device_get(e["losses"])]
        rows.append({
            k: e[k] for k in ("name", "compile_s", "cublaslt_fp8_calls",
                              "audit_fp8_requested", "audit_flagged")
        } | {"step_ms": t * 1e3, "tokens_per_s": tokens / t, "final_loss": losses[-1],
             "skipped": e["skipped"]})  # fmt: skip
    result = {
        "machine": _machine(),
        "size": args.size,
        "params": models.param_count(params),
        "rows": rows,
    }
    for row in rows:
        print(
            f"{row['name']:<15} {row['step_ms']:8.1f} ms/step {row['tokens_per_s']:10.0f} tok/s "
            f"loss {row['final_loss']:.4f}  cuBLASLt FP8 calls {row['cublaslt_fp8_calls']}, "
            f"FP8 products requested {row['audit_fp8_requested']} (calls and products are "
            "counted apart: they need not match)",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
