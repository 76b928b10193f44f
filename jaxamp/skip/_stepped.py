"""What a skipped step keeps: the verdict of the last step, and model state chosen by it.

Params and optimizer state are kept by the guarded step itself (``_guard``); what
a train step writes besides them (BatchNorm statistics, Flax mutable collections,
nnx ``BatchStat``, fp8 metadata) is chosen here, on the device, by the verdict the
step left in the optimizer state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.errors import named
from jaxamp._utils.tree import find_one
from jaxamp.loss_scale import all_finite, get_loss_scale, select_tree
from jaxamp.skip._metrics import find_spike_state
from jaxamp.skip._skip_nonfinite import SkipNonfiniteState

__all__ = ["stepped", "where_stepped"]


def _window(opt_state: Any) -> SkipNonfiniteState | None:
    """The accumulating ``skip_nonfinite`` state inside ``opt_state``, if any."""
    found = find_one(
        opt_state,
        SkipNonfiniteState,
        what="skip_nonfinite states",
        hint="pass the sub-state you mean.",
    )
    return found if found is not None and found.mini_step is not None else None


@renamed_parameter("opt_state", "state", removed_in="0.5")
def stepped(state: Any, /) -> jax.Array:
    """Whether the last call's step was taken: a bool scalar, no host sync.

    False after a skipped step. With ``every_k > 1``, a call that ends a window
    says whether the window was applied; a call inside a window says whether its
    gradients so far are all finite (one read of the accumulator): once one
    micro-batch overflows, the window will be skipped, and so is what its later
    micro-batches would write. A loss-scale state that checks nothing
    (``jaxamp.no_scale()``) never skips.

    Args:
      state: the optimizer state after the step (or what holds it: a
        [`jaxamp.TrainState`][jaxamp.TrainState], a
        [`jaxamp.nnx.Optimizer`][jaxamp.nnx.Optimizer]), or the
        [`LossScaleState`][jaxamp.LossScaleState] after [`jaxamp.update`][jaxamp.update];
        positional-only.

    Returns:
      A bool scalar array: True if the step was taken.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> params = {"w": jnp.ones(2)}
      >>> _, state = jaxamp.step(tx, {"w": jnp.array([jnp.inf, 0.0])}, tx.init(params), params)
      >>> bool(jaxamp.stepped(state))
      False
    """
    with named("stepped"):
        return _taken(state)


def _taken(opt_state: Any) -> jax.Array:
    """[`stepped`][jaxamp.stepped]'s verdict; lookup errors are the caller's to name."""
    ls = get_loss_scale(opt_state)
    taken = ~ls.nonfinite_streak.astype(jnp.bool_)
    spikes = find_spike_state(opt_state)
    if spikes is not None:
        taken = taken & ~jnp.asarray(spikes.skipped)
    window = _window(opt_state)
    if window is None or not ls.mode.checks:
        return taken
    if jnp.ndim(window.mini_step):  # a state stacked over devices (pmap): per replica
        return jax.vmap(_taken)(opt_state)
    return lax.cond(window.mini_step == 0, lambda: taken, lambda: all_finite(window.acc))


def applied_calls(before: Any, after: Any) -> jax.Array:
    """How many optimizer calls the last call applied: an int32 scalar, no host sync.

    1 for a step taken, 0 for one skipped. With ``every_k > 1``: 0 inside a window,
    and at a window's end the window's number of micro-batches if it was applied (0
    if it was skipped), so that a counter of calls moves only over windows that
    changed the params, and by as much as ``optax.MultiSteps``'s would.

    Args:
      before: the optimizer state the call was given.
      after: the optimizer state it returned.
    """
    taken = stepped(after)
    old, new = _window(before), _window(after)
    if old is None or new is None:
        return taken.astype(jnp.int32)
    # A window ends when its count goes back to 0; its size is the count it had + 1
    # (k, or more for a window restored from a run with a larger every_k).
    ended = new.mini_step == 0
    return jnp.where(ended & taken, old.mini_step + 1, 0).astype(jnp.int32)


@renamed_parameter("opt_state", "state", removed_in="0.5")
def where_stepped(state: Any, /, new: Any, old: Any) -> Any:
    """``new`` if the last step was taken, ``old`` if it was skipped: model state.

    What a train step writes besides params and optimizer state (BatchNorm
    statistics, Flax mutable collections, nnx ``BatchStat`` and other non-``Param``
    Variables, fp8 amax histories) must not be written by a skipped step: a batch
    whose gradients overflowed has statistics that overflowed too, and writing them
    would poison every later evaluation. Call this after [`jaxamp.step`][jaxamp.step] (or
    ``tx.update``) with the new optimizer state. [`jaxamp.TrainState`][jaxamp.TrainState] does it
    for the keyword arguments of ``apply_gradients``. See [`stepped`][jaxamp.stepped] for what
    "taken" means under ``every_k`` and ``multi_transform`` (any partition skipped:
    the model state is kept).

    Args:
      state: the optimizer state *after* the step (or what holds it), or the
        ``LossScaleState`` after [`jaxamp.update`][jaxamp.update], as in
        [`stepped`][jaxamp.stepped]; positional-only.
      new: the model state the step computed.
      old: the model state before the step; the same tree structure, shapes and dtypes.

    Returns:
      ``new`` or ``old``, selected on the device (no host sync).

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> params, stats = {"w": jnp.ones(2)}, {"mean": jnp.zeros(2)}
      >>> grads, new_stats = {"w": jnp.array([jnp.inf, 1.0])}, {"mean": jnp.full(2, jnp.nan)}
      >>> params, opt_state = jaxamp.step(tx, grads, tx.init(params), params)
      >>> jaxamp.where_stepped(opt_state, new_stats, stats)
      {'mean': Array([0., 0.], dtype=float32)}
    """
    with named("where_stepped"):
        taken = _taken(state)
    try:
        return select_tree(taken, new, old)
    except ValueError as e:
        raise ValueError(
            "where_stepped: `new` and `old` must be the same model state before and after "
            f"the step (one tree structure, shapes and dtypes): {e}"
        ) from None
