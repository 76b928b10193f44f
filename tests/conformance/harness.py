"""What the conformance suite measures and checks, once for every model.

For a model (``models.Built``) and a compute dtype, :func:`evaluate` runs

1. the forward pass on the padded batch, jitted: float32, ``jaxamp.autocast(apply,
   dtype=d)`` and, where the package has a ``dtype=`` knob, the hand-cast model
   (float32 params): output error relative to float32's max, loss error, and
   whether anything float32 keeps finite came out inf / NaN; and
2. in the same compiled program (one compile per variant), the gradient at init
   (float16: loss scaled by 2**15, or less where float32's gradient times that
   overflows float16, as a dynamic scale would): cosine to the float32 gradient,
   for autocast and hand-cast;
3. ``steps`` training steps with ``jaxamp.value_and_grad`` + ``jaxamp.step``
   (AdamW; float16: ``jaxamp.dynamic_scale(2**15)``; bfloat16: skipping only, as
   the README recommends) against the same steps in float32 (plain JAX + optax)
   from the same init, counting skipped steps per step with
   ``jaxamp.metrics(opt_state)["skipped"]`` (float32: steps with non-finite
   gradients);
4. (``measure=True``) backward residual bytes (``benchmarks/bench_autocast.py``'s
   ``_residual_bytes``) and trace + compile seconds of ``jit(value_and_grad)``,
   autocast over float32.

Every figure goes into a row (a dict); an exception raised by autocast is
recorded in the row, not raised, so that one failing phase does not hide the
others. :func:`failures` turns a row into the list of broken requirements and
:func:`record` appends the row to ``$CONFORMANCE_OUT`` (JSON lines) for
``report.py``, which writes the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

from . import models

ROOT = Path(__file__).resolve().parents[2]
F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
DTYPES = {"float16": F16, "bfloat16": BF16}

FULL = os.environ.get("CONFORMANCE_FULL", "") not in ("", "0")
STEPS = 30 if FULL else 10  # CI: fewer steps, same assertions
# Models only `make conformance` runs (CI's 10-minute budget on 2 cores).
FULL_ONLY = {
    "flaxmodels-resnet18": "ResNet18's compiles take over a minute on 2 cores",
    "diffusers-unet": "the UNet's five compiles take about a minute on 2 cores",
    # CI keeps one of the four transformers models, BERT (an attention mask, a
    # tied MLM head; find_overflow runs on it too): ViT's patch embedding is a
    # convolution, which the equinox CNN row covers in CI; GPT-2's causal LM is the
    # linen LM row's kind of model; T5's encoder-decoder is the slowest row (~25 s).
    "hf-vit": "CI's budget: transformers' models run in CI as BERT",
    "hf-t5": "CI's budget: transformers' models run in CI as BERT",
    "hf-gpt2": "CI's budget: transformers' models run in CI as BERT",
    # equinox runs in CI as the BatchNorm CNN (its state, its filtered transforms).
    "equinox-transformer": "CI's budget: equinox runs in CI as the BatchNorm CNN",
    # The nnx LM runs in CI on a mesh (tests/multidevice/test_conformance_mesh.py,
    # tensor parallel in bfloat16; data parallel in float16 in make test-slow); Flax's
    # LSTM in float16 in tests/casting/test_autocast.py.
    "flax-nnx-attention": "CI's budget: CI runs it on an 8-device mesh instead",
    "flax-linen-lstm": "CI's budget: CI runs it in test_autocast.py (float16)",
    # A transformer runs in CI as BERT (bfloat16), and a float16 row as equinox's CNN;
    # the linen LM's block runs in tests/casting/test_autocast.py.
    "flax-linen-transformer": "CI's budget: transformers run in CI as BERT",
    "jraph-gnn": "CI's budget: CI's float16 row is equinox's BatchNorm CNN",
}
# The dtype of each model's CI row (the models FULL_ONLY leaves out have none in CI):
# both dtypes over CI's rows; `make conformance` runs the full cross product.
CI_DTYPE = {
    "flax-linen-transformer": "bfloat16",
    "flax-linen-lstm": "float16",
    "flax-nnx-attention": "bfloat16",
    "hf-gpt2": "float16",
    "hf-bert-mlm": "bfloat16",
    "hf-t5": "float16",
    "hf-vit": "float16",
    "flaxmodels-resnet18": "float16",
    "equinox-transformer": "bfloat16",
    "diffusers-unet": "float16",
    "jraph-gnn": "float16",  # its raw features leave float16's range: see failures()
    "equinox-batchnorm-cnn": "float16",
}
LOSS_RTOL = {"float16": 1e-2, "bfloat16": 3e-2}  # forward loss vs float32
TRAIN_RTOL = 0.02  # final loss after STEPS steps vs float32's
INIT_SCALE = 2.0**15
# "At least as good as hand-cast": autocast's forward error (relative to the
# output's max) may exceed the hand-cast model's by one rounding of the compute
# dtype (half its epsilon), its gradient cosine may fall short by 1e-4.
HAND_COS_SLACK = 1e-4


def ci_skip_reason(name: str, dtype: str) -> str | None:
    """Why CI (``make test``) leaves out this conformance row; None where it runs it."""
    if name in FULL_ONLY:
        return f"{name}: full suite only (make conformance): {FULL_ONLY[name]}"
    if CI_DTYPE[name] != dtype:
        return f"{name} in {dtype}: full suite only (make conformance)"
    return None


def build(name: str) -> models.Built:
    """The model, or ``pytest.skip`` naming why its package is unusable.

    Every model builds, whatever ``FULL_ONLY`` says: that list is which conformance
    rows CI skips (test_models.py); a test that names a model runs it."""
    dist, builder = models.MODELS[name]
    try:
        return _build_cached(name)
    except ImportError as e:
        pytest.skip(f"{name}: package {dist!r} cannot be imported: {e}")
    raise AssertionError(builder)  # unreachable


@functools.cache
def _build_cached(name: str) -> models.Built:
    return models.MODELS[name][1]()


def loss_of(logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """Weighted mean cross-entropy in float32 (padding positions have weight 0)."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def _loss_fn(apply: Any, built: models.Built) -> Any:
    of = built.loss or loss_of

    def loss(params: Any, state: Any, batch: dict[str, Any]) -> tuple[jax.Array, Any]:
        logits, new_state = apply(params, state, batch)
        return of(logits, batch), (new_state, logits)

    return loss


