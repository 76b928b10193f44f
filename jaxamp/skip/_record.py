"""Which gradient leaves were non-finite: a per-leaf record kept in the optimizer state.

One int32 vector with an entry per leaf of the params (in ``jax.tree.leaves``
order): on how many non-finite steps the leaf held an inf or NaN, negative if it
did on the last one. Each leaf's flag comes from the finite check itself, which
reduces every leaf on its own, every step, so no leaf is read again for the record
(with ``jaxamp.step(..., finite=)``, where nothing is checked here, a skip branch
reads them). The guarded step (``_guard``) updates the record after its conds,
elementwise on that one vector, in place: one small fusion a step, and ``4 *
n_leaves`` bytes of state. It is kept out of the conds, since a branch that hands a
buffer through unchanged makes XLA copy it, there and again into the donated
output. [`jaxamp.explain`][jaxamp.explain] turns the record into words on the host.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.tree import render_path, saturating_inc
from jaxamp._utils.variables import is_variable

__all__ = ["NonfiniteLeaves"]


def leaf_layout(tree: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(key path, shape)`` of each leaf of ``tree``, in ``jax.tree.leaves`` order.

    An nnx ``Variable`` is named by where it sits (``up.kernel``), not by its own
    attribute (``up.kernel.value``): the name a user reads in the model, and the one
    an nnx optimizer's pure state gives.
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
        inner = [((), leaf)]
        if is_variable(leaf):
            # Drop the Variable's own key (its value attribute) from each inner path.
            inner = [(p[1:], x) for p, x in jax.tree_util.tree_flatten_with_path(leaf)[0]]
        for sub, x in inner:
            shape = x.shape if hasattr(x, "shape") else np.shape(x)
            out.append((render_path((*path, *sub)), tuple(shape)))
    return tuple(out)


class Layout:
    """The key paths and shapes of the params a record was built for (static).

    Kept in the record's tree structure, not in its leaves: a checkpoint stores
    nothing of it, and a restored record takes it from the restore target, as a
    [`jaxamp.LossScaleState`][jaxamp.LossScaleState] takes its mode. Compared and hashed by a
    digest, so a large model's layout costs a jit cache lookup one small hash.
    """

    __slots__ = ("_digest", "entries")

    def __init__(self, entries: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        self.entries = entries
        self._digest = hashlib.blake2b(repr(entries).encode(), digest_size=8).digest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other._digest == self._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:  # short: it shows in every printed tree structure
        return f"Layout({len(self.entries)} leaves, {self._digest.hex()})"


class NonfiniteLeaves(NamedTuple):
    """Which gradient leaves held inf or NaN, one entry per leaf of the params.

    Entries follow ``jax.tree.leaves(params)``; [`jaxamp.explain`][jaxamp.explain] names them
    by key path, and refuses params of another layout than ``tx.init`` saw. One
    int32 vector: a leaf's magnitude is on how many non-finite steps it was
    non-finite so far (saturating at ``2**31 - 1``), and its sign is negative if it was
    non-finite on the last one. (A leaf non-finite on the last
    step has been counted, so the two facts fit one number; one small array is one
    buffer a step carries, and no state says "last" with a count of zero.)

    Attributes:
      signed_counts: int32[n_leaves], as above.
      layout: the key paths and shapes of the params given to ``tx.init`` (``None``
        for a record built by hand). Static: part of the tree structure, not a
        leaf, so checkpoints hold only ``signed_counts`` and a restored record
        takes its layout from the restore target.
      last: bool[n_leaves] (derived), the leaves that were non-finite on the last
        skipped non-finite step (all False before the first).
      count: int32[n_leaves] (derived), on how many non-finite steps each leaf was
        non-finite so far.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf, 0.0])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> state.nonfinite_leaves.last, state.nonfinite_leaves.count
      (Array([False,  True], dtype=bool), Array([0, 1], dtype=int32))
    """

    signed_counts: jax.Array
    layout: Layout | None = None

    @property
    def last(self) -> jax.Array:
        return self.signed_counts < 0

    @property
    def count(self) -> jax.Array:  # type: ignore[override]  # tuple.count: not used on a record
        return abs(self.signed_counts)


# The layout is aux data, the counts the only child, keyed as the NamedTuple's own
# flattening keys it: checkpoints and paths are those of a record without a layout.
jax.tree_util.register_pytree_with_keys(
    NonfiniteLeaves,
    lambda r: (((jax.tree_util.GetAttrKey("signed_counts"), r.signed_counts),), r.layout),
    lambda layout, children: NonfiniteLeaves(children[0], layout),
    flatten_func=lambda r: ((r.signed_counts,), r.layout),
)


def init(tree: Any) -> NonfiniteLeaves:
    """No leaf non-finite yet: one entry per leaf of ``tree``, and its layout."""
    layout = Layout(leaf_layout(tree))
    return NonfiniteLeaves(jnp.zeros((len(layout),), jnp.int32), layout)


def check_length(stats: NonfiniteLeaves, n_leaves: int) -> None:
    """Trace time: the record must have one entry per gradient leaf."""
    if stats.signed_counts.shape != (n_leaves,):
        raise ValueError(
            f"the optimizer state tracks {stats.signed_counts.shape[-1]} gradient leaves but the "
            f"gradients have {n_leaves}: pass the opt_state that tx.init(params) "
            "returned for these params."
        )


def after_step(stats: NonfiniteLeaves, ok: jax.Array, every: jax.Array) -> NonfiniteLeaves:
    """The record after a step, from ``ok`` (bool[n_leaves]: which leaves were finite,
    agreed over the devices) and ``every`` (bool[]: every part's gradients finite).

    A step on which every part was finite (taken, or skipped only for a spike)
    leaves the record as it was. Otherwise each leaf's sign says whether it was
    non-finite on this step, and its count grows by one if it was. Elementwise on
    one small vector: one fusion, written in place into the donated record.
    """
    bad = ~ok
    count = saturating_inc(stats.count, bad.astype(jnp.int32))
    return stats._replace(
        signed_counts=jnp.where(every, stats.signed_counts, jnp.where(bad, -count, count))
    )
