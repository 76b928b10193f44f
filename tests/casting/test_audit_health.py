"""``AuditReport.health_table``: ``jaxamp.fp8_health``'s figures beside audit's products."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxamp
from tests.casting.test_fp8_health import _planted


def test_the_planted_casts_are_the_flagged_ones():
    loss, params, x, x_inf, c = _planted("tensorwise")
    step = jaxamp.fp8_health(loss)
    (_, health), _ = jax.jit(step)(params, x, x_inf)
    text = jaxamp.audit(step)(params, x, x_inf).health_table(health)
    lines = text.splitlines()
    assert lines[0] == "FP8 health: 4 products, 2 casts flagged"
    rows = {tuple(line.split()[:2]): line for line in lines[2:]}
    assert len(rows) == 4 * 3  # lhs, rhs and grad of each product
    flagged = {key for key, line in rows.items() if "flushed to zero" in line or "inf/NaN" in line}
    assert flagged == {("Planted/sat", "lhs"), ("Planted/under", "grad")}
    assert "inf/NaN: the product is NaN" in rows["Planted/sat", "lhs"]
    share = float((c < 1).mean())
    assert f"{share:.3%} flushed to zero" in rows["Planted/under", "grad"]
    # On the CPU XLA runs the FP8 products as dots.
    assert all(" dot " in f" {line} " for line in rows.values())


def test_a_product_outside_any_module_is_joined_to_its_kernel():
    """fp8_health names it by the weight it reads (``w``: there is no module path),
    audit's HLO rows by its empty module path: the table must still find its
    kernel."""
    w = jax.random.normal(jax.random.key(0), (64, 64))
    f = jaxamp.autocast(
        lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=jaxamp.fp8(first_last_bf16=False)
    )
    step = jaxamp.fp8_health(lambda w, x: jnp.sum(f(w, x)))
    x = jnp.ones((32, 64))
    (_, health), _ = step(w, x)
    rows = jaxamp.audit(step)(w, x).health_table(health).splitlines()[2:]
    assert [line.split()[:2] for line in rows] == [["w", c] for c in ("lhs", "rhs", "grad")]
    assert all(" dot " in f" {line} " and "?" not in line for line in rows)
