"""``Fp8Selection``: what ``jaxamp.fp8_select`` measured and chose, as data a user can
read, edit, pass back to ``jaxamp.fp8(select=...)`` and checkpoint."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SIGNAL", "Fp8Selection"]

#: What ``Fp8Selection.signal`` names: the measure its errors are in.
SIGNAL = "relative gradient error vs bfloat16 autocast: ||g_fp8 - g_bf16|| / ||g_bf16||"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Fp8Selection(Mapping[str, bool]):
    """What ``jaxamp.fp8_select`` measured and chose; as a mapping, layer -> bool.

    Pass it back as ``jaxamp.fp8(select=selection)`` (``audit`` then gives each
    decision's measured reason), or ``dict(selection)`` edited, or read back
    from JSON / a checkpoint (``to_dict`` / ``from_dict``).

    Attributes:
      modules: layer -> True (its products run FP8) or False (kept in the
        autocast dtype). A layer is its module path as ``jaxamp.audit`` prints
        it (``Block_0/Dense_1``), or, where the products of one module path read
        different weights (equinox scopes its layers by class) or there is no
        path (an nnx module merged inside the function, a plain function), the
        path of the weight its product reads in the function's arguments
        (``mlp/0/layers/1/weight``, ``attn/query/kernel``); audit's per-op
        rows give each product's layer (``OpRow.layer``).
      reasons: layer -> the measured reason of its decision.
      alone: layer -> the error with only its products in FP8.
      error: the error with every kept module in FP8 (0.0 when none is kept).
      budget: the budget it was selected with.
      scaling: the FP8 scaling it was measured with.
      signal: what the errors measure (``SIGNAL``).
      noise: the gradient's sampling noise measured with ``other_batches``, in
        the units of the errors (0.0 without them).
      common: with ``other_batches``, the estimate of the part of the kept set's
        error common to every batch, relative to the mean gradient (a bound one
        standard error above it is held to `budget`, each reason gives it; the
        part that changes from batch to batch is held to `threshold`); 0.0
        without them, or where their gradients show no mean direction.
    """

    modules: dict[str, bool]
    reasons: dict[str, str]
    alone: dict[str, float]
    error: float
    budget: float
    scaling: str
    signal: str = SIGNAL
    noise: float = 0.0
    common: float = 0.0

    @property
    def threshold(self) -> float:
        """The largest error of a kept set that changes from batch to batch: `budget`
        beside `noise` (the budget without other batches; ``fp8_select``)."""
        return _threshold(self.budget, self.noise)

    def __getitem__(self, path: str) -> bool:
        return self.modules[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def kept(self) -> float:
        """The share of candidate layers kept in FP8 (1.0 when there is none)."""
        return sum(self.modules.values()) / len(self.modules) if self.modules else 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, bool, float): ``json.dumps`` it, or save it in a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fp8Selection:
        """The selection ``to_dict`` wrote (e.g. ``json.loads`` of it)."""
        try:
            return cls(
                modules={str(k): bool(v) for k, v in data["modules"].items()},
                reasons={str(k): str(v) for k, v in data["reasons"].items()},
                alone={str(k): float(v) for k, v in data["alone"].items()},
                error=float(data["error"]),
                budget=float(data["budget"]),
                scaling=str(data["scaling"]),
                signal=str(data.get("signal", SIGNAL)),
                noise=float(data.get("noise", 0.0)),
                common=float(data.get("common", 0.0)),
            )
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(
                "Fp8Selection.from_dict: expected what Fp8Selection.to_dict returns (keys "
                f"'modules', 'reasons', 'alone', 'error', 'budget', 'scaling'); {e!r}"
            ) from e

    def __str__(self) -> str:
        n = sum(self.modules.values())
        beside = (
            f", common {self.common:.3g}, varying within {self.threshold:.3g} beside "
            f"sampling noise {self.noise:.3g}"
        ) * (self.noise > 0)
        lines = [
            f"jaxamp.fp8_select ({self.scaling}, budget {self.budget:g}{beside}): {n} of "
            f"{len(self.modules)} layers in FP8, error {self.error:.4g} ({self.signal})"
        ]
        for path in self.modules:
            on = "FP8 " if self.modules[path] else "bf16"
            lines.append(f"  {on}  {path or '(no module, no weight)'}: {self.reasons[path]}")
        return "\n".join(lines)


def _threshold(budget: float, noise: float) -> float:
    """The error e at which ``sqrt(noise**2 + e**2) - noise`` reaches `budget`."""
    return math.sqrt(budget**2 + 2 * budget * noise)
