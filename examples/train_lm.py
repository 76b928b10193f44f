"""Mixed-precision training of a small transformer language model, four ways.

The demo behind ``make demo``. It trains a byte-level Flax transformer on the
Python standard library's own source files (on every machine, no download) with
optax AdamW inside a jitted train step, from the same initialisation and on the
same batches, once per run:

* ``fp32``      float32 everywhere: the reference.
* ``fp16``      float16 compute (``jaxamp.autocast``) with *no* loss scaling and
                no skipping: small gradients underflow to zero in float16.
* ``fp16-amp``  float16 compute with ``jaxamp.autocast`` + ``jaxamp.skip_nonfinite``
                + dynamic loss scaling: what jaxamp is for.
* ``bf16``      bfloat16 compute with ``jaxamp.autocast`` and skipping only
                (bfloat16 has float32's range, so it needs no loss scale).

Each run shows a progress bar (loss, loss scale, skipped steps), saves an orbax
checkpoint every ``--ckpt-every`` steps (``--resume`` continues exactly where a
run stopped: the batch of step ``i`` is a pure function of ``(seed, i)``), and at
the end the script prints a table and writes under ``--out``: ``summary.json``,
``table.txt`` and ``loss_curves.png``; with ``--docs DIR`` (as ``make demo`` runs it)
also the table, the run's figures and the plot that the documentation shows.

Run ``python examples/train_lm.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct

import jaxamp

RUN_NAMES = ("fp32", "fp16", "fp16-amp", "bf16")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """How one run computes and protects its optimizer step."""

    name: str
    compute_dtype: Any  # None: plain float32, no autocast
    loss_scaling: bool  # dynamic loss scaling (only meaningful for float16)
    skip_nonfinite: bool  # wrap the optimizer in jaxamp.skip_nonfinite
    description: str


RUN_SPECS = {
    "fp32": RunSpec("fp32", None, False, False, "float32"),
    "fp16": RunSpec("fp16", jnp.float16, False, False, "float16 autocast, no loss scaling"),
    "fp16-amp": RunSpec(
        "fp16-amp", jnp.float16, True, True, "float16 autocast + skip_nonfinite + dynamic scale"
    ),
    "bf16": RunSpec("bf16", jnp.bfloat16, False, True, "bfloat16 autocast + skip_nonfinite"),
}


# --------------------------------------------------------------------------- flags


# argparse `type=` parsers: argparse prefixes their message with the flag, e.g.
# "argument --steps: must be an integer >= 1, got 0", and exits with status 2.
def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def _positive_float() -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
        return value

    return parse


def _run_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in RUN_SPECS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated subset of {','.join(RUN_NAMES)}, "
            f"got {text!r}" + (f" (unknown: {', '.join(bad)})" if bad else "")
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"lists a run twice: {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line; every default is sized for a 2-core CPU in a few minutes."""
    p = argparse.ArgumentParser(
        description=(
            "Train a small byte-level transformer LM on the Python standard library's "
            "source in float32, float16 without loss scaling, float16 with jaxamp "
            "(autocast + skip_nonfinite + dynamic loss scale) and bfloat16, from the same "
            "initialisation, and compare them in a table and a plot."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=_int_at_least(1), default=250, help="optimizer steps per run")
    p.add_argument(
        "--batch-size",
        type=_int_at_least(1),
        default=16,
        help="sequences per batch",
    )
    p.add_argument(
        "--seq-len",
        type=_int_at_least(2),
        default=128,
        help="bytes per training sequence",
    )
    p.add_argument(
        "--model-dim",
        type=_int_at_least(8),
        default=128,
        help="transformer width (a multiple of --heads)",
    )
    p.add_argument("--layers", type=_int_at_least(1), default=2, help="transformer blocks")
    p.add_argument("--heads", type=_int_at_least(1), default=4, help="attention heads")
    p.add_argument(
        "--lr",
        type=_positive_float(),
        default=3e-3,
        help="peak AdamW learning rate (linear warmup, cosine decay)",
    )
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument(
        "--loss-tokens",
        type=_int_at_least(0),
        default=2**19,
        help="the loss is the sum of per-token losses divided by this: the token "
        "count of the global batch that each step's batch is one micro-batch "
        "of (2**19: a 0.5M-token batch, as in GPT-2/3 training). 0: the mean "
        "over --batch-size x --seq-len",
    )
    p.add_argument(
        "--runs",
        type=_run_list,
        default=list(RUN_NAMES),
        help="comma-separated runs to do: " + ",".join(RUN_NAMES),
    )
    p.add_argument(
        "--init-scale",
        type=_positive_float(),
        default=2.0**24,
        help="initial loss scale of the fp16-amp run (2**24: PyTorch's 2**16 for a loss "
        "whose gradients are 2**8 times smaller than a per-step mean's, see --loss-tokens)",
    )
    p.add_argument(
        "--growth-interval",
        type=_int_at_least(1),
        default=20,
        help="clean steps before the fp16-amp loss scale doubles (PyTorch uses "
        "2000 for long runs; a 250-step demo needs a short interval for the scale to "
        "climb into float16's overflow and back off)",
    )
    p.add_argument(
        "--max-scale",
        type=_positive_float(),
        default=2.0**32,
        help="upper bound of the fp16-amp loss scale (above the 2**27-2**28 where this "
        "model's float16 backward overflows, so the run shows backoffs)",
    )
    p.add_argument(
        "--spike-step",
        type=_int_at_least(0),
        default=150,
        help="the batch of this step is random bytes (a corrupted shard): a loss spike. The "
        "runs with skip_nonfinite also skip spikes (jaxamp.spike_rule()); 0: no bad batch",
    )
    p.add_argument(
        "--spike-window",
        type=_int_at_least(2),
        default=128,
        help="steps of loss / gradient-norm history the spike rule keeps (warm-up: half)",
    )
    p.add_argument(
        "--corpus-bytes",
        type=_int_at_least(10_000),
        default=2_000_000,
        help="bytes of standard-library source to read",
    )
    p.add_argument(
        "--eval-batches",
        type=_int_at_least(1),
        default=8,
        help="held-out batches per evaluation",
    )
    p.add_argument(
        "--eval-every",
        type=_int_at_least(1),
        default=50,
        help="evaluate every this many steps (and at the end)",
    )
    p.add_argument(
        "--log-every",
        type=_int_at_least(1),
        default=10,
        help="fetch metrics from the device every this many steps",
    )
    p.add_argument(
        "--ckpt-every",
        type=_int_at_least(1),
        default=50,
        help="save an orbax checkpoint every this many steps",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue each run from its latest checkpoint under --out",
    )
    p.add_argument(
        "--stop-after",
        type=_int_at_least(1),
        default=None,
        help="stop each run (with a checkpoint) after this many steps of this "
        "session, as if interrupted; continue later with --resume",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument(
        "--docs",
        default=None,
        help="also write what the documentation shows of this run into this directory: "
        "demo_table.md, demo_run.md (its figures) and demo.png (`make demo`: "
        "docs/_generated, so that the pages show the run that `make demo` made)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--no-find-overflow",
        action="store_true",
        help="skip the jaxamp.find_overflow reports after the fp16-amp run",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and cross-checks the flags; bad values exit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_dim % args.heads:
        parser.error(f"--model-dim ({args.model_dim}) must be a multiple of --heads ({args.heads})")
    if not 0 <= args.weight_decay < 1:
        parser.error(f"--weight-decay must be in [0, 1), got {args.weight_decay}")
    return args


# --------------------------------------------------------------------------- data


def load_corpus(max_bytes: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Reads the standard library's ``.py`` files as bytes; splits train/eval by file.

    Files are sorted by name so every machine with the same Python builds the same
    corpus. Every tenth file goes to the eval split, so no eval text is ever trained on.

    Returns:
      ``(train_bytes, eval_bytes, files)`` with uint8 arrays.
    """
    stdlib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    train, evals, used, total = [], [], [], 0
    for i, path in enumerate(files):
        if total >= max_bytes:
            break
        with open(path, "rb") as f:
            data = f.read(max_bytes - total)
        (evals if i % 10 == 9 else train).append(np.frombuffer(data, np.uint8))
        used.append(os.path.basename(path))
        total += len(data)
    train_arr = np.concatenate(train) if train else np.zeros(0, np.uint8)
    eval_arr = np.concatenate(evals) if evals else np.zeros(0, np.uint8)
    if min(len(train_arr), len(eval_arr)) <= seq_len + 1:
        raise SystemExit(
            f"error: the corpus read from {stdlib} is too small for --seq-len {seq_len} "
            f"(train {len(train_arr)} bytes, eval {len(eval_arr)} bytes); raise --corpus-bytes."
        )
    return train_arr, eval_arr, used


def get_batch(data: jax.Array, key: jax.Array, batch_size: int, seq_len: int) -> jax.Array:
    """``batch_size`` random windows of ``seq_len + 1`` bytes, as int32 (inputs + next byte)."""
    starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - seq_len - 1)
    window = lambda s: jax.lax.dynamic_slice(data, (s,), (seq_len + 1,))
    return jax.vmap(window)(starts).astype(jnp.int32)


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

    dim: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        hd = self.dim // self.heads
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * self.dim, use_bias=False)(h).reshape(b, t, 3, self.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        h = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, self.dim)
        x = x + nn.Dense(self.dim)(h)
        h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h))


class ByteLM(nn.Module):
    """A small decoder-only transformer over bytes (vocabulary 256)."""

    dim: int
    layers: int
    heads: int
    max_len: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(256, self.dim)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.dim))
        x = x + pos[: tokens.shape[1]].astype(x.dtype)
        for _ in range(self.layers):
            x = Block(self.dim, self.heads)(x)
        return nn.Dense(256)(nn.LayerNorm()(x))


# --------------------------------------------------------------------------- training


@struct.dataclass
class RunState:
    """Everything a run needs to continue: parameters and optimizer state."""

    params: Any
    opt_state: Any


def make_optimizer(args: argparse.Namespace, spec: RunSpec) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay and clipping, protected as the run asks."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 20), args.steps, end_value=args.lr / 10
    )
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),  # inside skip_nonfinite: sees unscaled gradients
        optax.adamw(schedule, weight_decay=args.weight_decay),
    )
    if not spec.skip_nonfinite:
        return inner
    # Also skip a step whose loss or gradient norm spikes far above the last 128
    # steps' (OLMo-core's rule: 6 standard deviations, after 64 steps of history).
    spikes = jaxamp.spike_rule(window=args.spike_window)
    loss_scale = (
        jaxamp.dynamic_scale(
            init_scale=args.init_scale,
            growth_interval=args.growth_interval,
            max_scale=args.max_scale,
        )
        if spec.loss_scaling
        else None
    )
    return jaxamp.skip_nonfinite(inner, loss_scale, spikes=spikes)


def zero_grad_fraction(grads: Any) -> jax.Array:
    """Share of gradient entries that are exactly zero: the float16 underflow meter.

    The token embedding is left out: its rows for bytes absent from the batch are
    zero in every precision, which would only hide the difference.
    """
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    leaves = [g for path, g in flat if "Embed" not in jax.tree_util.keystr(path)]
    zeros = sum(jnp.sum(g == 0) for g in leaves)
    return (zeros / sum(g.size for g in leaves)).astype(jnp.float32)


def make_loss_fn(args: argparse.Namespace, model: ByteLM) -> tuple[Callable[..., Any], float]:
    """``loss_fn(params, batch)`` and the factor that turns its value into a per-token mean."""

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        # Mean next-byte cross-entropy over batch * seq: the usual reduction, and the
        # one that makes per-token gradients small (1 / (batch * seq) each).
        logits = model.apply(params, batch[:, :-1])
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return per_token.sum() / loss_tokens

    # The loss is a sum over tokens divided by `loss_tokens`: by default the tokens of a
    # large global batch of which this step's batch is one micro-batch (see --loss-tokens).
    # `to_mean` turns it back into the per-token mean for logging.
    loss_tokens = float(args.loss_tokens or args.batch_size * args.seq_len)
    return loss_fn, loss_tokens / (args.batch_size * args.seq_len)


def make_fns(
    args: argparse.Namespace,
    spec: RunSpec,
    model: ByteLM,
    tx: optax.GradientTransformation,
    train_data: jax.Array,
    eval_data: jax.Array,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Builds the jitted ``train_step(state, step) -> (state, metrics)`` and ``evaluate``."""
    data_key = jax.random.fold_in(jax.random.key(args.seed), 1)
    eval_key = jax.random.fold_in(jax.random.key(args.seed), 2)

    loss_fn, to_mean = make_loss_fn(args, model)

    # autocast runs matmuls in float16/bfloat16 and softmax, norms and the loss in float32;
    # the parameters stay float32 (the master weights AdamW updates).
    amp_loss = (
        loss_fn
        if spec.compute_dtype is None
        else jaxamp.autocast(loss_fn, dtype=spec.compute_dtype)
    )

    def train_step(state: RunState, step: jax.Array) -> tuple[RunState, dict[str, jax.Array]]:
        # The batch of step i depends only on (seed, i): a resumed run sees the same data.
        key = jax.random.fold_in(data_key, step)
        batch = get_batch(train_data, key, args.batch_size, args.seq_len)
        # --spike-step: that step's batch is random bytes, as from a corrupted shard.
        noise = jax.random.randint(key, batch.shape, 0, 256, jnp.int32)
        batch = jnp.where(step + 1 == args.spike_step, noise, batch)
        if spec.loss_scaling:
            # The unscaled loss and the gradients of the scaled loss, in one call.
            loss, grads = jaxamp.value_and_grad(amp_loss)(state.opt_state, state.params, batch)
            loss = loss.astype(jnp.float32) * to_mean
        else:
            loss, grads = jax.value_and_grad(amp_loss)(state.params, batch)
            loss = loss * to_mean
        # Underflow meter: the share of gradient entries that are exactly zero.
        zero_frac = zero_grad_fraction(grads)
        if spec.skip_nonfinite:  # the spike rule judges the per-token mean loss
            params, opt_state = jaxamp.step(
                tx, grads, state.opt_state, state.params, value=loss.astype(jnp.float32)
            )
            m = jaxamp.metrics(opt_state)
            scale, skipped, spikes = m["loss_scale"], m["skipped_steps"], m["spike_skipped_steps"]
        else:
            params, opt_state = jaxamp.step(tx, grads, state.opt_state, state.params)
            scale, skipped, spikes = jnp.float32(1.0), jnp.int32(0), jnp.int32(0)
        metrics = {
            "loss": loss.astype(jnp.float32),
            "loss_scale": scale,
            "skipped": skipped,
            "spike_skipped": spikes,
            "zero_grad_frac": zero_frac,
        }
        return RunState(params, opt_state), metrics

    def evaluate(params: Any) -> jax.Array:
        def one(i: jax.Array) -> jax.Array:
            batch = get_batch(
                eval_data, jax.random.fold_in(eval_key, i), args.batch_size, args.seq_len
            )
            return amp_loss(params, batch).astype(jnp.float32) * to_mean

        return jnp.mean(jax.lax.map(one, jnp.arange(args.eval_batches)))

    return jax.jit(train_step, donate_argnums=0), jax.jit(evaluate)


# --------------------------------------------------------------------------- checkpoints


def _checkpoint_manager(path: str) -> Any:
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.abspath(path),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )


def save_checkpoint(mngr: Any, step: int, state: RunState, history: dict[str, Any]) -> None:
    """Saves the run state and its metric history (so curves survive a resume)."""
    import orbax.checkpoint as ocp

    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(history)
        ),
        force=True,
    )
    mngr.wait_until_finished()


def restore_checkpoint(mngr: Any, target: RunState) -> tuple[int, RunState, dict[str, Any]] | None:
    """The latest ``(step, state, history)`` or None; ``target`` gives structure and shardings."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()
        ),
    )
    return step, restored["state"], restored["history"]


# --------------------------------------------------------------------------- one run


def _config_key(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that must match for a checkpoint to be resumed."""
    keys = (
        "steps",
        "batch_size",
        "seq_len",
        "model_dim",
        "layers",
        "heads",
        "lr",
        "weight_decay",
        "loss_tokens",
        "init_scale",
        "growth_interval",
        "max_scale",
        "spike_step",
        "spike_window",
        "corpus_bytes",
        "seed",
    )
    return {k: getattr(args, k) for k in keys}


def train_run(
    args: argparse.Namespace,
    spec: RunSpec,
    model: ByteLM,
    init_params: Any,
    train_data: jax.Array,
    eval_data: jax.Array,
) -> dict[str, Any]:
    """Trains one run to ``args.steps`` (resuming if asked) and returns its history."""
    run_dir = os.path.join(args.out, spec.name)
    os.makedirs(run_dir, exist_ok=True)
    tx = make_optimizer(args, spec)
    # A fresh copy per run: the train step donates its input buffers.
    params = jax.tree.map(jnp.array, init_params)
    state = RunState(params, tx.init(params))
    history: dict[str, Any] = {
        "config": _config_key(args),
        "step": [],
        "loss": [],
        "loss_scale": [],
        "skipped": [],
        "spike_skipped": [],
        "zero_grad_frac": [],
        "eval_step": [],
        "eval_loss": [],
        "train_time_s": 0.0,
        "timed_steps": 0,
    }
    mngr = _checkpoint_manager(os.path.join(run_dir, "ckpt"))
    start = 0
    if args.resume:
        found = restore_checkpoint(mngr, state)
        if found is not None:
            start, state, history = found
            if history["config"] != _config_key(args):
                diff = {
                    k: (history["config"].get(k), v)
                    for k, v in _config_key(args).items()
                    if history["config"].get(k) != v
                }
                raise SystemExit(
                    f"error: --resume: the checkpoint in {run_dir} was made with other "
                    f"settings (checkpoint, now): {diff}. Use the same flags or another --out."
                )
    elif mngr.latest_step() is not None:
        # A fresh run must not mix with an old one's checkpoints.
        for s in mngr.all_steps():
            mngr.delete(s)

    train_step, evaluate = make_fns(args, spec, model, tx, train_data, eval_data)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(
            total=args.steps,
            initial=start,
            desc=f"{spec.name:>8}",
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
        )

    pending: list[tuple[int, dict[str, jax.Array]]] = []

    def flush() -> None:
        # The only host syncs of the loop: metrics of the last `log_every` steps at once.
        if not pending:
            return
        fetched = jax.device_get([m for _, m in pending])
        for (i, _), m in zip(pending, fetched, strict=True):
            history["step"].append(i + 1)
            for k in ("loss", "loss_scale", "zero_grad_frac"):
                history[k].append(float(m[k]))
            history["skipped"].append(int(m["skipped"]))
            history["spike_skipped"].append(int(m["spike_skipped"]))
        if bar is not None:
            bar.set_postfix(progress_postfix(spec, history), refresh=False)
            bar.update(len(pending))
        pending.clear()

    # Step time counts training only: the compile step, evals and checkpoints are left out.
    mark: float | None = None
    interrupted = False

    def lap() -> None:
        nonlocal mark
        if mark is not None:
            history["train_time_s"] += time.perf_counter() - mark
            mark = time.perf_counter()

    def on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt

    old_handler = signal.signal(signal.SIGTERM, on_sigterm)
    i = start
    stop = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    try:
        while i < stop:
            state, m = train_step(state, jnp.int32(i))
            pending.append((i, m))
            i += 1
            if mark is None:  # the first step of a session compiles: start the clock after it
                jax.block_until_ready(m)
                mark = time.perf_counter()
            else:
                history["timed_steps"] += 1
            if i % args.log_every == 0 or i == args.steps:
                flush()
            if i % args.eval_every == 0 or i == args.steps or i % args.ckpt_every == 0:
                flush()
                lap()
                if i % args.eval_every == 0 or i == args.steps:
                    history["eval_step"].append(i)
                    history["eval_loss"].append(float(evaluate(state.params)))
                if i % args.ckpt_every == 0 or i == args.steps:
                    save_checkpoint(mngr, i, state, history)
                mark = time.perf_counter()
        if i < args.steps:  # --stop-after: leave a checkpoint to resume from
            flush()
            save_checkpoint(mngr, i, state, history)
    except KeyboardInterrupt:
        interrupted = True
        flush()
        save_checkpoint(mngr, i, state, history)
    finally:
        signal.signal(signal.SIGTERM, old_handler)
        if bar is not None:
            bar.close()
    if interrupted:
        raise SystemExit(
            f"\ninterrupted at step {i} of run {spec.name}; checkpoint saved. "
            "Run again with --resume (and the same flags) to continue."
        )
    if spec.skip_nonfinite and i == args.steps:
        # Which gradient leaves overflowed, and how often: read from the optimizer state.
        why = jaxamp.explain(state.opt_state, state.params)
        history["explain"] = {"text": str(why), "last": list(why.last), "counts": why.counts}
        if spec.loss_scaling and not args.no_find_overflow:
            history["find_overflow"] = find_overflows(
                args, model, state.params, train_data, history
            )
    return history


def _report_dict(report: jaxamp.types.OverflowReport) -> dict[str, Any]:
    keys = ("found", "primitive", "pass_", "dtype", "module_path", "line", "magnitude")
    return {**{k: getattr(report, k) for k in keys}, "text": str(report)}


def find_overflows(
    args: argparse.Namespace,
    model: ByteLM,
    params: Any,
    train_data: jax.Array,
    history: dict[str, Any],
) -> dict[str, Any]:
    """``jaxamp.find_overflow`` on the final float16 model, outside the train step.

    1. A planted overflow: the last block's MLP up-projection kernel times 10**5, at
       loss scale 1: its float16 matmul leaves float16's range in the forward pass.
    2. The run's own overflows: the batch of the last skipped step (if any), at the
       largest scale the run reached, or the first power of two above it (up to 2^3
       times) where the final params overflow on that batch.
    """
    loss_fn, _ = make_loss_fn(args, model)
    data_key = jax.random.fold_in(jax.random.key(args.seed), 1)
    batch_of = lambda i: get_batch(
        train_data, jax.random.fold_in(data_key, i), args.batch_size, args.seq_len
    )
    up = f"Block_{args.layers - 1}"
    planted = jax.tree.map(lambda x: x, params)
    kernel = planted["params"][up]["Dense_2"]["kernel"]
    planted["params"][up]["Dense_2"]["kernel"] = kernel * 1e5
    out = {
        "planted": _report_dict(
            jaxamp.find_overflow(loss_fn, scale=1.0, dtype=jnp.float16)(planted, batch_of(0))
        )
    }
    skipped = np.flatnonzero(np.diff([0, *history["skipped"]]))
    if len(skipped):
        # The params that overflowed are gone (the run went on); the final ones, on the
        # batch of the last skipped step, from the largest scale the run reached upwards.
        step = int(history["step"][skipped[-1]]) - 1
        top = int(math.log2(max(history["loss_scale"])))
        for exponent in range(top, top + 4):
            report = jaxamp.find_overflow(loss_fn, scale=2.0**exponent, dtype=jnp.float16)(
                params, batch_of(step)
            )
            if report.found:
                break
        out["last_skipped_step"] = {
            "step": step + 1,
            "loss_scale": 2.0**exponent,
            **_report_dict(report),
        }
    return out


# --------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, histories: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON summary: one entry per run, plus the settings."""
    tail = max(1, min(20, args.steps // 10))
    base = histories.get("fp32")
    base_time = _mean_step_time(base) if base else None
    runs = {}
    for name, h in histories.items():
        t = _mean_step_time(h)
        runs[name] = {
            "description": RUN_SPECS[name].description,
            # Mean of the last `tail` steps: one batch's loss is noisy.
            "final_train_loss": float(np.mean(h["loss"][-tail:])),
            "final_eval_loss": h["eval_loss"][-1],
            "steps_skipped": h["skipped"][-1],
            "spikes_skipped": h["spike_skipped"][-1] if RUN_SPECS[name].skip_nonfinite else None,
            "explain": h.get("explain"),
            "find_overflow": h.get("find_overflow"),
            "final_loss_scale": h["loss_scale"][-1],
            "zero_grad_frac_mean": float(np.mean(h["zero_grad_frac"])),
            "zero_grad_frac_final": float(np.mean(h["zero_grad_frac"][-tail:])),
            "step_time_s": t,
            "step_time_vs_fp32": (t / base_time) if (t and base_time) else None,
            "history": {
                k: h[k]
                for k in (
                    "step",
                    "loss",
                    "loss_scale",
                    "skipped",
                    "spike_skipped",
                    "zero_grad_frac",
                    "eval_step",
                    "eval_loss",
                )
            },
        }
    return {
        "config": {**_config_key(args), "runs": list(histories)},
        "train_loss_is_mean_of_last_steps": tail,
        "platform": f"{jax.default_backend()} ({jax.device_count()} device, "
        f"{os.cpu_count()} CPU cores)",
        "runs": runs,
    }


def _mean_step_time(h: dict[str, Any]) -> float | None:
    return h["train_time_s"] / h["timed_steps"] if h["timed_steps"] else None


def format_table(summary: dict[str, Any]) -> str:
    """The terminal table, with its footnotes."""
    head = (
        "run",
        "train loss",
        "eval loss",
        "skipped",
        "spikes",
        "final scale",
        "zero grads",
        "step time",
    )
    rows = [head]
    for name, r in summary["runs"].items():
        rel = r["step_time_vs_fp32"]
        rows.append(
            (
                name,
                f"{r['final_train_loss']:.4f}",
                f"{r['final_eval_loss']:.4f}",
                str(r["steps_skipped"]),
                "-" if r["spikes_skipped"] is None else str(r["spikes_skipped"]),
                _format_scale(r["final_loss_scale"]) if RUN_SPECS[name].loss_scaling else "-",
                f"{100 * r['zero_grad_frac_mean']:.2f}%",
                f"{rel:.2f}x" if rel is not None else "-",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    line = lambda row: "  ".join(
        cell.ljust(w) if c == 0 else cell.rjust(w)
        for c, (cell, w) in enumerate(zip(row, widths, strict=True))
    )
    rule = "-" * len(line(head))
    out = [rule, line(head), rule] + [line(r) for r in rows[1:]] + [rule]
    out += [
        f"train loss: mean of the last {summary['train_loss_is_mean_of_last_steps']} steps; "
        "zero grads: share of gradient entries that are exactly 0 (mean over steps).",
        "skipped: steps skipped for non-finite gradients; spikes: steps skipped as loss / "
        "gradient-norm spikes (jaxamp.spike_rule; - : no spike rule in this run).",
        "step time: relative to fp32 on this machine (" + summary["platform"] + "). On a CPU "
        "this is no mixed-precision speedup:",
        "  XLA's CPU backend runs float16/bfloat16 matmuls in float32 plus casts. The speedup "
        "needs a GPU/TPU.",
    ]
    return "\n".join(out)


def format_run_facts(
    args: argparse.Namespace, summary: dict[str, Any], wall_s: float, command: str
) -> str:
    """The figures docs/demo.md quotes from this run, as a Markdown list: the pages
    include this file, so that no figure there is older than the last ``make demo``."""
    runs = summary["runs"]
    minutes, seconds = divmod(round(wall_s), 60)
    out = [
        f"- **This run**: `{command}`, "
        f"{minutes} min {seconds:02d} s of wall time on {summary['platform']}, "
        "compiles, evaluations, checkpoints and find_overflow included."
    ]
    spiked = args.spike_step and "fp32" in runs and args.spike_step <= args.steps
    if spiked:
        h = runs["fp32"]["history"]
        before = h["loss"][max(0, args.spike_step - 11) : args.spike_step - 1]
        out.append(
            f"- **The corrupted batch** (step {args.spike_step}): fp32's loss on it is "
            f"{h['loss'][args.spike_step - 1]:.1f} nats/byte, against "
            f"{min(before):.1f}–{max(before):.1f} on the ten steps before it."
        )
    if "fp16" in runs:
        h = runs["fp16"]["history"]
        frac = [
            100 * z
            for s, z in zip(h["step"], h["zero_grad_frac"], strict=True)
            if s >= 20 and s != args.spike_step
        ]
        others = max(
            100 * max(r["history"]["zero_grad_frac"]) for n, r in runs.items() if n != "fp16"
        )
        if frac:
            out.append(
                f"- **fp16's underflow**: from step 20 on, {min(frac):.0f}–{max(frac):.0f} % of "
                "its gradient entries are exactly zero"
                + (
                    f" ({100 * h['zero_grad_frac'][args.spike_step - 1]:.0f} % on the random "
                    f"batch of step {args.spike_step})"
                    if spiked
                    else ""
                )
                + f"; at most {others:.2f} % in any step of the other runs."
            )
    amp = runs.get("fp16-amp")
    if amp is not None:
        h = amp["history"]
        backoffs = [
            f"{s} ({_format_scale(h['loss_scale'][i - 1] if i else args.init_scale)} → "
            f"{_format_scale(h['loss_scale'][i])})"
            for i, s in enumerate(h["step"])
            if h["skipped"][i] > (h["skipped"][i - 1] if i else 0)
        ]
        out.append(
            f"- **fp16-amp's loss scale**: from {_format_scale(args.init_scale)}, doubling after "
            f"{args.growth_interval} clean steps; "
            + (
                (
                    f"{len(backoffs)} steps skipped as non-finite, each halving it: "
                    if len(backoffs) > 1
                    else "1 step skipped as non-finite, halving it: "
                )
                + ", ".join(backoffs)
                if backoffs
                else "no step overflowed"
            )
            + f". It ends at {_format_scale(h['loss_scale'][-1])}."
        )
        if amp["explain"]:
            # A list item's code block is indented by four spaces (Markdown's continuation).
            text = amp["explain"]["text"].strip().replace("\n", "\n    ")
            out.append(
                f"- **`jaxamp.explain(opt_state, params)`** after the run:\n\n    ```\n    {text}"
            )
            out.append("    ```\n")
        for case, title in (
            ("last_skipped_step", "The run's last overflow, re-found"),
            ("planted", "A planted overflow (the last block's MLP up-projection kernel x 10^5, "
             "loss scale 1)"),
        ):  # fmt: skip
            found = (amp["find_overflow"] or {}).get(case)
            if not found:
                continue
            at = (
                f" on the final params and the batch of step {found['step']}, at loss scale "
                f"{_format_scale(found['loss_scale'])},"
                if case == "last_skipped_step"
                else ""
            )
            what = (
                f"names the {found['dtype']} `{found['primitive']}` of the {found['pass_']} "
                f"pass in module `{found['module_path']}`, line {found['line']} of "
                f"`train_lm.py`, {found['magnitude'] / 65504:.1f}x float16's maximum"
                if found["found"]
                else "finds nothing"
            )
            out.append(f"- **{title}**: `jaxamp.find_overflow`{at} {what}.")
    return "\n".join(out) + "\n"


def progress_postfix(spec: RunSpec, history: dict[str, Any]) -> dict[str, Any]:
    """The progress bar's figures; a run without loss scaling shows no scale (its
    "scale" is a constant 1 that nothing reads)."""
    out: dict[str, Any] = {"loss": f"{history['loss'][-1]:.3f}"}
    if spec.loss_scaling:
        out["scale"] = _format_scale(history["loss_scale"][-1])
    if spec.skip_nonfinite:
        out["skipped"] = history["skipped"][-1]
    return out


def find_overflow_note(found: dict[str, Any], history: dict[str, Any]) -> str:
    """What the find_overflow box says: a re-run after training (the final params on a
    skipped step's batch), at a scale the run itself may never have reached."""
    scale, top = found["loss_scale"], max(history["loss_scale"])
    at = _format_scale(scale) + (
        ", the run's largest" if scale == top else f", above the run's {_format_scale(top)}"
    )
    where = found["module_path"] or "?"
    return (
        f"find_overflow, re-run after training: the final params\n"
        f"on step {found['step']}'s batch at scale {at}:\n"
        f"{found['primitive']} ({found['pass_']}) in {where}, line {found['line']}"
    )


def _format_scale(scale: float) -> str:
    exponent = math.log2(scale) if scale > 0 else 0.5
    return f"2^{int(exponent)}" if exponent == int(exponent) else f"{scale:g}"


def plot(summary: dict[str, Any], path: str) -> None:
    """Loss curves, the loss-scale trajectory and the zero-gradient share, in one PNG."""
    import matplotlib.pyplot as plt

    fig = figure(summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(summary: dict[str, Any]) -> Any:
    """The demo's figure. Its one legend sits below the panels and the find_overflow
    note in headroom above the scale curve, so neither covers a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fp32": "black", "fp16": "tab:red", "fp16-amp": "tab:blue", "bf16": "tab:green"}
    # fp32, fp16-amp and bf16 lie on top of each other: widths and dashes keep all visible.
    styles = {
        "fp32": {"lw": 3.5, "alpha": 0.35},
        "fp16": {"lw": 1.4},
        "fp16-amp": {"lw": 1.4, "ls": "--"},
        "bf16": {"lw": 1.2, "ls": ":"},
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    spikes: list[tuple[str, np.ndarray, np.ndarray]] = []
    ax_loss, ax_scale, ax_zero = axes
    note = None
    for name, r in summary["runs"].items():
        h = r["history"]
        steps, loss = np.asarray(h["step"]), np.asarray(h["loss"])
        k = max(1, len(loss) // 50)  # light smoothing: a moving average over ~2% of the run
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        style = {"color": colors[name], **styles[name]}
        ax_loss.plot(steps[k - 1 :], smooth, label=name, **style)
        ax_loss.plot(h["eval_step"], h["eval_loss"], "o", color=colors[name], ms=4)
        ax_zero.plot(steps, 100 * np.asarray(h["zero_grad_frac"]), **style)
        spiked = np.diff(np.concatenate([[0], h["spike_skipped"]])) > 0
        if spiked.any():  # drawn once the y range is known: a spike's loss is off the top
            spikes.append((name, steps[spiked], loss[spiked]))
        if RUN_SPECS[name].loss_scaling:
            ax_scale.step(steps, h["loss_scale"], where="post", **style)
            skipped = np.diff(np.concatenate([[0], h["skipped"]])) > 0
            if skipped.any():
                ax_scale.plot(
                    steps[skipped],
                    np.asarray(h["loss_scale"])[skipped],
                    "x",
                    color="tab:red",
                    label="skipped step (overflow)",
                )
            found = (r.get("find_overflow") or {}).get("last_skipped_step")
            if found and found["found"]:  # what find_overflow named for the last overflow
                note = find_overflow_note(found, h)
                ax_scale.axhline(
                    found["loss_scale"], color="0.4", lw=1, ls=":", label="find_overflow re-run"
                )
    ax_loss.set(
        title="Loss (lines: train, dots: eval)", xlabel="step", ylabel="cross-entropy (nats/byte)"
    )
    lo = min(
        min(r["history"]["eval_loss"] + r["history"]["loss"]) for r in summary["runs"].values()
    )
    top = lo + 4.0
    ax_loss.set_ylim(max(0.0, lo - 0.1), top)
    for i, (name, at, value) in enumerate(spikes):
        y = np.minimum(value, top - 0.25 - 0.3 * i)
        ax_loss.plot(at, y, "v", color=colors[name], ms=9, mfc="none", mew=1.6,
                     label=f"{name}: skipped as a spike")  # fmt: skip
        for x, v, yy in zip(at, value, y, strict=True):
            ax_loss.annotate(f"loss {v:.1f}", (x, yy), xytext=(-52, -3), textcoords="offset points",
                             fontsize=8, color=colors[name])  # fmt: skip
    ax_scale.set(title="fp16-amp dynamic loss scale", xlabel="step", ylabel="loss scale")
    ax_scale.set_yscale("log", base=2)
    if note is not None:
        # Headroom above the curve (and the re-run's scale, the dotted line) for the note.
        lo_s, hi_s = ax_scale.get_ylim()
        ax_scale.set_ylim(lo_s, hi_s * (hi_s / lo_s) ** 0.45)
        ax_scale.text(0.02, 0.98, note, transform=ax_scale.transAxes, fontsize=8, va="top",
                      bbox={"boxstyle": "round", "fc": "white", "alpha": 0.9})  # fmt: skip
    ax_zero.set(title="Gradient entries exactly zero", xlabel="step", ylabel="% of entries")
    for ax in axes:
        ax.grid(alpha=0.3)
    # One legend for the three panels, below them: the runs share colours and styles.
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo; returns the summary that it also writes to ``--out/summary.json``."""
    args = parse_args(argv)
    started = time.perf_counter()
    train_np, eval_np, files = load_corpus(args.corpus_bytes, args.seq_len)
    print(
        f"corpus: {len(files)} files of {os.path.dirname(os.__file__)} "
        f"({len(train_np):,} train / {len(eval_np):,} eval bytes); "
        f"{jax.default_backend()} backend"
    )
    train_data, eval_data = jnp.asarray(train_np), jnp.asarray(eval_np)
    model = ByteLM(args.model_dim, args.layers, args.heads, args.seq_len)
    # One initialisation shared by every run.
    init_params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))
    n_params = sum(x.size for x in jax.tree.leaves(init_params))
    print(
        f"model: {args.layers} layers, width {args.model_dim}, {n_params:,} parameters; "
        f"{args.steps} steps of {args.batch_size}x{args.seq_len} bytes per run"
    )
    os.makedirs(args.out, exist_ok=True)

    histories = {}
    for name in args.runs:
        histories[name] = train_run(
            args, RUN_SPECS[name], model, init_params, train_data, eval_data
        )
    unfinished = [n for n, h in histories.items() if not h["step"] or h["step"][-1] < args.steps]
    if unfinished:
        print(f"stopped early (--stop-after) in: {', '.join(unfinished)}; continue with --resume")
        return {}

    summary = summarize(args, histories)
    table = format_table(summary)
    print(table)
    for name, r in summary["runs"].items():
        if r["explain"]:
            print(f"\n{name}: jaxamp.explain(opt_state, params)\n{r['explain']['text']}")
        for case, found in (r["find_overflow"] or {}).items():
            print(f"\n{name}: jaxamp.find_overflow, {case.replace('_', ' ')}\n{found['text']}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(table + "\n")
    png = os.path.join(args.out, "loss_curves.png")
    plot(summary, png)
    print(f"wrote {args.out}/summary.json, table.txt and loss_curves.png")
    if args.docs:
        os.makedirs(args.docs, exist_ok=True)
        with open(os.path.join(args.docs, "demo_table.md"), "w") as f:
            f.write(f"```\n{table}\n```\n")
        with open(os.path.join(args.docs, "demo_run.md"), "w") as f:
            flags = sys.argv[1:] if argv is None else list(argv)
            command = " ".join(["examples/train_lm.py", *flags])
            f.write(format_run_facts(args, summary, time.perf_counter() - started, command))
        plot(summary, os.path.join(args.docs, "demo.png"))
        print(f"wrote {args.docs}/demo_table.md, demo_run.md and demo.png")
    return summary


if __name__ == "__main__":
    main()
