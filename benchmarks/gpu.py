"""GPU benchmark (issue 13): what mixed precision buys, what safety costs, and the cond.

Run ``make bench-gpu`` or ``python3 benchmarks/gpu.py --out DIR`` with a Python whose
jax sees a CUDA GPU (plus flax, optax, jmp, tqdm, orbax, matplotlib). The driver runs
each part in its own process, in this order, each under a time cap when ``--budget-s``
is given, and writes one JSON per part under ``--out``:

``payoff``        (``payoff.json``) the ~124M GPT-2-small-shape LM of ``models.py``
                  (``--size large``), one batch shape for all: float32 at JAX's default
                  matmul precision and at ``"highest"``, bfloat16 autocast +
                  ``skip_nonfinite``, float16 autocast + dynamic scaling (``jaxamp.step``),
                  and the hand-cast (Flax ``dtype=``) bfloat16 / float16 models. Every
                  variant trains from the same init on the same stream of byte-level
                  batches; timed steps are training steps (interleaved rounds, medians).
                  Peak memory is measured per variant in a fresh process (``--part peak``,
                  which loads the executable from the persistent compilation cache).
``safety-large``  (``safety_large.json``) ``run.py``'s variants (the ``make bench``
                  table) at ``--size large``, then the host-sync probe and a
                  ``jax.profiler`` trace of plain / ``jaxamp.step`` / compute-then-select.
``cond-small``    (``cond_small.json``) the same for plain / ``jaxamp.step`` /
                  compute-then-select at the default (small) size.
``demo``          (``demo.json``) ``examples/train_lm.py`` as ``make demo`` runs it, timed.

The driver also writes ``run.json`` (machine, parts, durations), ``log.txt`` (all
output) and ``hlo.tar.gz`` (the optimized HLO of each step), and prints the tables last.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import io
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

PAYOFF_VARIANTS = (
    "f32",
    "f32_highest",
    "bf16_autocast",
    "f16_autocast",
    "bf16_hand",
    "f16_hand",
)
PAYOFF_DESCRIPTIONS = {
    "f32": "float32, JAX default matmul precision, optax update + apply_updates",
    "f32_highest": "float32 under jax.default_matmul_precision('highest'), optax",
    "bf16_autocast": "jaxamp.autocast(bfloat16) + skip_nonfinite (no scale), jaxamp.step",
    "f16_autocast": "jaxamp.autocast(float16) + skip_nonfinite(dynamic_scale), jaxamp.step",
    "bf16_hand": "Flax dtype=bfloat16 model + skip_nonfinite (no scale), jaxamp.step",
    "f16_hand": "Flax dtype=float16 model + skip_nonfinite(dynamic_scale), jaxamp.step",
}
PARTS = ("payoff", "safety-large", "cond-small", "demo")
# Seconds each part may take when --budget-s is given; later parts get what earlier
# parts leave over.
PART_CAPS = {"payoff": 300, "safety-large": 140, "cond-small": 50, "demo": 80}
PROBE_NAMES = ("plain", "jaxamp_step", "jaxamp_step_select")
LEARNING_RATE, WARMUP_STEPS = 6e-4, 30

# --------------------------------------------------------------------------- common


def _setup_jax(cache_dir: str | None) -> None:
    import jax

    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _check_backend(allow_cpu: bool) -> None:
    import jax

    if jax.default_backend() != "gpu" and not allow_cpu:
        raise SystemExit(
            f"benchmarks/gpu.py: JAX's backend is {jax.default_backend()!r}, not 'gpu'. "
            "Run it with a CUDA build of jax (pip install 'jax[cuda13]'), or pass "
            "--allow-cpu for a (meaningless) smoke run."
        )


def _memory_stats() -> dict[str, int]:
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without stats
        stats = {}
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(stats[k]) for k in keys if k in stats}


def _memory_analysis(compiled: Any) -> dict[str, int | None]:
    mem = compiled.memory_analysis()
    names = ("temp", "argument", "output", "alias", "generated_code")
    return {
        f"{n}_bytes": (int(getattr(mem, f"{n}_size_in_bytes", -1)) if mem is not None else None)
        for n in names
    }


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {k: float(cost.get(k, float("nan"))) for k in ("flops", "bytes accessed")}


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_DOT_DTYPE = re.compile(r"= (\w+)\[[^\]]*\]\{?[^ ]* (?:dot|convolution)\(")


def hlo_stats(text: str) -> dict[str, Any]:
    """What the compiled step computes its matrix products with (optimized HLO text)."""
    return {
        "custom_calls": dict(collections.Counter(_CUSTOM_CALL.findall(text)).most_common()),
        "dot_result_dtypes": dict(collections.Counter(_DOT_DTYPE.findall(text))),
        "tf32_mentions": len(re.findall(r"tf32", text, re.I)),
        "highest_precision_operands": text.count("operand_precision={highest,highest}"),
        "triton_gemm_fusions": len(re.findall(r'"kind":"__triton_gemm"', text)),
        "conditional": len(re.findall(r"\bconditional\(", text)),
        "cond_placement": cond_placement(text),
    }


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")


def cond_placement(text: str) -> list[dict[str, str]]:
    """For each ``conditional`` in optimized HLO: the computation it sits in.

    A conditional inside a ``command_buffer`` computation of the HLO is captured in a
    CUDA graph. One outside may still be: on jax 0.11.2 (H200, 2026-11-22) the runtime
    turned the whole thunk sequence, conditional included, into one CUDA graph that the
    HLO text does not show. The profile (``summarize_xspace``) is the evidence that
    counts: device-to-host copies, host syncs and graph launches per step.
    """
    out, current = [], "?"
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _COMPUTATION.match(line)
            current = m.group(1) if m else line[:60]
            continue
        if re.search(r"\bconditional\(", line):
            name = line.strip().split(" ", 1)[0]
            out.append(
                {
                    "op": name,
                    "computation": current,
                    "in_command_buffer": str("command_buffer" in current),
                }
            )
    return out


def _write_hlo(hlo_dir: str | None, name: str, text: str) -> None:
    if not hlo_dir:
        return
    Path(hlo_dir).mkdir(parents=True, exist_ok=True)
    with gzip.open(Path(hlo_dir) / f"{name}.hlo.txt.gz", "wt") as f:
        f.write(text)


def _json_default(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def _dump(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=_json_default))
    print(f"wrote {path}", flush=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- payoff


def _optimizer() -> Any:
    import optax

    schedule = optax.warmup_constant_schedule(0.0, LEARNING_RATE, WARMUP_STEPS)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b2=0.95, weight_decay=0.1),
    )


def payoff_variant(name: str, cfg: Any) -> tuple[Callable[[Any], Any], Callable[..., Any]]:
    """``(init(params) -> opt_state, step(params, opt_state, tokens))`` for one variant.

    ``step`` returns ``(params, opt_state, loss, skipped_steps, loss_scale)``; ``tokens``
    is a ``(batch, seq_len + 1)`` int32 array (inputs and next-token targets).
    """
    import jax
    import jax.numpy as jnp
    import models
    import optax

    import jaxamp

    if name not in PAYOFF_VARIANTS:
        raise ValueError(f"unknown payoff variant {name!r}; choose from {PAYOFF_VARIANTS}")
    compute = {"bf16": jnp.bfloat16, "f16": jnp.float16}.get(name.split("_")[0])
    hand = name.endswith("_hand")
    model = models.TransformerLM(cfg, dtype=compute if hand else None)

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        return models.loss_fn(model, params, (tokens[:, :-1], tokens[:, 1:]))

    if name.endswith("_autocast"):
        loss = jaxamp.autocast(loss, dtype=compute)
    inner = _optimizer()

    if compute is None:
        tx = inner
        highest = name == "f32_highest"

        def f32_step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
            with _precision("highest" if highest else None):
                value, grads = jax.value_and_grad(loss)(params, tokens)
                updates, opt_state = tx.update(grads, opt_state, params)
            return (
                optax.apply_updates(params, updates),
                opt_state,
                value,
                jnp.int32(0),
                jnp.float32(1.0),
            )

        return tx.init, f32_step

    scaled = compute == jnp.float16
    tx = jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale() if scaled else None)

    def amp_step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
        if scaled:
            ls = jaxamp.get_loss_scale(opt_state)
            value, grads = jax.value_and_grad(lambda p: jaxamp.scale(ls, loss(p, tokens)))(params)
            value = value / ls.scale
        else:  # bfloat16: float32's range, no scale; still skip a non-finite step
            value, grads = jax.value_and_grad(loss)(params, tokens)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        m = jaxamp.metrics(opt_state)
        return params, opt_state, value, m["skipped_steps"], m["loss_scale"]

    return tx.init, amp_step


def _precision(prec: str | None) -> Any:
    """``jax.default_matmul_precision(prec)`` as a context (a no-op for None)."""
    import jax

    if prec is None:
        return _nullcontext()
    return jax.default_matmul_precision(prec)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _batches(cfg: Any, n: int, seed: int) -> list[Any]:
    """``n`` batches of byte tokens from the standard library's source (train_lm's corpus)."""
    import jax
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    import train_lm

    corpus, _, _ = train_lm.load_corpus(4_000_000, cfg.seq_len)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - cfg.seq_len - 1, size=(n, cfg.batch))
    idx = starts[..., None] + np.arange(cfg.seq_len + 1)
    host = corpus[idx].astype(np.int32)
    return [jax.device_put(b) for b in host]


def _build_payoff(
    name: str, cfg: Any, params: Any, tokens: Any, hlo_dir: str | None = None
) -> dict[str, Any]:
    import jax
    import run as bench_run

    init, step = payoff_variant(name, cfg)
    p = bench_run._copy(params)
    state = (p, init(p))
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*state, tokens)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    _write_hlo(hlo_dir, f"payoff_{name}", text)
    return {
        "name": name, "compiled": compiled, "state": state, "compile_s": compile_s,
        "memory_analysis": _memory_analysis(compiled), "cost": _cost(compiled),
        "hlo": hlo_stats(text), "k": 0, "losses": [], "times": [],
    }  # fmt: skip


def _train(entry: dict[str, Any], batches: list[Any], n: int) -> float:
    """Runs ``n`` training steps on the entry's next batches; seconds per step."""
    import jax

    compiled, state, k = entry["compiled"], entry["state"], entry["k"]
    t0 = time.perf_counter()
    for i in range(n):
        p, o, loss, skipped, scale = compiled(*state, batches[k + i])
        state = (p, o)
        entry["losses"].append(loss)
    jax.block_until_ready((state, loss))
    dt = (time.perf_counter() - t0) / n
    entry["state"], entry["k"] = state, k + n
    entry["skipped"], entry["loss_scale"] = int(skipped), float(scale)
    return dt


