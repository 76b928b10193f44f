"""Trace + compile cost of ``jaxamp.autocast`` against hand-written casts.

A 12-layer pre-LayerNorm transformer written in plain JAX is compiled three
ways: in float32 (``f``), with float16 casts written by hand the way a careful
user would (matmuls in float16, LayerNorm statistics and softmax in float32),
and as ``jaxamp.autocast(f, dtype=float16)``. For the forward pass and for a
``value_and_grad`` step we time ``jax.jit(...).lower(...).compile()`` on a
fresh function object each repetition (so nothing is cached) and report the
median (the train step is compiled once: it takes seconds on CPU), plus the
ratio autocast / hand-cast that the issue asks to keep at or below 1.3x.

Run: ``python benchmarks/bench_autocast.py [--quick]``; ``run(quick)`` returns
the same figures as a dict for ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxamp  # noqa: E402

LAYERS, WIDTH, HEADS, SEQ, BATCH = 12, 64, 4, 32, 2
F16, F32 = jnp.float16, jnp.float32


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
    """Float32 parameters of the 12-layer transformer."""
    layers = []
    for k in jax.random.split(key, LAYERS):
        ks = jax.random.split(k, 4)
        layers.append({
            "ln1": jnp.ones(WIDTH), "ln2": jnp.ones(WIDTH),
            "qkv": jax.random.normal(ks[0], (WIDTH, 3 * WIDTH)) * WIDTH**-0.5,
            "out": jax.random.normal(ks[1], (WIDTH, WIDTH)) * WIDTH**-0.5,
            "up": jax.random.normal(ks[2], (WIDTH, 4 * WIDTH)) * WIDTH**-0.5,
            "down": jax.random.normal(ks[3], (4 * WIDTH, WIDTH)) * (4 * WIDTH) ** -0.5,
        })  # fmt: skip
    return layers


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, cast: Callable) -> jax.Array:
    def heads(t: jax.Array) -> jax.Array:
        return t.reshape(BATCH, SEQ, HEADS, WIDTH // HEADS)

    logits = jnp.einsum("bqhd,bkhd->bhqk", cast(heads(q)), cast(heads(k)))
    logits = logits.astype(F32) * (WIDTH // HEADS) ** -0.5  # softmax in float32
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", cast(weights), cast(heads(v)))
    return out.reshape(BATCH, SEQ, WIDTH)


def _id(x: jax.Array) -> jax.Array:
    return x


def _to_f16(x: jax.Array) -> jax.Array:
    return x.astype(F16)


def _forward(params: list[dict[str, jax.Array]], x: jax.Array, cast: Callable) -> jax.Array:
    for p in params:
        h = _layer_norm(x, p["ln1"])  # statistics in float32 (x is float32)
        q, k, v = jnp.split(cast(h) @ cast(p["qkv"]), 3, axis=-1)
        x = x + (cast(_attention(q, k, v, cast)) @ cast(p["out"])).astype(F32)
        h = _layer_norm(x, p["ln2"])
        h = jax.nn.gelu(cast(h) @ cast(p["up"]))
        x = x + (cast(h) @ cast(p["down"])).astype(F32)
    return x


def model_f32(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """The model as written: float32 throughout."""
    return _forward(params, x, _id)


def model_hand_cast(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """Hand-written mixed precision: float16 matmuls, float32 norms and softmax."""
    return _forward(params, x, _to_f16)


def _loss(model: Callable) -> Callable:
    def loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(model(params, x)))

    return loss


def _compile_seconds(make: Callable[[], Callable], args: tuple, reps: int) -> float:
    times = []
    for _ in range(reps):
        fn = make()  # a fresh function object: no tracing or lowering cache hit
        start = time.perf_counter()
        jax.jit(fn).lower(*args).compile()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool = False) -> dict[str, Any]:
    """Measures trace+compile time of f32, hand-cast and autocast variants.

    Args:
      quick: fewer repetitions (for smoke tests).

    Returns:
      ``{"config": ..., "forward": {...}, "train_step": {...}}`` where each
      inner dict has seconds for ``"float32"``, ``"hand_cast"`` and
      ``"autocast"`` and the ratio ``"autocast_over_hand_cast"``.

    Example:
      >>> figures = run(quick=True)
      >>> figures["forward"]["autocast_over_hand_cast"]
    """
    # A train-step compile of this model takes seconds on CPU: time it once
    # (forward thrice) so the whole script stays under a minute on 2 cores.
    reps = 1 if quick else 3
    step_reps = 1
    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, WIDTH))
    args = (params, x)
    results: dict[str, Any] = {
        "config": {"layers": LAYERS, "width": WIDTH, "heads": HEADS, "seq": SEQ,
                   "batch": BATCH, "reps": reps, "step_reps": step_reps,
                   "backend": jax.default_backend(), "jax": jax.__version__},
    }  # fmt: skip
    variants = {
        "float32": lambda: (lambda p, x: model_f32(p, x)),
        "hand_cast": lambda: (lambda p, x: model_hand_cast(p, x)),
        "autocast": lambda: jaxamp.autocast(lambda p, x: model_f32(p, x), dtype=F16),
    }
    # Warm up JAX's own one-off initialisation so it is not charged to a variant.
    jax.jit(model_f32).lower(*args).compile()
    for name, wrap in (("forward", None), ("train_step", jax.value_and_grad)):
        row = {}
        for variant, make in variants.items():
            factory = make if wrap is None else (lambda m=make, w=wrap: w(_loss(m())))
            row[variant] = _compile_seconds(factory, args, reps if wrap is None else step_reps)
        row["autocast_over_hand_cast"] = row["autocast"] / row["hand_cast"]
        results[name] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    figures = run(quick=parser.parse_args().quick)
    cfg = figures["config"]
    print(f"autocast trace+compile, {cfg['layers']}-layer transformer (width {cfg['width']}), "
          f"{cfg['backend']}, jax {cfg['jax']}, median of {cfg['reps']} "
          f"(train step: {cfg['step_reps']})")
    print(f"{'':12s} {'float32 s':>10s} {'hand-cast s':>12s} {'autocast s':>11s} "
          f"{'autocast/hand':>14s}")
    for name in ("forward", "train_step"):
        r = figures[name]
        print(f"{name:12s} {r['float32']:10.3f} {r['hand_cast']:12.3f} {r['autocast']:11.3f} "
              f"{r['autocast_over_hand_cast']:13.2f}x")


if __name__ == "__main__":
    main()
