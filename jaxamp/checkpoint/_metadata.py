"""What a saved checkpoint holds, read from orbax's metadata: ``check_restorable``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from jaxamp._utils.tree import path_key, render_path
from jaxamp.loss_scale import LossScaleState

__all__ = ["check_restorable"]

_MISSING = object()
_MAX_LISTED = 8


def _is_subtree(node: Any) -> bool:
    return isinstance(node, Mapping | list | tuple)


def child(node: Any, entry: Any) -> Any:
    k = path_key(entry)
    if isinstance(node, Mapping):
        if k in node:
            return node[k]
        return node.get(str(k), _MISSING)
    if isinstance(node, list | tuple):
        if isinstance(k, str) and hasattr(node, k):  # a namedtuple kept as such
            return getattr(node, k)
        if isinstance(k, int) and 0 <= k < len(node):
            return node[k]
        return _MISSING
    return _MISSING


def saved_tree(saved: Any) -> Any:
    """The nested tree of array metadata inside whatever orbax's ``metadata`` returned."""
    saved = getattr(saved, "item_metadata", saved)  # StepMetadata -> TreeMetadata
    return getattr(saved, "tree", saved)  # TreeMetadata -> nested dict / list


def _missing(saved_tree: Any, target: Any) -> list[tuple[Any, ...]]:
    """Key paths of the target's leaves that the saved tree does not hold as leaves."""
    missing = []
    for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        node = saved_tree
        for entry in path:
            node = child(node, entry)
            if node is _MISSING:
                break
        if node is _MISSING or node is None or _is_subtree(node):
            missing.append(tuple(path))
    return missing


def check_restorable(saved: Any, target: Any, *, where: str = "the checkpoint") -> None:
    """Raises a clear error if ``saved`` lacks leaves that ``target`` needs.

    Compares structure only (orbax itself checks shapes and dtypes on restore).
    Above all it catches a checkpoint written without a loss-scale state (a plain
    optax optimizer) being restored into a [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] state.

    Args:
      saved: what orbax's ``metadata`` returns for the checkpoint
        (``StandardCheckpointer().metadata(path)``,
        ``CheckpointManager.item_metadata(step)``), or its ``.tree``.
      target: the tree to restore into: real arrays or ``jax.ShapeDtypeStruct``
        leaves (an abstract target), with any jaxamp state inside.
      where: how to name the checkpoint in the error message.

    Raises:
      ValueError: naming the missing loss-scale state (its path and fields) and
        the other missing leaves, with the way to migrate a plain optax checkpoint;
        or, when ``saved`` describes no tree (orbax could not read the metadata of
        a missing or corrupted checkpoint), saying so.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> saved = {"inner_state": [None, None]}  # as orbax describes a plain sgd state
      >>> jaxamp.checkpoint.check_restorable(saved, tx.init(params))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: the checkpoint has no loss-scale state at `loss_scale` ...
    """
    tree = saved_tree(saved)
    if tree is None:
        # orbax's `metadata` describes no tree when it could not read one.
        raise ValueError(
            f"{where} has no readable metadata (orbax describes no tree): the checkpoint is "
            "missing, incomplete or corrupted, so nothing can be checked. Restore it with orbax "
            "to see orbax's own error."
        )
    missing = _missing(tree, target)
    if not missing:
        return
    missing_set = set(missing)

    # Which LossScaleStates in the target are (partly) absent from the checkpoint.
    scale_paths = [
        tuple(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            target, is_leaf=lambda x: isinstance(x, LossScaleState)
        )[0]
        if isinstance(leaf, LossScaleState)
    ]
    parts, covered = [], set()
    for sp in scale_paths:
        fields = [p for p in missing_set if p[: len(sp)] == sp]
        if not fields:
            continue
        covered.update(fields)
        names = ", ".join(sorted(render_path(p[len(sp) :]) for p in fields))
        parts.append(f"{where} has no loss-scale state at `{render_path(sp)}` (missing: {names})")
    others = [p for p in missing if p not in covered]
    if others:
        listed = ", ".join(f"`{render_path(p)}`" for p in others[:_MAX_LISTED])
        more = f" and {len(others) - _MAX_LISTED} more" if len(others) > _MAX_LISTED else ""
        parts.append(f"{where} lacks {len(others)} leaves the target needs: {listed}{more}")
    message = "; ".join(parts) + "."
    if others and all("nonfinite_leaves" in map(str, map(path_key, p)) for p in others):
        message += (
            " It was written by jaxamp < 0.3, whose states kept no per-leaf record of "
            "non-finite gradients. Restore into the target with that record left out, "
            "target._replace(nonfinite_leaves=None) for the skip_nonfinite state, then "
            "put a fresh one in: restored._replace(nonfinite_leaves="
            "tx.init(params).nonfinite_leaves)."
        )
    if covered:
        message += (
            " It was probably written by an optimizer not wrapped in jaxamp.skip_nonfinite "
            "(plain optax). To resume it with jaxamp, restore the inner optimizer's state "
            "(target: jax.eval_shape(inner.init, params)) and put it in a fresh state: "
            "tx.init(params)._replace(inner_state=inner_state), where "
            "tx = jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale(...))."
        )
    raise ValueError(message)
