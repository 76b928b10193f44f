"""FP8 on programs we did not write: Flax's lm1b example model (linen) and its gemma
example model (nnx, ``fp8_client_gemma``), with and without ``jaxamp.fp8_select``.

The client is ``TransformerLM`` of flax's ``examples/lm1b/models.py``, imported at run
time from a flax checkout (``--lm1b DIR``, the directory holding that file; nothing of
it is copied here), trained as a byte LM on the Python standard library's source
(``bench_low_precision.Task``: a fresh batch each step, the held-out loss over 8 fixed
batches of 32 windows), with the example's loss: weighted cross entropy of the logits
against the inputs themselves (the model shifts its inputs right), weight 0 at padding
(byte 0, which Python source does not hold: every weight is 1), summed over tokens over
the weights' sum (``harness.loss_of``).

Config (``CONFIG``), reduced from the example's default (``configs/default.py``: vocab
30,000 sentencepiece tokens, emb / qkv 512, mlp 2048, 6 layers, 8 heads, 128 tokens,
dropout 0.1, batch 32 per device) to train on 2 CPU cores in minutes: vocab 256 (bytes),
``emb_dim = qkv_dim = 128``, ``mlp_dim = 512``, 2 layers, 4 heads, 64 tokens
(``max_len = 64``), batch 16, dropout 0 and ``deterministic=True`` (runs differ only in
their arithmetic), float32 params; the rest as the example (no shared embeddings,
logits from their own Dense, sinusoidal positions). The optimizer is the example's
AdamW (peak learning rate 0.0016, ``b1 = 0.9, b2 = 0.98, eps = 1e-9``, weight decay 0.1)
on ``bench_low_precision.schedule`` (5 % warmup, cosine decay to 0: the example's
rsqrt schedule decays too little in a few hundred steps), behind
``jaxamp.skip_nonfinite`` with no loss scale (the bfloat16 recipe), stepped through
``jaxamp.value_and_grad`` + ``jaxamp.step``.

Rows, from the same init over the same batches:

* float32 (no autocast), bfloat16 autocast (``jaxamp.autocast(apply, dtype=bfloat16)``);
* FP8 tensorwise and rowwise (``fp8=jaxamp.fp8(scaling)``), every product FP8 takes;
* FP8 tensorwise and rowwise with ``jaxamp.fp8_select``'s selection at its default
  budget (and at each ``--budgets`` value), calibrated as ``tests/conformance/fp8.py``'s
  ``select`` does: on a training batch (the one of the step half way through) at
  bfloat16 autocast's parameters after half of the steps; and at the default budget
  with the next two steps' batches as ``other_batches`` (``OTHERS``: the budget beside
  the sampling noise of a step on a fresh batch, as this task trains).

Each row: the held-out loss of its final params judged in float32, over bfloat16
autocast's and float32's; forward products in FP8 of all (``jaxamp.audit``, as the
conformance FP8 rows count them); layers the selection kept; skipped steps. Goal
(``fp8.GOAL``): within 1 % of bfloat16 autocast. Under the table, bfloat16's own noise
band on this client (``fp8.perturbed``: bfloat16 autocast trained from the init moved by
a relative 2**-9, ``--noise-seeds`` draws, over the unperturbed run): how far the final
loss moves by a change that is no change of precision.

On the CPU XLA computes an FP8 product as a float32 product of the FP8 values (a GPU's
FP8 GEMM's numbers up to summation order, not its speed). The defaults (600 steps, 3
noise draws), measured at ``nice -n 19`` on 2 cores that other jobs shared: 13 CPU-minutes
(780 s), 27:40 wall at 47 % of a core; alone on 2 cores, 13 minutes at most.

Run: ``python benchmarks/fp8_clients.py --lm1b ~/flax/examples/lm1b [--out r.json]``,
or ``--gemma ~/flax/examples/gemma`` for the nnx client (``fp8_client_gemma``'s docstring:
its config; the rest, data, optimizer, rows and table, is this module's);
``fp8_client_clm.py`` runs this module's rows on transformers' GPT-2, its own recipe.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_low_precision  # noqa: E402

import jaxamp  # noqa: E402
from tests.conformance import fp8, harness, models  # noqa: E402

#: ``TransformerConfig`` fields for the client (the module docstring says what the
#: example's default is); ``max_len`` is the task's sequence length.
CONFIG = {
    "vocab_size": 256,
    "output_vocab_size": 256,
    "emb_dim": 128,
    "qkv_dim": 128,
    "mlp_dim": 512,
    "num_layers": 2,
    "num_heads": 4,
    "dropout_rate": 0.0,
    "attention_dropout_rate": 0.0,
    "deterministic": True,
}
#: The example's AdamW (``train.py``), its default learning rate and weight decay.
ADAMW = {"b1": 0.9, "b2": 0.98, "eps": 1e-9, "weight_decay": 0.1}
LR = 0.0016
STEPS, NOISE_SEEDS = 600, 3
#: The selection rows with ``other_batches``: the batches of the two steps after the
#: calibration batch's.
OTHERS = 2
SCALINGS = fp8.SCALINGS


def load_lm1b(directory: str | Path) -> ModuleType:
    """flax's ``examples/lm1b/models.py`` from `directory`, as the module
    ``flax_examples_lm1b_models`` (a name no module of ours or flax's has)."""
    path = Path(directory).expanduser() / "models.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"--lm1b {directory}: no models.py there; give the directory of flax's "
            "examples/lm1b in a flax checkout, e.g. --lm1b ~/flax/examples/lm1b"
        )
    spec = importlib.util.spec_from_file_location("flax_examples_lm1b_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [n for n in ("TransformerLM", "TransformerConfig") if not hasattr(module, n)]
    if missing:
        raise AttributeError(
            f"--lm1b {directory}: models.py defines no {', '.join(missing)}; give the "
            "directory of flax's examples/lm1b (the linen TransformerLM)"
        )
    return module


def lm1b_batch(window: jax.Array) -> dict[str, jax.Array]:
    """The example's batch from a batch of ``seq + 1``-byte windows: the first ``seq``
    bytes are the inputs and, the model shifting them right itself, the targets;
    weight 0 at padding (byte 0), as the example's train step weighs its tokens."""
    inputs = window[:, :-1]
    return {"inputs": inputs, "labels": inputs, "weights": (inputs > 0).astype(jnp.float32)}


class ClientTask(bench_low_precision.Task):
    """A client as ``bench_low_precision``'s byte-LM task, and as a conformance
    ``models.Built`` (``built``: ``apply(params, state, batch)``, the first training batch)
    for ``harness`` and ``fp8``'s functions. A client sets ``name``, ``config`` (its
    fields, as the results record them), ``client_batch`` and calls ``_set_apply``; one
    trained otherwise than the lm1b example (``fp8_client_clm``) also sets
    ``client_loss``, ``optimizer`` and ``optimizer_info``."""

    # Every client trains on the same batches and is judged on the same held-out ones.
    data_seed = 4
    config: dict[str, Any]
    built: models.Built
    #: ``loss(logits, batch)``, a float32 scalar; None: the examples' weighted cross
    #: entropy (``harness.loss_of``).
    client_loss: Callable[[jax.Array, dict[str, Any]], jax.Array] | None = None
    #: ``optimizer``'s, as the results record it.
    optimizer_info: dict[str, Any] = {
        "adamw": ADAMW,
        "peak_lr": LR,
        "schedule": "5 % warmup, cosine to 0",
    }

    def __init__(self) -> None:
        super().__init__(quick=False)

    @staticmethod
    def client_batch(window: jax.Array) -> dict[str, jax.Array]:
        """The example's batch (``inputs``, ``labels``, ``weights``) from a batch of
        ``seq + 1``-byte windows."""
        raise NotImplementedError

    def optimizer(self, steps: int) -> optax.GradientTransformation:
        """The optimizer of a run of `steps` steps: the lm1b example's AdamW on
        ``bench_low_precision.schedule``."""
        return optax.adamw(bench_low_precision.schedule(LR, steps), **ADAMW)  # type: ignore[arg-type]

    def _set_apply(self, params: Any, apply: Any) -> None:
        first = self.client_batch(self.batch(0))
        lr = self.optimizer_info["peak_lr"]
        self.built = models.Built(params, {}, first, apply, None, lr=lr, loss=self.client_loss)
        loss = harness._loss_fn(apply, self.built)
        self._set_loss(lambda p, window: loss(p, {}, self.client_batch(window))[0])


class Lm1bTask(ClientTask):
    """flax's linen ``TransformerLM`` at `config`."""

    name = "Flax lm1b TransformerLM (examples/lm1b/models.py)"
    client_batch = staticmethod(lm1b_batch)

    def __init__(self, module: Any, config: dict[str, Any] = CONFIG) -> None:
        super().__init__()
        self.config = {**config, "max_len": self.seq}
        model = module.TransformerLM(module.TransformerConfig(**self.config))

        def apply(params: Any, state: Any, batch: dict[str, Any]) -> tuple[jax.Array, Any]:
            return model.apply({"params": params}, batch["inputs"]), state

        tokens = jnp.ones((1, self.seq), jnp.int32)
        # The example annotates its params for sharding (nn.Partitioned): plain arrays here.
        self._set_apply(
            nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens)["params"]), apply
        )


