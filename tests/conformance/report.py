"""Writes the conformance tables (rows from harness.record) into benchmarks/RESULTS.md.

``python tests/conformance/report.py ROWS.jsonl [RESULTS.md]``: replaces the section
between the conformance markers (appends it the first time) and prints the table; the
FP8 rows (``fp8.py``) go between the FP8 markers, in RESULTS.md's FP8 section, those
with ``jaxamp.fp8_select``'s selection between the selection markers; the noise rows
(``fp8.noise_floor``) are a column of both.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
FP8_BEGIN, FP8_END = "<!-- conformance-fp8:begin -->", "<!-- conformance-fp8:end -->"
SELECT_BEGIN = "<!-- conformance-fp8-select:begin -->"
SELECT_END = "<!-- conformance-fp8-select:end -->"
PACKAGES = ("jax", "flax", "optax", "transformers", "flaxmodels", "equinox", "diffusers", "jraph")


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _cell(row: dict[str, Any]) -> list[str]:
    a, h, t, t32 = (row.get(k) or {} for k in ("autocast", "hand", "train", "train_f32"))
    skips = "-"
    if t and t32:
        calibration = row.get("calibration_skips", 0)
        note = f" ({calibration} calibrating)" if calibration else ""
        skips = f"{sum(t['skipped'])}{note} / {sum(t32['skipped'])}"
    final = t["final"] / t32["final"] if t and t32 else None
    if row["failures"]:
        verdict = "FAIL: " + "; ".join(f.replace("|", "/") for f in row["failures"])
    elif row.get("beyond_range") and a.get("nonfinite"):
        verdict = "pass: overflows visibly (inputs past the dtype's range), every step skipped"
    else:
        verdict = "pass"
    return [
        row["model"],
        row["dtype"],
        _num(a.get("out_err"), ".2e"),
        _num(h.get("out_err"), ".2e"),
        _num(a.get("loss_err"), ".1e"),
        _num(a.get("grad_cos"), ".6f"),
        _num(h.get("grad_cos"), ".6f"),
        _num(final, ".4f"),
        skips,
        _num(row.get("residual_ratio"), ".2f"),
        _num(row.get("compile_ratio"), ".2f"),
        verdict,
    ]


def table(rows: list[dict[str, Any]]) -> str:
    versions = []
    for p in PACKAGES:
        try:
            versions.append(f"{p} {metadata.version(p)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{p} (not installed)")
    steps = max((r["steps"] for r in rows), default=0)
    head = [
        "model", "dtype", "fwd err autocast", "fwd err hand", "loss err", "grad cos autocast",
        "grad cos hand", "final loss / f32", "skips amp / f32", "residuals / f32",
        "compile / f32", "result",
    ]  # fmt: skip
    lines = [
        "## Conformance: autocast on third-party models (`make conformance`)",
        "",
        f"{', '.join(versions)}. Tiny configs (width 32, 2 layers, batch 4 x 16 with "
        "padding: lengths 16, 11, 5 and an all-padding row; flaxmodels' ResNet18: 8 images "
        "of 64x64, its `fwd err` and `grad cos` the mean over 4 batches, because one "
        "small-batch BatchNorm batch is noise; diffusers' UNet: 8x8 latents, denoising MSE "
        "loss; jraph's GNN: 4 padded graphs, raw node features up to 3.5e5, masked binary "
        "cross-entropy over 128 tasks), random init. `fwd err`: max "
        "|y - y_f32| / max |y_f32| of the logits (inf: a non-finite output where float32's is "
        "finite); `hand`: the package's own `dtype=` knob with float32 params (`-`: no such "
        "knob); `loss err`: relative; `grad cos`: cosine of the gradient at init to float32's "
        f"(float16 loss scaled by 2^15); `final loss / f32`: after {steps} AdamW steps "
        "(float16: dynamic scale from 2^15; bfloat16: skip only), both judged by the float32 "
        "model; `calibrating`: leading float16 skips that float32's own gradient at init "
        "forces (it times the scale overflows float16); `residuals`: backward residual bytes "
        "(`bench_autocast._residual_bytes`); "
        "`compile`: trace + compile seconds of `jit(value_and_grad)`. Requirements and "
        "tolerances: `tests/conformance/harness.py`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in sorted(rows, key=lambda r: (r["model"], r["dtype"])):
        lines.append("| " + " | ".join(_cell(row)) + " |")
    return "\n".join(lines)


def _verdict(row: dict[str, Any]) -> str:
    verdict = "FAIL: " + "; ".join(row["failures"]) if row["failures"] else "pass"
    if not row["failures"] and row.get("note"):
        verdict = row["note"]  # a documented outcome (fp8.NO_FP8, EXCLUDE, MISSES)
    return verdict.replace("|", "/")


def _ratio(row: dict[str, Any]) -> str:
    a, b = row.get("fp8") or {}, row.get("bf16") or {}
    if "final" not in a or "final" not in b:
        return "-"
    ratio = a["final"] / b["final"]
    return f"{ratio:.4f} ({100 * (ratio - 1):+.2f} %)"


def _noise(noise: dict[str, list[float]], model: str) -> str:
    """The spread of bfloat16 autocast's own final loss (``fp8.noise_floor``)."""
    if model not in noise:
        return "-"
    lo, hi = (100 * (f(noise[model]) - 1) for f in (min, max))
    return f"{lo:+.2f} to {hi:+.2f} %"


