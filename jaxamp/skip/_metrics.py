"""Scalars to log: the loss scale, its counters, and what the last step skipped."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.errors import named
from jaxamp._utils.tree import find_one
from jaxamp.loss_scale import LossScaleState, get_loss_scale
from jaxamp.skip._spikes import SpikeState

__all__ = ["metrics"]


@renamed_parameter("opt_state_or_loss_scale_state", "state", removed_in="0.5")
def metrics(state: Any, /) -> dict[str, jax.Array]:
    """Scalars to log: loss scale, counters and whether the last step was skipped.

    Jit-safe: returns arrays, never pulls them to the host.

    Args:
      state: a [`LossScaleState`][jaxamp.LossScaleState] or an optax state
        containing one (from [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite]), or what holds
        that: a ``TrainState``, a [`jaxamp.nnx.Optimizer`][jaxamp.nnx.Optimizer].

    Returns:
      A dict of scalar arrays: ``loss_scale``, ``growth_tracker``,
      ``nonfinite_streak``, ``skipped_steps`` (steps skipped for non-finite
      gradients) and ``skipped`` (bool: the last step was skipped). With a
      [`jaxamp.spike_rule`][jaxamp.spike_rule], also ``spike_skipped_steps`` (steps skipped as
      spikes, counted apart) and ``spike_skipped`` (the last step was one);
      ``skipped`` is then True for either reason. With ``every_k > 1`` a "step"
      is a window: the loss scale and these counters move at a window's end only,
      so a call inside a window still reports the last window's verdict, while
      [`jaxamp.stepped`][jaxamp.stepped] says whether the current window is finite
      so far (what gates the model state's writes).

    Examples:
      >>> import jaxamp
      >>> sorted(jaxamp.metrics(jaxamp.dynamic_scale()))
      ['growth_tracker', 'loss_scale', 'nonfinite_streak', 'skipped', 'skipped_steps']
    """
    with named("metrics"):
        s = get_loss_scale(state)
    out = {
        "loss_scale": s.scale,
        "growth_tracker": s.growth_tracker,
        "nonfinite_streak": s.nonfinite_streak,
        "skipped_steps": s.skipped_steps,
        # streak != 0 without a Python constant: eagerly, that would be a host transfer.
        "skipped": s.nonfinite_streak.astype(jnp.bool_),
    }
    spikes = find_spike_state(state)
    if spikes is not None:
        out["spike_skipped_steps"] = jnp.asarray(spikes.skips)
        out["spike_skipped"] = jnp.asarray(spikes.skipped)
        out["skipped"] = out["skipped"] | out["spike_skipped"]
    return out


def find_spike_state(opt_state: Any) -> SpikeState | None:
    """The one [`jaxamp.types.SpikeState`][jaxamp.types.SpikeState] inside an optimizer state, or
    None."""
    if isinstance(opt_state, LossScaleState):
        return None
    return find_one(opt_state, SpikeState, what="SpikeStates", hint="pass the sub-state you mean.")
