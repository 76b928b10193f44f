"""Optimizer state in 8 and 16 bits (``jaxamp.low_precision_state``): memory, bytes, fidelity.

Memory and bytes, from the compiled step alone (nothing runs, so the ~124M GPT is
measured on a CPU too): the same AdamW (``variants.adamw()``) with its moments stored

* ``adamw``: float32 (plain optax, the reference);
* ``adamw mu_dtype=bf16``: optax's own bfloat16 first moment;
* ``lps bf16``: ``jaxamp.low_precision_state(adamw, jnp.bfloat16)``;
* ``lps 8bit``: ``jaxamp.low_precision_state(adamw, "8bit")``;
* ``lps bf16 + bf16 params`` and ``lps 8bit + bf16 params``: the same on bfloat16
  params, ``jaxamp.apply_with_stochastic_rounding`` last (no float32 master copy).

For each: the optimizer state's bytes per parameter (``nbytes`` of its leaves), the
params' and the step's: XLA ``compiled.memory_analysis()`` arguments + outputs +
temps (params, state and batch donated, as in ``run.py``), per parameter; and the
step's ``compiled.cost_analysis()["bytes accessed"]`` as a ratio to plain AdamW's,
with the compiled step's fusions and how many of them read or write a ``u8`` array
(the 8-bit codes).

Fidelity (``--fidelity``): ``examples/train_lm.py``'s LM as ``make demo`` builds it
(its optimizer: global-norm clip 1.0, AdamW with warm-up and cosine decay, weight
decay 0.01; float32 compute), trained from the same init on the same batches with
each way of storing the moments; the final held-out loss as a ratio to float32
moments'.

``--fidelity-gpt2``: the same on ``transformers``' GPT-2 (bench_low_precision.py's
byte-LM task), two rounding seeds per stored format. ``--paired-gpt2``: that task on
five other streams of training batches, each stored format against float32 moments on
the same batches, beside float32 moments with the learning rate moved by 0.2 %
(``BAND``): how far a run moves when nothing that matters changes.

Run: ``python benchmarks/bench_optimizer_state.py [--quick] [--no-large] [--fidelity STEPS]
[--fidelity-gpt2 STEPS] [--paired-gpt2 STEPS]``;
``make bench`` runs the memory table on its model and the ~124M GPT.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (HERE, ROOT, ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import hlo_paths  # noqa: E402
import models  # noqa: E402
import variants  # noqa: E402

import jaxamp  # noqa: E402

BF16 = jnp.bfloat16

#: name -> (moments' dtype for low_precision_state (None: plain optax), params' dtype,
#: optax.adamw's mu_dtype)
OPTIMIZERS: dict[str, tuple[Any, Any, Any]] = {
    "adamw": (None, jnp.float32, None),
    "adamw mu_dtype=bf16": (None, jnp.float32, BF16),
    "lps bf16": (BF16, jnp.float32, None),
    "lps 8bit": ("8bit", jnp.float32, None),
    "lps bf16 + bf16 params": (BF16, BF16, None),
    "lps 8bit + bf16 params": ("8bit", BF16, None),
}

GENERATED = ROOT / "docs" / "_generated" / "optimizer_state_table.md"


def make_tx(name: str) -> optax.GradientTransformation:
    """The named optimizer: ``variants.adamw()``'s hyperparameters, its moments stored as named."""
    stored, param_dtype, mu_dtype = OPTIMIZERS[name]
    tx = optax.adamw(variants.LEARNING_RATE, weight_decay=variants.WEIGHT_DECAY, mu_dtype=mu_dtype)
    if stored is not None:
        tx = jaxamp.low_precision_state(tx, stored)
    if param_dtype != jnp.float32:
        tx = optax.chain(tx, jaxamp.apply_with_stochastic_rounding(jax.random.key(0)))
    return tx


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


_U8 = re.compile(r"\bu8\[")


def _fusions(text: str) -> tuple[int, int]:
    """Fusion ops in the compiled module's entry computation, and those with a ``u8``
    operand or result (the 8-bit codes)."""
    entry, in_entry, total, u8 = [], False, 0, 0
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
        elif in_entry and line.startswith("}"):
            break
        elif in_entry:
            entry.append(line)
    for line in entry:
        if " fusion(" in line or re.search(r"= \S+ fusion\(", line):
            total += 1
            u8 += bool(_U8.search(line))
    return total, u8


