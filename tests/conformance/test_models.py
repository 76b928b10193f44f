"""jaxamp.autocast and dynamic loss scaling on model code other people wrote.

One test per model x dtype (see harness.py for what each checks). CI runs the
models ``harness.FULL_ONLY`` does not list, each in one dtype (``harness.CI_DTYPE``;
both dtypes over them), for
``STEPS = 10`` training steps; ``make conformance`` runs every model in both, for
30, measures residual bytes and compile time, and writes the table in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

from . import harness, models


@pytest.mark.parametrize("dtype", sorted(harness.DTYPES))
@pytest.mark.parametrize("name", list(models.MODELS))
def test_conformance(name: str, dtype: str) -> None:
    if not harness.FULL and (why := harness.ci_skip_reason(name, dtype)):
        pytest.skip(why)
    harness.check(harness.evaluate(name, dtype))


def test_ci_rows_cover_both_dtypes() -> None:
    """Every model has a CI dtype, FULL_ONLY names only models, and the rows CI runs
    (the models FULL_ONLY leaves, each in its CI dtype) hold both dtypes."""
    assert set(harness.CI_DTYPE) == set(models.MODELS)
    assert set(harness.FULL_ONLY) <= set(models.MODELS), set(harness.FULL_ONLY) - set(models.MODELS)
    ci_rows = {
        (n, d) for n in models.MODELS for d in harness.DTYPES if not harness.ci_skip_reason(n, d)
    }
    assert {d for _, d in ci_rows} == set(harness.DTYPES), sorted(ci_rows)


@pytest.mark.skipif(
    not harness.FULL,
    reason="full suite only (make conformance): its jraph-gnn float16 row already fails "
    "on clipped logits; find_overflow's re-runs of the GNN take ~20 s on 2 cores",
)
def test_raw_features_past_float16_are_reported_not_clipped() -> None:
    """jraph-gnn's raw node features (up to 3.5e5) leave float16's range.

    Under float16 autocast its outputs are inf / NaN where float32's are finite
    (the conformance row then wants every step skipped), or they match float32:
    never finite logits computed from clipped features. When they overflow,
    ``jaxamp.find_overflow`` names a float16 op of the forward pass, and its
    advice, followed, removes that overflow.
    """
    from tests.casting.test_find_overflow import assert_advice_works

    built = harness.build("jraph-gnn")
    ref = np.asarray(built.apply(built.params, None, built.batch)[0])
    amp = jaxamp.autocast(built.apply, dtype=jnp.float16)
    got = np.asarray(amp(built.params, None, built.batch)[0], np.float64)
    assert np.isfinite(ref).all()
    if np.isfinite(got).all():  # then it must be float32's answer, to float16's rounding
        err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert err <= harness.LOSS_RTOL["float16"], f"finite logits {err:.3g} off: clipped"
        return

    def loss(params: Any, batch: dict[str, Any]) -> jax.Array:
        return built.loss(built.apply(params, None, batch)[0], batch)

    report = jaxamp.find_overflow(loss, scale=1.0)(built.params, built.batch)
    assert report.found and report.low_precision and report.pass_ == "forward", str(report)
    assert report.dtype == "float16" and report.magnitude > float(jnp.finfo(jnp.float16).max)
    assert report.module_path is not None and report.module_path.startswith("GraphConvNet")
    assert_advice_works(report, loss, built.params, built.batch)
