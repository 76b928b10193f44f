"""``AuditReport.health_table``: ``jaxamp.fp8_health``'s figures beside the products
``jaxamp.audit`` lists.

audit compiles a function and never runs it (its arguments may be shapes
only), so it cannot measure a cast; ``fp8_health`` measures them in the train
step. The table joins the two by layer (its module path from the per-op rows):
per FP8 product and cast, the amax and the fractions that saturate and flush,
with the kernel XLA runs the product's forward on, and a flag where a cast
loses values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxamp.casting._fp8._fp8_health import UNNAMED, pool

#: The fraction of a cast flushed to zero from which the table flags it: one
#: element in a thousand, a share of the gradient or activation that FP8 drops.
FLUSH_FLAG = 1e-3


def flags(stats: Mapping[str, float]) -> list[str]:
    """What one cast's statistics say is wrong, in words."""
    out = []
    if stats["saturated"] > 0:
        out.append(f"{stats['saturated']:.3%} inf/NaN: the product is NaN")
    if stats["flushed"] >= FLUSH_FLAG:
        out.append(f"{stats['flushed']:.3%} flushed to zero")
    return out


def table(
    matmuls: tuple[Any, ...], ops: tuple[Any, ...],
    health: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> list[tuple[str, ...]]:  # fmt: skip
    """Rows ``(layer, cast, amax, saturated, flushed, kernel, flags)`` of `health`
    (``fp8_health``'s dict, its arrays read here, on the host, pooled where they
    are mapped: ``_pooled``), each with the
    kernel of `matmuls`' forward product of the layer's module path (`ops`, the
    per-op rows, say which module a layer is in)."""
    kernels: dict[str, str] = {}
    for r in matmuls:
        if r.pass_ == "forward" and r.requested.startswith("f8"):
            kernels.setdefault(r.module or UNNAMED, r.kernel)
    module_of = {
        r.layer: r.module or UNNAMED for r in ops if r.layer and r.dtype == "float8_e4m3fn"
    }
    rows = []
    for name, casts in health.items():
        layer = name.partition("#")[0]
        module = module_of.get(layer, layer)
        for cast, stats in casts.items():
            s = {k: _pooled(k, v) for k, v in stats.items()}
            rows.append((
                name, cast, f"{s['amax']:.4g}", f"{s['saturated']:.3%}", f"{s['flushed']:.3%}",
                kernels.get(module, "?"), "; ".join(flags(s)),
            ))  # fmt: skip
    return rows


def _pooled(stat: str, value: Any) -> float:
    """One figure of a cast, pooled over the axes a ``vmap`` or a ``shard_map`` put
    on it (one per example or device), as ``fp8_health`` pools a scan's iterations."""
    return float(pool(stat, np.asarray(value, np.float64)))
