"""Which gradient leaves were non-finite: a per-leaf record kept in the optimizer state.

Two small vectors with one entry per leaf of the params (in ``jax.tree.leaves``
order): whether the leaf held an inf or NaN on the last non-finite step, and on
how many non-finite steps so far. They are computed inside the guarded step's
skip branch (``_guard``), which runs only when a step is skipped, so a finite
step pays nothing but carrying them: ``5 * n_leaves`` bytes of state. Large
leaves' flags come from the finite check itself (it reads each large leaf on its
own, every step); only the small leaves, which the check reads joined per dtype,
are read again, in the skip branch (reading the large ones there cost the optax
path 6.5 MB of temp on the bench model: XLA kept more buffers live across the
cond).
:func:`jaxamp.explain` turns them into words on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._tree import is_float_leaf, leaf_finite

__all__ = ["NonfiniteLeaves"]

_INT32_MAX = 2**31 - 1


class NonfiniteLeaves(NamedTuple):
    """Which gradient leaves held inf or NaN, one entry per leaf of the params.

    Entries follow ``jax.tree.leaves(params)``; :func:`jaxamp.explain` names them
    by key path.

    Attributes:
      last: bool[n_leaves], the leaves that were non-finite on the last skipped
        non-finite step (all False before the first).
      count: int32[n_leaves], on how many non-finite steps each leaf was
        non-finite so far (saturating at 2**31 - 1).

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf, 0.0])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> state.nonfinite_leaves.last, state.nonfinite_leaves.count
      (Array([False,  True], dtype=bool), Array([0, 1], dtype=int32))
    """

    last: jax.Array
    count: jax.Array


def init(tree: Any) -> NonfiniteLeaves:
    """No leaf non-finite yet: one entry per leaf of ``tree``."""
    n = len(jax.tree.leaves(tree))
    return NonfiniteLeaves(jnp.zeros((n,), jnp.bool_), jnp.zeros((n,), jnp.int32))


def bad_leaves(tree: Any, axis_name: Any, known: Sequence[bool] = ()) -> jax.Array:
    """bool[n_leaves]: which leaves of ``tree`` hold an inf or NaN, ORed over ``axis_name``.

    One reduction per floating leaf not ``known`` (those are False here: the finite
    check already has their flags). Run only where a step is skipped.
    """
    known = list(known) or [False] * len(jax.tree.leaves(tree))
    flags = [
        ~leaf_finite(x) if is_float_leaf(x) and not k else jnp.array(False)
        for x, k in zip(jax.tree.leaves(tree), known, strict=True)
    ]
    bad = jnp.stack(flags) if flags else jnp.zeros((0,), jnp.bool_)
    if axis_name is not None:
        bad = lax.pmax(bad.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return bad


def record(stats: NonfiniteLeaves, bad: jax.Array, finite: jax.Array) -> NonfiniteLeaves:
    """The record after a step: ``bad`` (all False on a finite step) becomes the last."""
    if stats.last.shape != bad.shape:
        raise ValueError(
            f"the optimizer state tracks {stats.last.shape[-1]} gradient leaves but the "
            f"gradients have {bad.shape[-1]}: pass the opt_state that tx.init(params) "
            "returned for these params."
        )
    count = stats.count + jnp.where(bad & (stats.count < _INT32_MAX), 1, 0).astype(jnp.int32)
    return NonfiniteLeaves(jnp.where(finite, stats.last, bad), count)