def _flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _rel_err(y: jax.Array, ref: jax.Array) -> float:
    """max |y - ref| / max |ref| where float32 is finite; inf if y is not finite there."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    ok = np.isfinite(ref)
    if not np.all(np.isfinite(y[ok])):
        return float("inf")
    return float(np.max(np.abs(y[ok] - ref[ok])) / max(np.max(np.abs(ref[ok])), 1e-30))


def _nonfinite_where_f32_finite(y: jax.Array, ref: jax.Array) -> int:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return int(np.sum(np.isfinite(ref) & ~np.isfinite(y)))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("nan")
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def _grad_scale(dtype_name: str, grad_max_f32: float) -> float:
    """float16: 2**15, halved while float32's gradient times it would overflow float16
    (where a dynamic scale settles before its first step); bfloat16: 1."""
    if dtype_name != "float16":
        return 1.0
    scale = INIT_SCALE
    while grad_max_f32 * scale > float(jnp.finfo(F16).max) and scale > 1:
        scale /= 2
    return scale


# The checks compile many small programs; XLA's LLVM optimisations are most of
# their compile time on a CPU and change no HLO-level numerics. The measured
# compile times (_measure) use the default options.
_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(f: Any, *args: Any) -> Any:
    return jax.jit(f).lower(*args).compile(compiler_options=_FAST)


def _batches(built: models.Built) -> tuple[dict[str, Any], ...]:
    return (built.batch, *built.more_batches)


def _probe(apply: Any, built: models.Built) -> Any:
    """Compiled ``(params, scale, batch) -> ((loss, logits), grads of loss*scale / scale)``."""
    loss = _loss_fn(apply, built)

    def scaled(
        p: Any, scale: jax.Array, batch: dict[str, Any]
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        value, (_, logits) = loss(p, built.state, batch)
        return value * scale, (value, logits)

    def probe(p: Any, scale: jax.Array, batch: dict[str, Any]) -> Any:
        (_, aux), g = jax.value_and_grad(scaled, has_aux=True)(p, scale, batch)
        return aux, jax.tree.map(lambda x: x / scale, g)

    return _compile(probe, built.params, jnp.float32(1.0), built.batch)


def _train(apply: Any, built: models.Built, loss_scale: Any, steps: int) -> dict[str, Any]:
    """`steps` AdamW steps with jaxamp.value_and_grad + jaxamp.step; losses and skips per step."""
    tx = jaxamp.skip_nonfinite(optax.adamw(built.lr), loss_scale)
    loss = _loss_fn(apply, built)

    def step(params: Any, state: Any, opt_state: Any) -> tuple[Any, Any, Any, Any, Any]:
        (value, (new_state, _)), grads = jaxamp.value_and_grad(loss, has_aux=True)(
            opt_state, params, state, built.batch
        )
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        m = jaxamp.metrics(opt_state)
        state = jaxamp.where_stepped(opt_state, new_state, state)  # a skip keeps BatchNorm stats
        return params, state, opt_state, value, m["skipped"]

    run = _run_steps(built, tx, step, steps)
    run["scale"] = float(jaxamp.metrics(run.pop("opt_state"))["loss_scale"])
    return run


def _final_loss(ref: dict[str, Any], built: models.Built, train: dict[str, Any]) -> float:
    """The outcome of training, judged by the float32 model on the final params."""
    # (BatchNorm in training mode normalises by batch statistics: the running
    # averages in the state are outputs, not inputs, of the loss.)
    return float(ref["probe"](train["params"], jnp.float32(1.0), built.batch)[0][0])


_REFERENCES: dict[tuple[str, int], dict[str, Any]] = {}


def _reference(name: str, built: models.Built, steps: int) -> dict[str, Any]:
    """float32 forward, gradient and training (shared by both dtypes in one process)."""
    if (name, steps) not in _REFERENCES:
        _REFERENCES[name, steps] = _reference_uncached(built, steps)
    return _REFERENCES[name, steps]


def _reference_uncached(built: models.Built, steps: int) -> dict[str, Any]:
    probe = _probe(built.apply, built)
    each = []
    for batch in _batches(built):
        (loss, logits), grad = probe(built.params, jnp.float32(1.0), batch)
        each.append({"logits": np.asarray(logits), "loss": float(loss), "grad": _flat(grad)})
    ref = {"probe": probe, "each": each, **each[0]}
    ref["grad_max"] = max(float(np.max(np.abs(e["grad"]))) for e in each)
    train = _train_float32(built, steps)
    train["final"] = _final_loss(ref, built, train)
    ref["train"] = {k: v for k, v in train.items() if k not in ("params", "state")}
    return ref


def _train_float32(built: models.Built, steps: int) -> dict[str, Any]:
    """The reference: the same AdamW steps in plain JAX + optax, no jaxamp.

    A step float32 "needs" to skip is one whose gradients are not all finite.
    """
    tx = optax.adamw(built.lr)
    loss = _loss_fn(built.apply, built)

    def step(params: Any, state: Any, opt_state: Any) -> tuple[Any, Any, Any, Any, Any]:
        (value, (new_state, _)), grads = jax.value_and_grad(loss, has_aux=True)(
            params, state, built.batch
        )
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state, value, ~finite

    run = _run_steps(built, tx, step, steps)
    run.pop("opt_state")
    return run


def _run_steps(built: Any, tx: Any, step: Any, steps: int) -> dict[str, Any]:
    """Runs a compiled `step` `steps` times from the model's init; the losses and skips."""
    params, state, opt_state = built.params, built.state, tx.init(built.params)
    step = _compile(step, params, state, opt_state)
    losses, skipped = [], []
    for _ in range(steps):
        params, state, opt_state, value, skip = step(params, state, opt_state)
        losses.append(value)
        skipped.append(skip)
    return {
        "losses": [float(v) for v in losses],
        "skipped": [bool(s) for s in skipped],
        "params": params,
        "state": state,
        "opt_state": opt_state,
    }


