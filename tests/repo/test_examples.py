"""End-to-end tests of the examples: the LM demo at a tiny size, and each small example.

Everything runs in subprocesses with ``sys.executable``, the way a user runs it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY = [
    "--steps", "30", "--batch-size", "8", "--seq-len", "32", "--model-dim", "32",
    "--layers", "1", "--heads", "2", "--eval-every", "15", "--ckpt-every", "10",
    "--log-every", "5", "--eval-batches", "2", "--corpus-bytes", "200000", "--no-progress",
    "--spike-step", "24", "--spike-window", "16",
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
            os.environ.get("XLA_FLAGS", "")
            + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        ).strip(),
    }
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_demo_tiny_end_to_end(tmp_path: Path, jax_cache: Path) -> None:
    """All four runs at a tiny size (the resume: the next test)."""
    out = tmp_path / "demo"
    docs = tmp_path / "docs"  # what `make demo` writes into docs/_generated
    argv = [str(EXAMPLES / "train_lm.py"), *TINY, "--out", str(out), "--docs", str(docs)]
    proc = _run(argv, jax_cache)
    for name in ("summary.json", "table.txt", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    assert (docs / "demo_table.md").read_text() == f"```\n{(out / 'table.txt').read_text()}```\n"
    assert (docs / "demo.png").stat().st_size > 0
    assert "- **fp16-amp's loss scale**: from 2^24" in (docs / "demo_run.md").read_text()
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
    # The batch of step 24 is random bytes: a loss spike every run sees. The runs with
    # the spike rule skip it (and only it); the others take it.
    for name in ("fp16-amp", "bf16"):
        assert runs[name]["spikes_skipped"] == 1, name
        spiked = np.flatnonzero(np.diff([0, *runs[name]["history"]["spike_skipped"]]))
        assert list(spiked + 1) == [24], name
        assert runs[name]["explain"]["text"].startswith(
            ("No step", f"{runs[name]['steps_skipped']} step")
        )
    assert runs["fp32"]["spikes_skipped"] is None and runs["fp32"]["explain"] is None
    # find_overflow names the planted overflow: the up-projection of the last block,
    # its forward float16 matmul, at its line in train_lm.py.
    planted = runs["fp16-amp"]["find_overflow"]["planted"]
    source = (EXAMPLES / "train_lm.py").read_text().splitlines()
    line = 1 + next(i for i, s in enumerate(source) if "h = nn.Dense(4 * self.dim)" in s)
    assert (planted["found"], planted["primitive"], planted["pass_"]) == (
        True,
        "dot_general",
        "forward",
    )
    assert (planted["module_path"], planted["line"]) == ("ByteLM/Block_0/Dense_2", line)
    assert planted["magnitude"] > 65504
    loss = runs["fp32"]["history"]["loss"]
    assert loss[23] > max(loss[10:23]) + 1.0  # the bad batch's loss: a spike


# CI's budget: three more runs of the demo; CI checks a bit-for-bit resume in
# tests/checkpoint (and make test-slow in tests/multidevice/test_resume.py).
@pytest.mark.slow
def test_demo_interrupted_and_resumed_matches_the_straight_run(
    tmp_path: Path, jax_cache: Path
) -> None:
    """Interrupt the fp16-amp run after 13 steps, resume it, compare with the straight run."""
    amp_only = [*TINY, "--runs", "fp16-amp", "--no-find-overflow"]
    straight_out, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run([str(EXAMPLES / "train_lm.py"), *amp_only, "--out", str(straight_out)], jax_cache)
    cut = [str(EXAMPLES / "train_lm.py"), *amp_only, "--out", str(resumed)]
    _run([*cut, "--stop-after", "13"], jax_cache)
    assert not (resumed / "summary.json").exists()
    _run([*cut, "--resume"], jax_cache)
    read = lambda out: json.loads((out / "summary.json").read_text())["runs"]["fp16-amp"]
    again, straight = read(resumed)["history"], read(straight_out)["history"]
    for key in ("step", "loss", "loss_scale", "skipped", "zero_grad_frac", "eval_loss"):
        assert again[key] == straight[key], key


def _load_demo():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_lm", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GENERATED = ROOT / "docs" / "_generated"


def test_demo_figures_in_the_docs_are_the_last_make_demo_runs() -> None:
    """docs/demo.md and docs/guide.md show the table, figures and plot that `make demo`
    writes (`--docs docs/_generated`), included at build time: no copy to go stale."""
    recipe = subprocess.run(
        ["make", "-n", "demo", "DEMO_STAMP=Makefile"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert recipe.endswith("examples/train_lm.py --docs docs/_generated"), recipe
    run = (GENERATED / "demo_run.md").read_text()
    assert "This run**: `examples/train_lm.py --docs docs/_generated`," in run  # the defaults
    assert (GENERATED / "demo.png").stat().st_size > 0
    table = (GENERATED / "demo_table.md").read_text()
    for page, includes in {
        "demo.md": ("demo_table.md", "demo_run.md", "demo.png"),
        "guide.md": ("demo_table.md", "demo.png"),
    }.items():
        text = (ROOT / "docs" / page).read_text()
        for name in includes:
            assert f"_generated/{name}" in text, (page, name)
        # no table row written into the page by hand
        rows = [line for line in table.splitlines() if line.startswith(("fp32 ", "fp16 "))]
        assert rows and not any(row.split()[1] in text for row in rows), page


def test_demo_doc_points_at_the_lines_find_overflow_names() -> None:
    # The docs quote find_overflow's reports of `make demo` (docs/_generated/demo_run.md):
    # a source line each. They must still be the lines of those layers when
    # train_lm.py changes (else: run `make demo` again).
    run = (GENERATED / "demo_run.md").read_text()
    source = (EXAMPLES / "train_lm.py").read_text().splitlines()
    quoted = {
        "`ByteLM/Dense_0`, line ": "return nn.Dense(256)(",
        "`ByteLM/Block_1/Dense_2`, line ": "h = nn.Dense(4 * self.dim)(",
    }
    for where, code in quoted.items():
        assert where in run, where
        line = int(run.split(where)[1].split()[0])
        assert code in source[line - 1], (where, source[line - 1])


def test_demo_run_facts_format(tmp_path: Path) -> None:
    """format_run_facts on a small summary: the skipped steps with the scales around
    each, the underflow range, the corrupted batch's loss."""
    module = _load_demo()
    args = module.parse_args(["--steps", "30", "--spike-step", "24", "--init-scale", "8"])
    steps = list(range(1, 31))
    skipped = [0] * 10 + [1] * 20
    base = {
        "step": steps,
        "loss": [2.0] * 23 + [9.0] + [2.0] * 6,
        "zero_grad_frac": [0.0] * 30,
        "loss_scale": [8.0] * 9 + [8.0, 4.0] + [4.0] * 19,
        "skipped": skipped,
    }
    fp16 = {**base, "zero_grad_frac": [0.5] * 23 + [0.1] + [0.9] * 6}
    summary = {
        "platform": "cpu (1 device, 2 CPU cores)",
        "runs": {
            "fp32": {"history": base},
            "fp16": {"history": fp16},
            "fp16-amp": {"history": base, "explain": {"text": "a\nb"}, "find_overflow": None},
        },
    }
    facts = module.format_run_facts(args, summary, 125.0, "examples/train_lm.py")
    assert "2 min 05 s of wall time" in facts
    assert "fp32's loss on it is 9.0 nats/byte, against 2.0–2.0" in facts
    assert "50–90 % of its gradient entries" in facts and "(10 % on the random" in facts
    assert "1 step skipped as non-finite, halving it: 11 (2^3 → 2^2)" in facts
    # explain's report: a code block inside its list item (four spaces), the list goes on
    assert "after the run:\n\n    ```\n    a\n    b\n    ```\n" in facts


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


