"""bfloat16 params without a float32 master copy: memory, step time and convergence.

Five optimizers, all AdamW behind ``jaxamp.skip_nonfinite`` (no loss scale: the
bfloat16 recipe), all computing the forward and backward in bfloat16:

* ``fp32-master``: float32 params and moments; the forward casts the params.
* ``fp32-master+mu-bf16``: the same with ``mu_dtype=bfloat16``.
* ``bf16+sr``: bfloat16 params (and so moments), ``jaxamp.apply_with_stochastic_rounding`` last.
* ``bf16+kahan``: bfloat16 params and moments, ``jaxamp.apply_with_kahan_summation`` last.
* ``bf16-plain``: bfloat16 params and moments, nothing else.

Measured: bytes per parameter of params + optimizer state (summed over the actual
arrays, ``nbytes``, divided by the parameter count); the step time as a ratio to
``fp32-master`` (one process, every step compiled first, interleaved rounds with
the order rotating); the final loss of a run with a cosine learning-rate schedule
that decays to zero, so that late updates are small, on (a) the demo LM of
``examples/train_lm.py`` and (b) ``transformers``' Flax GPT-2 (random init from a
small config), both as byte LMs on the standard library's source, held-out loss.

Run: ``python benchmarks/bench_low_precision.py [--quick]`` (``make bench`` runs it).
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
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
for sub in ("", "examples"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

import jaxamp  # noqa: E402

VARIANTS = ("fp32-master", "fp32-master+mu-bf16", "bf16+sr", "bf16+kahan", "bf16-plain")
BF16 = jnp.bfloat16


def make_tx(name: str, lr: Any, seed: int = 0) -> optax.GradientTransformation:
    """The variant's optimizer, wrapped in ``skip_nonfinite`` as the bf16 recipe is."""
    mu = {"mu_dtype": BF16} if name != "fp32-master" else {}
    chain = [optax.clip_by_global_norm(1.0), optax.adamw(lr, b2=0.95, weight_decay=0.01, **mu)]
    if name == "bf16+sr":
        chain.append(jaxamp.apply_with_stochastic_rounding(jax.random.key(seed)))
    elif name == "bf16+kahan":
        chain.append(jaxamp.apply_with_kahan_summation())
    return jaxamp.skip_nonfinite(optax.chain(*chain))


def param_dtype(name: str) -> Any:
    return jnp.float32 if name.startswith("fp32") else BF16


def bytes_per_param(params: Any, opt_state: Any) -> float:
    """Bytes of every array in params and optimizer state, per parameter."""
    count = sum(x.size for x in jax.tree.leaves(params))
    total = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    return total / count


def make_step(
    name: str, loss: Callable[[Any, Any], jax.Array], lr: Any, seed: int = 0
) -> tuple[Callable[..., Any], optax.GradientTransformation]:
    tx = make_tx(name, lr, seed)

    def forward(p: Any, batch: Any) -> jax.Array:
        # bfloat16 compute in every variant; for the float32 master a cast copy.
        return loss(jax.tree.map(lambda x: x.astype(BF16), p), batch)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(forward)(params, batch)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, value

    return step, tx