def _error_text(e: BaseException) -> str:
    """The exception and the innermost frame inside jaxamp (where it was raised)."""
    where = ""
    for frame in traceback.extract_tb(e.__traceback__):
        if "/jaxamp/" in frame.filename:
            where = f" [at jaxamp/{frame.filename.split('/jaxamp/')[-1]}:{frame.lineno}]"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:300]}{where}"


def _probe_figures(apply: Any, built: models.Built, ref: dict[str, Any], scale: float) -> dict:
    """Forward error, loss error, non-finite outputs and gradient cosine of one variant.

    With several probe batches (``Built.more_batches``), the output error and the
    gradient cosine are means over the batches (``grad_cos_each`` lists the
    cosines), the loss error and the non-finite count their worst / total.
    """
    probe = _probe(apply, built)
    rows = []
    for batch, r in zip(_batches(built), ref["each"], strict=True):
        (loss, logits), grad = probe(built.params, jnp.float32(scale), batch)
        rows.append(
            {
                "out_err": _rel_err(logits, r["logits"]),
                "nonfinite": _nonfinite_where_f32_finite(logits, r["logits"]),
                "loss_err": abs(float(loss) - r["loss"]) / abs(r["loss"]),
                "grad_cos": _cosine(_flat(grad), r["grad"]),
            }
        )
    out = {
        "out_err": float(np.mean([r["out_err"] for r in rows])),
        "nonfinite": sum(r["nonfinite"] for r in rows),
        "loss_err": max(r["loss_err"] for r in rows),
        "grad_cos": float(np.mean([r["grad_cos"] for r in rows])),
    }
    if len(rows) > 1:
        out["grad_cos_each"] = [r["grad_cos"] for r in rows]
    return out


