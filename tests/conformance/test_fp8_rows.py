"""FP8 through autocast on the conformance corpus (issue 33): ``jaxamp.fp8``
tensorwise and rowwise against bfloat16 autocast and float32 (see fp8.py).

``make conformance`` only (``CONFORMANCE_FULL=1``): every row trains its model
three times (float32, bfloat16 autocast, FP8), which CI's budget has no room for.
"""

from __future__ import annotations

import pytest

from . import fp8, harness


@pytest.mark.skipif(not harness.FULL, reason="FP8 rows: full suite only (make conformance)")
@pytest.mark.parametrize("scaling", fp8.SCALINGS)
@pytest.mark.parametrize("name", fp8.MODELS)
def test_fp8_conformance(name: str, scaling: str) -> None:
    fp8.check(fp8.evaluate(name, scaling))


@pytest.mark.skipif(not harness.FULL, reason="FP8 rows: full suite only (make conformance)")
@pytest.mark.parametrize("scaling", fp8.SCALINGS)
@pytest.mark.parametrize("name", sorted(fp8.EXCLUDE))
def test_fp8_conformance_with_the_documented_exclusion(name: str, scaling: str) -> None:
    fp8.check(fp8.evaluate(name, scaling, exclude=fp8.EXCLUDE[name]))


@pytest.mark.skipif(not harness.FULL, reason="FP8 rows: full suite only (make conformance)")
@pytest.mark.parametrize("scaling", fp8.SCALINGS)
@pytest.mark.parametrize("name", fp8.MODELS)
def test_fp8_conformance_with_the_selection(name: str, scaling: str) -> None:
    fp8.check(fp8.evaluate(name, scaling, selected=True))


@pytest.mark.skipif(not harness.FULL, reason="FP8 rows: full suite only (make conformance)")
@pytest.mark.parametrize(("name", "scaling"), sorted(fp8.SELECT_BUDGET))
def test_fp8_conformance_with_the_selection_at_the_documented_budget(
    name: str, scaling: str
) -> None:
    budget = fp8.SELECT_BUDGET[name, scaling]
    fp8.check(fp8.evaluate(name, scaling, selected=True, budget=budget))


def test_fp8_rows_name_models_of_the_corpus() -> None:
    from . import models

    assert set(fp8.MODELS) <= set(models.MODELS)
    assert {name for name, _ in fp8.SELECT_BUDGET} <= set(fp8.MODELS)
    documented = set(fp8.NO_FP8) | set(fp8.EXCLUDE) | set(fp8.MISSES)
    assert documented <= set(fp8.MODELS)
    assert not set(fp8.EXCLUDE) & set(fp8.MISSES)


