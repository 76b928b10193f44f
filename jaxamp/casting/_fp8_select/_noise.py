"""The sampling noise ``jaxamp.fp8_select(other_batches=...)`` measures, and the part of
FP8's error it does not hide: the one common to every batch (``_fp8_select``'s docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def _noise(
    ref: np.ndarray, args: tuple[Any, ...], others: Sequence[tuple[Any, ...]],
    at: Callable[[tuple[Any, ...]], Callable[..., np.ndarray]],
    wrt: Callable[[tuple[Any, ...]], list[Any]],
) -> tuple[float, list[np.ndarray]]:  # fmt: skip
    """The sampling noise of one batch's gradient relative to `ref`'s norm, from the
    bfloat16 gradients at `others` (returned too): ``sqrt(mean ||ref - g_k||**2 / 2) /
    ||ref||``."""

    def spec(a: tuple[Any, ...]) -> Any:
        return jax.tree.structure(a), [getattr(x, "shape", None) for x in jax.tree.leaves(a)]

    sq, grads = [], []
    for k, other in enumerate(others):
        if spec(other) != spec(args):
            raise ValueError(
                f"jaxamp.fp8_select: other_batches[{k}] is not shaped like the calibration "
                "arguments; give each other batch as the same arguments of fun, with the "
                "same structure and shapes: other_batches=[(params, batch_2)]"
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
        grads.append(at(other)(None))
        sq.append(float(np.sum((ref - grads[-1]) ** 2)))
    noise = math.sqrt(sum(sq) / len(sq) / 2) / float(np.linalg.norm(ref)) if sq else 0.0
    return noise, grads


def _bias(d0: np.ndarray, g0: np.ndarray, ds: list[np.ndarray], gs: list[np.ndarray]) -> float:
    """``||b|| / ||mu||``: the FP8 error common to every batch against the mean gradient,
    from independent batches (``E[d_0 . d_k] = ||b||**2``, ``E[g_0 . g_k] = ||mu||**2``);
    inf where the mean gradient is lost in the noise."""
    b2 = max(float(np.mean([d0 @ d for d in ds])), 0.0)
    m2 = float(np.mean([g0 @ g for g in gs]))
    return math.sqrt(b2 / m2) if m2 > 0 else math.inf