def measure(size: str | models.ModelConfig, names: tuple[str, ...] = tuple(OPTIMIZERS)) -> dict:
    """Compiles each optimizer's donated train step on ``size``'s model (shapes only:
    no array is allocated or run) and returns its static figures."""
    cfg = models.SIZES[size] if isinstance(size, str) else size
    model = models.TransformerLM(cfg)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), jnp.int32)
    params32 = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros(tokens.shape, jnp.int32))
    )
    params32 = params32["params"]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params32))

    def loss(p: Any, batch: Any) -> jax.Array:
        return models.loss_fn(model, p, batch)

    rows = {}
    for name in names:
        tx = make_tx(name)
        dtype = OPTIMIZERS[name][1]
        params = jax.tree.map(lambda x, d=dtype: jax.ShapeDtypeStruct(x.shape, d), params32)
        state = jax.eval_shape(tx.init, params)

        def step(params: Any, state: Any, batch: Any, tx: Any = tx) -> Any:
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        t0 = time.perf_counter()
        compiled = (
            jax.jit(step, donate_argnums=(0, 1)).lower(params, state, (tokens, tokens)).compile()
        )
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        if isinstance(cost, list | tuple):
            cost = cost[0] if cost else {}
        text = compiled.as_text()
        fusions, u8 = _fusions(text)
        rows[name] = {
            "state_bytes_per_param": _nbytes(state) / n,
            "params_bytes_per_param": _nbytes(params) / n,
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "step_bytes_per_param": (
                mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            )
            / n,
            "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
            "kernels": hlo_paths.finite_step_kernels(text),
            "fusions": fusions,
            "u8_fusions": u8,
            "compile_s": time.perf_counter() - t0,
        }
        print(
            f"  {cfg.d_model}x{cfg.n_layers} {name:<24} compiled {rows[name]['compile_s']:.1f} s",
            flush=True,
        )
    base = rows["adamw"] if "adamw" in rows else None
    for r in rows.values():
        r["bytes_ratio"] = r["bytes_accessed"] / base["bytes_accessed"] if base else float("nan")
        r["step_ratio"] = (
            r["step_bytes_per_param"] / base["step_bytes_per_param"] if base else float("nan")
        )
    return {"model": {**vars(cfg), "params": n}, "rows": rows}


# ----------------------------------------------------------------------- fidelity


def fidelity(
    steps: int, names: tuple[str, ...], dim: int = 64, seq: int = 64, batch: int = 16, seed: int = 0
) -> dict[str, Any]:
    """``make demo``'s LM and optimizer (float32 compute), each way of storing the
    moments, same init and batches; the final held-out loss (the demo's ``evaluate``)."""
    import train_lm

    args = train_lm.parse_args(
        [
            f"--steps={steps}",
            f"--model-dim={dim}",
            f"--seq-len={seq}",
            f"--batch-size={batch}",
            "--spike-step=0",
        ]
    )
    train, evals, _ = train_lm.load_corpus(args.corpus_bytes, args.seq_len)
    train, evals = jnp.asarray(train), jnp.asarray(evals)
    model = train_lm.ByteLM(args.model_dim, args.layers, args.heads, args.seq_len)
    tokens = jnp.zeros((1, args.seq_len), jnp.int32)
    init = jax.jit(model.init)(jax.random.key(args.seed), tokens)
    spec = train_lm.RUN_SPECS["fp32"]
    out: dict[str, Any] = {
        "steps": steps,
        "model": {"dim": dim, "seq": seq, "batch": batch},
        "rows": {},
    }
    for name in names:
        stored = FIDELITY[name]
        tx = train_lm.make_optimizer(args, spec)
        if stored is not None:
            tx = jaxamp.low_precision_state(tx, stored, seed=seed)
        step, evaluate = train_lm.make_fns(args, spec, model, tx, train, evals)
        state = train_lm.RunState(jax.tree.map(jnp.array, init), tx.init(init))
        t0 = time.perf_counter()
        for i in range(steps):
            state, _ = step(state, jnp.int32(i))
        loss = float(evaluate(state.params))
        out["rows"][name] = {"eval_loss": loss, "wall_s": time.perf_counter() - t0}
        print(f"  {name:<28} held-out loss {loss:.4f}", flush=True)
    base = out["rows"].get("float32 moments", {}).get("eval_loss")
    for r in out["rows"].values():
        r["ratio"] = r["eval_loss"] / base if base else float("nan")
    return out


