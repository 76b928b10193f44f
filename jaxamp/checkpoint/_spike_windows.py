"""Restoring a spike history ([`jaxamp.types.SpikeState`][jaxamp.types.SpikeState]) saved with
another window.

A [`jaxamp.spike_rule`][jaxamp.spike_rule]'s window shapes its state (two rings of ``window``
values), so a checkpoint written with ``window=8`` does not fit an optimizer built
with ``window=16``, and orbax refuses it with a shape error about padding. The
history is configuration the user may change on resume, like ``growth_interval``:
[`jaxamp.checkpoint.restore`][jaxamp.checkpoint.restore] restores the saved rings as they are and
moves their newest values into rings of the target's window (:func:`resize`). When that cannot
be done, the error names the spike history and both windows.

Spike states are found by their fields, as a [`SpikeState`][jaxamp.types.SpikeState] or as a
mapping of
its fields (``nnx.state`` of an optimizer), so both forms are handled alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.tree import path_key, render_path
from jaxamp._utils.variables import held_value
from jaxamp.skip import SpikeState

_FIELDS = ("losses", "grad_norms", "count", "skips", "skipped")
_RINGS = ("losses", "grad_norms")


class Mismatch(NamedTuple):
    """One spike history whose saved window differs from the target's."""

    path: tuple[Any, ...]
    saved: int
    wanted: int
    saved_shape: tuple[int, ...]


def _is_spike_node(node: Any) -> bool:
    if isinstance(node, SpikeState):
        return True
    return isinstance(node, Mapping) and all(f in node for f in _FIELDS)


def _field(node: Any, name: str) -> Any:
    return getattr(node, name) if isinstance(node, SpikeState) else node[name]


def _shape(x: Any) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(int(d) for d in shape)


def has_spikes(target: Any) -> bool:
    """Whether ``target`` holds a spike history."""
    nodes = jax.tree.leaves(target, is_leaf=_is_spike_node)
    return any(_is_spike_node(n) for n in nodes)


def mismatches(saved_tree: Any, target: Any, child: Callable[[Any, Any], Any]) -> list[Mismatch]:
    """The spike histories of ``target`` that ``saved_tree`` (orbax metadata) holds
    with another window; ``child`` walks one path entry of the saved tree."""
    found = []
    flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_spike_node)[0]
    for path, node in flat:
        if not _is_spike_node(node):
            continue
        leaves = jax.tree.leaves(_field(node, "losses"))
        wanted = _shape(leaves[0]) if len(leaves) == 1 else None
        saved = saved_tree
        for entry in (*path, jax.tree_util.GetAttrKey("losses")):
            saved = child(saved, entry)
        saved_shape = _shape(held_value(saved))  # through an nnx Variable's saved form
        if wanted and saved_shape and saved_shape[-1] != wanted[-1]:
            found.append(Mismatch(tuple(path), saved_shape[-1], wanted[-1], saved_shape))
    return found


def _under(path: tuple[Any, ...], prefix: tuple[Any, ...], names: tuple[str, ...]) -> bool:
    n = len(prefix)
    return (
        len(path) > n
        and [path_key(e) for e in path[:n]] == [path_key(e) for e in prefix]
        and path_key(path[n]) in names
    )


def saved_shapes_target(target: Any, found: list[Mismatch]) -> Any:
    """``target`` with each mismatched ring shaped as saved (abstract leaves)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, leaf in flat:
        hit = next((m for m in found if _under(path, m.path, _RINGS)), None)
        if hit is not None:
            sharding = getattr(leaf, "sharding", None)
            leaf = jax.ShapeDtypeStruct(hit.saved_shape, leaf.dtype, sharding=sharding)
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def into_target_windows(restored: Any, target: Any, found: list[Mismatch]) -> Any:
    """``restored`` (rings as saved) with each mismatched history moved into the
    target's window, placed like the target's leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(restored)
    targets = jax.tree.leaves(target)
    leaves = [leaf for _, leaf in flat]
    for m in found:
        at = {
            path_key(path[len(m.path)]): i
            for i, (path, _) in enumerate(flat)
            if _under(path, m.path, ("losses", "grad_norms", "count"))
        }
        losses, norms, count = resize(
            leaves[at["losses"]], leaves[at["grad_norms"]], leaves[at["count"]], m.wanted
        )
        for name, value in (("losses", losses), ("grad_norms", norms), ("count", count)):
            i = at[name]
            sharding = getattr(targets[i], "sharding", None)
            value = value.astype(np.dtype(leaves[i].dtype))
            leaves[i] = value if sharding is None else jax.device_put(value, sharding)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def restore_other_windows(
    read_saved_tree: Callable[[], Any],
    run: Callable[[Any], Any],
    target: Any,
    child: Callable[[Any, Any], Any],
) -> Any:
    """After orbax refused ``target``: the restore with the saved windows, resized, or
    None when the spike windows are not what failed (or this restore fails too)."""
    try:
        tree = read_saved_tree()
        found = [] if tree is None else mismatches(tree, target, child)
    except Exception:
        return None
    if not found:
        return None
    try:
        restored = run(saved_shapes_target(target, found))
    except Exception:
        return None
    return into_target_windows(restored, target, found)