def matmul_probe(n_big: int = 8192) -> dict[str, Any]:
    """Error (vs float64 on the host) and speed of one ``n_big``-cubed matmul per precision."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    n_err = min(2048, n_big)
    a64, b64 = rng.standard_normal((n_err, n_err)), rng.standard_normal((n_err, n_err))
    ref = a64 @ b64
    a, b = jnp.asarray(a64, jnp.float32), jnp.asarray(b64, jnp.float32)
    big = [jax.random.normal(jax.random.key(i), (n_big, n_big), jnp.float32) for i in (1, 2)]
    out: dict[str, Any] = {}
    cases = [("float32 default", None, None), ("float32 'high'", "high", None),
             ("float32 'highest'", "highest", None), ("bfloat16", None, jnp.bfloat16),
             ("float16", None, jnp.float16)]  # fmt: skip
    for label, prec, cast in cases:
        with _precision(prec):
            if cast is None:
                f = jax.jit(lambda x, y: x @ y)
            else:
                f = jax.jit(lambda x, y, c=cast: (x.astype(c) @ y.astype(c)).astype(jnp.float32))
            got = np.asarray(f(a, b), np.float64)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            x, y = big
            if cast is not None:
                x, y = x.astype(cast), y.astype(cast)
                f = jax.jit(lambda x, y: x @ y)
            f(x, y).block_until_ready()
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                f(x, y).block_until_ready()
                times.append(time.perf_counter() - t0)
        t = _median(times)
        out[label] = {
            "rel_err_vs_f64": err,
            "n_err": n_err,
            "n": n_big,
            "ms": t * 1e3,
            "tflops": 2 * n_big**3 / t / 1e12,
        }
    return out


def cmd_payoff(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import models
    import run as bench_run

    t_start = time.perf_counter()
    _setup_jax(args.cache_dir)
    _check_backend(args.allow_cpu)
    info = bench_run.machine_info()
    cfg = models.SIZES[args.size]
    total = args.warmup + args.rounds * args.steps
    print(
        f"payoff: size={args.size} batch {cfg.batch}x{cfg.seq_len}, {total} training steps "
        f"per variant ({args.warmup} warm-up + {args.rounds} rounds x {args.steps}); "
        f"{info['device_kind']}, jax {info['jax']}",
        flush=True,
    )
    mm = matmul_probe(8192 if jax.default_backend() == "gpu" else 256)
    for k, v in mm.items():
        print(
            f"  matmul {k:<18} rel err {v['rel_err_vs_f64']:.2e}  {v['n']}^3: {v['ms']:.2f} ms"
            f" = {v['tflops']:.1f} TFLOP/s",
            flush=True,
        )
    batches = _batches(cfg, total, args.seed)
    model = models.TransformerLM(cfg)
    params = model.init(jax.random.key(args.seed), batches[0][:, :-1])["params"]
    n_params = models.param_count(params)
    names = [n for n in PAYOFF_VARIANTS if not args.only or n in args.only.split(",")]
    # One at a time by default: XLA autotunes GEMMs on the GPU while compiling, and
    # concurrent compiles would time their candidates against each other's kernels.
    with ThreadPoolExecutor(max(1, args.payoff_compile_workers)) as pool:
        futures = [
            pool.submit(_build_payoff, n, cfg, params, batches[0], args.hlo_dir) for n in names
        ]
        entries = [f.result() for f in futures]
    for e in entries:
        print(
            f"  compiled {e['name']:<14} {e['compile_s']:6.1f} s  temp "
            f"{e['memory_analysis']['temp_bytes'] / 2**30:.2f} GiB "
            f"({args.payoff_compile_workers} at a time)",
            flush=True,
        )
    t_timing = time.perf_counter()
    for e in entries:  # the first call of each executable, then the timed warm-up
        _train(e, batches, 1)
    warm = [_train(e, batches, max(1, args.warmup - 1)) for e in entries]
    rounds = args.rounds
    if args.time_limit:
        # Fit the rounds into what is left (warm-up step times are an upper bound).
        left = args.time_limit - (time.perf_counter() - t_start) - 20
        fit = int(left // (sum(warm) * args.steps)) if sum(warm) > 0 else rounds
        if fit < rounds:
            rounds = max(3, fit)
            print(
                f"  --time-limit {args.time_limit:.0f} s: {rounds} rounds instead of {args.rounds}",
                flush=True,
            )
    for r in range(rounds):
        k = r % len(entries)
        for e in entries[k:] + entries[:k]:
            e["times"].append(_train(e, batches, args.steps))
        print(
            f"  round {r + 1}/{rounds}: "
            + "  ".join(f"{e['name']} {e['times'][-1] * 1e3:.1f}" for e in entries),
            flush=True,
        )
    timing_s = time.perf_counter() - t_timing
    tokens = cfg.batch * cfg.seq_len
    base = {n: _median(e["times"]) for e in entries for n in [e["name"]]}
    rows = []
    for e in entries:
        t = _median(e["times"])
        losses = [float(x) for x in jax.device_get(e["losses"])]
        rows.append({
            "name": e["name"], "description": PAYOFF_DESCRIPTIONS[e["name"]],
            "step_ms": t * 1e3, "step_ms_all": [x * 1e3 for x in e["times"]],
            "tokens_per_s": tokens / t,
            "speedup_vs_f32": base["f32"] / t if "f32" in base else None,
            "speedup_vs_f32_highest": (base["f32_highest"] / t if "f32_highest" in base
                                       else None),
            "compile_s": e["compile_s"], "memory_analysis": e["memory_analysis"],
            "cost": e["cost"], "hlo": e["hlo"], "losses": losses,
            "skipped_steps": e["skipped"], "final_loss_scale": e["loss_scale"],
        })  # fmt: skip
    profile = {}
    for e in entries:
        if e["name"] not in args.profile_variants.split(","):
            continue

        def run_steps(e: dict[str, Any] = e) -> None:
            state = e["state"]
            for i in range(args.profile_steps):
                p, o, *_ = e["compiled"](*state, batches[i])
                state = (p, o)
            jax.block_until_ready(state)
            e["state"] = state

        profile[e["name"]] = _profile(
            run_steps, args.profile_steps, Path(args.trace_dir) / "payoff" / e["name"]
        )
    if profile:
        print(format_profile(profile, top=12), flush=True)
    result = {
        "part": "payoff", "machine": info, "size": args.size, "profile": profile,
        "compile_workers": args.payoff_compile_workers,
        "model": {**vars(cfg), "params": n_params},
        "schedule": {"warmup": args.warmup, "rounds": rounds, "steps_per_round": args.steps,
                     "training_steps": args.warmup + rounds * args.steps,
                     "lr": LEARNING_RATE, "warmup_steps": WARMUP_STEPS,
                     "optimizer": "clip_by_global_norm(1) + adamw(b2=0.95, wd=0.1), "
                                  "linear warm-up then constant"},
        "matmul_probe": mm, "timing_wall_s": timing_s,
        "memory_stats_all_variants_in_one_process": _memory_stats(),
        "variants": rows,
    }  # fmt: skip
    _dump(Path(args.out) / "payoff.json", result)
    print(format_payoff(result))
    return result


def cmd_peak(args: argparse.Namespace) -> dict[str, Any]:
    """One payoff variant alone in this process: peak device memory over a few steps."""
    import jax
    import models

    _setup_jax(args.cache_dir)
    _check_backend(args.allow_cpu)
    cfg = models.SIZES[args.size]
    batches = _batches(cfg, 4, args.seed)
    model = models.TransformerLM(cfg)
    params = model.init(jax.random.key(args.seed), batches[0][:, :-1])["params"]
    entry = _build_payoff(args.variant, cfg, params, batches[0])
    del params
    before = _memory_stats()
    _train(entry, batches, 3)
    after = _memory_stats()
    out = {"variant": args.variant, "compile_or_cache_load_s": entry["compile_s"],
           "before_steps": before, "after_steps": after,
           "peak_bytes": after.get("peak_bytes_in_use")}  # fmt: skip
    print("PEAK_JSON " + json.dumps(out), flush=True)
    return out


def _peak_gib(r: dict[str, Any]) -> str:
    b = r.get("peak_bytes")
    return f"{b / 2**30:.2f}" if b else "-"


def format_payoff(result: dict[str, Any]) -> str:
    """The payoff table, the loss table and the targets."""
    rows = {r["name"]: r for r in result["variants"]}
    m = result["model"]
    lines = [
        f"payoff: {m['params'] / 1e6:.1f}M-param GPT (d={m['d_model']}, {m['n_layers']} layers,"
        f" vocab {m['vocab']}), batch {m['batch']}x{m['seq_len']} tokens, "
        f"{result['machine']['device_kind']}",
    ]
    head = (f"{'variant':<15}{'ms/step':>9}{'x f32':>7}{'x f32hi':>8}{'tok/s':>10}"
            f"{'peak GiB':>9}{'temp GiB':>9}{'args GiB':>9}{'compile s':>10}"
            f"{'final loss':>11}{'skipped':>8}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for name, r in rows.items():
        ma = r["memory_analysis"]
        sp = r["speedup_vs_f32"]
        sph = r["speedup_vs_f32_highest"]
        final = statistics.fmean(r["losses"][-20:])
        lines.append(
            f"{name:<15}{r['step_ms']:>9.2f}{(sp or float('nan')):>7.2f}"
            f"{(sph or float('nan')):>8.2f}{r['tokens_per_s']:>10.0f}{_peak_gib(r):>9}"
            f"{ma['temp_bytes'] / 2**30:>9.2f}{ma['argument_bytes'] / 2**30:>9.2f}"
            f"{r['compile_s']:>10.1f}{final:>11.4f}{r['skipped_steps']:>8}"
        )
    lines.append(
        "x f32 / x f32hi: speedup = f32 (default precision) / f32_highest median step "
        "time over this row's; peak: peak_bytes_in_use of this variant alone in a "
        "fresh process (3 steps); temp/args: compiled.memory_analysis(); final loss: "
        "mean of the last 20 training losses"
    )
    # Loss table
    n = len(next(iter(rows.values()))["losses"])
    marks = [s for s in (1, 10, 25, 50, 100, 150, 200, 250, 300, n) if s <= n]
    marks = sorted(set(marks))
    lines.append("")
    lines.append("training loss (mean of the 10 steps ending at the step; step 1: itself)")
    lines.append(f"{'step':<15}" + "".join(f"{s:>8}" for s in marks))
    for name, r in rows.items():
        cells = []
        for s in marks:
            window = r["losses"][max(0, s - 10) : s] if s >= 10 else r["losses"][s - 1 : s]
            cells.append(f"{statistics.fmean(window):>8.3f}")
        lines.append(f"{name:<15}" + "".join(cells))
    mm = result.get("matmul_probe") or {}
    if mm:
        lines.append("")
        lines.append("one matmul: rel. error vs float64 (<= 2048^2 inputs) and speed (n^3)")
        for k, v in mm.items():
            lines.append(
                f"  {k:<18} err {v['rel_err_vs_f64']:.1e}  n={v['n']} {v['ms']:7.2f} ms  "
                f"{v['tflops']:6.1f} TFLOP/s"
            )
    lines.append("")
    lines += payoff_targets(rows)
    return "\n".join(lines)


def payoff_targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 13's payoff targets as MET / MISSED lines with the figures."""
    out = []

    def verdict(ok: bool) -> str:
        return "MET   " if ok else "MISSED"

    for amp in ("bf16_autocast", "f16_autocast", "bf16_hand", "f16_hand"):
        if amp not in rows:
            continue
        for ref, key in (("f32", "speedup_vs_f32"), ("f32_highest", "speedup_vs_f32_highest")):
            sp = rows[amp].get(key)
            if sp is not None:
                out.append(
                    f"{verdict(sp >= 1.8)} {amp} {sp:.2f}x the speed of {ref} (target >= 1.8x)"
                )
    if "f16_autocast" in rows and "bf16_autocast" in rows:
        r = rows["f16_autocast"]["step_ms"] / rows["bf16_autocast"]["step_ms"]
        out.append(
            f"{verdict(r <= 1.03)} f16_autocast step time {r:.3f}x bf16_autocast's "
            "(target <= 1.03x)"
        )
    for dt in ("bf16", "f16"):
        a, h = rows.get(f"{dt}_autocast"), rows.get(f"{dt}_hand")
        if not (a and h):
            continue
        r = a["step_ms"] / h["step_ms"]
        out.append(
            f"{verdict(r <= 1.05)} {dt} autocast step time {r:.3f}x hand-cast's (target <= 1.05x)"
        )
        if a.get("peak_bytes") and h.get("peak_bytes"):
            r = a["peak_bytes"] / h["peak_bytes"]
            out.append(
                f"{verdict(r <= 1.05)} {dt} autocast peak memory {r:.3f}x hand-cast's "
                "(target <= 1.05x)"
            )
        r = a["memory_analysis"]["temp_bytes"] / h["memory_analysis"]["temp_bytes"]
        out.append(f"{'(info)':<6} {dt} autocast temp buffer {r:.3f}x hand-cast's")
    return out


