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
        # Arrays by shape and dtype (another dtype is another program, compiled again,
        # and its rounding no sampling noise); anything else (a Python scalar, an
        # equinox model's function) is the calibration's on every batch (compiled in),
        # so it must be the same.
        leaves = jax.tree.leaves(a)
        return jax.tree.structure(a), [
            (x.shape, np.dtype(x.dtype)) if hasattr(x, "shape") else _Static(x) for x in leaves
        ]

    sq, grads = [], []
    for k, other in enumerate(others):
        if spec(other) != spec(args):
            raise ValueError(
                f"jaxamp.fp8_select: other_batches[{k}] is not shaped like the calibration "
                "arguments; give each other batch as the same arguments of fun, with the "
                "same structure, shapes and dtypes and the same values where they are not "
                "arrays: "
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
        # A batch given twice is not an independent batch: it would read as no noise
        # between the two and as FP8 error common to them, each estimate off. Equal
        # arrays are caught before the gradient runs (where reductions are not bitwise
        # deterministic too); the same examples in another order (a loader's next
        # epoch) by a mean loss's gradient, equal bit for bit.
        _once(k, [j for j, o in enumerate([args, *others[:k]]) if _same_arrays(o, other)])
        grads.append(at(other))
        _once(k, [j for j, g in enumerate([ref, *grads[:-1]]) if np.array_equal(g, grads[-1])])
        sq.append(float(np.sum((ref - grads[-1]) ** 2)))
    noise = math.sqrt(sum(sq) / len(sq) / 2) / float(np.linalg.norm(ref)) if sq else 0.0
    return noise, grads


def _once(k: int, same: list[int]) -> None:
    """Refuses ``other_batches[k]`` where it repeats the batches `same` names (0: the
    calibration batch, j: ``other_batches[j - 1]``)."""
    if same:
        was = "the calibration batch" if same[0] == 0 else f"other_batches[{same[0] - 1}]"
        raise ValueError(
            f"jaxamp.fp8_select: other_batches[{k}] is {was} again (every array, or the "
            "bfloat16 gradient, equal: the same examples, perhaps in another order): no "
            "sampling noise between them; give each other batch other examples of the "
            "training data: other_batches=[(params, batch_2), (params, batch_3)]"
        )


def split(ds: list[np.ndarray]) -> tuple[float, float]:
    """``(||c||, ||v||)``: FP8's errors `ds` on independent batches (the calibration's
    first) as the part common to them, ``||c||**2 = mean_{i<j} d_i . d_j`` (``pair_means``;
    0 where the estimate is negative), and the part that changes, ``||v||**2 = mean
    ||d_i||**2 - ||c||**2``: the one the calibration batch's error has besides it."""
    c2 = max(pair_means(ds)[0], 0.0)
    v2 = max(float(np.mean([d @ d for d in ds])) - c2, 0.0)
    return math.sqrt(c2), math.sqrt(v2)


def pair_means(vs: list[np.ndarray]) -> tuple[float, np.ndarray]:
    """``mean_{i<j} v_i . v_j`` over the independent batches' `vs`, and the same with each
    batch left out in turn (the jackknife's samples; none under 3 batches), signed: a
    negative one is the noise of the estimate, which a clamp at 0 would hide."""
    n = len(vs)
    gram = np.array([[a @ b for b in vs] for a in vs])
    off = gram - np.diag(np.diag(gram))
    total = off.sum() / 2
    loo = (total - off.sum(1)) / ((n - 1) * (n - 2) / 2) if n >= 3 else np.zeros(0)
    return float(total / (n * (n - 1) / 2)), loo


def common_bound(ds: list[np.ndarray], mean: tuple[float, np.ndarray]) -> tuple[float, float]:
    """``(estimate, bound)`` of ``||c|| / ||mu||``: FP8's error common to the batches
    (errors `ds`) against the mean gradient (`mean`: ``pair_means`` of the bfloat16
    gradients, every one positive), the bound one jackknife standard error above the
    estimate of the squared ratio. Both are ratios of noisy sums over the parameters:
    on the tests' student toy, with the calibration batch and one or two others, the
    estimate alone let in a layer whose common error is 2.5 times the budget in 26 % /
    18 % of draws of the batches (the bound with two others: under 1 %)."""
    (c2, c_loo), (m2, m_loo) = pair_means(ds), mean
    ratio, loo = c2 / m2, c_loo / m_loo
    n = len(ds)
    se = math.sqrt((n - 1) / n * float(np.sum((loo - loo.mean()) ** 2)))
    return math.sqrt(max(ratio, 0.0)), math.sqrt(max(ratio + se, 0.0))


def _same_arrays(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether every array leaf of `a` equals `b`'s (their structures already match)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(x is y or np.array_equal(x, y) for x, y in pairs if hasattr(x, "shape"))


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
