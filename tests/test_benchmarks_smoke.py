"""Smoke test of the benchmark harness: every variant compiles, runs, and jaxamp's
compiled steps hold no host callback / send / recv / outfeed / infeed.

No timing is asserted. A tiny MLP stands in for the transformer to keep compiles short.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import run as bench_run  # noqa: E402
import variants as variants_lib  # noqa: E402

import jaxamp  # noqa: E402


def _loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def test_every_variant_compiles_runs_and_jaxamp_has_no_host_traffic() -> None:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (8, 16)) * 0.1,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 4)) * 0.1,
    }
    batch = (jax.random.normal(k3, (4, 8)), jnp.ones((4, 4)))
    variants = variants_lib.build_variants(_loss)
    assert [v.name for v in variants] == list(variants_lib.VARIANT_NAMES)
    for v in variants:
        entry = bench_run.compile_variant(v, params, batch)
        assert entry["bytes_accessed"] > 0 and entry["temp_bytes"] is not None, v.name
        first = None
        # Accumulating variants step once per window: run one window and one call more.
        calls = variants_lib.EVERY_K + 1 if "multisteps" in v.name or "every_k" in v.name else 2
        for _ in range(calls):
            *state, loss = entry["compiled"](*entry["state"], batch)
            entry["state"] = tuple(state)
            assert math.isfinite(float(loss)), v.name
            first = float(loss) if first is None else first
        assert float(loss) < first, f"{v.name} did not train"
        if v.is_jaxamp:
            assert not entry["hlo"]["host_traffic"], (v.name, entry["hlo"])
            assert int(jaxamp.metrics(entry["state"][1])["skipped_steps"]) == 0, v.name
    # The scanner itself must see a host callback when there is one.
    cb = jax.jit(lambda x: jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((), x.dtype), x))
    assert bench_run.scan_hlo(cb.lower(jnp.float32(1)).compile().as_text())["host_traffic"]
