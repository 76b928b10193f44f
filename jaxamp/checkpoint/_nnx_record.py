"""A 0.3 ``jaxamp.nnx.Optimizer`` checkpoint whose record holds copies of frozen Params.

The nnx optimizer keeps, in its ``kept`` record, the model state a forward can
write, to put it back on a skipped step. 0.3 recorded every Variable outside
``wrt``, so an optimizer with ``wrt=nnx.LoRAParam`` (or any ``wrt`` that leaves
Params out) saved a copy of the frozen base model in its checkpoint. Since 0.4 a
forward's writes are all it records (Params outside ``wrt`` are read, never
written), so orbax refuses such a checkpoint for the missing leaves and offers a
partial restore. The copies are the frozen Params themselves, which the model's
own checkpoint holds, so they are safe to drop:
[`jaxamp.checkpoint.restore`][jaxamp.checkpoint.restore] restores everything else
and leaves them on the host, unused.

Nothing else is dropped: only when every leaf the checkpoint holds beyond the
target is under a ``kept`` record, and the target needs no leaf the checkpoint
lacks, is the old record read this way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxamp._utils.tree import path_key

_RECORD = "kept"


def _is_subtree(node: Any) -> bool:
    return isinstance(node, Mapping | list | tuple)


def _saved_leaves(node: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf of orbax's metadata tree (nested mappings and sequences), by its key path."""
    if isinstance(node, Mapping):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, list | tuple):
        items = [(str(i), v) for i, v in enumerate(node)]
    else:
        return {path: node}
    out: dict[tuple[str, ...], Any] = {}
    for k, v in items:
        out.update(_saved_leaves(v, path + (k,)))
    return out


def _target_paths(target: Any) -> list[tuple[str, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(target)[0]
    return [tuple(str(path_key(e)) for e in path) for path, _ in flat]


def _old_copies(saved: Any, target: Any) -> set[tuple[str, ...]] | None:
    """The saved leaves to drop, or None when the checkpoint is not a 0.3 record case."""
    if not _is_subtree(saved):
        return None
    leaves = _saved_leaves(saved)
    wanted = set(_target_paths(target))
    extra = set(leaves) - wanted
    if not extra or not wanted <= set(leaves):
        return None
    if not all(_RECORD in p[:-1] for p in extra):
        return None
    return extra


def _placeholder(meta: Any) -> np.ndarray | None:
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    if shape is None or dtype is None:
        return None
    return np.zeros(tuple(shape), np.dtype(dtype))  # restored on the host, then dropped


def _mirror(saved: Any, leaf: Callable[[tuple[str, ...]], Any], path: tuple[str, ...] = ()) -> Any:
    """A tree of the saved tree's containers, each leaf given by ``leaf(path)``."""
    if isinstance(saved, Mapping):
        return {k: _mirror(v, leaf, path + (str(k),)) for k, v in saved.items()}
    if isinstance(saved, list | tuple):
        vals = [_mirror(v, leaf, path + (str(i),)) for i, v in enumerate(saved)]
        if hasattr(saved, "_make"):
            return type(saved)._make(vals)
        return type(saved)(vals)
    return leaf(path)


def _pick(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k] if isinstance(tree, Mapping) else tree[int(k)]
    return tree


def restore_without_old_copies(
    read_tree: Callable[[], Any], run: Callable[[Any], Any], target: Any
) -> Any:
    """Restores ``target`` from a checkpoint whose nnx record also holds frozen Params.

    Args:
      read_tree: returns orbax's metadata tree of the checkpoint.
      run: orbax's restore into a target tree.
      target: the tree to restore into.

    Returns:
      The restored tree with ``target``'s structure, or None when the checkpoint
      holds nothing beyond ``target`` but under a ``kept`` record (then orbax's
      own error, or another of jaxamp's, explains the failure).
    """
    try:
        saved = read_tree()
    except Exception:
        return None
    drop = _old_copies(saved, target)
    if drop is None:
        return None
    placeholders = {p: _placeholder(_saved_leaves(saved)[p]) for p in drop}
    if any(v is None for v in placeholders.values()):
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    by_path = {tuple(str(path_key(e)) for e in path): x for path, x in flat}
    restored = run(_mirror(saved, lambda p: by_path[p] if p in by_path else placeholders[p]))
    return jax.tree_util.tree_unflatten(treedef, [_pick(restored, p) for p in by_path])
