"""jaxamp.autocast and dynamic loss scaling on model code other people wrote.

One test per model x dtype (see harness.py for what each checks). CI runs
``STEPS = 10`` training steps; ``make conformance`` runs 30, measures residual
bytes and compile time, and writes the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import pytest

from . import harness, models


@pytest.mark.parametrize("dtype", sorted(harness.DTYPES))
@pytest.mark.parametrize("name", list(models.MODELS))
def test_conformance(name: str, dtype: str) -> None:
    harness.check(harness.evaluate(name, dtype))