# --------------------------------------------------------------------------- safety / cond


def sync_probe(entries: list[dict[str, Any]], batch: Any, n: int, rounds: int) -> dict[str, Any]:
    """Does a step make the host wait for the device? Dispatch time vs completion time.

    Per round and entry: ``n`` steps dispatched back to back (``dispatch``: until the
    Python loop has issued them all; ``async``: until the last one is done), then ``n``
    steps each followed by ``block_until_ready`` (``blocked``). A step that copies its
    predicate to the host and waits for it cannot be issued ahead of the device, so its
    dispatch time approaches its async time.
    """
    import jax

    res: dict[str, dict[str, list[float]]] = {
        e["variant"].name: {"dispatch": [], "async": [], "blocked": []} for e in entries
    }
    for r in range(rounds):
        k = r % len(entries)
        for e in entries[k:] + entries[:k]:
            compiled, state = e["compiled"], e["state"]
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(n):
                *state, loss = compiled(*state, batch)
            t1 = time.perf_counter()
            jax.block_until_ready((state, loss))
            t2 = time.perf_counter()
            for _ in range(n):
                *state, loss = compiled(*state, batch)
                jax.block_until_ready((state, loss))
            t3 = time.perf_counter()
            e["state"] = tuple(state)
            d = res[e["variant"].name]
            d["dispatch"].append((t1 - t0) / n)
            d["async"].append((t2 - t0) / n)
            d["blocked"].append((t3 - t2) / n)
    out = {}
    for name, d in res.items():
        med = {k: _median(v) * 1e3 for k, v in d.items()}
        out[name] = {
            "dispatch_ms": med["dispatch"], "async_ms": med["async"],
            "blocked_ms": med["blocked"], "dispatch_over_async": med["dispatch"] / med["async"],
            "all_ms": {k: [x * 1e3 for x in v] for k, v in d.items()},
        }  # fmt: skip
    return {"steps_per_round": n, "rounds": rounds, "variants": out}