def _train_gpt2(task: Any, steps: int, stored: Any, seed: int, lr_scale: float = 1.0) -> float:
    """One run of ``fidelity_gpt2``'s task and optimizer; the final held-out loss."""
    import bench_low_precision as blp

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(blp.schedule(task.lr * lr_scale, steps), b2=0.95, weight_decay=0.01),
    )
    if stored is not None:
        tx = jaxamp.low_precision_state(tx, stored, seed=seed)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any]:
        grads = jax.grad(task.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = task.params, tx.init(task.params)
    for i in range(steps):
        params, opt_state = step(params, opt_state, task.batch(i))
    evaluate = jax.jit(task.loss)
    return float(np.mean([float(evaluate(params, b)) for b in task.eval_batches]))


def fidelity_gpt2(steps: int, names: tuple[str, ...], seeds: tuple[int, ...] = (0, 1)) -> dict:
    """``transformers``' FlaxGPT2LMHeadModel (code we did not write; bench_low_precision's
    byte-LM task: random init, a fresh batch each step, held-out loss over 8 batches)
    with AdamW (global-norm clip 1.0, b2 0.95, weight decay 0.01, warm-up and cosine
    decay from 3e-3), float32 params and compute; each way of storing the moments,
    the stored ones with each rounding seed."""
    import bench_low_precision as blp

    task = blp.GPT2(quick=False)
    out: dict[str, Any] = {"steps": steps, "model": task.name, "rows": {}}
    for name in names:
        stored = FIDELITY[name]
        runs = seeds if stored is not None else seeds[:1]
        losses = [_train_gpt2(task, steps, stored, seed) for seed in runs]
        out["rows"][name] = {"eval_loss": float(np.mean(losses)), "each": losses}
        print(f"  {name:<28} held-out loss {losses}", flush=True)
    base = out["rows"].get("float32 moments", {}).get("eval_loss")
    for r in out["rows"].values():
        r["ratio"] = r["eval_loss"] / base if base else float("nan")
    return out


#: The learning rate moved by 2**-9 (0.2 %) either way: float32 moments' own band, a
#: change of the trajectory no user would call a different run.
BAND = (1 - 2.0**-9, 1 + 2.0**-9)


def paired_gpt2(
    steps: int,
    names: tuple[str, ...],
    data_seeds: tuple[int, ...] = (10, 11, 12, 13, 14),
    band: bool = True,
) -> dict:
    """``fidelity_gpt2``'s task on other data: for each data seed (another stream of
    training batches, the same held-out batches), float32 moments, float32 moments
    with the learning rate moved by ``BAND`` (unless not `band`), and each stored
    format (rounding seed 0), from the same init. A final loss is as sensitive to the
    path as to the format: a stored format is judged by its mean difference from
    float32 over the data seeds (paired), beside the spread float32's own band shows."""
    import bench_low_precision as blp

    task = blp.GPT2(quick=False)
    rows: dict[str, list[float]] = {}
    for data_seed in data_seeds:
        task.data_seed = data_seed
        base = _train_gpt2(task, steps, None, 0)
        runs = {f"float32, lr x {m:.4f}": (None, m) for m in (BAND if band else ())}
        runs.update({name: (FIDELITY[name], 1.0) for name in names if FIDELITY[name] is not None})
        for name, (stored, lr_scale) in runs.items():
            diff = _train_gpt2(task, steps, stored, 0, lr_scale) / base - 1
            rows.setdefault(name, []).append(diff)
            print(f"  data {data_seed} {name:<28} {diff * 100:+.2f} %", flush=True)
    return {"steps": steps, "model": task.name, "data_seeds": data_seeds, "rows": rows}


FIDELITY: dict[str, Any] = {
    "float32 moments": None,
    "lps bf16": BF16,
    "lps 8bit": "8bit",
    'lps {"mu": "8bit", "nu": bf16}': {"mu": "8bit", "nu": BF16},
}


# ----------------------------------------------------------------------- reports


def format_memory(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"Model: {m['params'] / 1e6:.1f}M params ({m['n_layers']} layers, d={m['d_model']}, "
        f"vocab {m['vocab']}, batch {m['batch']} x {m['seq_len']})",
        "",
        "| optimizer | state B/param | params B/param | step B/param (args + outputs + temps) "
        "| step bytes accessed (MB) | vs adamw | fusions (with u8) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['state_bytes_per_param']:.3f} | {r['params_bytes_per_param']:.0f} "
            f"| {r['step_bytes_per_param']:.2f} | {r['bytes_accessed'] / 1e6:.1f} "
            f"| {r['bytes_ratio']:.3f}x | {r['fusions']} ({r['u8_fusions']}) |"
        )
    return "\n".join(lines)


def format_fidelity(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"make demo's LM (dim {m['dim']}, seq {m['seq']}, batch {m['batch']}), "
        f"{result['steps']} steps, held-out loss",
        "",
        "| moments stored as | final held-out loss | vs float32 moments |",
        "|---|---|---|",
    ]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r['eval_loss']:.4f} | {(r['ratio'] - 1) * 100:+.2f} % |")
    return "\n".join(lines)


