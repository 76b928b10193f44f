"""jaxamp.autocast and dynamic loss scaling on model code other people wrote.

One test per model x dtype (see harness.py for what each checks). CI runs each
model in one dtype (``harness.CI_DTYPE``; both dtypes over the models) for
``STEPS = 10`` training steps; ``make conformance`` runs every model in both, for
30, measures residual bytes and compile time, and writes the table in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import pytest

from . import harness, models


@pytest.mark.parametrize("dtype", sorted(harness.DTYPES))
@pytest.mark.parametrize("name", list(models.MODELS))
def test_conformance(name: str, dtype: str) -> None:
    if not harness.FULL and harness.CI_DTYPE[name] != dtype:
        pytest.skip(f"{name} in {dtype}: full suite only (make conformance)")
    harness.check(harness.evaluate(name, dtype))


def test_ci_runs_every_model_and_both_dtypes() -> None:
    assert set(harness.CI_DTYPE) == set(models.MODELS)
    assert set(harness.CI_DTYPE.values()) == set(harness.DTYPES)
