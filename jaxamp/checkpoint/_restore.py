"""Orbax checkpointing of jaxamp training states: orbax's restore, checked on both sides.

Nothing special is needed to *save*: a [`jaxamp.LossScaleState`][jaxamp.LossScaleState] is a pytree
whose counters and numeric configuration (``growth_factor``, ``hysteresis``,
``min_scale``, ``max_scale``, ...) are all array leaves, so ``ocp.StandardCheckpointer``
and ``ocp.CheckpointManager`` with ``ocp.args.StandardSave`` write it with the rest of
the optimizer state, and a restored state continues bit for bit. Only the
[`jaxamp.types.Mode`][jaxamp.types.Mode] (``"dynamic"``, ``"static"``, ...) is static: it is not
stored
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
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxamp.checkpoint import _every_k, _nnx_record, _spike_windows, _stored_blocks
from jaxamp.checkpoint._metadata import check_restorable, child, saved_tree
from jaxamp.checkpoint._validate import validate_restored

__all__ = ["restore"]


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
        tree = None if saved is None else saved_tree(saved)
    except Exception:
        return
    if tree is None or (isinstance(tree, Mapping) and not isinstance(tree, dict)):
        return  # nothing readable, or a multi-item manager's Composite: orbax's error stands
    try:
        _every_k.explain(tree, target, where)
        _spike_windows.explain(tree, target, child, where)  # before: it says why leaves lack
        _stored_blocks.explain(tree, target, child, where)
        check_restorable(tree, target, where=where)
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
    source = _source(checkpointer, target, directory, step)
    # A spike history saved with another window is restored as saved, then resized.
    # A checkpointer's metadata is read first (silently), so that orbax never fails
    # on it; a manager's can be read only after a failed restore.
    other_windows = lambda: _spike_windows.restore_other_windows(
        source.read_tree, source.run, target, child
    )
    first = not source.manager and _spike_windows.has_spikes(target)
    restored = other_windows() if first else None
    if restored is None:
        try:
            restored = source.run(target)
        except Exception as e:
            restored = None if first else other_windows()
            if restored is None:
                restored = _nnx_record.restore_without_old_copies(
                    source.read_tree, source.run, target
                )
            if restored is None:
                source.explain(e)
                e.add_note(f"(raised by orbax while jaxamp.checkpoint.restore read {source.where})")
                raise
    validate_restored(restored, source.where)
    return restored


class _Source(NamedTuple):
    """How to read one checkpoint, from a checkpointer and a directory or a manager and a step."""

    where: str  # the checkpoint, as error messages name it
    run: Callable[[Any], Any]  # orbax's restore into a target
    read_tree: Callable[[], Any]  # the saved tree's metadata
    explain: Callable[[Exception], None]  # raises the clear error for orbax's, if there is one
    manager: bool


def _source(checkpointer: Any, target: Any, directory: Any, step: int | None) -> _Source:
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
    if hasattr(checkpointer, "latest_step"):  # a CheckpointManager (or one like it)
        if directory is not None:
            raise TypeError("restore: pass `step=` (not `directory=`) with a CheckpointManager.")
        if step is None:
            step = checkpointer.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint found in {checkpointer.directory}.")
        where = f"the checkpoint at step {step} in {checkpointer.directory}"
        return _Source(
            where,
            lambda t: checkpointer.restore(step, args=ocp.args.StandardRestore(t)),
            lambda: saved_tree(checkpointer.item_metadata(step)),
            # The metadata is read only after a failed restore, when the manager knows
            # the item's handler: probing a fresh manager's metadata logs two warnings.
            lambda e: _explain_manager_failure(checkpointer, step, target, where, e),
            manager=True,
        )
    if directory is None:
        raise TypeError("restore: a checkpointer needs `directory=` (the checkpoint's path).")
    where = f"the checkpoint {directory}"
    if isinstance(checkpointer, ocp.StandardCheckpointer):
        run = lambda t: checkpointer.restore(directory, t)
    else:
        run = lambda t: checkpointer.restore(directory, args=ocp.args.StandardRestore(t))
    read_metadata = lambda: checkpointer.metadata(directory)
    return _Source(
        where,
        run,
        lambda: saved_tree(read_metadata()),
        lambda e: _explain_failure(read_metadata, target, where, e),
        manager=False,
    )