def test_a_documented_miss_is_a_note_and_an_undocumented_one_fails() -> None:
    def row(name: str, fp8_final: float, variant: str = "") -> dict:
        return {"model": name, "variant": variant, "errors": {}, "final_f32": 1.0,
                "scaling": "tensorwise",
                "products": {"fp8": 3}, "fp8": {"final": fp8_final, "nonfinite": 0},
                "bf16": {"final": 1.0}}  # fmt: skip

    known = row("hf-t5", 1.03)
    assert fp8.failures(known) == [] and "see the rows with modules=" in known["note"]
    excluded = row("hf-t5", 1.03, "modules={'decoder': False}")
    assert fp8.failures(excluded)  # tensorwise: must meet it
    excluded = {**row("hf-t5", 1.015, "modules={'decoder': False}"), "scaling": "rowwise"}
    assert fp8.failures(excluded) == [] and "closes most of the gap" in excluded["note"]
    assert fp8.failures(row("hf-t5", 1.0 + fp8.MISS_BOUND + 0.01))  # beyond the bound
    assert fp8.failures(row("hf-gpt2", 1.03))  # no documented miss
    assert fp8.failures(row("hf-gpt2", 1.005)) == []
    # A selection that keeps none because every layer alone is over its budget says
    # so; one that keeps none otherwise fails.
    alone = {"up/kernel": 0.08, "down/kernel": 0.06}
    none = {**row("flax-nnx-attention", 1.0, "fp8_select (budget 0.05)"),
            "products": {"fp8": 0}, "selection": {"budget": 0.05, "alone": alone}}  # fmt: skip
    assert fp8.failures(none) == [] and "keeps none" in none["note"] and "0.06" in none["note"]
    under = {**none, "selection": {"budget": 0.05, "alone": {"up/kernel": 0.04}}}
    assert fp8.failures(under) == ["no product ran in FP8"]
    for scaling in fp8.SCALINGS:  # a selection's row: the goal, whatever the model
        chosen = {**row("flax-linen-transformer", 1.011, "fp8_select (budget 0.05)"),
                  "scaling": scaling, "selection": {}}  # fmt: skip
        assert fp8.failures(chosen)
        assert fp8.failures({**chosen, "fp8": {"final": 1.009, "nonfinite": 0}}) == []
    # Where SELECT_BUDGET names the budget that meets the goal, a miss at another is a
    # note pointing at that row; that row, and the other scaling's, must meet it.
    (name, scaling), budget = next(iter(fp8.SELECT_BUDGET.items()))
    wide = {**row(name, 1.017, "fp8_select (budget 0.05)"), "scaling": scaling,
            "selection": {"budget": 0.05}}  # fmt: skip
    assert fp8.failures(wide) == [] and f"budget={budget:g}" in wide["note"]
    assert fp8.failures({**wide, "selection": {"budget": budget}})
    other = next(s for s in fp8.SCALINGS if (name, s) not in fp8.SELECT_BUDGET)
    assert fp8.failures({**wide, "scaling": other})


def test_report_puts_selection_rows_in_their_table_with_the_noise_floor(tmp_path) -> None:
    import json

    from . import report

    def row(variant: str, final: float, **more) -> dict:
        return {"model": "hf-gpt2", "kind": "fp8", "scaling": "rowwise", "variant": variant,
                "steps": 30, "final_f32": 1.0, "failures": [], "fp8": {"final": final},
                "bf16": {"final": 1.0}, "products": {"fp8": 4, "total": 13, "kept": {}},
                **more}  # fmt: skip

    selection = {"modules": {"h/0/attn": True, "h/0/mlp": False}, "budget": 0.05, "error": 0.04}
    rows = [
        row("", 1.03),
        row("fp8_select (budget 0.05)", 1.005, selection=selection),
        {
            "model": "hf-gpt2",
            "kind": "fp8_noise",
            "steps": 30,
            "rel": 2.0**-9,
            "ratios": [0.9974, 1.0064, 1.0],
        },  # fmt: skip
    ]
    src, dst = tmp_path / "rows.jsonl", tmp_path / "RESULTS.md"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst.write_text(f"a\n{report.FP8_BEGIN}\nold\n{report.FP8_END}\nb\n"
                   f"{report.SELECT_BEGIN}\nold\n{report.SELECT_END}\nc\n")  # fmt: skip
    import sys

    argv, sys.argv = sys.argv, ["report.py", str(src), str(dst)]
    try:
        report.main()
    finally:
        sys.argv = argv
    text = dst.read_text()
    fp8_part = text[text.index(report.FP8_BEGIN) : text.index(report.FP8_END)]
    select_part = text[text.index(report.SELECT_BEGIN) : text.index(report.SELECT_END)]
    assert "old" not in text and text.startswith("a\n") and text.rstrip().endswith("c")
    assert "1.0300 (+3.00 %)" in fp8_part and "fp8_select" not in fp8_part
    assert "| hf-gpt2 | rowwise | 0.05 | 1 of 2 | 4 of 13 | 0.04 |" in select_part
    assert "1.0050 (+0.50 %)" in select_part and "1.0300" not in select_part
    assert fp8_part.count("-0.26 to +0.64 %") == 1 == select_part.count("-0.26 to +0.64 %")