def _demo_summary() -> dict:
    """A demo summary shaped as train_lm.py writes it: 40 steps, a loss spike at step 32
    (near the right edge, where curves run under a legend placed inside), one overflow
    in the fp16-amp run that backs its scale off from 2**25, and find_overflow's re-run
    of that batch found at 2**26, a scale the run never reached."""
    n = 40
    steps = list(range(1, n + 1))
    loss = [6.0 * 0.97**i + 2.0 for i in range(n)]
    loss[31] = 9.0  # the spike
    spike = [int(i >= 31) for i in range(n)]
    scale = [2.0**24] * 10 + [2.0**25] * 15 + [2.0**24] * 15
    skipped = [0] * 25 + [1] * 15
    runs = {}
    for name in ("fp32", "fp16", "fp16-amp", "bf16"):
        shift = 0.8 if name == "fp16" else 0.0
        runs[name] = {"history": {
            "step": steps, "loss": [v + shift for v in loss], "eval_step": [20, 40],
            "eval_loss": [loss[19] + shift, loss[39] + shift],
            "zero_grad_frac": [0.3 if name == "fp16" else 0.0] * n,
            "spike_skipped": spike if name in ("fp16-amp", "bf16") else [0] * n,
            "loss_scale": scale if name == "fp16-amp" else [1.0] * n,
            "skipped": skipped if name == "fp16-amp" else [0] * n,
        }}  # fmt: skip
    runs["fp16-amp"]["find_overflow"] = {"last_skipped_step": {
        "step": 26, "loss_scale": 2.0**26, "found": True, "primitive": "dot_general",
        "pass_": "backward", "module_path": "ByteLM/Dense_0", "line": 350,
    }}  # fmt: skip
    return {"runs": runs}