def train(task: ClientTask, apply: Any, steps: int, params: Any = None) -> dict[str, Any]:
    """`steps` steps of `task`'s optimizer on the model run by `apply` (from the init,
    or `params`), a fresh batch each; the final held-out loss judged in float32, the
    skipped steps and the params half way through (``"half"``, where the selection is
    calibrated)."""
    built = task.built
    tx = jaxamp.skip_nonfinite(task.optimizer(steps))
    loss = harness._loss_fn(apply, built)

    @jax.jit
    def step(params: Any, opt_state: Any, window: jax.Array) -> tuple[Any, Any]:
        batch = task.client_batch(window)
        _, grads = jaxamp.value_and_grad(loss, has_aux=True)(opt_state, params, {}, batch)
        return jaxamp.step(tx, grads, opt_state, params)

    params = built.params if params is None else params
    opt_state, half = tx.init(params), None
    for i in range(steps):
        if i == steps // 2:
            half = params
        params, opt_state = step(params, opt_state, task.batch(i))
    return {
        "final": task.final_loss(params, jnp.float32),
        "skipped": int(jaxamp.metrics(opt_state)["skipped_steps"]),
        "half": half,
    }


def select(
    task: ClientTask,
    scaling: str,
    params: Any,
    step: int,
    budget: float | None = None,
    others: int = 0,
) -> jaxamp.types.Fp8Selection:
    """``jaxamp.fp8_select`` (`budget`, or its default) on the float32 model's loss on
    the batch of training step `step`, at `params` (bfloat16 autocast's at that step);
    with `others`, the batches of the steps after it as ``other_batches``."""
    loss = harness._loss_fn(task.built.apply, task.built)

    def value(p: Any, batch: dict[str, Any]) -> jax.Array:
        return loss(p, {}, batch)[0]

    given: dict[str, Any] = {} if budget is None else {"budget": budget}
    batches = [(params, task.client_batch(task.batch(step + k))) for k in range(1, others + 1)]
    chosen = jaxamp.fp8_select(value, scaling=scaling, other_batches=batches, **given)
    return chosen(params, task.client_batch(task.batch(step)))


