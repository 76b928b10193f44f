"""Orbax checkpointing of jaxamp training states: orbax's restore, checked on both sides.

Nothing special is needed to *save*: a [`jaxamp.LossScaleState`][jaxamp.LossScaleState] is a pytree
whose counters and numeric configuration (``growth_factor``, ``hysteresis``,
``min_scale``, ``max_scale``, ...) are all array leaves, so ``ocp.StandardCheckpointer``
and ``ocp.CheckpointManager`` with ``ocp.args.StandardSave`` write it with the rest of
the optimizer state, and a restored state continues bit for bit. Only the
[`jaxamp.Mode`][jaxamp.Mode] (``"dynamic"``, ``"static"``, ...) is static: it is not stored
and comes from the restore target.

**Restoring into another configuration.** Every number comes from the
checkpoint and only the mode from the target: restoring a
``jaxamp.compat.torch_grad_scaler(init_scale=0.25)`` checkpoint into a
``jaxamp.dynamic_scale()`` target gives a dynamic state with scale 0.25,
``min_scale=0`` and ``max_scale=inf``, exactly the saved run. The state stores
nothing derived from its numbers (whether the scale can drop below 1 is read
from the scale at run time), so nothing can go stale. To change the
configuration of a restored run, ``replace`` the restored state (validated like
the constructors), e.g. ``ls.replace(growth_interval=500)``. A spike history
saved with another window is moved into the target's (see [`restore`][jaxamp.checkpoint.restore]).

[`restore`][jaxamp.checkpoint.restore] is orbax's restore with a check on each side:

- before: nothing. Orbax restores first, so a missing or corrupted checkpoint
  (a deleted or truncated ``_METADATA``, ``manifest.ocdbt`` or ``d/*`` file)
  raises orbax's own error. Only when orbax fails *and* the checkpoint's
  metadata is readable and lacks leaves the target needs (typically a checkpoint
  written by a plain optax optimizer restored into a ``jaxamp.skip_nonfinite``
  state) does it raise a ``ValueError`` naming the missing loss-scale state.
  It reads no metadata on a successful restore (but a checkpointer's, silently,
  when the target holds a spike history), so it logs nothing that plain orbax
  does not.
- after: every [`jaxamp.LossScaleState`][jaxamp.LossScaleState] in the result is validated like
  the constructors' arguments (a hand-edited checkpoint with a negative counter,
  a zero or infinite scale or ``min_scale > max_scale`` raises a ``ValueError``
  naming the field and the checkpoint). Only those scalars are read back to the
  host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxamp import _checkpoint_every_k, _checkpoint_spikes
from jaxamp._leaf_stats import NonfiniteLeaves
from jaxamp._leaf_stats import validate as validate_leaves
from jaxamp._loss_scale import FIELD_NAMES, LossScaleState, Mode, validate
from jaxamp._spikes import SpikeState
from jaxamp._spikes import validate as validate_spikes
from jaxamp._tree import path_key, render_path

__all__ = ["check_restorable", "restore"]

_MISSING = object()
_MAX_LISTED = 8


def _is_subtree(node: Any) -> bool:
    return isinstance(node, Mapping | list | tuple)


def _child(node: Any, entry: Any) -> Any:
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
    saved_tree = _saved_tree(saved)
    if saved_tree is None:
        # orbax's `metadata` describes no tree when it could not read one.
        raise ValueError(
            f"{where} has no readable metadata (orbax describes no tree): the checkpoint is "
            "missing, incomplete or corrupted, so nothing can be checked. Restore it with orbax "
            "to see orbax's own error."
        )
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


def _explain_failure(read_metadata: Any, target: Any, where: str, error: Exception) -> None:
    """After orbax failed: the clear missing-leaves error, if that is what happened.

    Raises [`check_restorable`][jaxamp.checkpoint.check_restorable]'s ``ValueError`` (chained to
    orbax's error) only when the checkpoint's metadata can be read and lacks leaves the target
    needs. A missing or corrupted checkpoint has no readable metadata (orbax's ``metadata`` then
    raises, or describes no tree), and returns here, so that orbax's own error comes through
    unchanged.
    """
    try:
        saved = read_metadata()
        tree = None if saved is None else _saved_tree(saved)
    except Exception:
        return
    if tree is None or (isinstance(tree, Mapping) and not isinstance(tree, dict)):
        return  # nothing readable, or a multi-item manager's Composite: orbax's error stands
    try:
        _checkpoint_every_k.explain(tree, target, where)
        check_restorable(tree, target, where=where)
        _checkpoint_spikes.explain(tree, target, _child, where)
    except ValueError as clear:
        raise clear from error


def _explain_manager_failure(manager: Any, step: int, target: Any, where: str, error: Exception):
    """After a manager's restore failed: a missing step or item by name, else as above."""
    steps = list(manager.all_steps())
    if step not in steps:
        raise FileNotFoundError(
            f"no checkpoint at step {step} in {manager.directory} (steps there: {steps})."
        ) from error
    try:
        saved = manager.item_metadata(step)
    except Exception:
        return
    if isinstance(saved, Mapping) and not len(saved):  # a Composite of no items
        raise ValueError(
            f"{where} holds no readable item: its directory is incomplete or corrupted "
            f"(orbax: {type(error).__name__}: {error})"
        ) from error
    _explain_failure(lambda: saved, target, where, error)