_D2H = re.compile(r"memcpy.*(dtoh|d2h|device\s*to\s*host|->\s*host|->\s*pinned)", re.I)
_H2D = re.compile(r"memcpy.*(htod|h2d|host\s*to\s*device)", re.I)
_SYNC = re.compile(r"(stream|event|ctx|device)synchronize|blockhostuntildone|synchronize", re.I)
_HOST_COPY = re.compile(r"cu(da)?memcpy\w*dtoh|cudamemcpy\b", re.I)
_GRAPH = re.compile(r"graphlaunch", re.I)
_LAUNCH = re.compile(r"(culaunchkernel|cudalaunchkernel|launchkernel)", re.I)


def summarize_xspace(path: str, steps: int) -> dict[str, Any]:
    """Counts from a jax.profiler trace: D2H copies, host syncs, graph and kernel launches."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    counts = collections.Counter()
    device_ns: collections.Counter[str] = collections.Counter()
    device_n: collections.Counter[str] = collections.Counter()
    planes = {}
    for plane in data.planes:
        device = "/device:" in plane.name
        names: collections.Counter[str] = collections.Counter()
        lines = []
        for line in plane.lines:
            n_ev = 0
            for ev in line.events:
                n_ev += 1
                nm = ev.name
                names[nm[:100]] += 1
                if device:
                    device_ns[nm[:100]] += ev.duration_ns
                    device_n[nm[:100]] += 1
                if device and _D2H.search(nm):
                    counts["device_memcpy_d2h"] += 1
                if device and _H2D.search(nm):
                    counts["device_memcpy_h2d"] += 1
                if not device:
                    if _SYNC.search(nm):
                        counts["host_sync_calls"] += 1
                    if _HOST_COPY.search(nm):
                        counts["host_memcpy_dtoh_calls"] += 1
                    if _GRAPH.search(nm):
                        counts["host_graph_launches"] += 1
                    if _LAUNCH.search(nm):
                        counts["host_kernel_launches"] += 1
            lines.append(f"{line.name} ({n_ev})")
        planes[plane.name] = {"lines": lines[:40], "top_events": names.most_common(30)}
    keys = (
        "device_memcpy_d2h",
        "device_memcpy_h2d",
        "host_sync_calls",
        "host_memcpy_dtoh_calls",
        "host_graph_launches",
        "host_kernel_launches",
    )
    per_step = {k: counts[k] / steps for k in keys}
    per_step["device_events"] = sum(device_n.values()) / steps
    per_step["device_busy_ms"] = sum(device_ns.values()) / steps / 1e6
    top = [(n, device_n[n] / steps, t / steps / 1e3) for n, t in device_ns.most_common(25)]
    return {
        "steps": steps,
        "per_step": per_step,
        "planes": planes,
        "top_device_time": top,
    }  # (name, events/step, us/step)


def _profile(run_steps: Callable[[], None], steps: int, d: Path) -> dict[str, Any]:
    """Traces ``run_steps()`` (``steps`` steps, blocked at the end) with jax.profiler."""
    import jax

    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # no Python events: only runtime, CUDA API and device
    except Exception:  # noqa: BLE001 - an older or newer profiler API
        options = None
    try:
        with jax.profiler.trace(str(d), profiler_options=options):
            run_steps()
        files = sorted(d.rglob("*.xplane.pb"))
        return summarize_xspace(str(files[-1]), steps) if files else {"error": "no trace"}
    except Exception as exc:  # noqa: BLE001 - a profiler that does not work here
        return {"error": f"{type(exc).__name__}: {exc}"}


def profile_steps(
    entries: list[dict[str, Any]], batch: Any, steps: int, trace_root: Path
) -> dict[str, Any]:
    """A ``jax.profiler`` trace of ``steps`` back-to-back steps per entry, summarised."""
    import jax

    out = {}
    for e in entries:
        name = e["variant"].name

        def run_steps(e: dict[str, Any] = e, name: str = name) -> None:
            state = e["state"]
            for i in range(steps):
                with jax.profiler.StepTraceAnnotation(name, step_num=i):
                    *state, loss = e["compiled"](*state, batch)
            jax.block_until_ready((state, loss))
            e["state"] = tuple(state)

        out[name] = _profile(run_steps, steps, trace_root / name)
    return out


def cmd_safety(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import models
    import run as bench_run
    import variants as variants_lib

    _setup_jax(args.cache_dir)
    _check_backend(args.allow_cpu)
    info = bench_run.machine_info()
    steps, rounds, warmup = bench_run._SCHEDULE[args.size]
    steps, rounds = args.bench_steps or steps, args.bench_rounds or rounds
    model, params, batch = models.build(args.size)
    cfg = models.SIZES[args.size]
    print(
        f"{args.tag}: size={args.size} ({models.param_count(params) / 1e6:.2f}M params, "
        f"batch {cfg.batch}x{cfg.seq_len}), {rounds} rounds x {steps} steps, {warmup} warm-up;"
        f" {info['device_kind']}, jax {info['jax']}",
        flush=True,
    )

    def loss(p: Any, b: Any) -> jax.Array:
        return models.loss_fn(model, p, b)

    only = tuple(x for x in args.only.split(",") if x) or None
    variants = variants_lib.build_variants(loss, only)
    t0 = time.perf_counter()
    # Compiled in parallel threads: compile s is then wall time under contention.
    with ThreadPoolExecutor(max(1, args.compile_workers)) as pool:
        futures = [pool.submit(bench_run.compile_variant, v, params, batch) for v in variants]
        entries = [f.result() for f in futures]
    print(
        f"  compiled {len(entries)} variants in {time.perf_counter() - t0:.1f} s "
        f"({args.compile_workers} threads)",
        flush=True,
    )
    for v, e in zip(variants, entries, strict=True):
        text = e["compiled"].as_text()
        e["gpu_hlo"] = hlo_stats(text)
        if v.name in ("jaxamp_step", "jaxamp_optax", "plain", "jaxamp_step_select"):
            _write_hlo(args.hlo_dir, f"{args.tag}_{v.name}", text)
        print(f"  compiled {v.name:<24} {e['compile_s']:.1f} s", flush=True)
    bench_run.time_variants(entries, batch, steps, rounds, warmup)
    rows = bench_run.build_rows(entries)
    for r, e in zip(rows, entries, strict=True):
        r["gpu_hlo"] = e["gpu_hlo"]
    table = bench_run.format_table(rows)
    targets = bench_run.check_targets(rows, info["platform"])
    by = {r["name"]: r for r in rows}
    if "jaxamp_step" in by:
        t = by["jaxamp_step"]["time_ratio"]
        targets.append(
            f"{'PASS' if t <= 1.03 else 'MISS'} jaxamp.step time {t:.3f}x (GPU target <= 1.03x)"
        )
    print(table)
    print("\n".join(targets), flush=True)
    probe_entries = [e for e in entries if e["variant"].name in PROBE_NAMES]
    probe = sync_probe(probe_entries, batch, args.probe_steps, args.probe_rounds)
    print(format_probe(probe), flush=True)
    trace_root = Path(args.trace_dir) / args.tag
    profile = profile_steps(probe_entries, batch, args.profile_steps, trace_root)
    print(format_profile(profile, top=10), flush=True)
    result = {
        "part": args.tag, "machine": info, "size": args.size,
        "model": {**vars(cfg), "params": models.param_count(params)},
        "schedule": {"steps_per_round": steps, "rounds": rounds, "warmup": warmup},
        "variants": rows, "targets": targets, "table": table, "sync_probe": probe,
        "profile": profile, "memory_stats_process": _memory_stats(),
    }  # fmt: skip
    _dump(Path(args.out) / f"{args.tag.replace('-', '_')}.json", result)
    return result


def format_probe(probe: dict[str, Any]) -> str:
    head = f"{'variant':<22}{'dispatch ms':>12}{'async ms':>10}{'blocked ms':>11}{'disp/async':>11}"
    lines = [
        f"host-sync probe: {probe['steps_per_round']} steps per round, "
        f"{probe['rounds']} rounds, medians per step",
        head,
        "-" * len(head),
    ]
    for name, v in probe["variants"].items():
        lines.append(
            f"{name:<22}{v['dispatch_ms']:>12.3f}{v['async_ms']:>10.3f}"
            f"{v['blocked_ms']:>11.3f}{v['dispatch_over_async']:>11.3f}"
        )
    lines.append(
        "dispatch: time for Python to issue the steps; async: until the last is done; "
        "blocked: block_until_ready after every step"
    )
    return "\n".join(lines)


def format_profile(profile: dict[str, Any], top: int = 0) -> str:
    keys = (
        "device_memcpy_d2h",
        "device_memcpy_h2d",
        "host_sync_calls",
        "host_memcpy_dtoh_calls",
        "host_graph_launches",
        "host_kernel_launches",
        "device_events",
        "device_busy_ms",
    )
    short = (
        "D2H copies",
        "H2D copies",
        "host syncs",
        "host DtoH",
        "graph launch",
        "kernel launch",
        "GPU events",
        "GPU busy ms",
    )
    head = f"{'per step (profile)':<22}" + "".join(f"{s:>14}" for s in short)
    lines = [head, "-" * len(head)]
    for name, p in profile.items():
        if "error" in p:
            lines.append(f"{name:<22}{p['error']}")
            continue
        lines.append(
            f"{name:<22}" + "".join(f"{p['per_step'].get(k, float('nan')):>14.2f}" for k in keys)
        )
    lines.append("GPU events / busy: device events per step and the sum of their durations")
    if top:
        for name, p in profile.items():
            lines.append(f"  {name}: top GPU time per step (us, events)")
            for n, ev, us in p.get("top_device_time", [])[:top]:
                lines.append(f"    {us:9.1f} us {ev:6.1f}x  {n[:90]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    demo_out = Path(args.demo_out)
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_lm.py"),
        "--out",
        str(demo_out),
        "--no-progress",
        *shlex.split(args.demo_args),
    ]
    print("demo: " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(proc.stdout + proc.stderr, flush=True)
    summary = {}
    if (demo_out / "summary.json").exists():
        summary = json.loads((demo_out / "summary.json").read_text())
    table = (demo_out / "table.txt").read_text() if (demo_out / "table.txt").exists() else ""
    result = {
        "part": "demo",
        "command": cmd,
        "returncode": proc.returncode,
        "wall_s": wall,
        "table": table,
        "summary": summary,
    }
    print(f"demo wall time {wall:.1f} s (returncode {proc.returncode})", flush=True)
    _dump(Path(args.out) / "demo.json", result)
    return result


# --------------------------------------------------------------------------- driver


def _stream(
    cmd: list[str], log: io.TextIOBase, timeout: float | None, env: dict[str, str] | None = None
) -> tuple[int | str, str]:
    """Runs ``cmd``, echoing its output to stdout and ``log``; kills it at ``timeout``."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        bufsize=1,
    )
    captured: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            captured.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    th.join(timeout=10)
    return rc, "".join(captured)