def run(
    task: ClientTask,
    steps: int = STEPS,
    noise_seeds: int = NOISE_SEEDS,
    budgets: tuple[float, ...] = (),
    log: Any = print,
) -> dict[str, Any]:
    """Every row (module docstring), as a dict: ``rows``, ``noise`` (ratios), ``config``."""
    built = task.built
    bf16 = jaxamp.autocast(built.apply, dtype=jnp.bfloat16)
    rows: list[dict[str, Any]] = []

    def row(name: str, apply: Any, **extra: Any) -> dict[str, Any]:
        start = time.perf_counter()
        t = train(task, apply, steps)
        out = {"row": name, "final": t["final"], "skipped": t["skipped"], **extra}
        if "fp8" in name:
            out["products"] = fp8._products(apply, built)
        out["seconds"] = time.perf_counter() - start
        rows.append(out)
        log(f"{name}: {t['final']:.5f} ({out['seconds']:.0f} s)")
        return t

    row("float32", built.apply)
    half = row("bfloat16 autocast", bf16)["half"]
    for scaling in SCALINGS:
        cfg = jaxamp.fp8(scaling)
        row(f"fp8 {scaling}", jaxamp.autocast(built.apply, dtype=jnp.bfloat16, fp8=cfg))
    for budget, others in [(None, 0), *((b, 0) for b in budgets), (None, OTHERS)]:
        for scaling in SCALINGS:
            chosen = select(task, scaling, half, steps // 2, budget, others)
            cfg = jaxamp.fp8(scaling, select=chosen)
            apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16, fp8=cfg)
            beside = f", {others} other batches" if others else ""
            name = f"fp8 {scaling}, fp8_select (budget {chosen.budget:g}{beside})"
            row(name, apply, budget=chosen.budget, selection=chosen.to_dict())
    f32, base = rows[0]["final"], rows[1]["final"]
    for r in rows:
        r["ratio_bf16"], r["ratio_f32"] = r["final"] / base, r["final"] / f32
        r["meets_goal"] = abs(r["ratio_bf16"] - 1) <= fp8.GOAL
    noise = []
    for seed in range(noise_seeds):
        moved = train(task, bf16, steps, params=fp8.perturbed(built.params, seed))
        noise.append(moved["final"] / base)
        log(f"bfloat16 noise draw {seed}: {noise[-1]:.4f}")
    return {
        "client": task.name,
        "config": {**task.config, "batch": task.bsz, "seq": task.seq},
        "optimizer": task.optimizer_info,
        "steps": steps,
        "goal": fp8.GOAL,
        "noise": {"rel": fp8.NOISE_REL, "ratios": noise},
        "rows": rows,
    }


