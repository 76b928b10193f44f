"""The FP8 rows of the conformance suite: ``jaxamp.fp8`` on other people's models.

For a model and a scaling (``"tensorwise"``, ``"rowwise"``), :func:`evaluate` runs
``jaxamp.autocast(apply, dtype=bfloat16, fp8=jaxamp.fp8(scaling))`` beside bfloat16
autocast and float32 (``harness``'s reference, shared with the dtype rows):

1. forward error, loss error and gradient cosine at init against float32
   (``harness._probe_figures``), for FP8 and for bfloat16 autocast;
2. ``harness.STEPS`` AdamW steps through ``jaxamp.value_and_grad`` + ``jaxamp.step``
   with no loss scale (skipping only, as bfloat16; FP8 gradients are scaled by
   their own amax), the final loss judged by the float32 model, against bfloat16
   autocast's and float32's;
3. which products ran in FP8, from ``jaxamp.audit``'s per-op view of the forward
   pass: how many, and why each other one stayed bfloat16 (first / last layer,
   dimensions not multiples of 16).

The goal (``GOAL``): the final loss within 1 % of bfloat16 autocast's, which a
row with ``jaxamp.fp8_select``'s selection (its default budget, calibrated on
the training batch at bfloat16 autocast's parameters half way through) must meet. Where a
model misses it, measured, ``EXCLUDE`` names what to keep in bfloat16 (found with
:func:`leave_one_out`, docs/fp8.md) and a second row runs with it, which must meet
the goal; ``MISSES`` are the models no small exclusion brings there. Only ``make
conformance`` runs these rows (``harness.FULL``): CI never pays for them, nor for
:func:`noise_floor`, how far bfloat16 autocast's own final loss moves when its
init moves by less than bfloat16's rounding (``python -m tests.conformance.fp8
noise``; ``make conformance`` runs it).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

import jaxamp

from . import harness, models

SCALINGS = ("tensorwise", "rowwise")
# The transformers of the corpus. The others have no product FP8 takes at the
# corpus's sizes: the convolutional models (ResNet18, the UNet, the equinox CNN)
# run their convolutions in bfloat16 (FP8 covers dot_general), the LSTM's cell
# products have 4 rows and the GNN's 4 padded graphs 30-odd nodes (not multiples
# of 16).
MODELS = (
    "flax-linen-transformer",
    "flax-nnx-attention",
    "hf-gpt2",
    "hf-bert-mlm",
    "hf-t5",
    "hf-vit",
    "equinox-transformer",
)
GOAL = 0.01  # |final loss / bfloat16 autocast's - 1|
#: Models with no FP8 product at the corpus's sizes, and why (``jaxamp.audit``'s
#: reasons): their rows check that FP8 changes nothing.
NO_FP8 = {
    "hf-vit": "every product has M = 4 images x 17 tokens (16 patches + the class token) = 68 "
    "or attention's K = 8 (head size): not multiples of 16",
}
#: What keeps a model that misses the goal within it, measured (leave_one_out and
#: groups of layers; docs/fp8.md): a ``jaxamp.fp8(modules=...)`` rule.
EXCLUDE = {
    # Leaving out any one kind of the decoder's layers recovers half the gap at
    # most; the decoder, which computes the logits, all of it.
    "hf-t5": {"decoder": False},
    # The two eqx.nn.MLP Linear layers of each block (eqx.nn.MultiheadAttention: no).
    "equinox-transformer": {"eqx.nn.MLP": False},
}
#: The scalings whose rows with the exclusion must meet the goal: it was found on
#: tensorwise; rowwise it closes most of the gap, not all (a note within MISS_BOUND).
EXCLUDE_MEETS = ("tensorwise",)
#: Models that miss the goal with no small exclusion that fixes it: their miss is
#: a note within MISS_BOUND. Both fit one batch of random targets down to a loss
#: near 0 (0.14, 0.02): FP8's rounding in every layer limits how far.
MISSES = {
    "flax-linen-transformer": "no one layer: leaving out any one kind of FP8 layer leaves "
    "+2.2 to +3.9 % (tensorwise); fp8_select keeps 1 or 2 of its 11 layers within 1 %",
    "flax-nnx-attention": "as the linen LM (one block; this harness builds the nnx module "
    "inside its apply, so there are no module names to exclude by; fp8_select names its "
    "layers by their kernels)",
}
MISS_BOUND = 0.08
#: Where ``jaxamp.fp8_select``'s default budget misses the goal, the budget one
#: argument away that meets it, measured; a second selection row runs with it and
#: must meet the goal. The equinox transformer fits its batch to a loss of 0.005,
#: where each FP8 layer adds about 0.3 % to the final loss whatever its gradient
#: error at the calibration point: the default keeps 9 of 11 layers rowwise.
SELECT_BUDGET = {("equinox-transformer", "rowwise"): 0.02}

_BF16_RUNS: dict[tuple[str, int], dict[str, Any]] = {}


def _bf16(name: str, built: models.Built, ref: dict[str, Any], steps: int) -> dict[str, Any]:
    """bfloat16 autocast's probe figures and final loss (once per model in a process)."""
    if (name, steps) not in _BF16_RUNS:
        apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16)
        probe = harness._probe_figures(apply, built, ref, 1.0)
        train = harness._train(apply, built, None, steps)
        probe["final"] = harness._final_loss(ref, built, train)
        _BF16_RUNS[name, steps] = probe
    return _BF16_RUNS[name, steps]


