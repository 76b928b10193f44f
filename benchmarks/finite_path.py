"""Issue 34's figures: what a finite step reads and writes, against the peers, and what
its taken branches copy; and the same on a model of many small leaves.

A finite step's bytes are XLA's cost analysis of the compiled step with every
conditional reduced to the branch a finite step takes (``hlo_paths``); for a peer
without a conditional they are its static figure. Compile-only: nothing here is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# The peers that compute the step, then select it away (or skip it inside optax),
# against which each jaxamp path is held; every_k against the accumulation anchor.
SELECT_PEERS = ("jmp", "flax_dynamic_scale", "optax_apply_if_finite")
HELD = {
    "jaxamp_step": SELECT_PEERS,
    "jaxamp_optax": SELECT_PEERS,
    "jaxamp_nnx": SELECT_PEERS,
    "jaxamp_every_k": ("optax_multisteps",),
}
# What the many-leaves study compiles: jaxamp's three paths and their peers.
LEAVES_VARIANTS = (
    "plain",
    "jaxamp_step",
    "jaxamp_optax",
    "jaxamp_every_k",
    "jmp",
    "flax_dynamic_scale",
    "optax_apply_if_finite",
    "optax_multisteps",
)


def targets(rows: list[dict[str, Any]], model: str) -> list[str]:
    """PASS / MISS: each jaxamp path's finite-path bytes <= the best peer's, and no copy
    in the branches a finite step takes."""
    by = {r["name"]: r for r in rows}
    out = []
    for name, peers in HELD.items():
        present = [by[p] for p in peers if p in by]
        if name not in by or not present:
            continue
        r = by[name]
        best = min(present, key=lambda p: p["finite_path_bytes"])
        got, ref = r["finite_path_bytes"], best["finite_path_bytes"]
        verdict = "PASS" if got <= ref else "MISS"
        out.append(
            f"{verdict} {name} finite-path bytes {got / 1e6:.1f} MB <= best peer's "
            f"({best['name']} {ref / 1e6:.1f} MB; {got / ref:.3f}x) on {model}; static "
            f"{r['bytes_accessed'] / 1e6:.1f} MB vs {best['bytes_accessed'] / 1e6:.1f} MB"
        )
    for name in HELD:
        if name not in by:
            continue
        h = by[name]["hlo"]
        verdict = "PASS" if h["taken_copies"] == 0 else "MISS"
        out.append(
            f"{verdict} {name}: {h['taken_copies']} copy kernels ({h['taken_layout_copies']} of "
            f"them layout changes; {h['taken_copy_bytes'] / 1e6:.3f} MB written) in the branches "
            f"a finite step takes on {model}; per conditional, copy kernels per branch (the "
            f"last is a finite step's): {h['branch_copies']}"
        )
    return out


def study(
    build_variants: Callable[..., list[Any]],
    compile_variant: Callable[..., dict[str, Any]],
    models: Any,
    size: str = "many_leaves",
) -> list[dict[str, Any]]:
    """Compiles ``LEAVES_VARIANTS`` on ``models.SIZES[size]`` (no run), one row each."""
    model, params, batch = models.build(size)

    def loss(p: Any, b: Any) -> jax.Array:
        return models.loss_fn(model, p, b)

    rows = []
    for v in build_variants(loss, LEAVES_VARIANTS):
        e = compile_variant(v, params, batch)
        rows.append(
            {
                "name": v.name,
                "bytes_accessed": e["bytes_accessed"],
                "finite_path_bytes": e["finite_path_bytes"],
                "temp_bytes": e["temp_bytes"],
                "kernels": sum(e["hlo"]["finite_step_kernels"].values()),
                "hlo": {
                    k: e["hlo"][k]
                    for k in ("taken_copies", "taken_copy_bytes", "taken_layout_copies")
                }
                | {"branch_copies": e["hlo"]["branch_copies"]},
            }
        )
    return rows


def format_study(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of the many-leaves study (ratios to ``plain``)."""
    plain = rows[0]
    head = (
        f"{'variant':<24}{'bytes MB':>10}{'finite MB':>10}{'finite x':>9}{'temp MB':>9}"
        f"{'temp x':>8}{'kernels':>8}{'copies':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<24}{r['bytes_accessed'] / 1e6:>10.2f}"
            f"{r['finite_path_bytes'] / 1e6:>10.2f}"
            f"{r['finite_path_bytes'] / plain['finite_path_bytes']:>9.3f}"
            f"{r['temp_bytes'] / 1e6:>9.3f}{r['temp_bytes'] / plain['temp_bytes']:>8.3f}"
            f"{r['kernels']:>8}{r['hlo']['taken_copies']:>7}"
        )
    return "\n".join(lines)
