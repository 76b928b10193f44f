"""Loss scaling's pure functions: scale, unscale, check for inf / NaN, update.

Each takes a [`LossScaleState`][jaxamp.LossScaleState] and returns arrays or a new state;
XLA compiles them into the step. The finite check is ``jaxamp._utils.finite``'s:
each large gradient leaf read on its own, the small ones one reduction per dtype.

The dynamic rule, applied by [`update`][jaxamp.update] once per step::

    if finite:
        nonfinite_streak = 0
        growth_tracker += 1
        if hysteresis_refill != "growth":
            hysteresis_tracker = hysteresis
        if growth_tracker >= growth_interval:
            scale = min(scale * growth_factor, max_scale, 2**126)
            growth_tracker = 0
            hysteresis_tracker = hysteresis
    else:
        skipped_steps += 1
        nonfinite_streak += 1
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
            if scale <= max(min_scale, 2**-126):
                min_scale_backoffs += 1
            scale = max(scale * backoff_factor, min_scale, 2**-126)
            hysteresis_tracker = hysteresis if hysteresis_refill == "finite_and_backoff" else 0

The scale stays in ``[2**-126, 2**126]`` whatever the bounds say, so that both it
and ``1 / scale`` are normal float32 numbers: a subnormal reciprocal is flushed to
0 by XLA and would turn every gradient into an exact, "finite" zero.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._utils.conversion_checks import check_update_owned, mark_loss_scaled
from jaxamp._utils.deprecation import REQUIRED, renamed_parameter
from jaxamp._utils.dtypes import is_inexact, times_wide
from jaxamp._utils.finite import agree, as_finite, leaf_flags, unscaled
from jaxamp._utils.tree import saturating_inc
from jaxamp.loss_scale._state import (
    CONFIG_FIELDS,
    HYSTERESIS_REFILL,
    SCALE_MAX,
    SCALE_MIN,
    LossScaleState,
    Mode,
    check_state,
)
from jaxamp.loss_scale._unscaled import Unscaled

__all__ = ["scale", "unscale_and_check", "update"]


@renamed_parameter("state", "loss_scale", removed_in="0.5")
def scale(loss_scale: LossScaleState, /, tree: Any = REQUIRED) -> Any:
    """Multiplies every floating leaf of ``tree`` by the loss scale.

    Each leaf keeps its dtype; the product is computed in float32 (or wider), so a
    float16 loss is scaled without the scale itself overflowing float16.

    Args:
      loss_scale: the [`LossScaleState`][jaxamp.LossScaleState] (positional-only); inside
        an optimizer state, ``jaxamp.get_loss_scale(opt_state)``.
      tree: a loss or any pytree; non-floating leaves pass through.

    Returns:
      ``tree`` with floating leaves multiplied by ``loss_scale.scale``.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.scale(jaxamp.static_scale(8.0), jnp.array(0.5, jnp.float16))
      Array(4., dtype=float16)
    """
    if tree is REQUIRED:  # PyTorch's one-argument scaler.scale(loss)
        raise TypeError(
            "jaxamp.scale takes the loss-scale state first, then the loss (PyTorch's "
            "scaler.scale(loss) keeps the state in the scaler): jaxamp.scale("
            "jaxamp.get_loss_scale(opt_state), loss)."
        )
    state = check_state(loss_scale, "scale")
    mark_loss_scaled()
    if not state.mode.scales:
        return tree
    return jax.tree.map(lambda x: times_wide(x, state.scale) if is_inexact(x) else x, tree)


@renamed_parameter("state", "loss_scale", removed_in="0.5")
def unscale_and_check(
    loss_scale: LossScaleState, /, grads: Any, *, axis_name: Any = None
) -> tuple[Any, jax.Array]:
    """Divides gradients by the loss scale and checks them for inf / NaN.

    Args:
      loss_scale: the [`LossScaleState`][jaxamp.LossScaleState] the gradients were
        scaled with (positional-only).
      grads: a pytree of (scaled) gradients. Non-floating leaves (ints, bools,
        ``float0``, ``None``) pass through; each leaf keeps its dtype (float8 too).
      axis_name: a mapped axis name (``pmap`` / ``shard_map``) over which the
        answer is agreed: one non-finite value on any device gives ``False`` on all.

    Returns:
      ``(grads, finite)``: the unscaled gradients, marked as such (an
      [`Unscaled`][jaxamp.types.Unscaled]: edit them with ``jax.tree.map`` or optax, hand them
      to [`jaxamp.step`][jaxamp.step], read the plain tree as ``grads.tree``), and a
      ``bool[]`` that is False if any unscaled floating leaf holds an inf or NaN. A
      state that checks nothing (``static_scale(..., check_finite=False)``,
      [`no_scale`][jaxamp.no_scale]) returns True.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> g, finite = jaxamp.unscale_and_check(jaxamp.static_scale(4.0), jnp.array([2.0, 8.0]))
      >>> g.tree, bool(finite)
      (Array([0.5, 2. ], dtype=float32), True)
    """
    state = check_state(loss_scale, "unscale_and_check")
    is_mark = lambda x: isinstance(x, Unscaled)  # noqa: E731
    if any(map(is_mark, jax.tree.leaves(grads, is_leaf=is_mark))):
        raise TypeError(
            "jaxamp.unscale_and_check: these gradients were already unscaled (they are "
            "what unscale_and_check returned; PyTorch raises likewise on a second "
            "unscale_()): dividing them again makes them `scale` times too small. Pass "
            "them on as they are: jaxamp.step(tx, grads, opt_state, params, finite=finite)."
        )
    scale = state.scale if state.mode.scales else None
    if not state.mode.checks:
        return Unscaled(unscaled(grads, scale)), jnp.array(True)
    flags, _ = leaf_flags(grads, scale)
    return Unscaled(unscaled(grads, scale)), agree(jnp.all(flags), axis_name)


@renamed_parameter("state", "loss_scale", removed_in="0.5")
def update(loss_scale: LossScaleState, /, finite: Any) -> LossScaleState:
    """Advances the loss-scale state by one step (the rule is in the module docstring).

    Finite step: ``growth_tracker += 1``, ``nonfinite_streak = 0``, the hysteresis
    allowance is restored; after ``growth_interval`` finite steps in a row the scale
    grows to ``min(scale * growth_factor, max_scale)`` and ``growth_tracker``
    restarts at 0.

    Non-finite step: ``skipped_steps += 1``, ``nonfinite_streak += 1``,
    ``growth_tracker = 0``, ``hysteresis_tracker -= 1``; when it reaches 0 the scale
    backs off to ``max(scale * backoff_factor, min_scale)`` and the allowance is
    restored.

    The scale stays within ``[2**-126, 2**126]``. A static or disabled state moves only
    the counters. Every leaf of the result is a new array (none is shared with
    ``loss_scale``), so either may be donated.

    Args:
      loss_scale: the current [`LossScaleState`][jaxamp.LossScaleState] (positional-only).
      finite: a bool scalar (usually from [`unscale_and_check`][jaxamp.unscale_and_check]).

    Returns:
      The next [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(init_scale=4.0, growth_interval=1)
      >>> float(jaxamp.update(s, True).scale), float(jaxamp.update(s, False).scale)
      (8.0, 2.0)
    """
    check_update_owned(loss_scale)
    return advance(loss_scale, finite)


def advance(loss_scale_state: LossScaleState, finite: Any) -> LossScaleState:
    """[`update`][jaxamp.update] without its check that no guard owns the state: the
    guard's own update of the state it owns."""
    s = check_state(loss_scale_state, "update")
    finite = as_finite(finite, "update")
    growth_tracker = jnp.where(finite, saturating_inc(s.growth_tracker), 0)
    grow = finite & (growth_tracker >= s.growth_interval)
    growth_tracker = jnp.where(grow, 0, growth_tracker)

    refill_on_finite = grow | (s.hysteresis_refill >= HYSTERESIS_REFILL.index("finite"))
    refill_on_backoff = s.hysteresis_refill == HYSTERESIS_REFILL.index("finite_and_backoff")
    tracker = jnp.where(
        finite,
        jnp.where(refill_on_finite, s.hysteresis, s.hysteresis_tracker),
        s.hysteresis_tracker - 1,
    )
    backoff = ~finite & (tracker <= 0)
    tracker = jnp.where(backoff, jnp.where(refill_on_backoff, s.hysteresis, 0), tracker)

    floor = jnp.maximum(s.min_scale, SCALE_MIN)
    stuck = backoff & (s.scale <= floor)
    new_scale = s.scale
    if s.mode is Mode.DYNAMIC:
        grown = jnp.minimum(s.scale * s.growth_factor, jnp.minimum(s.max_scale, SCALE_MAX))
        shrunk = jnp.maximum(s.scale * s.backoff_factor, floor)
        new_scale = jnp.where(grow, grown, jnp.where(backoff, shrunk, s.scale))
    else:
        stuck = jnp.array(False)

    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    config = {f: jnp.array(getattr(s, f), copy=True) for f in CONFIG_FIELDS}
    return LossScaleState(
        scale=jnp.array(new_scale, jnp.float32, copy=True),
        growth_tracker=i32(growth_tracker),
        hysteresis_tracker=i32(tracker),
        nonfinite_streak=i32(jnp.where(finite, 0, saturating_inc(s.nonfinite_streak))),
        skipped_steps=i32(saturating_inc(s.skipped_steps, (~finite).astype(jnp.int32))),
        min_scale_backoffs=i32(saturating_inc(s.min_scale_backoffs, stuck.astype(jnp.int32))),
        **config,
        mode=s.mode,
    )