def _host_view(x: Any) -> Any:
    """A leaf as this process can read it: a replicated or local part, never a gather."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


def _is_loss_scale(node: Any) -> bool:
    """A LossScaleState, or one flattened into a mapping of its fields (``nnx.state``)."""
    if isinstance(node, LossScaleState):
        return True
    return isinstance(node, Mapping) and all(f in node for f in FIELD_NAMES)


def _from_fields(node: Mapping[str, Any]) -> LossScaleState:
    # nnx keeps the static mode in the graph, not in the state: the field ranges
    # are checked under the scaling mode that has no mode-specific rule.
    values = {f: jax.tree.leaves(node[f])[0] for f in FIELD_NAMES}  # unwrap nnx Variables
    return LossScaleState(**values, mode=Mode.STATIC)


def _is_record(node: Any) -> bool:
    """A per-leaf record, or one flattened into a mapping of its field (``nnx.state``)."""
    if isinstance(node, NonfiniteLeaves):
        return True
    # Its one leaf: the layout is static (tree structure), so nnx's mapping lacks it.
    return isinstance(node, Mapping) and set(node) == {"signed_counts"}


def _validate_restored(tree: Any, where: str) -> None:
    """Checks every loss-scale state, spike state and per-leaf record in a restored tree."""
    found = [
        (path, leaf if isinstance(leaf, LossScaleState) else _from_fields(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_loss_scale)[0]
        if _is_loss_scale(leaf)
    ]
    for path, node in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, SpikeState) or _is_record(x)
    )[0]:
        if isinstance(node, SpikeState):
            validate_spikes(jax.tree.map(_host_view, node), f"{where} at `{render_path(path)}`")
        elif _is_record(node):
            # nnx wraps the field in a Variable: take the array out.
            counts = jax.tree.leaves(node[0] if isinstance(node, tuple) else node["signed_counts"])
            layout = node.layout if isinstance(node, NonfiniteLeaves) else None
            record = NonfiniteLeaves(_host_view(counts[0]), layout)
            validate_leaves(record, f"{where} at `{render_path(path)}`")
    if not found:
        return
    # One transfer, of the loss-scale scalars only.
    host = jax.device_get([jax.tree.map(_host_view, state) for _, state in found])
    for (path, state), values in zip(found, host, strict=True):
        label = f"{where} at `{render_path(path)}`"
        shapes = {np.shape(x) for x in jax.tree.leaves(values)}
        # A replicated state (a leading device axis, as with pmap) is checked per replica.
        lead = shapes.pop() if len(shapes) == 1 else ()
        for index in np.ndindex(*lead):
            replica = jax.tree.map(lambda x, i=index: np.asarray(x)[i], values)
            at = f"{label} (replica {index})" if lead else label
            try:
                validate(replica, at)
            except ValueError as e:
                raise ValueError(
                    f"{e} A restore takes every number from the checkpoint and only the mode "
                    f"from the target (here {state.mode.value!r})."
                ) from None


def restore(
    checkpointer: Any,
    target: Any,
    *,
    directory: Any = None,
    step: int | None = None,
) -> Any:
    """Restores a standard (pytree) checkpoint into ``target`` and validates its loss scales.

    Works with ``ocp.StandardCheckpointer`` (or any ``ocp.Checkpointer`` with a
    ``StandardCheckpointHandler``) and a single-item ``ocp.CheckpointManager``
    saved with ``ocp.args.StandardSave``. The target may be abstract
    (``jax.ShapeDtypeStruct`` leaves, e.g. from ``jax.eval_shape``); give its
    leaves a ``sharding`` to restore sharded arrays onto a mesh, which may have a
    different number of devices than the one that saved.

    Every number of a restored [`jaxamp.LossScaleState`][jaxamp.LossScaleState] (counters *and*
    configuration: ``growth_factor``, ``min_scale``, ``max_scale``, ...) comes from
    the checkpoint; only its static ``mode`` comes from ``target``. A target built
    with another configuration therefore restores the saved run's configuration,
    not its own; nothing derived is stored, so nothing goes stale. Change a
    restored configuration with ``state.replace(...)``.

    A spike history ([`jaxamp.spike_rule`][jaxamp.spike_rule]) saved with another window than
    the target's is restored as saved and moved into the target's window: the
    newest ``min(recorded, window)`` values are kept. Into a smaller window, the
    run continues exactly as one built with that window would have; into a larger
    one, the history fills up over the next steps.

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
        loss-scale state (see [`check_restorable`][jaxamp.checkpoint.check_restorable]); if a spike
        history of another window cannot be moved into the target's (naming both windows); or if a
        restored loss-scale state is invalid (a negative counter, a scale of 0 or inf, ``min_scale >
        max_scale``, ...), naming the field and the checkpoint.
      FileNotFoundError: if a manager holds no checkpoint.
      Exception: orbax's own error, unchanged, for a missing directory or step
        and for a corrupted checkpoint.

    Examples:
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

    if isinstance(checkpointer, str | os.PathLike):
        raise TypeError(
            f"restore: the first argument is the orbax checkpointer or CheckpointManager, "
            f"not a path (got {checkpointer!r}). Pass the path as `directory=`: "
            "jaxamp.checkpoint.restore(ocp.StandardCheckpointer(), target, "
            f"directory={str(checkpointer)!r}), or restore from a manager: "
            "jaxamp.checkpoint.restore(ocp.CheckpointManager(root), target, step=step)."
        )
    if not (hasattr(checkpointer, "latest_step") or hasattr(checkpointer, "restore")):
        raise TypeError(
            "restore: `checkpointer` must be an orbax checkpointer (ocp.StandardCheckpointer()) "
            f"or an ocp.CheckpointManager, got {type(checkpointer).__name__}."
        )
    manager = hasattr(checkpointer, "latest_step")
    if manager:  # a CheckpointManager (or one like it)
        if directory is not None:
            raise TypeError("restore: pass `step=` (not `directory=`) with a CheckpointManager.")
        if step is None:
            step = checkpointer.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint found in {checkpointer.directory}.")
        where = f"the checkpoint at step {step} in {checkpointer.directory}"
        run = lambda t: checkpointer.restore(step, args=ocp.args.StandardRestore(t))
        read_tree = lambda: _saved_tree(checkpointer.item_metadata(step))
        # The metadata is read only after a failed restore, when the manager knows
        # the item's handler: probing a fresh manager's metadata logs two warnings.
        explain = lambda e: _explain_manager_failure(checkpointer, step, target, where, e)
    else:
        if directory is None:
            raise TypeError("restore: a checkpointer needs `directory=` (the checkpoint's path).")
        where = f"the checkpoint {directory}"
        if isinstance(checkpointer, ocp.StandardCheckpointer):
            run = lambda t: checkpointer.restore(directory, t)
        else:
            run = lambda t: checkpointer.restore(directory, args=ocp.args.StandardRestore(t))
        read_metadata = lambda: checkpointer.metadata(directory)
        read_tree = lambda: _saved_tree(read_metadata())
        explain = lambda e: _explain_failure(read_metadata, target, where, e)
    # A spike history saved with another window is restored as saved, then resized.
    # A checkpointer's metadata is read first (silently), so that orbax never fails
    # on it; a manager's can be read only after a failed restore.
    other_windows = lambda: _checkpoint_spikes.restore_other_windows(read_tree, run, target, _child)
    first = not manager and _checkpoint_spikes.has_spikes(target)
    restored = other_windows() if first else None
    if restored is None:
        try:
            restored = run(target)
        except Exception as e:
            restored = None if first else other_windows()
            if restored is None:
                explain(e)
                e.add_note(f"(raised by orbax while jaxamp.checkpoint.restore read {where})")
                raise
    _validate_restored(restored, where)
    return restored
