"""Orbax checkpointing of jaxamp training states, with a clear error for what is missing.

Nothing special is needed to *save*: a :class:`jaxamp.LossScaleState` is a pytree
whose counters and numeric configuration (``growth_factor``, ``hysteresis``,
``min_scale``, ...) are all array leaves, so ``ocp.StandardCheckpointer`` and
``ocp.CheckpointManager`` with ``ocp.args.StandardSave`` write it with the rest of
the optimizer state, and a restored state continues bit for bit. Only the mode
(``dynamic``, ``enabled``, ``skip_nonfinite``) is static: it is not stored and
comes from the restore target.

:func:`restore` is orbax's restore with one check in front: it compares the
saved tree with the target and, when the target wants leaves the checkpoint
does not have (typically a checkpoint written by a plain optax optimizer being
restored into a ``jaxamp.skip_nonfinite`` state), raises a ``ValueError`` naming
the missing loss-scale state and leaves, instead of orbax's structure mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxamp._loss_scale import LossScaleState

__all__ = ["check_restorable", "restore"]

_MISSING = object()
_MAX_LISTED = 8


def _key(entry: Any) -> Any:
    """The plain str / int that one jax key-path entry stands for."""
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def _render(path: Sequence[Any]) -> str:
    """A key path as orbax names it: ``opt_state.loss_scale.scale``."""
    return ".".join(str(_key(e)) for e in path) or "<root>"


def _is_subtree(node: Any) -> bool:
    return isinstance(node, Mapping | list | tuple)


def _child(node: Any, entry: Any) -> Any:
    k = _key(entry)
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


def _saved_tree(saved: Any) -> Any:
    """The nested tree of array metadata inside whatever orbax's ``metadata`` returned."""
    saved = getattr(saved, "item_metadata", saved)  # StepMetadata -> TreeMetadata
    return getattr(saved, "tree", saved)  # TreeMetadata -> nested dict / list


def _missing(saved_tree: Any, target: Any) -> list[tuple[Any, ...]]:
    """Key paths of the target's leaves that the saved tree does not hold as leaves."""
    missing = []
    for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        node = saved_tree
        for entry in path:
            node = _child(node, entry)
            if node is _MISSING:
                break
        if node is _MISSING or node is None or _is_subtree(node):
            missing.append(tuple(path))
    return missing


def check_restorable(saved: Any, target: Any, *, where: str = "the checkpoint") -> None:
    """Raises a clear error if ``saved`` lacks leaves that ``target`` needs.

    Compares structure only (orbax itself checks shapes and dtypes on restore).
    Above all it catches a checkpoint written without a loss-scale state (a plain
    optax optimizer) being restored into a :func:`jaxamp.skip_nonfinite` state.

    Args:
      saved: what orbax's ``metadata`` returns for the checkpoint
        (``StandardCheckpointer().metadata(path)``,
        ``CheckpointManager.item_metadata(step)``), or its ``.tree``.
      target: the tree to restore into: real arrays or ``jax.ShapeDtypeStruct``
        leaves (an abstract target), with any jaxamp state inside.
      where: how to name the checkpoint in the error message.

    Raises:
      ValueError: naming the missing loss-scale state (its path and fields) and
        the other missing leaves, with the way to migrate a plain optax checkpoint.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> saved = {"inner_state": [None, None]}  # as orbax describes a plain sgd state
      >>> jaxamp.checkpoint.check_restorable(saved, tx.init(params))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: the checkpoint has no loss-scale state at `loss_scale` ...
    """
    saved_tree = _saved_tree(saved)
    missing = _missing(saved_tree, target)
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
        names = ", ".join(sorted(_render(p[len(sp) :]) for p in fields))
        parts.append(f"{where} has no loss-scale state at `{_render(sp)}` (missing: {names})")
    others = [p for p in missing if p not in covered]
    if others:
        listed = ", ".join(f"`{_render(p)}`" for p in others[:_MAX_LISTED])
        more = f" and {len(others) - _MAX_LISTED} more" if len(others) > _MAX_LISTED else ""
        parts.append(f"{where} lacks {len(others)} leaves the target needs: {listed}{more}")
    message = "; ".join(parts) + "."
    if covered:
        message += (
            " It was probably written by an optimizer not wrapped in jaxamp.skip_nonfinite "
            "(plain optax). To resume it with jaxamp, restore the inner optimizer's state "
            "(target: jax.eval_shape(inner.init, params)) and wrap it: "
            "jaxamp.SkipNonfiniteState(inner_state, jaxamp.dynamic_scale(...))."
        )
    raise ValueError(message)


