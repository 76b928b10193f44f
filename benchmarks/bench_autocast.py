"""What ``jaxamp.autocast`` costs and saves, against float32 and hand-written casts.

Two studies, one Flax transformer family (pre-LayerNorm blocks, causal
attention, GELU MLP), written once with a Flax ``dtype`` field:

* memory: bytes of the residuals the backward pass keeps (read from the
  differentiated program, ``jax.ad_checkpoint``'s residual listing: it does
  not depend on the backend) and ``compiled.memory_analysis()`` temp bytes of
  the jitted gradient step, for float32, ``autocast`` float16 / bfloat16 and
  the hand-cast model (Flax ``dtype=float16``), on a 4-block transformer
  (width 256, 4 heads, MLP 1024, batch 8 x 128; unrolled and with
  ``nn.scan``) and on the demo LM of
  ``examples/train_lm.py`` (autocast only: it has no ``dtype`` field); plus
  the autocast output's error against float32 relative to its max.
* compile cost: trace + compile seconds of ``jax.jit(value_and_grad(loss))``
  at 4, 12 and 48 layers, unrolled and with ``nn.scan``, for float32, the
  hand-cast model and autocast (width 64, so that compiling dominates).

Run: ``python benchmarks/bench_autocast.py [--quick]``; ``run(quick)`` returns
the figures as a dict for ``benchmarks/run.py`` (quick: 4 and 12 layers).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jaxamp  # noqa: E402

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


class Block(nn.Module):
    """Pre-LayerNorm block; ``dtype`` is Flax's computation dtype (None: float32)."""

    dim: int
    heads: int
    mlp: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        hd = self.dim // self.heads
        h = nn.LayerNorm(dtype=self.dtype)(x)
        qkv = nn.Dense(3 * self.dim, use_bias=False, dtype=self.dtype)(h)
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, hd), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(np.float32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        h = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, self.dim)
        x = x + nn.Dense(self.dim, dtype=self.dtype)(h)
        h = nn.Dense(self.mlp, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(self.dim, dtype=self.dtype)(nn.gelu(h))


class Stack(nn.Module):
    layers: int
    dim: int
    heads: int
    mlp: int
    dtype: Any = None
    scan: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.dtype is not None:
            x = x.astype(self.dtype)  # what an Embed(dtype=...) hands the first block
        if self.scan:
            body = nn.scan(
                lambda blk, c, _: (blk(c), None),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            x, _ = body(Block(self.dim, self.heads, self.mlp, self.dtype), x, None)
        else:
            for _ in range(self.layers):
                x = Block(self.dim, self.heads, self.mlp, self.dtype)(x)
        return nn.LayerNorm(dtype=self.dtype)(x).astype(F32)


def _residual_bytes(loss: Callable[..., jax.Array], *args: Any) -> int:
    from jax._src.ad_checkpoint import saved_residuals  # the listing print_saved_residuals prints

    total = 0
    for aval, _ in saved_residuals(loss, *args):
        total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return total


def _temp_bytes(loss: Callable[..., jax.Array], *args: Any) -> int:
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    mem = compiled.memory_analysis()
    return int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1


def _memory_row(apply: Callable[..., jax.Array], params: Any, x: jax.Array) -> dict[str, float]:
    def loss(p: Any) -> jax.Array:
        return jnp.mean(jnp.square(apply(p, x)))

    return {
        "residual_bytes": _residual_bytes(loss, params),
        "temp_bytes": _temp_bytes(loss, params),
    }


def memory_study() -> dict[str, Any]:
    """Residual and temp bytes of the gradient step, and output error vs float32."""
    out: dict[str, Any] = {}
    x = jax.random.normal(jax.random.key(1), (8, 128, 256), F32)
    # The same blocks unrolled, and stacked with nn.scan (the residual stream
    # is then a loop carry).
    for study, scan in (("transformer", False), ("transformer_scan", True)):
        cfg = {"layers": 4, "dim": 256, "heads": 4, "mlp": 1024, "scan": scan}
        f32_model = Stack(**cfg)
        params = f32_model.init(jax.random.key(0), x)
        ref = f32_model.apply(params, x)
        variants = {
            "float32": f32_model.apply,
            "autocast_f16": jaxamp.autocast(f32_model.apply, dtype=F16),
            "autocast_bf16": jaxamp.autocast(f32_model.apply, dtype=BF16),
            "hand_cast_f16": Stack(**cfg, dtype=F16).apply,
        }
        rows = {}
        for name, apply in variants.items():
            row = _memory_row(apply, params, x)
            y = apply(params, x)
            row["err_vs_f32"] = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
            rows[name] = row
        out[study] = {"config": {**cfg, "batch": "8x128"}, "rows": rows}

    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    assert spec is not None and spec.loader is not None
    lm = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = lm
    spec.loader.exec_module(lm)
    model = lm.ByteLM(dim=128, layers=2, heads=4, max_len=128)  # the demo's defaults
    tokens = jax.random.randint(jax.random.key(2), (16, 128), 0, 256)
    lm_params = model.init(jax.random.key(0), tokens)
    ref = model.apply(lm_params, tokens)
    rows = {}
    for name, apply in {
        "float32": model.apply,
        "autocast_f16": jaxamp.autocast(model.apply, dtype=F16),
        "autocast_bf16": jaxamp.autocast(model.apply, dtype=BF16),
    }.items():
        row = _memory_row(lambda p, t, a=apply: a(p, t), lm_params, tokens)
        y = apply(lm_params, tokens)
        row["err_vs_f32"] = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
        rows[name] = row
    out["demo_lm"] = {"config": {"dim": 128, "layers": 2, "heads": 4, "batch": "16x128"},
                      "rows": rows}  # fmt: skip
    return out


_COMPILE_VARIANTS = ("float32", "hand_cast", "autocast")


def _compile_once(
    cfg: dict[str, Any], params: Any, x: jax.Array, name: str
) -> tuple[float, float, float]:
    """(trace + lower s, compile s, process CPU s of both) of a fresh value_and_grad step.

    Process CPU time (all threads) is less sensitive than wall time to other
    processes on a shared machine.
    """
    if name == "hand_cast":
        apply = Stack(**cfg, dtype=F16).apply
    elif name == "autocast":
        apply = jaxamp.autocast(Stack(**cfg).apply, dtype=F16)
    else:
        apply = Stack(**cfg).apply

    def loss(p: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(apply(p, x)))

    cpu = time.process_time()
    start = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, x)
    mid = time.perf_counter()
    lowered.compile()
    return mid - start, time.perf_counter() - mid, time.process_time() - cpu


def compile_study(layer_counts: tuple[int, ...], repeats: int = 3) -> dict[str, Any]:
    """Trace + compile seconds of the value_and_grad step (width 64, batch 2 x 32).

    Every repetition builds fresh functions (nothing is reused from JAX's
    caches but what a new model would reuse too) and runs the three variants
    interleaved, in a rotating order, so that load on a shared machine falls on
    all of them alike; each figure is the median over `repeats`.
    """
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), F32)
    out: dict[str, Any] = {}
    for scan in (False, True):
        for layers in layer_counts:
            cfg = {"layers": layers, "dim": 64, "heads": 4, "mlp": 256, "scan": scan}
            params = Stack(**cfg).init(jax.random.key(0), x)
            samples: dict[str, list[tuple[float, float, float]]] = {
                n: [] for n in _COMPILE_VARIANTS
            }
            for rep in range(repeats):
                k = rep % len(_COMPILE_VARIANTS)
                for name in _COMPILE_VARIANTS[k:] + _COMPILE_VARIANTS[:k]:
                    samples[name].append(_compile_once(cfg, params, x, name))
            row: dict[str, Any] = {"repeats": repeats}
            for name, runs in samples.items():
                row[name] = float(np.median([a + b for a, b, _ in runs]))
                row[f"{name}_lower"] = float(np.median([a for a, _, _ in runs]))
                row[f"{name}_compile"] = float(np.median([b for _, b, _ in runs]))
                row[f"{name}_cpu"] = float(np.median([c for _, _, c in runs]))
            row["autocast_over_hand_cast"] = row["autocast"] / row["hand_cast"]
            row["autocast_over_float32"] = row["autocast"] / row["float32"]
            row["cpu_autocast_over_hand_cast"] = row["autocast_cpu"] / row["hand_cast_cpu"]
            row["cpu_autocast_over_float32"] = row["autocast_cpu"] / row["float32_cpu"]
            out[f"{'scan' if scan else 'unrolled'}_{layers}"] = row
    return out