def _outcome(row: dict[str, Any], noise: dict[str, list[float]]) -> list[str]:
    """The training columns both FP8 tables end with: final losses, ratio, noise, result."""
    a, b = row.get("fp8") or {}, row.get("bf16") or {}
    return [
        _num(a.get("final"), ".5f"),
        _num(b.get("final"), ".5f"),
        _num(row.get("final_f32"), ".5f"),
        _ratio(row),
        _noise(noise, row["model"]),
        _verdict(row),
    ]


def _fp8_cell(row: dict[str, Any], noise: dict[str, list[float]]) -> list[str]:
    a, b, p = (row.get(k) or {} for k in ("fp8", "bf16", "products"))
    return [
        row["model"],
        row["scaling"] + (f", `{row['variant']}`" if row.get("variant") else ""),
        f"{p['fp8']} of {p['total']}" if p else "-",
        _num(a.get("out_err"), ".2e"),
        _num(b.get("out_err"), ".2e"),
        _num(a.get("grad_cos"), ".5f"),
        _num(b.get("grad_cos"), ".6f"),
        *_outcome(row, noise),
    ]


NOISE_TEXT = (
    "`bf16 noise`: bfloat16 autocast's own final loss, trained {seeds} times from the init "
    "perturbed by a relative {rel:.3g} (half of bfloat16's rounding step; "
    "`fp8.noise_floor`), over the unperturbed run's: how far the final loss moves by a "
    "change that is no change of precision."
)


def _noise_text(noise_rows: Sequence[dict[str, Any]]) -> str:
    if not noise_rows:
        return ""
    r = noise_rows[0]
    return " " + NOISE_TEXT.format(seeds=len(r["ratios"]), rel=r["rel"])