#: The noise floor's perturbation (``noise_floor``): each floating parameter at init
#: times ``1 + NOISE_REL * N(0, 1)``, half of bfloat16's relative rounding step (a
#: smaller change than casting the parameters to bfloat16), ``NOISE_SEEDS`` draws.
NOISE_REL = 2.0**-9
NOISE_SEEDS = 5


def perturbed(params: Any, seed: int) -> Any:
    """`params` with each floating leaf times ``1 + NOISE_REL * N(0, 1)`` (draw `seed`):
    the noise floor's init, a change smaller than casting it to bfloat16."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [
        x * (1 + NOISE_REL * jax.random.normal(k, x.shape, x.dtype))
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, moved)


def noise_floor(name: str, steps: int = harness.STEPS) -> dict[str, Any]:
    """How far bfloat16 autocast's final loss moves by a change that is no change of
    precision: `NOISE_SEEDS` trainings from the init perturbed by ``NOISE_REL``, each
    over the unperturbed run's final loss (``ratios``). A FP8 row's ratio to bfloat16
    autocast is one draw of the same kind of path change (FP8's rounding moves every
    step a little): where these ratios spread as far as the 1 % goal, one row's miss
    or pass is within what the metric itself varies by. A row for
    ``$CONFORMANCE_OUT`` (``kind`` ``"fp8_noise"``; report.py reads it)."""
    built = harness.build(name)
    ref = harness._reference(name, built, steps)
    base = _bf16(name, built, ref, steps)["final"]
    apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16)
    ratios = []
    for seed in range(NOISE_SEEDS):
        run = dataclasses.replace(built, params=perturbed(built.params, seed))
        t = harness._train(apply, run, None, steps)
        ratios.append(harness._final_loss(ref, built, t) / base)
    return {"model": name, "kind": "fp8_noise", "steps": steps, "rel": NOISE_REL, "ratios": ratios}


def _products(apply: Any, built: models.Built) -> dict[str, Any]:
    """The forward pass's ``dot_general``s as ``jaxamp.audit`` lists them: how many ran
    in FP8, and for the others, why not (the reason after "not FP8: ", counted)."""
    report = jaxamp.audit(apply)(built.params, built.state, built.batch)
    dots = [r for r in report.ops if r.primitive == "dot_general"]
    kept: collections.Counter[str] = collections.Counter()
    for r in dots:
        if r.dtype != "float8_e4m3fn":
            why = r.reason.partition("not FP8: ")[2] or f"{r.op_class} ({r.rule}), {r.dtype}"
            # "M, N, K = 16, 16, 8, not all ...": one entry per reason, not per shape
            kept[re.sub(r"M, N, K = [\d, ]+, ", "", why)] += 1
    return {
        "fp8": sum(r.dtype == "float8_e4m3fn" for r in dots),
        "total": len(dots),
        "kept": dict(kept),
        "fp8_modules": sorted({r.module for r in dots if r.dtype == "float8_e4m3fn"}),
    }


def select(
    name: str, scaling: str, steps: int, budget: float | None = None
) -> jaxamp.types.Fp8Selection:
    """``jaxamp.fp8_select`` (`budget`, or its default) on the model's loss on its training
    batch, at bfloat16 autocast's parameters after half of `steps`: a checkpoint part
    way through training, as docs/fp8.md advises. At init FP8 costs the gradient
    least: there the equinox transformer's every FP8 product fits the budget, and
    training with all of them misses the goal by 3.7 %; after 15 of its 30 steps the
    MLP's do not (the exclusion found by hand)."""
    built = harness.build(name)
    loss = harness._loss_fn(built.apply, built)

    def value(params: Any, batch: dict[str, Any]) -> Any:
        return loss(params, built.state, batch)[0]

    bf16 = jaxamp.autocast(built.apply, dtype=jnp.bfloat16)
    params = harness._train(bf16, built, None, steps // 2)["params"]
    given = {} if budget is None else {"budget": budget}
    return jaxamp.fp8_select(value, scaling=scaling, **given)(params, built.batch)


def evaluate(
    name: str,
    scaling: str,
    steps: int = harness.STEPS,
    exclude: dict[str, bool] | None = None,
    selected: bool = False,
    budget: float | None = None,
) -> dict[str, Any]:
    """Every figure of one model x scaling (with `exclude`: ``jaxamp.fp8(modules=...)``;
    `selected`: with ``jaxamp.fp8_select``'s selection at `budget`, by default its
    default); errors recorded, not raised."""
    built = harness.build(name)
    ref = harness._reference(name, built, steps)
    chosen = select(name, scaling, steps, budget) if selected else None
    cfg = jaxamp.fp8(scaling, modules=exclude, select=chosen)
    apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16, fp8=cfg)
    variant = f"modules={exclude}" if exclude else ""
    if chosen is not None:
        variant = f"fp8_select (budget {chosen.budget:g})"
    row: dict[str, Any] = {
        "model": name,
        "kind": "fp8",
        "package": models.MODELS[name][0],
        "dtype": f"fp8 {scaling}" + (f", {variant}" if variant else ""),
        "scaling": scaling,
        "variant": variant,
        "steps": steps,
        "final_f32": ref["train"]["final"],
        "errors": {},
    }
    if chosen is not None:
        row["selection"] = chosen.to_dict()

    def phase(key: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # recorded; failures() reports it
            row["errors"][key] = harness._error_text(e)

    def bf16() -> None:
        row["bf16"] = _bf16(name, built, ref, steps)

    def forward() -> None:
        row["fp8"] = harness._probe_figures(apply, built, ref, 1.0)

    def train() -> None:
        t = harness._train(apply, built, None, steps)
        row["fp8"]["final"] = harness._final_loss(ref, built, t)
        row["skipped"] = sum(t["skipped"])

    phase("bfloat16", bf16)
    phase("products", lambda: row.update(products=_products(apply, built)))
    phase("forward", forward)
    if "fp8" in row:
        phase("train", train)
    return row


def failures(row: dict[str, Any]) -> list[str]:
    """The goals this row misses, as readable sentences (empty: it meets them).

    Sets ``row["note"]``: a documented outcome (no FP8 product, a known miss, the
    exclusion that meets the goal), shown in the table's result column.
    """
    out = [f"raised in {k}: {v}" for k, v in row["errors"].items()]
    a, b = row.get("fp8") or {}, row.get("bf16") or {}
    name, default = row["model"], not row.get("variant")
    if a.get("nonfinite"):
        out.append(f"forward: {a['nonfinite']} outputs inf/NaN where float32's are finite")
    selection = row.get("selection")
    if row.get("products", {}).get("fp8") == 0:
        if name in NO_FP8:
            row["note"] = f"no FP8 product: {NO_FP8[name]}"
        elif (
            selection
            and selection["alone"]
            and all(e > selection["budget"] for e in selection["alone"].values())
        ):
            # What the selection is for: where FP8 costs every layer more than the
            # budget, it keeps them in bfloat16 and says why.
            least = min(selection["alone"].values())
            row["note"] = (
                f"the selection keeps none: each layer alone moves the gradient by "
                f"{least:.3g} or more, over the budget {selection['budget']:g}"
            )
        else:
            out.append("no product ran in FP8")
    if row.get("skipped"):
        out.append(f"training: {row['skipped']} steps skipped (bfloat16 autocast skips none)")
    if "final" in a and "final" in b:
        ratio = a["final"] / b["final"]
        row["ratio_bf16"], row["ratio_f32"] = ratio, a["final"] / row["final_f32"]
        miss = f"{100 * (ratio - 1):+.2f} %, goal ±{100 * GOAL:g} %"
        # A selection's row is judged by the goal alone (it is what fp8_select is
        # for), unless SELECT_BUDGET names the budget that meets it and this row ran
        # at another.
        excluded = not default and "selection" not in row and row["scaling"] not in EXCLUDE_MEETS
        tighter = SELECT_BUDGET.get((name, row["scaling"]))
        wider = selection is not None and tighter not in (None, selection.get("budget"))
        known = (default and (name in EXCLUDE or name in MISSES)) or excluded or wider
        if known and abs(ratio - 1) <= MISS_BOUND:
            if abs(ratio - 1) > GOAL:
                fix = MISSES.get(name, f"see the rows with modules={EXCLUDE.get(name)}")
                if excluded:
                    fix = "the exclusion, found on tensorwise, closes most of the gap"
                if wider:
                    fix = f"see the row with budget={tighter:g}"
                row["note"] = f"misses the 1 % goal: {fix}"
        elif not abs(ratio - 1) <= GOAL:
            out.append(
                f"training: final loss {a['final']:.5g} vs bfloat16 autocast's {b['final']:.5g} "
                f"({miss})"
            )
    return out


def check(row: dict[str, Any]) -> None:
    """Record the row (``$CONFORMANCE_OUT``), fail with every missed goal at once."""
    harness.record(row, failures)
    broken = failures(row)
    assert not broken, f"{row['model']} {row['dtype']}:\n  " + "\n  ".join(broken)


def groups(modules: list[str]) -> list[str]:
    """``jaxamp.fp8(modules=)`` patterns, one per kind of FP8 layer in `modules`
    (module paths): the last path component (``key``, ``Dense_0``, ``wi``), which
    matches that layer in every block; a path of class names (equinox) as a path."""
    out = []
    for m in modules:
        last = m.rsplit("/", 1)[-1]
        pattern = m if last.startswith("eqx.") else last
        if pattern and pattern not in out:
            out.append(pattern)
    return out


def leave_one_out(name: str, scaling: str, steps: int = harness.STEPS) -> dict[str, float]:
    """The final loss over bfloat16 autocast's with each kind of FP8 layer kept in
    bfloat16 in turn (``modules={pattern: False}``): which layer a miss comes from.

    ``python -m tests.conformance.fp8 MODEL [SCALING]`` prints it."""
    built = harness.build(name)
    ref = harness._reference(name, built, steps)
    base = _bf16(name, built, ref, steps)["final"]
    fp8_apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8(scaling))
    out = {}
    for pattern in groups(_products(fp8_apply, built)["fp8_modules"]):
        cfg = jaxamp.fp8(scaling, modules={pattern: False})
        apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16, fp8=cfg)
        t = harness._train(apply, built, None, steps)
        out[pattern] = harness._final_loss(ref, built, t) / base
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["noise"]:  # make conformance: a noise row per FP8 model
        for name in sys.argv[2:] or [m for m in MODELS if m not in NO_FP8]:
            row = noise_floor(name)
            harness.record(row, lambda r: [])
            print(name, " ".join(f"{r:.4f}" for r in row["ratios"]), flush=True)
    else:
        print(leave_one_out(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tensorwise"))