def format_fidelity_gpt2(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']}, {result['steps']} steps, held-out loss (stored: mean of the "
        "rounding seeds, each in brackets)",
        "",
        "| moments stored as | final held-out loss | vs float32 moments |",
        "|---|---|---|",
    ]
    for name, r in result["rows"].items():
        each = ", ".join(f"{x:.4f}" for x in r["each"])
        shown = f"{r['eval_loss']:.4f}" + (f" ({each})" if len(r["each"]) > 1 else "")
        lines.append(f"| {name} | {shown} | {(r['ratio'] - 1) * 100:+.2f} % |")
    return "\n".join(lines)


def format_paired_gpt2(result: dict[str, Any]) -> str:
    seeds = ", ".join(str(d) for d in result["data_seeds"])
    lines = [
        f"{result['model']}, {result['steps']} steps, final held-out loss vs float32 "
        f"moments' on the same data (data seeds {seeds})",
        "",
        "| run | by data seed | mean | largest |",
        "|---|---|---|---|",
    ]
    for name, diffs in result["rows"].items():
        each = ", ".join(f"{d * 100:+.2f}" for d in diffs)
        worst = max(diffs, key=abs)
        lines.append(
            f"| {name} | {each} % | {np.mean(diffs) * 100:+.2f} % | {worst * 100:+.2f} % |"
        )
    return "\n".join(lines)


def run(quick: bool = False, large: bool = True) -> dict[str, Any]:
    """The memory table on ``make bench``'s model (``tiny`` if ``quick``) and, if
    ``large``, the ~124M GPT."""
    out = {"default": measure("tiny" if quick else "default")}
    if large and not quick:
        out["large"] = measure("large")
    return out


def format_report(result: dict[str, Any]) -> str:
    return "\n\n".join(format_memory(r) for r in result.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (smoke)")
    ap.add_argument("--no-large", action="store_true", help="skip the ~124M GPT")
    ap.add_argument(
        "--fidelity",
        type=int,
        default=0,
        metavar="STEPS",
        help="also train make demo's LM this many steps per way of storing",
    )
    ap.add_argument(
        "--fidelity-gpt2",
        type=int,
        default=0,
        metavar="STEPS",
        help="also train transformers' GPT-2 this many steps per way of storing (two seeds)",
    )
    ap.add_argument(
        "--paired-gpt2",
        type=int,
        default=0,
        metavar="STEPS",
        help="also the GPT-2 runs on five other data seeds, paired with float32's and its band",
    )
    ap.add_argument("--write", action="store_true", help=f"write {GENERATED.relative_to(ROOT)}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = run(args.quick, not args.no_large)
    report = format_report(result)
    if args.fidelity:
        fid = fidelity(args.fidelity, tuple(FIDELITY))
        report += "\n\n" + format_fidelity(fid)
    if args.fidelity_gpt2:
        fid = fidelity_gpt2(args.fidelity_gpt2, tuple(FIDELITY))
        report += "\n\n" + format_fidelity_gpt2(fid)
    if args.paired_gpt2:
        pairs = paired_gpt2(args.paired_gpt2, tuple(FIDELITY))
        report += "\n\n" + format_paired_gpt2(pairs)
    print(report)
    if args.write:
        GENERATED.parent.mkdir(parents=True, exist_ok=True)
        GENERATED.write_text(report + "\n")
    print(
        f"({time.perf_counter() - t0:.0f} s, jax {jax.__version__}, {jax.devices()[0].device_kind})"
    )


if __name__ == "__main__":
    main()
