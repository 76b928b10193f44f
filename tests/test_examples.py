"""End-to-end tests of the examples: the LM demo at a tiny size, and each small example.

Everything runs in subprocesses with ``sys.executable``, the way a user runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = [
    "--steps", "30", "--batch-size", "8", "--seq-len", "32", "--model-dim", "32",
    "--layers", "1", "--heads", "2", "--eval-every", "15", "--ckpt-every", "10",
    "--log-every", "5", "--eval-batches", "2", "--corpus-bytes", "200000", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compilation cache shared by the subprocesses: most of their time is compiling."""
    return tmp_path_factory.mktemp("jax_cache")


def _run(args: list[str], cache: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        # Tiny programs: compiling dominates, and LLVM's optimisation takes a third of it.
        "XLA_FLAGS": (
            os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
        ).strip(),
    }
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_demo_tiny_end_to_end_and_exact_resume(tmp_path: Path, jax_cache: Path) -> None:
    """All four runs at a tiny size; then an interrupted run resumed must match bit for bit."""
    out = tmp_path / "demo"
    proc = _run([str(EXAMPLES / "train_lm.py"), *TINY, "--out", str(out)], jax_cache)
    for name in ("summary.json", "table.txt", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert list(runs) == ["fp32", "fp16", "fp16-amp", "bf16"]
    fp32, amp = runs["fp32"]["final_eval_loss"], runs["fp16-amp"]["final_eval_loss"]
    assert abs(amp - fp32) <= 0.02 * fp32, (amp, fp32)
    # Without loss scaling, float16 gradients underflow to exactly zero; with it, they don't.
    assert runs["fp16"]["zero_grad_frac_mean"] > runs["fp32"]["zero_grad_frac_mean"] + 0.05
    assert runs["fp16-amp"]["zero_grad_frac_mean"] <= runs["fp32"]["zero_grad_frac_mean"] + 0.01
    for name, r in runs.items():
        assert len(r["history"]["loss"]) == 30, name
        assert r["step_time_vs_fp32"] > 0, name
        assert any((out / name / "ckpt").iterdir()), name
    assert "fp16-amp" in proc.stdout and "step time" in proc.stdout  # the table

    # Interrupt the fp16-amp run after 13 steps, resume it, compare with the straight run.
    resumed = tmp_path / "resumed"
    amp_only = [*TINY, "--runs", "fp16-amp", "--out", str(resumed)]
    _run([str(EXAMPLES / "train_lm.py"), *amp_only, "--stop-after", "13"], jax_cache)
    assert not (resumed / "summary.json").exists()
    _run([str(EXAMPLES / "train_lm.py"), *amp_only, "--resume"], jax_cache)
    again = json.loads((resumed / "summary.json").read_text())["runs"]["fp16-amp"]["history"]
    straight = runs["fp16-amp"]["history"]
    for key in ("step", "loss", "loss_scale", "skipped", "zero_grad_frac", "eval_loss"):
        assert again[key] == straight[key], key


def _load_demo():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_lm", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--steps", "0"], "--steps"),
        (["--batch-size", "x"], "--batch-size"),
        (["--runs", "fp32,fp8"], "--runs"),
        (["--lr", "-1"], "--lr"),
        (["--model-dim", "30", "--heads", "4"], "--model-dim"),
    ],
)
def test_demo_rejects_bad_flags(argv: list[str], flag: str, capsys) -> None:
    demo = _load_demo()
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [
        "quickstart",
        "flax_train_state",
        "nnx_example",
        "grad_accumulation",
        "grad_clipping",
        "pytorch_port",
        "module_rules",
    ],
)
def test_small_example_runs(name: str, jax_cache: Path) -> None:
    proc = _run([str(EXAMPLES / f"{name}.py")], jax_cache, timeout=120)
    assert "loss" in proc.stdout
    assert "nan" not in proc.stdout.lower()