def _measure(built: models.Built, amp_apply: Any) -> dict[str, Any]:
    """Residual bytes and trace + compile seconds of jit(value_and_grad), autocast / float32."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_autocast import _residual_bytes

    out: dict[str, Any] = {}
    times: dict[str, float] = {}
    for label, apply in (("float32", built.apply), ("autocast", amp_apply)):
        loss = _loss_fn(apply, built)

        def scalar(p: Any, loss: Any = loss) -> jax.Array:  # noqa: B023
            return loss(p, built.state, built.batch)[0]

        out[f"residual_bytes_{label}"] = _residual_bytes(scalar, built.params)
        # a fresh function each time: nothing reused from jit's caches
        start = time.perf_counter()
        jax.jit(jax.value_and_grad(lambda p, f=scalar: f(p))).lower(built.params).compile()
        times[label] = time.perf_counter() - start
    out["residual_ratio"] = out["residual_bytes_autocast"] / out["residual_bytes_float32"]
    out["compile_ratio"] = times["autocast"] / times["float32"]
    out["compile_s_float32"], out["compile_s_autocast"] = times["float32"], times["autocast"]
    return out


def evaluate(
    name: str,
    dtype_name: str,
    steps: int = STEPS,
    measure: bool = FULL,
    built: models.Built | None = None,
) -> dict[str, Any]:
    """Every figure of one model x dtype (see the module docstring); errors recorded, not raised.

    `built`: the model as prepared by the caller (e.g. sharded over a mesh),
    under a `name` of its own; by default ``models.MODELS[name]``.
    """
    if built is None:
        built = build(name)
    dtype = DTYPES[dtype_name]
    ref = _reference(name, built, steps)
    amp_apply = jaxamp.autocast(built.apply, dtype=dtype)
    row: dict[str, Any] = {
        "model": name,
        "package": models.MODELS[name.split("@")[0]][0],
        "dtype": dtype_name,
        "steps": steps,
        "notes": built.notes,
        "loss_f32": ref["loss"],
        "grad_max_f32": ref["grad_max"],
        "beyond_range": dtype_name in built.beyond_range,
        "errors": {},
    }
    scale = _grad_scale(dtype_name, ref["grad_max"])
    row["grad_scale"] = scale

    def phase(key: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # recorded; failures() reports it
            row["errors"][key] = _error_text(e)

    def forward() -> None:
        row["autocast"] = _probe_figures(amp_apply, built, ref, scale)

    def hand() -> None:
        row["hand"] = _probe_figures(built.hand(dtype), built, ref, scale)

    def train() -> None:
        ls = jaxamp.dynamic_scale(init_scale=INIT_SCALE) if dtype_name == "float16" else None
        t = _train(amp_apply, built, ls, steps)
        t["final"] = _final_loss(ref, built, t)
        row["train"] = {k: v for k, v in t.items() if k not in ("params", "state")}
        row["train_f32"] = ref["train"]

    phase("forward", forward)
    if built.hand is not None:
        phase("hand", hand)
    phase("train", train)
    if measure:
        phase("measure", lambda: row.update(_measure(built, amp_apply)))
    return row


def failures(row: dict[str, Any]) -> list[str]:
    """The requirements this row breaks, as readable sentences (empty: it conforms)."""
    out = [f"autocast raised in {k}: {v}" for k, v in row["errors"].items() if k != "hand"]
    tol = LOSS_RTOL[row["dtype"]]
    a = row.get("autocast")
    if overflows_visibly(row):
        # Inputs past the dtype's range (models.Built.beyond_range): inf / NaN
        # outputs are the required outcome, and every step must be skipped;
        # finite outputs must match float32 (below), never come from clipped values.
        t = row.get("train")
        if t is not None and not all(t["skipped"]):
            applied = [i for i, s in enumerate(t["skipped"]) if not s]
            out.append(f"training: steps {applied} applied although the forward overflows")
        return out
    if a is not None:
        if a["nonfinite"]:
            out.append(f"forward: {a['nonfinite']} outputs inf/NaN where float32's are finite")
        if not a["loss_err"] <= tol:
            out.append(f"forward: loss rel. error {a['loss_err']:.3g} > {tol}")
        if row.get("beyond_range") and not a["out_err"] <= tol:
            out.append(
                f"forward: finite outputs {a['out_err']:.3g} off float32's (relative to their "
                f"max, > {tol}) from inputs past {row['dtype']}'s range: clipped, not reported"
            )
        h = row.get("hand")
        if h is not None:
            half_ulp = float(jnp.finfo(DTYPES[row["dtype"]]).eps) / 2
            if not a["out_err"] <= h["out_err"] + half_ulp:
                out.append(
                    f"hand-cast: autocast output error {a['out_err']:.3g} worse than the "
                    f"dtype= model's {h['out_err']:.3g}"
                )
            # (A hand-cast gradient that is not finite sets no bar: its cosine is NaN.)
            bar = min(h["grad_cos"], 1.0) - HAND_COS_SLACK
            if "grad_cos" in a and np.isfinite(bar) and not a["grad_cos"] >= bar:
                out.append(
                    f"hand-cast: autocast gradient cosine {a['grad_cos']:.6f} below the "
                    f"dtype= model's {h['grad_cos']:.6f}"
                )
    t, t32 = row.get("train"), row.get("train_f32")
    if t is not None:
        ratio = t["final"] / t32["final"]
        row["final_ratio"] = ratio
        if not abs(ratio - 1) <= TRAIN_RTOL:
            out.append(
                f"training: final loss {t['final']:.5g} vs float32 {t32['final']:.5g} "
                f"(ratio {ratio:.4f}, allowed 1±{TRAIN_RTOL})"
            )
        needed = _needed_skips(row)
        pairs = zip(t["skipped"], t32["skipped"], strict=True)
        extra = [i for i, (s, s32) in enumerate(pairs) if s and not s32 and i not in needed]
        if extra:
            out.append(f"training: skipped steps {extra} that float32 did not need to skip")
    return out


def overflows_visibly(row: dict[str, Any]) -> bool:
    """A model whose inputs leave the dtype's range, whose autocast forward says so:
    non-finite outputs where float32's are finite."""
    a = row.get("autocast")
    return bool(row.get("beyond_range")) and a is not None and a["nonfinite"] > 0