def _percent(ratio: float) -> str:
    return f"{ratio:.4f} ({100 * (ratio - 1):+.2f} %)"


def format_table(result: dict[str, Any]) -> str:
    """The markdown table of `result` (``run``'s), and the noise band under it."""
    lines = [
        "| row | FP8 products | layers kept | held-out loss | vs bf16 autocast | vs float32 "
        "| skipped | goal (1 % of bf16) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        p = r.get("products")
        products = f"{p['fp8']} of {p['total']}" if p else "-"
        s = r.get("selection")
        kept = f"{sum(s['modules'].values())} of {len(s['modules'])}" if s else "-"
        goal = "-" if r["row"] == "bfloat16 autocast" else ("pass" if r["meets_goal"] else "miss")
        lines.append(
            f"| {r['row']} | {products} | {kept} | {r['final']:.5f} | {_percent(r['ratio_bf16'])} "
            f"| {_percent(r['ratio_f32'])} | {r['skipped']} | {goal} |"
        )
    noise = result["noise"]["ratios"]
    if noise:
        lines.append("")
        lines.append(
            f"bfloat16 autocast's noise band ({len(noise)} inits moved by a relative "
            f"{result['noise']['rel']:g}, over the unperturbed run): "
            f"{100 * (min(noise) - 1):+.2f} to {100 * (max(noise) - 1):+.2f} %"
        )
    return "\n".join(lines)


def _git_commit(directory: Path, file: str) -> str | None:
    """The commit of the checkout `directory`'s `file` is tracked in; None if none."""
    git = ["git", "-C", str(directory)]
    try:
        subprocess.run([*git, "ls-files", "--error-unmatch", file], capture_output=True,
                       check=True)  # fmt: skip
        out = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    client = p.add_mutually_exclusive_group(required=True)
    client.add_argument("--lm1b", help="flax's examples/lm1b directory (a checkout)")
    client.add_argument("--gemma", help="flax's examples/gemma directory (a checkout)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--noise-seeds", type=int, default=NOISE_SEEDS)
    p.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[],
        help="fp8_select budgets to run besides its default (e.g. 0.02)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps < 2:
        # optax's warmup + cosine schedule raises on fewer, in its own words.
        p.error(f"--steps {args.steps}: train at least 2 steps (default {STEPS})")
    start = time.perf_counter()
    if args.gemma:
        import fp8_client_gemma  # it imports this module: not at the top

        directory, file = args.gemma, "transformer.py"
        task: ClientTask = fp8_client_gemma.GemmaTask(fp8_client_gemma.load_gemma(directory))
    else:
        directory, file = args.lm1b, "models.py"
        task = Lm1bTask(load_lm1b(directory))
    result = run(task, args.steps, args.noise_seeds, tuple(args.budgets))
    result["flax_commit"] = _git_commit(Path(directory).expanduser(), file)
    return finish(result, start, args.out)


def finish(result: dict[str, Any], start: float, out: str | None, *notes: str) -> dict[str, Any]:
    """A client's `result` completed (jax version, wall time since `start`), printed
    (the table, `notes`) and written to `out` as JSON."""
    result["jax"] = jax.__version__
    result["wall_s"] = time.perf_counter() - start
    print("\n".join([format_table(result), *notes, f"wall time {result['wall_s']:.0f} s"]))
    if out:
        Path(out).write_text(json.dumps(result, indent=1, default=float) + "\n")
    return result


if __name__ == "__main__":
    main()