def _segments_points(line) -> np.ndarray:
    """A drawn line's path in display coordinates, each segment sampled densely."""
    xy = line.get_transform().transform(line.get_xydata())
    if line.get_drawstyle().startswith("steps"):  # steps-post: horizontal, then vertical
        corners = [xy[0]]
        for a, b in zip(xy[:-1], xy[1:], strict=True):
            corners += [(b[0], a[1]), b]
        xy = np.array(corners)
    if line.get_linestyle() in ("None", "", " "):
        return xy
    t = np.linspace(0, 1, 40)[:, None]
    return np.concatenate([a + t * (b - a) for a, b in zip(xy[:-1], xy[1:], strict=True)])


def test_demo_plot_legends_and_the_find_overflow_box_cover_no_curve(monkeypatch) -> None:
    """The legend covers no curve; the find_overflow box says its scale (2**26 here,
    above the run's 2**25) is a re-run after training, and covers no curve either."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    demo = _load_demo()
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    monkeypatch.setattr(plt, "close", lambda *a: None)
    demo.plot(_demo_summary(), "unused.png")
    (fig,) = saved
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [leg.get_window_extent(renderer) for leg in fig.legends]
    boxes += [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend()]
    notes = [t for ax in fig.axes for t in ax.texts if "find_overflow" in t.get_text()]
    assert len(notes) == 1
    text = notes[0].get_text()
    assert "re-run" in text and "2^26" in text and "above the run's 2^25" in text, text
    boxes.append(notes[0].get_bbox_patch().get_window_extent(renderer))
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label() == "find_overflow re-run":
                continue  # the re-run's scale: a reference line across the panel
            points = _segments_points(line)
            for box in boxes:
                covered = box.count_contains(points)
                assert covered == 0, (ax.get_title(), line.get_label(), box)


def test_demo_progress_bar_shows_a_scale_only_for_loss_scaled_runs() -> None:
    demo = _load_demo()
    history = {"loss": [2.5], "loss_scale": [2.0**15], "skipped": [0]}
    shown = {name: demo.progress_postfix(spec, history) for name, spec in demo.RUN_SPECS.items()}
    assert shown["fp16-amp"] == {"loss": "2.500", "scale": "2^15", "skipped": 0}
    assert shown["fp32"] == shown["fp16"] == {"loss": "2.500"}
    assert shown["bf16"] == {"loss": "2.500", "skipped": 0}  # skips, never scales


def test_make_demo_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    """`make demo` installs jaxamp with its `examples` extra (matplotlib, tqdm), not the
    test, docs, conformance and bench extras `make test` needs (1.2 GB)."""
    venv = tmp_path / "venv"  # absent: make prints the whole recipe (-n runs nothing)
    proc = subprocess.run(
        ["make", "-n", "demo", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in proc.stdout.splitlines() if "pip install" in line]
    assert any('-e ".[examples]"' in line for line in installs), proc.stdout
    for extra in ("dev", "docs", "conformance", "bench"):
        assert not any(extra in line for line in installs), (extra, installs)
    assert "examples/train_lm.py" in proc.stdout
    # The demo needs nothing outside that extra: its imports are jaxamp's own
    # dependencies, matplotlib and tqdm.
    source = (EXAMPLES / "train_lm.py").read_text()
    imported = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from ")) and not line.startswith("from __future__")
    }
    extra = {"matplotlib", "tqdm"}
    allowed = {"jax", "flax", "optax", "orbax", "numpy", "jaxamp", *extra}
    assert {m for m in imported if m not in sys.stdlib_module_names} <= allowed, imported


def test_make_docs_installs_only_the_docs_extra(tmp_path: Path) -> None:
    """`make docs` installs jaxamp with its `docs` extra (MkDocs and its plugins), not the
    test environment's extras; `make docs-check`, part of `make test`, may use them."""
    venv = tmp_path / "venv"  # absent: make prints the whole recipe (-n runs nothing)
    proc = subprocess.run(
        ["make", "-n", "docs", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in proc.stdout.splitlines() if "pip install" in line]
    assert installs and all('-e ".[docs]"' in line for line in installs), proc.stdout
    assert f"{venv}/bin/mkdocs build --strict" in proc.stdout


def test_quickstart_prints_what_its_docstring_shows(jax_cache: Path) -> None:
    """examples/quickstart.py prints the lines its docstring says a user will see: the
    loss falling, the scale at 2**15 halving on the one inf batch, one skipped step
    that left the params as they were."""
    proc = _run([str(EXAMPLES / "quickstart.py")], jax_cache, timeout=120)
    got = proc.stdout.strip().splitlines()
    doc = _load_source_docstring("quickstart")
    shown = [line.strip() for line in doc.splitlines() if line.startswith("    ")]
    assert len(got) == len(shown) == 6, (got, shown)
    steps = [line.split() for line in got[:5]]
    assert [int(s[1]) for s in steps] == [0, 50, 100, 150, 200]
    assert [float(s[6]) for s in steps] == [2.0**15] * 2 + [2.0**14] * 3
    assert [int(s[9]) for s in steps] == [0, 0, 1, 1, 1]
    assert ["<-" in line for line in got[:5]] == [False, False, True, False, False]
    losses = [float(s[3]) for s in steps]
    assert np.isnan(losses[2]) and losses[4] < losses[0] / 10, losses
    assert got[5] == "the skipped step left the params as they were: True"
    for line, want in zip(got, shown, strict=True):  # the docstring is what it prints
        a, b = line.split(), want.split()
        assert a[:3] == b[:3] and a[4:] == b[4:], (line, want)
        if a[2] == "loss" and a[3] != "nan":
            assert abs(float(a[3]) - float(b[3])) <= 0.1 * float(b[3]), (line, want)


def _load_source_docstring(name: str) -> str:
    import ast

    return ast.get_docstring(ast.parse((EXAMPLES / f"{name}.py").read_text())) or ""


# Examples without a reference test of their own (those with one run their main() or
# the script there), and what each must print: its own claims, read back from its output.
STEP = re.compile(r"^step +(\d+) +loss ([-\d.e+]+) +scale (\d+) +skipped (\d+)", re.M)


def _steps(out: str) -> tuple[list[int], list[float], list[int], list[int]]:
    rows = STEP.findall(out)
    assert rows, out
    steps, losses, scales, skipped = zip(*rows, strict=True)
    return (
        [int(i) for i in steps],
        [float(x) for x in losses],
        list(map(int, scales)),
        list(map(int, skipped)),
    )


def _flax_train_state(out: str) -> None:
    steps, losses, scales, skipped = _steps(out)
    assert steps == [0, 100, 200, 300]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 10
    assert scales == [2**15, 2**16, 2**17, 2**18]  # growth_interval=100, no overflow
    assert skipped == [0] * 4
    (accuracy,) = re.findall(r"^train accuracy ([\d.]+)$", out, re.M)
    assert float(accuracy) >= 0.95


def _checkpointing(out: str) -> None:
    # The injected inf at step 11 backed the scale off once before the save at step 12.
    assert "restored step 12: scale=16384 hysteresis_tracker=1 nonfinite_streak=1 skipped=1" in out
    assert "resumed run equals the uninterrupted one bit for bit: True" in out
    assert "'skipped_steps': 1.0" in out
    assert re.search(
        r"plain optax checkpoint: .* has no loss-scale state at `opt_state.loss_scale`", out
    )


def _module_rules(out: str) -> None:
    dtypes = dict(re.findall(r"^matmul in (\S+) +(\w+)$", out, re.M))
    assert dtypes == {
        **{f"Classifier/Dense_{i}": "float16" for i in range(4)},
        "Classifier/head": "float32",  # modules={"head": "float32"}
    }
    rows = re.findall(r"^step +(\d+) loss ([-\d.e+]+)$", out, re.M)
    assert [int(i) for i, _ in rows] == [0, 5, 10, 15, 19]
    losses = [float(x) for _, x in rows]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 5


EXAMPLE_CHECKS = {
    "flax_train_state": _flax_train_state,
    "checkpointing": _checkpointing,
    "module_rules": _module_rules,
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_CHECKS))
def test_small_example_runs(name: str, jax_cache: Path) -> None:
    """Each example runs as a user runs it and prints what it claims."""
    proc = _run([str(EXAMPLES / f"{name}.py")], jax_cache, timeout=120)
    assert "nan" not in proc.stdout.lower()
    EXAMPLE_CHECKS[name](proc.stdout)