def _nvidia_smi() -> str:
    q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw"
    try:
        return subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"


def _child_args(args: argparse.Namespace, part: str, timeout: float | None = None) -> list[str]:
    common = [
        "--out",
        args.out,
        "--cache-dir",
        args.cache_dir,
        "--hlo-dir",
        args.hlo_dir,
        "--trace-dir",
        args.trace_dir,
        "--seed",
        str(args.seed),
    ]
    if args.allow_cpu:
        common.append("--allow-cpu")
    if part == "payoff":
        limit = ["--time-limit", str(round(timeout - args.peak_reserve_s))] if timeout else []
        only = ["--only", args.only] if args.only else []
        return [
            "--part",
            "payoff",
            "--size",
            args.size,
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *limit,
            *only,
            *common,
        ]
    if part in ("safety-large", "cond-small"):
        large = part == "safety-large"
        size = args.size if large else args.small_size
        extra = (
            []
            if large
            else [
                "--only",
                "jaxamp_step,jaxamp_step_select",
                "--bench-steps",
                str(args.small_bench_steps),
            ]
        )
        if large and args.bench_rounds:
            extra += ["--bench-rounds", str(args.bench_rounds)]
        return [
            "--part",
            "safety",
            "--tag",
            part,
            "--size",
            size,
            "--probe-steps",
            str(args.probe_steps if large else args.small_probe_steps),
            "--probe-rounds",
            str(args.probe_rounds),
            "--profile-steps",
            str(args.profile_steps),
            *extra,
            *common,
        ]
    return ["--part", "demo", "--demo-out", args.demo_out, "--demo-args", args.demo_args, *common]


