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
import pytest
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import hlo_paths  # noqa: E402
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
            opt_state = v.opt_state_of(entry["state"])
            assert int(jaxamp.metrics(opt_state)["skipped_steps"]) == 0, v.name
    # The scanner itself must see a host callback when there is one.
    cb = jax.jit(lambda x: jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((), x.dtype), x))
    assert bench_run.scan_hlo(cb.lower(jnp.float32(1)).compile().as_text())["host_traffic"]


def test_gpu_benchmark_flags_variants_and_hlo_scan_on_cpu() -> None:
    # benchmarks/gpu.py is for a GPU. Here: its flags, that every payoff variant traces
    # (eval_shape: no compile, no run), and its scan of optimized HLO for conditionals.
    import gpu
    import models

    args = gpu.build_parser().parse_args(["--budget-s", "570", "--parts", "payoff,demo"])
    assert args.part == "all" and args.size == "large" and args.budget_s == 570
    payoff = gpu._child_args(args, "payoff", timeout=300.0)
    assert payoff[:2] == ["--part", "payoff"] and "--time-limit" in payoff
    assert gpu._child_args(args, "cond-small")[:4] == ["--part", "safety", "--tag", "cond-small"]

    cfg = models.SIZES["tiny"]
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32)
    params = jax.eval_shape(
        lambda t: models.TransformerLM(cfg).init(jax.random.key(0), t[:, :-1])["params"], tokens
    )
    for name in gpu.PAYOFF_VARIANTS:
        init, step = gpu.payoff_variant(name, cfg)
        out = jax.eval_shape(step, params, jax.eval_shape(init, params), tokens)
        assert out[2].shape == () and out[2].dtype == jnp.float32, name

    hlo = "ENTRY %main (p: f32[]) -> f32[] {\n  %c = f32[] conditional(%p, %a, %b)\n}\n"
    assert gpu.cond_placement(hlo) == [
        {"op": "%c", "computation": "main", "in_command_buffer": "False"}
    ]
    assert gpu.hlo_stats(hlo)["conditional"] == 1


def test_reduction_kernels_counts_fused_and_unfused_reductions() -> None:
    hlo = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%fused_computation (p: f32[8]) -> f32[] {
  %p = f32[8]{0} parameter(0)
  ROOT %r = f32[] reduce(f32[8]{0} %p, f32[] %c), dimensions={0}, to_apply=%add
}

%fused_computation.1 (p: f32[8]) -> f32[8] {
  ROOT %n = f32[8]{0} negate(f32[8]{0} %p)
}

ENTRY %main (x: f32[8]) -> f32[] {
  %f = f32[] fusion(f32[8]{0} %x), kind=kInput, calls=%fused_computation
  %g = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_computation.1
  ROOT %r2 = f32[] reduce(f32[8]{0} %g, f32[] %c), dimensions={0}, to_apply=%add
}
"""
    assert bench_run.reduction_kernels(hlo) == 2
    # On a real program: one reduction per separate sum, at least.
    f = jax.jit(lambda x, y: (jnp.sum(x), jnp.max(y * 2.0)))
    text = f.lower(jnp.ones(8), jnp.ones(16)).compile().as_text()
    assert bench_run.reduction_kernels(text) >= 2


@pytest.mark.slow
def test_the_record_is_timed_on_a_model_with_the_bench_models_leaves(tmp_path) -> None:
    argv = ["--size", "tiny", "--only", "jaxamp_step,jaxamp_step_no_record", "--no-finite-check"]
    argv += ["--no-autocast", "--no-low-precision", "--no-optimizer-state"]
    argv += ["--out", str(tmp_path / "r.json")]
    result = bench_run.main(argv)
    probe = result["record_probe"]
    assert probe["n_leaves"] == probe["bench_n_leaves"] > 0
    assert probe["step_us"] > 0 and math.isfinite(probe["record_us"])
    line = [t for t in result["targets"] if "timed on a narrow model" in t]
    assert len(line) == 1 and line[0].split()[0] in ("PASS", "MISS"), result["targets"]


def test_finite_step_kernels_counts_the_entry_and_the_true_branch_only() -> None:
    hlo = """HloModule m

%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(f32[8]{0} %p)
}

%skip (t: (f32[8], s32[4])) -> (f32[8], s32[4]) {
  %t = (f32[8]{0}, s32[4]{0}) parameter(0)
  %a = f32[8]{0} get-tuple-element(%t), index=0
  %b = s32[4]{0} get-tuple-element(%t), index=1
  %s1 = s32[4]{0} fusion(%b), kind=kLoop, calls=%fused_computation
  %s2 = s32[4]{0} fusion(%s1), kind=kLoop, calls=%fused_computation
  ROOT %r = (f32[8]{0}, s32[4]{0}) tuple(%a, %s2)
}

%apply (t: (f32[8], s32[4])) -> (f32[8], s32[4]) {
  %t = (f32[8]{0}, s32[4]{0}) parameter(0)
  %a = f32[8]{0} get-tuple-element(%t), index=0
  %b = s32[4]{0} get-tuple-element(%t), index=1
  %f = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %c = s32[4]{0} copy(%b)
  ROOT %r = (f32[8]{0}, s32[4]{0}) tuple(%f, %c)
}

%command_buffer (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %g = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation
}

