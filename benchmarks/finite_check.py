"""Ways to ask "is every gradient finite?", measured on the default model's gradients.

Each check is a jitted ``tree -> bool[]``. For each we report XLA bytes accessed,
temp memory, run time, and whether it catches a NaN, a +inf and a -inf planted in
one leaf, and whether it raises a false alarm on large but finite values.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jmp

import jaxamp

Check = Callable[[Any], jax.Array]


def _leaves(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def jaxamp_all_finite(tree: Any) -> jax.Array:
    """jaxamp's check: ``isfinite(sum(leaf - leaf))`` per leaf, combined with scalar ANDs."""
    return jaxamp.all_finite(tree)


def per_leaf_all(tree: Any) -> jax.Array:
    """``all(isfinite(leaf))`` per leaf, combined with scalar ANDs (jaxamp's first check)."""
    result = jnp.array(True)
    for x in _leaves(tree):
        result = result & jnp.all(jnp.isfinite(x))
    return result


def per_leaf_all_stacked(tree: Any) -> jax.Array:
    """jmp's check: per-leaf ``all(isfinite)``, the scalars stacked, then ``all``."""
    return jmp.all_finite(tree)


def concat_all(tree: Any) -> jax.Array:
    """Flatten and concatenate every leaf into one vector, then ``all(isfinite)``."""
    return jnp.all(jnp.isfinite(jnp.concatenate([x.ravel() for x in _leaves(tree)])))


def max_abs(tree: Any) -> jax.Array:
    """``isfinite(max(abs(leaf)))`` over leaves: relies on max propagating NaN."""
    m = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in _leaves(tree)]))
    return jnp.isfinite(m)


def sum_based(tree: Any) -> jax.Array:
    """``isfinite(sum(leaf))`` over leaves: inf and NaN propagate through a sum."""
    total = sum(jnp.sum(x, dtype=jnp.float32) for x in _leaves(tree))
    return jnp.isfinite(total)


def sum_times_zero(tree: Any) -> jax.Array:
    """``isfinite(sum(leaf * 0))``: ``x * 0`` is NaN exactly for inf / NaN, so no overflow."""
    total = sum(jnp.sum(x * 0, dtype=jnp.float32) for x in _leaves(tree))
    return jnp.isfinite(total)


def sum_self_difference(tree: Any) -> jax.Array:
    """``isfinite(sum(leaf - leaf))``: ``x - x`` is NaN exactly for inf / NaN, else 0.

    Unlike ``x * 0`` it needs no broadcast constant, which XLA:CPU materialises.
    """
    total = sum(jnp.sum(x - x, dtype=jnp.float32) for x in _leaves(tree))
    return jnp.isfinite(total)


CHECKS: dict[str, Check] = {
    "jaxamp.all_finite": jaxamp_all_finite,
    "per_leaf_isfinite_all": per_leaf_all,
    "per_leaf_all_stacked (jmp)": per_leaf_all_stacked,
    "concat_then_check": concat_all,
    "max_abs": max_abs,
    "sum": sum_based,
    "sum(x*0)": sum_times_zero,
    "sum(x-x)": sum_self_difference,
}


def _plant(tree: Any, value: float, *, all_big: bool = False) -> Any:
    """A copy of ``tree`` with ``value`` at one element of its middle leaf.

    With ``all_big`` the whole middle leaf is filled with ``value`` instead.
    """
    leaves, treedef = jax.tree.flatten(tree)
    i = len(leaves) // 2
    leaf = leaves[i]
    if all_big:
        leaves[i] = jnp.full_like(leaf, value)
    else:
        flat = leaf.ravel()
        leaves[i] = flat.at[flat.size // 2].set(value).reshape(leaf.shape)
    return jax.tree.unflatten(treedef, leaves)


def _cost(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("bytes accessed", float("nan")))


def run(grads: Any, reps: int = 20) -> dict[str, dict[str, Any]]:
    """Measures every check on ``grads`` (a float gradient tree).

    Args:
      grads: the gradient tree to check (finite).
      reps: timed calls per check; the median is reported.

    Returns:
      ``{check_name: {bytes_accessed, temp_bytes, time_us, catches_nan,
      catches_inf, catches_neg_inf, false_alarm_big_finite}}``.
    """
    probes = {
        "catches_nan": (_plant(grads, float("nan")), False),
        "catches_inf": (_plant(grads, float("inf")), False),
        "catches_neg_inf": (_plant(grads, float("-inf")), False),
        # 3e38 is finite in float32; a sum of many of them is not.
        "false_alarm_big_finite": (_plant(grads, 3e38, all_big=True), True),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, fn in CHECKS.items():
        compiled = jax.jit(fn).lower(grads).compile()
        mem = compiled.memory_analysis()
        row: dict[str, Any] = {
            "bytes_accessed": _cost(compiled),
            "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None,
        }
        assert bool(compiled(grads)), f"{name} says finite gradients are not finite"
        for probe, (tree, expected) in probes.items():
            got = bool(compiled(tree))
            if probe == "false_alarm_big_finite":
                row[probe] = got != expected
            else:
                row[probe] = got == expected
        compiled(grads).block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            compiled(grads).block_until_ready()
            times.append(time.perf_counter() - t0)
        row["time_us"] = statistics.median(times) * 1e6
        results[name] = row
    return results


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of :func:`run`'s results, ratios relative to jaxamp's check."""
    base = results["jaxamp.all_finite"]
    lines = [
        f"{'finite check':<28}{'bytes MB':>9}{'bytes x':>8}{'temp KB':>9}{'time us':>9}"
        f"{'time x':>7}{'NaN':>5}{'+inf':>5}{'-inf':>5}{'false alarm':>12}"
    ]
    yn = {True: "yes", False: "NO"}
    for name, r in results.items():
        lines.append(
            f"{name:<28}{r['bytes_accessed'] / 1e6:>9.2f}"
            f"{r['bytes_accessed'] / base['bytes_accessed']:>8.2f}"
            f"{(r['temp_bytes'] or 0) / 1e3:>9.1f}{r['time_us']:>9.0f}"
            f"{r['time_us'] / base['time_us']:>7.2f}"
            f"{yn[r['catches_nan']]:>5}{yn[r['catches_inf']]:>5}{yn[r['catches_neg_inf']]:>5}"
            f"{('YES' if r['false_alarm_big_finite'] else 'no'):>12}"
        )
    return "\n".join(lines)
