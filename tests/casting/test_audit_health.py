"""``AuditReport.health_table``: ``jaxamp.fp8_health``'s figures beside audit's products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def test_mapped_figures_are_pooled_the_largest_amax_and_the_mean_fraction():
    """fp8_health under ``vmap`` gives each figure per example; the table pools
    them as one cast of all the examples would count (each casts as many)."""
    w = jax.random.normal(jax.random.key(1), (64, 64))
    f = jaxamp.autocast(
        lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=jaxamp.fp8(first_last_bf16=False)
    )
    step = jaxamp.fp8_health(lambda w, x: jnp.sum(f(w, x)))
    # Example k: one element 2**(20 + k) times the rest, which its scale flushes.
    xs = jnp.ones((3, 32, 64)).at[:, 0, 0].set(2.0 ** (20 + jnp.arange(3)))
    (_, health), _ = jax.jit(jax.vmap(step, in_axes=(None, 0)))(w, xs)
    assert health["w"]["lhs"]["amax"].shape == (3,)
    one = [jax.jit(step)(w, x)[0][1]["w"]["lhs"] for x in xs]
    row = next(
        line.split()
        for line in jaxamp.audit(step)(w, xs[0]).health_table(health).splitlines()
        if line.split()[:2] == ["w", "lhs"]
    )
    assert max(float(h["amax"]) for h in one) == 2.0**22 and row[2] == f"{2.0**22:.4g}"
    flushed = np.mean([float(h["flushed"]) for h in one])
    assert 0 < flushed < 1 and row[4] == f"{flushed:.3%}"