def schedule(peak: float, steps: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(steps // 20, 1), steps, 0.0)


# ----------------------------------------------------------------------- the tasks


class Task:
    """A byte LM on the standard library's source: a model's float32 initial params,
    a fresh batch each step (a function of the step and ``data_seed``) and the
    held-out loss (8 batches of 32) as the final-loss measure."""

    name: str
    params: Any
    loss: Callable[[Any, Any], jax.Array]
    lr = 3e-3
    data_seed: int

    def __init__(self, quick: bool) -> None:
        import train_lm

        self.seq, self.bsz = (32, 8) if quick else (64, 16)
        self.dim, self.layers = (32, 1) if quick else (64, 2)
        train, evals, _ = train_lm.load_corpus(300_000, self.seq)
        self.train, self.evals = jnp.asarray(train), jnp.asarray(evals)
        self.get_batch = train_lm.get_batch

    def _set_logits(self, logits: Callable[[Any, jax.Array], jax.Array]) -> None:
        """The next-byte cross-entropy of ``logits(params, tokens)``, and its eval."""

        def loss(p: Any, batch: jax.Array) -> jax.Array:
            out = logits(p, batch[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(out, batch[:, 1:]).mean()

        self._set_loss(loss)

    def _set_loss(self, loss: Callable[[Any, jax.Array], jax.Array]) -> None:
        """``loss(params, window)`` (a batch of ``seq + 1``-byte windows) and its eval."""
        self.loss = loss
        key = jax.random.key(1)
        self.eval_batches = [
            self.get_batch(self.evals, jax.random.fold_in(key, i), 32, self.seq) for i in range(8)
        ]
        self._eval = jax.jit(loss)

    def batch(self, i: int) -> Any:
        key = jax.random.fold_in(jax.random.key(self.data_seed), i)
        return self.get_batch(self.train, key, self.bsz, self.seq)

    def final_loss(self, params: Any, dtype: Any = BF16) -> float:
        """The held-out loss, computed with `params` cast to `dtype`."""
        p = jax.tree.map(lambda x: x.astype(dtype), params)
        return float(np.mean([float(self._eval(p, b)) for b in self.eval_batches]))


class DemoLM(Task):
    """``examples/train_lm.py``'s ByteLM, small."""

    name = "demo LM (examples/train_lm.py ByteLM)"
    data_seed = 2

    def __init__(self, quick: bool) -> None:
        import train_lm

        super().__init__(quick)
        model = train_lm.ByteLM(self.dim, self.layers, 4, self.seq)
        tokens = jnp.zeros((1, self.seq), jnp.int32)
        self.params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        self._set_logits(lambda p, t: model.apply({"params": p}, t))


class GPT2(Task):
    """``transformers``' FlaxGPT2LMHeadModel (model code we did not write, the pinned
    ``conformance`` extra), random init from a small config."""

    name = "GPT-2 (transformers FlaxGPT2LMHeadModel)"
    data_seed = 3

    def __init__(self, quick: bool) -> None:
        from transformers import FlaxGPT2LMHeadModel, GPT2Config

        super().__init__(quick)
        cfg = GPT2Config(
            vocab_size=256, n_positions=self.seq, n_embd=self.dim, n_layer=self.layers, n_head=4
        )
        model = FlaxGPT2LMHeadModel(cfg, seed=0, _do_init=False)
        self.params = jax.jit(model.init_weights, static_argnums=1)(
            jax.random.key(0), (1, self.seq)
        )
        self._set_logits(lambda p, t: model(t, params=p).logits)


# ------------------------------------------------------------------ measurements


def train(task: Task, name: str, steps: int, seed: int = 0) -> dict[str, Any]:
    step, tx = make_step(name, task.loss, schedule(task.lr, steps), seed)
    params = jax.tree.map(lambda x: x.astype(param_dtype(name)), task.params)
    opt_state = tx.init(params)
    memory = bytes_per_param(params, opt_state)
    for i in range(steps):
        params, opt_state, _ = step(params, opt_state, task.batch(i))
    return {
        "final_loss": task.final_loss(params),
        "bytes_per_param": memory,
        "skipped": int(jaxamp.metrics(opt_state)["skipped_steps"]),
    }


def time_steps(task: Task, rounds: int, per_round: int) -> dict[str, float]:
    """Median step time per variant over interleaved rounds (order rotating)."""
    entries = {}
    batch = task.batch(0)
    for name in VARIANTS:
        step, tx = make_step(name, task.loss, 1e-3)
        dtype = param_dtype(name)
        params = jax.tree.map(lambda x, d=dtype: x.astype(d), task.params)
        state = (params, tx.init(params))
        for _ in range(2):  # compile and warm up
            *state, v = step(*state, batch)
        jax.block_until_ready(v)
        entries[name] = {"step": step, "state": tuple(state), "times": []}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            e = entries[name]
            state = e["state"]
            t0 = time.perf_counter()
            for _ in range(per_round):
                *state, v = e["step"](*state, batch)
            jax.block_until_ready((state, v))
            e["times"].append((time.perf_counter() - t0) / per_round)
            e["state"] = tuple(state)
    return {name: statistics.median(e["times"]) for name, e in entries.items()}


def run(quick: bool = False, seeds: int = 2) -> dict[str, Any]:
    """All measurements; ``quick`` is a smoke-sized run (tiny model, few steps)."""
    steps_lm, steps_tp = (40, 40) if quick else (600, 600)
    rounds, per_round = (2, 2) if quick else (7, 10)
    tasks = [(DemoLM(quick), steps_lm), (GPT2(quick), steps_tp)]
    out: dict[str, Any] = {"steps": {}, "convergence": {}, "memory": {}, "seeds": seeds}
    for task, steps in tasks:
        out["steps"][task.name] = steps
        rows = {}
        for name in VARIANTS:
            # Stochastic rounding is random: its loss is the mean over `seeds` keys.
            n = seeds if name == "bf16+sr" else 1
            runs = [train(task, name, steps, seed) for seed in range(n)]
            rows[name] = {
                "final_loss": float(np.mean([r["final_loss"] for r in runs])),
                "final_losses": [r["final_loss"] for r in runs],
                "skipped": sum(r["skipped"] for r in runs),
            }
            out["memory"].setdefault(name, runs[0]["bytes_per_param"])
            print(
                f"  {task.name[:28]:<28} {name:<20} loss {rows[name]['final_loss']:.4f}", flush=True
            )
        out["convergence"][task.name] = rows
    times = time_steps(tasks[0][0], rounds, per_round)
    out["step_ms"] = {k: v * 1e3 for k, v in times.items()}
    out["time_ratio"] = {k: v / times["fp32-master"] for k, v in times.items()}
    return out


def format_report(result: dict[str, Any]) -> str:
    names = list(result["convergence"])
    head = (
        "| variant | bytes/param (params + opt state) | step time vs fp32-master | "
        + " | ".join(
            f"final loss: {n} ({result['steps'][n]} steps) | vs fp32-master" for n in names
        )
        + " |"
    )
    lines = [head, "|" + "---|" * (3 + 2 * len(names))]
    for v in VARIANTS:
        cells = [v, f"{result['memory'][v]:.2f}", f"{result['time_ratio'][v]:.2f}x"]
        for n in names:
            rows = result["convergence"][n]
            loss, base = rows[v]["final_loss"], rows["fp32-master"]["final_loss"]
            shown = f"{loss:.4f}"
            if len(rows[v]["final_losses"]) > 1:
                shown += " (" + ", ".join(f"{x:.4f}" for x in rows[v]["final_losses"]) + ")"
            cells += [shown, f"{(loss - base) / base * 100:+.2f} %"]
        lines.append("| " + " | ".join(cells) + " |")
    ms = ", ".join(f"{k} {v:.1f} ms" for k, v in result["step_ms"].items())
    lines.append("")
    lines.append(f"step times (demo LM, median of interleaved rounds): {ms}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few steps (smoke)")
    ap.add_argument("--seeds", type=int, default=2, help="stochastic-rounding keys averaged")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = run(args.quick, args.seeds)
    print(format_report(result))
    print(
        f"({time.perf_counter() - t0:.0f} s, jax {jax.__version__}, {jax.devices()[0].device_kind})"
    )


if __name__ == "__main__":
    main()