def fp8_table(rows: list[dict[str, Any]], noise_rows: Sequence[dict[str, Any]] = ()) -> str:
    noise = {r["model"]: r["ratios"] for r in noise_rows}
    steps = max((r["steps"] for r in rows), default=0)
    head = [
        "model", "scaling", "FP8 products", "fwd err FP8", "fwd err bf16", "grad cos FP8",
        "grad cos bf16", "final loss FP8", "bf16", "f32", "FP8 / bf16", "bf16 noise", "result",
    ]  # fmt: skip
    lines = [
        "### FP8 on the conformance corpus (`make conformance`, `tests/conformance/fp8.py`)",
        "",
        "The same models, batches and float32 reference as the conformance table; "
        "`jaxamp.autocast(apply, dtype=bfloat16, fp8=jaxamp.fp8(scaling))` against bfloat16 "
        "autocast (`bf16`) and float32. `FP8 products`: forward `dot_general`s that ran in "
        "FP8, from `jaxamp.audit`'s per-op view (the others: first / last layer, or M, N, K "
        "not multiples of 16); `fwd err`: max |y - y_f32| / max |y_f32| of the logits; "
        f"`grad cos`: cosine of the gradient at init to float32's; `final loss`: after {steps} "
        "AdamW steps with no loss scale, judged by the float32 model. Goal: final loss within "
        "1 % of bfloat16 autocast's." + _noise_text(noise_rows),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in sorted(rows, key=lambda r: (r["model"], r.get("variant", ""), r["scaling"])):
        lines.append("| " + " | ".join(_fp8_cell(row, noise)) + " |")
    kept: dict[str, dict[str, int]] = {}
    for row in rows:
        if row.get("products") and row["scaling"] == "tensorwise" and not row.get("variant"):
            kept[row["model"]] = row["products"]["kept"]
    if kept:
        lines += ["", "Kept in bfloat16, and why (`jaxamp.audit(...).ops`):", ""]
        for model, why in sorted(kept.items()):
            lines.append(f"- {model}: " + "; ".join(f"{n} x {w}" for w, n in why.items()))
    return "\n".join(lines)


def select_table(rows: list[dict[str, Any]], noise_rows: Sequence[dict[str, Any]] = ()) -> str:
    """The rows trained with ``jaxamp.fp8_select``'s selection (``fp8.evaluate(...,
    selected=True)``)."""
    noise = {r["model"]: r["ratios"] for r in noise_rows}
    steps = max((r["steps"] for r in rows), default=0)
    budgets = sorted({r["selection"]["budget"] for r in rows})
    head = [
        "model", "scaling", "budget", "layers kept", "FP8 products", "kept set's gradient error",
        "final loss FP8", "bf16", "f32", "FP8 / bf16", "bf16 noise", "result",
    ]  # fmt: skip
    lines = [
        "### `jaxamp.fp8_select` on the conformance corpus (`make conformance`)",
        "",
        "`jaxamp.fp8_select(loss, scaling=..., budget=...)` (budgets "
        f"{', '.join(f'{b:g}' for b in budgets)}: relative gradient error against bfloat16 "
        "autocast; 0.05 is the default), calibrated on the training batch at bfloat16 "
        f"autocast's parameters after {steps // 2} steps; then {steps} AdamW steps from init with "
        "`jaxamp.fp8(scaling, select=selection)`, as the table above. `layers kept`: candidate "
        "layers left in FP8 (module paths, or the weights products read); `FP8 products`: "
        "forward products that ran in FP8 with the selection. Goal: final loss within 1 % of "
        "bfloat16 autocast's." + _noise_text(noise_rows),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in sorted(rows, key=lambda r: (r["model"], r["scaling"], -r["selection"]["budget"])):
        sel, p = row["selection"], row.get("products") or {}
        modules = sel.get("modules", {})
        cells = [
            row["model"],
            row["scaling"],
            f"{sel['budget']:g}",
            f"{sum(modules.values())} of {len(modules)}",
            f"{p['fp8']} of {p['total']}" if p else "-",
            f"{sel['error']:.3g}" if sum(modules.values()) else "-",
            *_outcome(row, noise),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _replace(text: str, begin: str, end: str, section: str) -> str:
    """`text` with the part between `begin` and `end` replaced (appended if absent)."""
    if begin in text and end in text:
        return text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    return text.rstrip("\n") + "\n\n" + section + "\n"


def main() -> None:
    src = Path(sys.argv[1])
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("benchmarks/RESULTS.md")
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    text = dst.read_text() if dst.exists() else ""
    noise = [r for r in rows if r.get("kind") == "fp8_noise"]
    fp8 = [r for r in rows if r.get("kind") == "fp8" and "selection" not in r]
    chosen = [r for r in rows if r.get("kind") == "fp8" and "selection" in r]
    rows = [r for r in rows if r.get("kind") not in ("fp8", "fp8_noise")]
    for begin, end, part, render in (
        (BEGIN, END, rows, table),
        (FP8_BEGIN, FP8_END, fp8, lambda p: fp8_table(p, noise)),
        (SELECT_BEGIN, SELECT_END, chosen, lambda p: select_table(p, noise)),
    ):
        if part:  # a run of only some rows leaves the other table as it was
            section = f"{begin}\n{render(part)}\n{end}"
            text = _replace(text, begin, end, section)
            print(section)
    dst.write_text(text)


if __name__ == "__main__":
    main()