def _manager_metadata(manager: Any, step: int) -> Any:
    import orbax.checkpoint as ocp

    try:
        saved = manager.item_metadata(step)
    except Exception:  # an item whose handler is not known yet: checked after the restore
        return None
    # A multi-item manager describes several items: leave those to orbax.
    return None if isinstance(saved, ocp.args.Composite) else saved


def restore(
    checkpointer: Any,
    target: Any,
    *,
    directory: Any = None,
    step: int | None = None,
) -> Any:
    """Restores a standard (pytree) checkpoint into ``target``, checking it first.

    Works with ``ocp.StandardCheckpointer`` (or any ``ocp.Checkpointer`` with a
    ``StandardCheckpointHandler``) and a single-item ``ocp.CheckpointManager``
    saved with ``ocp.args.StandardSave``. The target may be abstract
    (``jax.ShapeDtypeStruct`` leaves, e.g. from ``jax.eval_shape``); give its
    leaves a ``sharding`` to restore sharded arrays onto a mesh, which may have a
    different number of devices than the one that saved.

    Args:
      checkpointer: an orbax checkpointer or checkpoint manager.
      target: the tree to restore into (concrete or abstract).
      directory: the checkpoint's directory; required for a checkpointer.
      step: the step to restore with a manager; ``None`` means the latest.

    Returns:
      The restored tree, with ``target``'s structure and (for abstract leaves
      with a sharding) its shardings.

    Raises:
      ValueError: if the checkpoint lacks leaves the target needs, e.g. no
        loss-scale state (see :func:`check_restorable`).
      FileNotFoundError: if a manager holds no checkpoint.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax, orbax.checkpoint as ocp, jaxamp
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
      >>> state = {"params": params, "opt_state": tx.init(params)}
      >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
      ...     _ = mngr.save(0, args=ocp.args.StandardSave(state))
      ...     mngr.wait_until_finished()
      ...     abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
      ...     restored = jaxamp.checkpoint.restore(mngr, abstract)
      >>> float(jaxamp.get_loss_scale(restored["opt_state"]).scale)
      32768.0
    """
    import orbax.checkpoint as ocp  # here, so that `import jaxamp` does not pay for orbax

    if hasattr(checkpointer, "latest_step"):  # a CheckpointManager (or one like it)
        if directory is not None:
            raise TypeError("restore: pass `step=` (not `directory=`) with a CheckpointManager.")
        if step is None:
            step = checkpointer.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint found in {checkpointer.directory}.")
        where = f"the checkpoint at step {step} in {checkpointer.directory}"
        saved = _manager_metadata(checkpointer, step)
        if saved is not None:
            check_restorable(saved, target, where=where)
        try:
            return checkpointer.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:
            # A fresh manager learns the item's handler only on its first restore.
            if saved is None and (saved := _manager_metadata(checkpointer, step)) is not None:
                try:
                    check_restorable(saved, target, where=where)
                except ValueError as clear:
                    raise clear from e
            raise
    if directory is None:
        raise TypeError("restore: a checkpointer needs `directory=` (the checkpoint's path).")
    check_restorable(checkpointer.metadata(directory), target, where=f"the checkpoint {directory}")
    if isinstance(checkpointer, ocp.StandardCheckpointer):
        return checkpointer.restore(directory, target)
    return checkpointer.restore(directory, args=ocp.args.StandardRestore(target))