def _needed_skips(row: dict[str, Any]) -> set[int]:
    """Leading float16 steps whose skip float32's own gradient forces.

    Until the first step is taken the params are the init's, so the float32
    gradient at init, times the loss scale of that step (2**15, halved on each
    skip), not fitting in float16 means no float16 run could have taken the step:
    the loss scale calibrating itself, not a fault of autocast.
    """
    if row["dtype"] != "float16":
        return set()
    f16_max = float(jnp.finfo(F16).max)
    out, scale = set(), INIT_SCALE
    for i, skipped in enumerate(row["train"]["skipped"]):
        if not (skipped and row["grad_max_f32"] * scale > f16_max):
            break
        out.add(i)
        scale /= 2
    return out


def record(row: dict[str, Any], judge: Any = None) -> None:
    """Append the row (and its failures: `judge`'s, by default :func:`failures`) to
    $CONFORMANCE_OUT, if set."""
    path = os.environ.get("CONFORMANCE_OUT")
    if not path:
        return
    calibration = len(_needed_skips(row)) if "train" in row else 0
    # Judged first: the judge may note a documented outcome on the row (fp8.failures).
    found = (judge or failures)(row)
    row = {**row, "failures": found, "calibration_skips": calibration}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=float) + "\n")


def check(row: dict[str, Any]) -> None:
    """Record the row, print its figures, fail with every broken requirement at once."""
    record(row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("train", "train_f32")},
                     default=float))  # fmt: skip
    broken = failures(row)
    assert not broken, f"{row['model']} {row['dtype']}:\n  " + "\n  ".join(broken)