def _explain_on_off(saved_tree: Any, target: Any, child: Callable[[Any, Any], Any], where: str):
    """Raises a ``ValueError`` for a spike rule on one side only (saved or target)."""
    # A jaxamp guard's state (skip_nonfinite's, multi_transform's): a loss scale and a
    # spike history beside it.
    is_guard = lambda x: hasattr(x, "_fields") and {"loss_scale", "spikes"} <= set(x._fields)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_guard)[0]:
        if not is_guard(node):
            continue
        saved = saved_tree
        for entry in (*path, jax.tree_util.GetAttrKey("spikes")):
            saved = child(saved, entry)
        had = _is_spike_node(saved)
        at = render_path((*path, jax.tree_util.GetAttrKey("spikes")))
        if had and node.spikes is None:
            losses = jax.tree.leaves(_field(saved, "losses"))
            window = _shape(losses[0])[-1] if losses and _shape(losses[0]) else "..."
            raise ValueError(
                f"{where} was saved with a spike rule (`{at}`, window={window}) and the "
                "optimizer was built without one: build it with "
                f"spikes=jaxamp.spike_rule(window={window}, ...) to resume as saved."
            )
        if not had and node.spikes is not None:
            raise ValueError(
                f"{where} was saved without a spike rule and the optimizer was built with "
                f"one (`{at}`): restore into the optimizer as saved (no spikes=), then "
                "give the restored guard state (skip_nonfinite's or multi_transform's; "
                "in a TrainState, inside its opt_state) a fresh history: "
                "guard._replace(spikes=new_tx.init(params).spikes)."
            )


def explain(saved_tree: Any, target: Any, child: Callable[[Any, Any], Any], where: str) -> None:
    """Raises a ``ValueError`` naming each spike history saved with another window, or a
    spike rule on one side only."""
    _explain_on_off(saved_tree, target, child, where)
    found = mismatches(saved_tree, target, child)
    if not found:
        return
    parts = [
        f"{where} holds the spike history at `{render_path(m.path)}` with window={m.saved}, "
        f"and the optimizer was built with jaxamp.spike_rule(window={m.wanted})"
        for m in found
    ]
    raise ValueError(
        "; ".join(parts) + ". jaxamp.checkpoint.restore moves a history into another window "
        "(keeping its newest values), but that restore failed too; build the optimizer with "
        f"jaxamp.spike_rule(window={found[0].saved}, ...) to resume as saved."
    )


def resize(losses: Any, grad_norms: Any, count: Any, window: int) -> tuple[Any, Any, Any]:
    """A saved history moved into a ring of ``window`` slots: the newest values kept.

    Restoring a run into a rule of another window keeps the newest
    ``min(recorded, window)`` values, in order, oldest first, with ``count`` set to
    how many were kept: the ring a run of that window holds after recording them,
    up to a rotation that no decision depends on (the mean and deviation read the
    values as a set, and the next value overwrites the oldest either way). A smaller
    window thus continues exactly as a run built with it would have; a larger one
    starts with the saved values and fills up over the next steps. Leading axes (a
    replicated state) are kept. Works on host or device arrays, returns jax arrays.
    """
    losses, grad_norms = jnp.asarray(losses), jnp.asarray(grad_norms)
    count = jnp.asarray(count, jnp.int32)
    old = losses.shape[-1]
    kept = jnp.minimum(jnp.minimum(count, old), window)[..., None]
    j = jnp.arange(window)
    # Slot j of the new ring holds the value recorded `kept - j` steps ago, which the
    # old ring keeps at slot (count - kept + j) mod old (its slot is the index mod old).
    src = jnp.mod(count[..., None] - kept + j, old)
    src = jnp.where(j < kept, src, 0)

    def move(ring: jax.Array) -> jax.Array:
        return jnp.where(j < kept, jnp.take_along_axis(ring, src, axis=-1), 0.0)

    return move(losses), move(grad_norms), kept[..., 0].astype(jnp.int32)