def _run_peaks(args: argparse.Namespace, log: io.TextIOBase, deadline: float) -> None:
    """Per-variant peak memory, each variant alone in a fresh process, merged into payoff.json."""
    path = Path(args.out) / "payoff.json"
    if not path.exists():
        return
    result = json.loads(path.read_text())
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    names = [r["name"] for r in result["variants"]]
    peaks: dict[str, Any] = {}
    for i in range(0, len(names), args.peak_parallel):
        group = names[i : i + args.peak_parallel]
        left = deadline - time.perf_counter()
        if left < 20:
            print(f"peak: no time left for {group}", flush=True)
            break
        outs: dict[str, str] = {}

        def one(name: str, t: float = left, outs: dict[str, str] = outs) -> None:
            cmd = [
                sys.executable,
                __file__,
                "--part",
                "peak",
                "--variant",
                name,
                "--size",
                args.size,
                "--cache-dir",
                args.cache_dir,
                "--seed",
                str(args.seed),
            ]
            if args.allow_cpu:
                cmd.append("--allow-cpu")
            outs[name] = _stream(cmd, log, t, env)[1]

        threads = [threading.Thread(target=one, args=(n,)) for n in group]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for name, text in outs.items():
            for line in text.splitlines():
                if line.startswith("PEAK_JSON "):
                    peaks[name] = json.loads(line[len("PEAK_JSON ") :])
    for r in result["variants"]:
        p = peaks.get(r["name"])
        r["peak"] = p
        r["peak_bytes"] = p["peak_bytes"] if p else None
    _dump(path, result)