def test_nnx_example_claims(jax_cache: Path) -> None:
    """examples/nnx_example.py: the injected inf is the one skip, optimizer.step does not
    count it, the loss falls, and the resume from the checkpoint is bit for bit."""
    proc = _run([str(EXAMPLES / "nnx_example.py")], jax_cache, timeout=180)
    out = proc.stdout
    assert "skipped steps: 1 (the injected inf at step 20); optimizer.step 59 of 60 calls" in out
    assert "step 20  loss inf" in out and "skipped True" in out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    finite = [v for v in losses if np.isfinite(v)]
    assert finite[-1] < finite[0] / 10, losses
    assert "resumed from step 30, bit for bit: True" in out
    assert "nan" not in out.lower()


def test_bf16_params_example_claims(jax_cache: Path) -> None:
    """examples/bf16_params.py: stochastic rounding and Kahan end near the float32 run
    (within an ulp), plain bfloat16 falls behind, and an inf step keeps everything."""
    proc = _run([str(EXAMPLES / "bf16_params.py")], jax_cache, timeout=180)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    losses, ulps = summary["losses"], summary["ulps_from_float32"]
    for kind in ("stochastic rounding", "kahan"):
        assert ulps[kind] < 0.75, ulps  # the nearest bfloat16 values are 0.25 ulp away on average
        assert ulps["plain bfloat16"] > 2 * ulps[kind], ulps
        assert losses["plain bfloat16"] > 1.3 * losses[kind], losses
        assert losses[kind] < 1.25 * losses["float32"], losses
        assert summary["skip_kept"][kind] is True
    assert "bit for bit: True" in proc.stdout and "nan" not in proc.stdout.lower()


