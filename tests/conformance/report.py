"""Writes the conformance table (rows from harness.record) into benchmarks/RESULTS.md.

``python tests/conformance/report.py ROWS.jsonl [RESULTS.md]``: replaces the section
between the conformance markers (appends it the first time) and prints the table.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
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


def main() -> None:
    src = Path(sys.argv[1])
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("benchmarks/RESULTS.md")
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    section = f"{BEGIN}\n{table(rows)}\n{END}"
    text = dst.read_text() if dst.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    dst.write_text(text)
    print(section)


if __name__ == "__main__":
    main()
