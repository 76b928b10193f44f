"""What ``jaxamp.fp8_select(other_batches=...)`` measures on the batches: the gradient's
sampling noise, and FP8's error split into the part common to every batch and the part
that changes from batch to batch (``_fp8_select``'s docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def noise_of(
    ref: np.ndarray, args: tuple[Any, ...], others: Sequence[tuple[Any, ...]],
    at: Callable[[tuple[Any, ...]], np.ndarray],
    wrt: Callable[[tuple[Any, ...]], list[Any]],
) -> tuple[float, list[np.ndarray]]:  # fmt: skip
    """The sampling noise of one batch's gradient relative to `ref`'s norm, from the
    bfloat16 gradients at `others` (returned too): ``sqrt(mean ||ref - g_k||**2 / 2) /
    ||ref||``."""

    def spec(a: tuple[Any, ...]) -> Any:
        # Arrays by shape; anything else (a Python scalar, an equinox model's function)
        # is the calibration's on every batch (compiled in), so it must be the same.
        leaves = jax.tree.leaves(a)
        return jax.tree.structure(a), [getattr(x, "shape", _Static(x)) for x in leaves]

    sq, grads = [], []
    for k, other in enumerate(others):
        if spec(other) != spec(args):
            raise ValueError(
                f"jaxamp.fp8_select: other_batches[{k}] is not shaped like the calibration "
                "arguments; give each other batch as the same arguments of fun, with the "
                "same structure and shapes and the same values where they are not arrays: "
                "other_batches=[(params, batch_2)]"
            )
        # Another batch at other parameters differs by more than its examples: read as
        # sampling noise, the parameters' difference would let FP8 error in.
        theirs, ours = wrt(other), wrt(args)
        pairs = zip(theirs, ours, strict=False)
        if len(theirs) != len(ours) or not all(p is q or np.array_equal(p, q) for p, q in pairs):
            raise ValueError(
                f"jaxamp.fp8_select: other_batches[{k}] differs from the calibration "
                "arguments in what the gradient is of (argnums), not only in the batch; give "
                "each other batch at the same parameters: other_batches=[(params, batch_2)]"
            )
        grads.append(at(other))
        sq.append(float(np.sum((ref - grads[-1]) ** 2)))
    noise = math.sqrt(sum(sq) / len(sq) / 2) / float(np.linalg.norm(ref)) if sq else 0.0
    return noise, grads


def split(ds: list[np.ndarray]) -> tuple[float, float]:
    """``(||c||, ||v||)``: FP8's errors `ds` on independent batches (the calibration's
    first) as the part common to them, ``||c||**2 = mean_{i<j} d_i . d_j`` (0 where the
    estimate is negative), and the part that changes, ``||v||**2 = mean ||d_i||**2 -
    ||c||**2``: the one the calibration batch's error has besides the common part."""
    pairs = [ds[i] @ ds[j] for i in range(len(ds)) for j in range(i + 1, len(ds))]
    c2 = max(float(np.mean(pairs)), 0.0)
    v2 = max(float(np.mean([d @ d for d in ds])) - c2, 0.0)
    return math.sqrt(c2), math.sqrt(v2)


def mean_norm(gs: list[np.ndarray]) -> float:
    """The norm of the mean of the gradients `gs` on independent batches, without their
    own noise: ``sqrt(mean_{i<j} g_i . g_j)`` (0 where that is negative: no mean
    direction shows through the noise)."""
    pairs = [gs[i] @ gs[j] for i in range(len(gs)) for j in range(i + 1, len(gs))]
    return math.sqrt(max(float(np.mean(pairs)), 0.0)) if pairs else 0.0


class _Static:
    """A leaf that is not an array, compared by identity or ``==``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        if self.value is other.value:
            return True
        try:
            return bool(self.value == other.value)
        except Exception:  # an __eq__ that returns arrays, or raises
            return False

    __hash__ = None  # type: ignore[assignment]