# ----------------------------------------------------------------------------------------
# Each recipe against a reference computed without jaxamp.
#
# The examples' loops run here with float32 compute (autocast disabled) and power-of-two
# loss scales: multiplying by 2**k is exact in float32 (no overflow or underflow at these
# sizes), so the unscaled gradients of the scaled loss are the plain gradients bit for bit.
# What a skip leaves alone (params on a skipped step or micro-batch, a skipped partition,
# its optimizer state) is compared bit for bit. The params of steps that were applied are
# compared with the plain optax loop that leaves the skipped steps out to RTOL / ATOL:
# jaxamp runs the optimizer inside a `lax.cond`, which XLA compiles as its own computation
# and may contract multiply-adds into FMAs differently than in the plain program (measured:
# last-bit differences, under 1e-7 after 6 steps), while one optimizer step moves the
# params by ~1e-2 to 1e-3: a step wrongly taken or left out, or gradients unscaled twice,
# is far outside the tolerance (each test also checks that the steps it compares moved).
# With float16 compute the point of scaling is that it is *not* exact, so no such
# reference exists; those runs are covered by `test_small_example_runs`.
RTOL, ATOL = 1e-5, 1e-7


def _load(name: str):
    """Imports examples/<name>.py as a module (once per process)."""
    key = f"example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _plain_loop(loss, opt, params, batches, leave_out=()):
    """Plain JAX + optax, float32: the params after each batch; `leave_out` steps skipped."""
    import jax
    import optax

    grad, update = jax.jit(jax.grad(loss)), jax.jit(opt.update)
    apply = jax.jit(optax.apply_updates)
    state, out = opt.init(params), []
    for i, batch in enumerate(batches):
        if i not in leave_out:
            updates, state = update(grad(params, *batch), state, params)
            params = apply(params, updates)
        out.append(params)
    return out


def _close(a, b) -> bool:
    """Equal to RTOL / ATOL, leaf for leaf (see the note above)."""
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.allclose(x, y, rtol=RTOL, atol=ATOL) for x, y in zip(la, lb, strict=True)
    )