def cmd_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    bad = set(parts) - set(PARTS)
    if bad:
        raise SystemExit(f"--parts: unknown {sorted(bad)}; choose from {','.join(PARTS)}")
    t_start = time.perf_counter()
    log = open(out / "log.txt", "a")  # noqa: SIM115 - closed at the end
    smi = _nvidia_smi()
    header = (
        f"benchmarks/gpu.py {datetime.datetime.now().isoformat(timespec='seconds')}\n"
        f"argv: {' '.join(sys.argv)}\nXLA_FLAGS={os.environ.get('XLA_FLAGS', '')}\n{smi}\n"
    )
    print(header, flush=True)
    log.write(header)
    status: dict[str, Any] = {}
    for i, part in enumerate(parts):
        later = sum(PART_CAPS[p] for p in parts[i + 1 :])
        if args.budget_s:
            left = args.budget_s - (time.perf_counter() - t_start)
            timeout: float | None = max(PART_CAPS[part], left - later)
            timeout = min(timeout, left)
            if timeout < 15:
                status[part] = {"status": "not run: budget spent"}
                continue
        else:
            timeout = None
        t0 = time.perf_counter()
        print(f"\n===== {part} (timeout {timeout and round(timeout)} s) =====", flush=True)
        log.write(f"\n===== {part} =====\n")
        cmd = [sys.executable, __file__, *_child_args(args, part, timeout)]
        rc, _ = _stream(cmd, log, timeout)
        if part == "payoff" and rc == 0:
            deadline = t0 + timeout if timeout else time.perf_counter() + 600
            if args.budget_s:
                deadline = max(deadline, time.perf_counter() + 30)
            _run_peaks(args, log, deadline)
        status[part] = {"returncode": rc, "seconds": time.perf_counter() - t0}
        print(f"===== {part}: rc {rc}, {status[part]['seconds']:.0f} s", flush=True)
    summary = final_summary(out)
    print(summary, flush=True)
    log.write(summary + "\n")
    smi_end = _nvidia_smi()
    run_info = {
        "argv": sys.argv,
        "started": header,
        "nvidia_smi_start": smi,
        "nvidia_smi_end": smi_end,
        "parts": status,
        "total_s": time.perf_counter() - t_start,
    }
    _dump(out / "run.json", run_info)
    hlo = Path(args.hlo_dir)
    if hlo.exists():
        files = sorted(hlo.glob("*.hlo.txt.gz"))
        if sum(f.stat().st_size for f in files) > 15e6:  # keep under 16 MB: the steps only
            files = [f for f in files if "jaxamp_step" in f.name or "payoff_bf16" in f.name]
        with tarfile.open(out / "hlo.tar.gz", "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f.name)
    print(
        f"total {time.perf_counter() - t_start:.0f} s; parts: "
        + ", ".join(f"{k}: {v}" for k, v in status.items()),
        flush=True,
    )
    log.close()


def final_summary(out: Path) -> str:
    """All tables again, from the JSON files, so they are the last thing printed."""
    lines = ["", "=" * 30 + " SUMMARY " + "=" * 30]
    p = out / "payoff.json"
    if p.exists():
        lines += ["", format_payoff(json.loads(p.read_text()))]
    for tag in ("safety_large", "cond_small"):
        f = out / f"{tag}.json"
        if f.exists():
            r = json.loads(f.read_text())
            lines += [
                "",
                f"[{tag}] size={r['size']} ({r['model']['params'] / 1e6:.1f}M params)",
                r["table"],
                *r["targets"],
                format_probe(r["sync_probe"]),
                format_profile(r["profile"]),
            ]
            for v in r["variants"]:
                cp = v.get("gpu_hlo", {}).get("cond_placement")
                if cp:
                    lines.append(
                        f"  {v['name']}: conditionals in HLO computation "
                        + ", ".join(
                            f"{c['computation']} (an HLO command_buffer: {c['in_command_buffer']};"
                            " the runtime may still capture it, see the profile)"
                            for c in cp
                        )
                    )
    d = out / "demo.json"
    if d.exists():
        r = json.loads(d.read_text())
        lines += ["", f"[demo] wall {r['wall_s']:.1f} s, returncode {r['returncode']}", r["table"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- flags


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part",
        default="all",
        choices=("all", "payoff", "peak", "safety", "demo"),
        help="all: the driver; the others are what it runs, one per process",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="all: comma-separated parts")
    ap.add_argument("--out", default=str(HERE / "gpu_results"), help="folder for the results")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="all: total seconds; each part is capped (0: no caps)",
    )
    ap.add_argument("--size", default="large", help="model size (models.SIZES) of the big runs")
    ap.add_argument("--small-size", default="default", help="cond-small: model size")
    ap.add_argument("--warmup", type=int, default=20, help="payoff: warm-up training steps")
    ap.add_argument("--rounds", type=int, default=14, help="payoff: timed rounds")
    ap.add_argument("--steps", type=int, default=20, help="payoff: training steps per round")
    ap.add_argument("--only", default="", help="payoff / safety: comma-separated variants")
    ap.add_argument("--variant", default="bf16_autocast", help="peak: the payoff variant")
    ap.add_argument("--peak-parallel", type=int, default=3, help="peak processes at a time")
    ap.add_argument("--tag", default="safety", help="safety: name of the JSON")
    ap.add_argument(
        "--compile-workers", type=int, default=4, help="safety: variants compiled at once (threads)"
    )
    ap.add_argument(
        "--payoff-compile-workers",
        type=int,
        default=1,
        help="payoff: variants compiled at once (1: no autotuning contention)",
    )
    ap.add_argument(
        "--profile-variants",
        default="",
        help="payoff: comma-separated variants to trace with jax.profiler",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="payoff: seconds for the whole part; fewer rounds if needed (0: none)",
    )
    ap.add_argument(
        "--peak-reserve-s",
        type=float,
        default=70.0,
        help="all: seconds of the payoff part kept for the peak-memory processes",
    )
    ap.add_argument("--bench-steps", type=int, default=0, help="safety: steps per round")
    ap.add_argument("--bench-rounds", type=int, default=0, help="safety: rounds")
    ap.add_argument("--small-bench-steps", type=int, default=20, help="cond-small: steps/round")
    ap.add_argument("--probe-steps", type=int, default=8, help="sync probe: steps per round")
    ap.add_argument("--small-probe-steps", type=int, default=16, help="cond-small: probe steps")
    ap.add_argument("--probe-rounds", type=int, default=5, help="sync probe: rounds")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps in each profile trace")
    ap.add_argument(
        "--cache-dir",
        default="/tmp/jaxamp_gpu_cache",
        help="persistent compilation cache (peak processes load from it)",
    )
    ap.add_argument("--hlo-dir", default="/tmp/jaxamp_gpu_hlo", help="optimized HLO texts")
    ap.add_argument("--trace-dir", default="/tmp/jaxamp_gpu_trace", help="profiler traces")
    ap.add_argument("--demo-out", default="/tmp/jaxamp_gpu_demo", help="demo: train_lm --out")
    ap.add_argument("--demo-args", default="", help="demo: extra train_lm.py flags ('': make demo)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke test)")
    return ap


def main(argv: list[str] | None = None) -> Any:
    args = build_parser().parse_args(argv)
    if args.part == "all":
        return cmd_all(args)
    return {"payoff": cmd_payoff, "peak": cmd_peak, "safety": cmd_safety, "demo": cmd_demo}[
        args.part
    ](args)


if __name__ == "__main__":
    main()