def run(quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """Both studies.

    Args:
      quick: compile study at 4 and 12 layers only (48 otherwise too), one
        repetition unless `repeats` says otherwise.
      repeats: interleaved repetitions of each compile measurement (median);
        default 1 when quick, else 3.

    Returns:
      ``{"config": ..., "memory": {...}, "compile": {...}}``.

    Example:
      >>> figures = run(quick=True)
      >>> figures["memory"]["transformer"]["rows"]["autocast_f16"]["residual_bytes"]
    """
    # Warm up JAX's own one-off initialisation so it is not charged to a variant.
    jax.jit(lambda a: a + 1).lower(jnp.ones(2)).compile()
    return {
        "config": {"backend": jax.default_backend(), "jax": jax.__version__},
        "memory": memory_study(),
        "compile": compile_study((4, 12) if quick else (4, 12, 48), repeats or (1 if quick else 3)),
    }


def format_report(figures: dict[str, Any]) -> str:
    """The tables ``make bench`` prints."""
    lines = [f"autocast, {figures['config']['backend']}, jax {figures['config']['jax']}"]
    for study in ("transformer", "transformer_scan", "demo_lm") if "memory" in figures else ():
        block = figures["memory"][study]
        rows = block["rows"]
        base = rows["float32"]
        hand = rows.get("hand_cast_f16")
        lines.append(f"\n{study} {block['config']}: backward residuals and grad-step temp")
        lines.append(f"{'':15s} {'residual MB':>12s} {'x f32':>7s} {'x hand':>7s} "
                     f"{'temp MB':>9s} {'x f32':>7s} {'err/max':>9s}")  # fmt: skip
        for name, r in rows.items():
            vs_hand = f"{r['residual_bytes'] / hand['residual_bytes']:6.2f}x" if hand else "     -"
            lines.append(
                f"{name:15s} {r['residual_bytes'] / 2**20:12.2f} "
                f"{r['residual_bytes'] / base['residual_bytes']:6.2f}x {vs_hand:>7s} "
                f"{r['temp_bytes'] / 2**20:9.2f} {r['temp_bytes'] / base['temp_bytes']:6.2f}x "
                f"{r['err_vs_f32']:9.1e}"
            )
    reps = next(iter(figures["compile"].values()))["repeats"]
    lines.append(
        f"\ntrace + compile of jit(value_and_grad) (width 64), seconds, median of {reps} "
        "interleaved runs (trace+lower / compile in brackets)"
    )
    lines.append(f"{'':12s} {'float32':>17s} {'hand':>17s} {'autocast':>17s} "
                 f"{'x hand':>7s} {'x f32':>7s} | CPU s: {'f32':>6s} {'hand':>6s} "
                 f"{'autoc':>6s} {'x hand':>7s} {'x f32':>7s}")  # fmt: skip
    for name, r in figures["compile"].items():
        cells = " ".join(
            f"{r[v]:6.2f} ({r[v + '_lower']:4.1f}/{r[v + '_compile']:4.1f})"
            for v in _COMPILE_VARIANTS
        )
        cpu = " ".join(f"{r[v + '_cpu']:6.2f}" for v in _COMPILE_VARIANTS)
        lines.append(
            f"{name:12s} {cells} "
            f"{r['autocast_over_hand_cast']:6.2f}x {r['autocast_over_float32']:6.2f}x | "
            f"       {cpu} {r['cpu_autocast_over_hand_cast']:6.2f}x "
            f"{r['cpu_autocast_over_float32']:6.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="compile study at 4 and 12 layers")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved compile repetitions (median); default 3, 1 with --quick",
    )
    parser.add_argument("--compile-only", action="store_true", help="skip the memory study")
    args = parser.parse_args()
    if args.compile_only:
        jax.jit(lambda a: a + 1).lower(jnp.ones(2)).compile()
        figures = {
            "config": {"backend": jax.default_backend(), "jax": jax.__version__},
            "compile": compile_study((4, 12) if args.quick else (4, 12, 48), args.repeats or 3),
        }
    else:
        figures = run(quick=args.quick, repeats=args.repeats)
    print(format_report(figures))


if __name__ == "__main__":
    main()