def _moved(a, b) -> bool:
    """Some leaf differs by far more than the tolerance: a real optimizer step."""
    import jax
    import numpy as np

    return any(
        not np.allclose(x, y, rtol=100 * RTOL, atol=100 * ATOL)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _same(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def _with_inf(x, step: int):
    """The batches with an inf in batch `step` (one input value)."""
    return x.at[(step,) + (0,) * (x.ndim - 1)].set(float("inf"))


BAD = 2  # the step (or window) that overflows in the reference tests


def _amp_loop(train_step, params, opt_state, batches):
    """Runs a jaxamp train step over the batches with no host transfer allowed."""
    import jax

    out, extras = [], []
    with jax.transfer_guard("disallow"):
        for batch in batches:
            params, opt_state, *extra = train_step(params, opt_state, *batch)
            out.append(params)
            extras.append(extra)
    return out, opt_state, extras


LOSS = re.compile(r"\b(loss\w*(?: \+ penalty)?) ([-\d.e+]+|nan|inf)\b")


@pytest.fixture
def run_main(capsys):
    """Runs an example's main() (float16 autocast, as a user runs it) in this process."""

    def run(ex) -> str:
        ex.main()
        out = capsys.readouterr().out
        assert "nan" not in out.lower(), out
        # Every loss it prints is finite, and each one it tracks went down.
        series: dict[str, list[float]] = {}
        for label, value in LOSS.findall(out):
            series.setdefault(label, []).append(float(value))
        assert series, out
        for label, values in series.items():
            assert all(math.isfinite(v) for v in values), (label, values)
            assert len(values) < 2 or values[-1] < values[0], (label, values)
        return out

    return run


def _metrics(opt_state) -> dict:
    import jax

    import jaxamp

    return {k: v.item() for k, v in jax.device_get(jaxamp.metrics(opt_state)).items()}


def test_typical_loop_skips_exactly_the_overflowed_step(run_main) -> None:
    """pytorch_port.py: one inf batch costs that step, nothing else (vs plain SGD)."""
    import jax
    import optax

    ex = _load("pytorch_port")
    run_main(ex)
    inputs, targets = ex.make_data(6)
    inputs = _with_inf(inputs, BAD)
    params = ex.model.init(jax.random.key(1), inputs[0])
    tx = ex.jaxamp.skip_nonfinite(optax.sgd(0.1), ex.jaxamp.compat.torch_grad_scaler())
    got, state, _ = _amp_loop(
        ex.make_train_step(tx, amp=False),
        params,
        tx.init(params),
        zip(inputs, targets, strict=True),
    )
    loss = lambda p, x, y: ex.loss_fn(ex.model.apply(p, x), y)
    ref = _plain_loop(
        loss, optax.sgd(0.1), params, zip(inputs, targets, strict=True), leave_out={BAD}
    )
    assert all(_close(g, r) for g, r in zip(got, ref, strict=True))
    assert all(_moved(got[i], got[i - 1]) for i in range(1, len(got)) if i != BAD)
    assert _same(got[BAD], got[BAD - 1])  # skipped: bit for bit
    m = _metrics(state)
    assert m["skipped_steps"] == 1 and m["loss_scale"] == 2.0**15  # GradScaler: 2**16 * 0.5


@pytest.mark.parametrize("name", ["grad_clipping", "unscaled_grads"])
def test_clipping_equals_plain_clip_then_adam(name: str, run_main) -> None:
    """Clipping inside skip_nonfinite, or by hand after unscale_and_check + step(finite=),
    equals plain optax.chain(clip_by_global_norm, adam) without the overflowed step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    ex, ref_ex = _load(name), _load("grad_clipping")
    run_main(ex)
    xs, ys = ex.make_data(6)
    xs = _with_inf(xs, BAD)
    params = ex.model.init(jax.random.key(1), xs[0])
    tx = ex.make_tx()
    got, state, extras = _amp_loop(
        ex.make_train_step(tx, amp=False), params, tx.init(params), zip(xs, ys, strict=True)
    )
    loss = lambda p, x, y: ex.loss_fn(p, x, y, False)
    ref = _plain_loop(loss, ref_ex.make_inner(), params, zip(xs, ys, strict=True), leave_out={BAD})
    assert all(_close(g, r) for g, r in zip(got, ref, strict=True))
    assert all(_moved(got[i], got[i - 1]) for i in range(1, len(got)) if i != BAD)
    assert _metrics(state)["skipped_steps"] == 1
    if name == "unscaled_grads":
        # The pre-clip norm comes from the one unscale: it is the plain gradients' norm.
        clipped = 0
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            norm = float(extras[i][1])
            if i == BAD:
                assert not np.isfinite(norm)
                continue
            before = params if i == 0 else ref[i - 1]
            plain = float(optax.tree.norm(jax.grad(loss)(before, x, y)))
            assert norm == plain, (i, norm, plain)
            clipped += plain > ex.MAX_NORM
        assert clipped >= 2  # the clipping was active, so the test covers it
        assert jnp.isfinite(jnp.array(norm))


def test_accumulation_inf_costs_exactly_one_window(run_main) -> None:
    """grad_accumulation.py: an inf micro-batch in window 2 skips window 2 only; window 3
    trains normally. Reference: PyTorch's loop in plain JAX (grads of loss / K summed, one
    Adam step per window; with K = 4 a power of two, summing g / K is the mean exactly)."""
    import jax
    import jax.numpy as jnp
    import optax

    ex = _load("grad_accumulation")
    run_main(ex)
    k, windows = ex.EVERY_K, 4
    xs, ys = ex.make_data(windows)
    xs = xs.at[BAD, 1, 0, 0].set(jnp.inf)  # second micro-batch of window BAD
    params = ex.model.init(jax.random.key(1), xs[0, 0])
    tx = ex.make_tx()
    micro = [(xs[w, i], ys[w, i]) for w in range(windows) for i in range(k)]
    got, state, _ = _amp_loop(ex.make_micro_step(tx, amp=False), params, tx.init(params), micro)
    scales, st = [], tx.init(params)
    step = ex.make_micro_step(tx, amp=False)
    p = params
    for x, y in micro:  # the scale after each micro-batch
        p, st, _ = step(p, st, x, y)
        scales.append(float(ex.jaxamp.get_loss_scale(st).scale))

    loss = lambda p, x, y: ex.loss_fn(p, x, y, False)
    grad = jax.jit(jax.grad(lambda p, x, y: loss(p, x, y) / k))
    opt = optax.adam(1e-2)
    update, apply = jax.jit(opt.update), jax.jit(optax.apply_updates)
    ref_p, ref_state, ref = params, opt.init(params), []
    for w in range(windows):
        acc = jax.tree.map(jnp.zeros_like, ref_p)
        for i in range(k):
            acc = jax.tree.map(jnp.add, acc, grad(ref_p, xs[w, i], ys[w, i]))
        if w != BAD:
            updates, ref_state = update(acc, ref_state, ref_p)
            ref_p = apply(ref_p, updates)
        ref.append(ref_p)

    start = params
    for w in range(windows):
        for i in range(k - 1):  # micro-batches 1..K-1 leave the params alone
            assert _same(got[w * k + i], start), (w, i)
        assert _close(got[w * k + k - 1], ref[w]), w
        if w != BAD:
            assert _moved(got[w * k + k - 1], start), w
        start = got[w * k + k - 1]
    assert _same(got[(BAD + 1) * k - 1], got[BAD * k - 1])  # window BAD: skipped
    # The scale moves only at window ends: one backoff, at the end of window BAD.
    init = 2.0**12
    assert scales[: BAD * k] == [init] * (BAD * k)
    assert scales[BAD * k : (BAD + 1) * k] == [init] * (k - 1) + [init / 2]
    assert scales[(BAD + 1) * k :] == [init / 2] * ((windows - BAD - 1) * k)
    m = _metrics(state)
    assert m["skipped_steps"] == 1 and not m["skipped"]


def test_grad_penalty_equals_plain_double_backward(run_main) -> None:
    """grad_penalty.py: the scaled-then-unscaled inner gradients give plain JAX's
    loss + ||grad loss|| exactly, and the inf step is left out."""
    import jax
    import jax.numpy as jnp
    import optax

    ex = _load("grad_penalty")
    run_main(ex)
    xs, ys = ex.make_data(6)
    xs = _with_inf(xs, BAD)
    params = ex.model.init(jax.random.key(1), xs[0])
    tx = ex.make_tx()
    got, state, _ = _amp_loop(
        ex.make_train_step(tx, amp=False), params, tx.init(params), zip(xs, ys, strict=True)
    )

    def plain(p, x, y):
        g = jax.grad(lambda q: ex.loss_fn(q, x, y, False))(p)
        return ex.loss_fn(p, x, y, False) + jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(g)))

    ref = _plain_loop(plain, optax.adam(1e-2), params, zip(xs, ys, strict=True), leave_out={BAD})
    assert all(_close(g, r) for g, r in zip(got, ref, strict=True))
    assert all(_moved(got[i], got[i - 1]) for i in range(1, len(got)) if i != BAD)
    assert _metrics(state)["skipped_steps"] == 1


def test_multiple_optimizers_skip_only_the_overflowed_partition(run_main) -> None:
    """multiple_optimizers.py: model1's gradients overflow at step 2; optimizer1 skips it
    (model1's params and Adam state unchanged), optimizer0 steps; the scale backs off once.
    Reference: two plain optax optimizers on the gradients of loss0 + loss1."""
    import jax
    import jax.numpy as jnp
    import optax

    ex = _load("multiple_optimizers")
    run_main(ex)
    xs, ys = ex.make_data(5)
    faults = jnp.arange(5) == BAD
    params = ex.init_params(xs[0])
    tx = ex.make_tx()
    got, state, _ = _amp_loop(
        ex.make_train_step(tx, amp=False), params, tx.init(params), zip(xs, ys, faults, strict=True)
    )
    grad = jax.jit(jax.grad(lambda p, x, y: ex.losses(p, x, y, False)[0]))
    opts = {"model0": optax.sgd(1e-2, momentum=0.9), "model1": optax.adam(1e-3)}
    update = {k: jax.jit(o.update) for k, o in opts.items()}
    apply = jax.jit(optax.apply_updates)
    p, states = params, {k: o.init(params[k]) for k, o in opts.items()}
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        g = grad(p, x, y)
        new = dict(p)
        for k in opts:
            if not (k == "model1" and i == BAD):
                updates, states[k] = update[k](g[k], states[k], p[k])
                new[k] = apply(p[k], updates)
        p = new
        assert _close(got[i], p), i
    assert _same(got[BAD]["model1"], got[BAD - 1]["model1"])
    assert _moved(got[BAD]["model0"], got[BAD - 1]["model0"])
    # Optimizer1's Adam state: its count advanced on every step but the skipped one.
    assert int(state.inner_states["opt1"][0].count) == len(xs) - 1
    m = _metrics(state)
    assert m["skipped_steps"] == 1 and m["loss_scale"] == 2.0**9


def test_custom_vjp_loop_and_full_precision(run_main) -> None:
    """custom_autograd.py: full_precision(l2_norm) under autocast is the float32 function,
    value and gradient; mymm's forward is the float16 product; the loop skips the inf step."""
    import jax
    import jax.numpy as jnp
    import optax

    ex = _load("custom_autograd")
    run_main(ex)
    jaxamp = ex.jaxamp
    w = jax.random.normal(jax.random.key(3), (8, 32)) * 100.0  # its square sum overflows f16
    f = jaxamp.autocast(jaxamp.full_precision(ex.l2_norm), dtype=jnp.float16)
    assert _same(f(w), ex.l2_norm(w)) and _same(jax.grad(f)(w), jax.grad(ex.l2_norm)(w))
    a = jax.random.normal(jax.random.key(4), (4, 8))
    b = jax.random.normal(jax.random.key(5), (8, 3))
    out = jaxamp.autocast(ex.mymm, dtype=jnp.float16)(a, b)
    assert _same(out, (a.astype(jnp.float16) @ b.astype(jnp.float16)).astype(jnp.float32))

    xs, ys = ex.make_data(5)
    xs = _with_inf(xs, BAD)
    params = ex.init_params()
    tx = ex.make_tx()
    got, state, _ = _amp_loop(
        ex.make_train_step(tx, amp=False), params, tx.init(params), zip(xs, ys, strict=True)
    )
    ref = _plain_loop(
        ex.loss_fn, optax.adam(1e-2), params, zip(xs, ys, strict=True), leave_out={BAD}
    )
    assert all(_close(g, r) for g, r in zip(got, ref, strict=True))
    assert all(_moved(got[i], got[i - 1]) for i in range(1, len(got)) if i != BAD)
    assert _metrics(state)["skipped_steps"] == 1


def test_custom_vjp_backward_runs_under_autocast() -> None:
    """custom_autograd.py: differentiated under autocast, mymm's forward and its backward
    rule compute what float16 operands give (PyTorch's custom_fwd / custom_bwd)."""
    import jax
    import jax.numpy as jnp

    ex = _load("custom_autograd")
    a = jax.random.normal(jax.random.key(4), (4, 8))
    b = jax.random.normal(jax.random.key(5), (8, 3))
    f = ex.jaxamp.autocast(lambda a, b: jnp.sum(ex.mymm(a, b)), dtype=jnp.float16)
    value, (da, db) = jax.value_and_grad(f, argnums=(0, 1))(a, b)
    a16, b16 = a.astype(jnp.float16), b.astype(jnp.float16)
    g = jnp.ones((4, 3), jnp.float16)
    assert _same(value, jnp.sum((a16 @ b16).astype(jnp.float32)))
    assert _same(da, (g @ b16.T).astype(jnp.float32))
    assert _same(db, (a16.T @ g).astype(jnp.float32))


def test_data_parallel_matches_single_device_plain_optax(jax_cache: Path) -> None:
    """data_parallel.py on 8 simulated devices: shard_map, replicated jit and FSDP jit each
    equal single-device plain Adam on the whole batch without step 3, to float32 rounding
    (rtol 1e-5: the per-device means are reduced in another order than the global mean)."""
    script = """
import os
# _run passes this process's XLA_FLAGS, so data_parallel.py's own default is not used.
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
import numpy as np, jax, optax
import data_parallel as dp
assert jax.device_count() == 8, jax.device_count()
xs, ys = dp.data()
p, opt = dp.init_params(), optax.adam(1e-2)
s = opt.init(p)
for i in range(dp.STEPS):
    if i != dp.BAD_STEP:
        u, s = opt.update(jax.grad(dp.loss_fn)(p, xs[i], ys[i]), s, p)
        p = optax.apply_updates(p, u)
runs = [dp.shard_map_training(), dp.mesh_jit_training(False), dp.mesh_jit_training(True)]
for got in runs:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
print("all three match plain optax")
"""
    env_path = f"{EXAMPLES}"
    proc = _run(["-c", f"import sys; sys.path.insert(0, {env_path!r})\n" + script], jax_cache)
    assert "all three match plain optax" in proc.stdout