ENTRY %main (x: f32[8], y: s32[4], p: s32[]) -> (f32[8], s32[4]) {
  %x = f32[8]{0} parameter(0)
  %y = s32[4]{0} parameter(1)
  %p = s32[] parameter(2)
  %k = f32[] constant(1)
  %x2 = f32[8]{0} call(%x), to_apply=%command_buffer
  %t = (f32[8]{0}, s32[4]{0}) tuple(%x2, %y)
  ROOT %c = (f32[8]{0}, s32[4]{0}) conditional(%p, %t, %t), branch_computations={%skip, %apply}
}
"""
    assert bench_run.finite_step_kernels(hlo) == {
        "call f32[8]{0}": 1,
        "conditional (tuple)": 1,
        "fusion f32[8]{0}": 2,
        "copy s32[4]{0}": 1,
    }
    copies = hlo_paths.branch_copies(hlo)
    assert [[len(b) for b in c["branches"]] for c in copies] == [[0, 1]]
    assert copies[0]["branches"][1][0] == {
        "kind": "copy",
        "shape": "s32[4]{0}",
        "bytes": 16,
        "op_name": "",
    }
    # A fusion that only changes a layout is a copy kernel too; one that computes is not.
    layout = hlo.replace(
        "%c = s32[4]{0} copy(%b)",
        "%c = f32[8]{0} fusion(%a), kind=kLoop, calls=%wrapped_copy_computation",
    ).replace(
        "%command_buffer (a",
        "%wrapped_copy_computation (p: f32[8]) -> f32[8] {\n"
        "  %p = f32[8]{0} parameter(0)\n"
        "  ROOT %t = f32[8]{0} copy(f32[8]{0} %p)\n}\n\n%command_buffer (a",
    )
    got = hlo_paths.branch_copies(layout)[0]["branches"][1]
    assert [(x["kind"], x["bytes"]) for x in got] == [("layout", 32)]
    # The finite path calls the last branch on its operand, in place of the conditional.
    path = hlo_paths.finite_path_text(hlo)
    assert "conditional(" not in path
    assert "ROOT %c = (f32[8]{0}, s32[4]{0}) call(%t), to_apply=%apply" in path

    # A real program: the true branch's multiply is counted, the false branch's
    # reduction (the only f32[] op) is not.
    def f(p: jax.Array, x: jax.Array) -> jax.Array:
        return lax.cond(p, lambda x: x * 3.0, lambda x: x - jnp.sum(jnp.sin(x)), x)

    text = jax.jit(f).lower(jnp.bool_(True), jnp.ones(8)).compile().as_text()
    assert "f32[] reduce(" in text or "f32[] fusion(" in text
    got = bench_run.finite_step_kernels(text)
    assert got.get("conditional (tuple)") == 1, got
    assert got.get("fusion f32[8]{0}") == 1, got
    assert not any("f32[]" in k for k in got), got


def test_finite_path_bytes_count_the_taken_branch_only() -> None:
    # XLA's static figure counts the costlier branch (the false one here, which reads
    # three arrays); the finite path, the true branch's x * 3 (one read, one write).
    n = 1 << 16

    def f(p: jax.Array, x: jax.Array, y: jax.Array, z: jax.Array) -> jax.Array:
        return lax.cond(p, lambda: x * 3.0, lambda: x + y * z)

    args = (jnp.bool_(True), *(jnp.ones(n) for _ in range(3)))
    compiled = jax.jit(f).lower(*args).compile()
    static = bench_run._bytes_accessed(compiled)
    finite = hlo_paths.finite_path_bytes(compiled.as_text())
    assert hlo_paths.hlo_bytes(compiled.as_text()) == static  # the same analysis, from text
    assert 2 * 4 * n <= finite <= 2 * 4 * n + 64
    assert static >= 4 * 4 * n


@pytest.mark.slow
def test_low_precision_benchmark_trains_a_third_party_model_at_smoke_size() -> None:
    # benchmarks/bench_low_precision.py: its GPT-2 task (transformers' Flax model) trains
    # with bfloat16 params and stochastic rounding, and the memory figure counts what it
    # says (bfloat16 params and two bfloat16 moments: 6 bytes a parameter, plus scalars).
    import bench_low_precision as blp

    task = blp.GPT2(quick=True)
    first = task.final_loss(task.params)
    got = blp.train(task, "bf16+sr", 30)
    assert math.isfinite(got["final_loss"]) and got["final_loss"] < first, (first, got)
    assert 6.0 <= got["bytes_per_param"] < 6.01, got
    assert got["skipped"] == 0


@pytest.mark.slow
def test_optimizer_state_benchmark_counts_the_stored_bytes() -> None:
    # benchmarks/bench_optimizer_state.py: the state column is what low_precision_state
    # stores: a leaf of >= 4096 elements as 1 byte each and a float32 scale per 256 of
    # its last axis, per moment; smaller leaves as float32; plus two int32 counts.
    import bench_optimizer_state as bos
    import models

    cfg = models.ModelConfig(vocab=256, d_model=64, n_layers=1, n_heads=2, seq_len=8, batch=2)
    got = bos.measure(cfg, ("adamw", "lps 8bit"))
    shapes = jax.eval_shape(
        lambda: models.TransformerLM(cfg).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
    )["params"]
    leaves = [x.shape for x in jax.tree.leaves(shapes)]
    n = sum(math.prod(s) for s in leaves)

    def stored(s: tuple[int, ...]) -> int:
        size = math.prod(s)
        return size + 4 * math.prod(s[:-1]) * -(-s[-1] // 256) if size >= 4096 else 4 * size

    rows = got["rows"]
    assert got["model"]["params"] == n
    assert rows["adamw"]["state_bytes_per_param"] * n == 8 * n + 4
    assert rows["lps 8bit"]["state_bytes_per_param"] * n == 2 * sum(map(stored, leaves)) + 8
    assert rows["lps 8bit"]["u8_fusions"] > 0 == rows["adamw"]["u8_fusions"]
    assert rows["adamw"]["bytes_ratio"] == 1.0 and rows["lps 8bit"]["bytes_accessed"] > 0
