"""The loss-scale constructors: dynamic, static, check-only, and no scaling."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxamp._utils.deprecation import positional_deprecated, renamed_parameter
from jaxamp._utils.errors import named
from jaxamp.loss_scale._state import LossScaleState, Mode, fixed_state, fresh_state

__all__ = ["check_only", "dynamic_scale", "no_scale", "static_scale"]


@positional_deprecated(
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "max_consecutive_nonfinite",
    removed_in="0.5",
)
def dynamic_scale(
    init_scale: float = 2.0**15,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    max_consecutive_nonfinite: int | float | None = None,
    hysteresis_refill: str = "finite_and_backoff",
    raise_at_min_scale: bool = False,
) -> LossScaleState:
    """Dynamic loss scaling: grow after clean stretches, back off on overflow.

    Every argument but ``init_scale`` is keyword-only.

    Args:
      init_scale: the starting scale; within [min_scale, max_scale] and ``[2**-126, 2**126]``.
      growth_factor: multiplier (> 1) applied after ``growth_interval`` finite steps in a row.
      backoff_factor: multiplier in (0, 1) applied on overflow.
      growth_interval: finite steps in a row (>= 1) before each growth.
      hysteresis: non-finite steps (>= 1) tolerated before a backoff (Megatron's and
        DeepSpeed's ``hysteresis``, Paddle's ``decr_every_n_nan_or_inf``).
      min_scale: lower bound of the scale (>= 0); the default of 1 keeps the scale
        from ever going below 1. The scale never drops below ``2**-126`` in any case.
      max_scale: upper bound of the scale (inf allowed; the scale never exceeds ``2**126``).
      max_consecutive_nonfinite: more than this many non-finite steps in a row make
        [`check_health`][jaxamp.check_health] raise. ``None``: the default rule, more than 100 in a
        row once the scale is at its floor (``max(min_scale, 2**-126)``), where
        backing off cannot help any more. ``math.inf`` (or ``2**31 - 1``): never. The
        step itself is always skipped: a non-finite update is never applied. This is
        the one place the limit is set (with [`static_scale`][jaxamp.static_scale]'s
        and [`check_only`][jaxamp.check_only]'s).
      hysteresis_refill: what restores the hysteresis allowance:
        ``"finite_and_backoff"`` (every finite step and every backoff: only
        consecutive overflows count; Paddle), ``"finite"`` (every finite step, not a
        backoff: DeepSpeed's ``consecutive_hysteresis=True``) or ``"growth"`` (only
        a growth: Megatron-LM, DeepSpeed's default). Irrelevant when ``hysteresis=1``.
      raise_at_min_scale: if True, [`check_health`][jaxamp.check_health] raises once an overflow
        asks for a backoff while the scale is already at ``min_scale`` (DeepSpeed).

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState].

    Raises:
      ValueError / TypeError: naming the first argument outside its allowed range or type.

    Examples:
      >>> import jaxamp
      >>> state = jaxamp.dynamic_scale(init_scale=2.0**12, growth_interval=100)
      >>> float(jaxamp.update(state, False).scale)
      2048.0
    """
    return fresh_state(
        Mode.DYNAMIC,
        {"scale": "init_scale"},
        scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        max_consecutive_nonfinite=max_consecutive_nonfinite,
        hysteresis_refill=hysteresis_refill,
        raise_at_min_scale=raise_at_min_scale,
    )


@positional_deprecated("check_finite", removed_in="0.5")
@renamed_parameter("skip_nonfinite", "check_finite", removed_in="0.5")
def static_scale(
    scale: float = 2.0**15,
    *,
    check_finite: bool = True,
    max_consecutive_nonfinite: int | float | None = None,
) -> LossScaleState:
    """A fixed loss scale that never changes.

    Args:
      scale: the loss scale, in ``[2**-126, 2**126]``.
      check_finite: if True, gradients are checked and non-finite steps skipped;
        if False, nothing is checked and every step is applied (MindSpore's
        ``drop_overflow_update=False``).
      max_consecutive_nonfinite: as in [`dynamic_scale`][jaxamp.dynamic_scale]; with
        a fixed scale the default rule raises after more than 100 in a row.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState] whose [`update`][jaxamp.update] moves only the
      counters.

    Examples:
      >>> import jaxamp
      >>> float(jaxamp.update(jaxamp.static_scale(128.0), False).scale)
      128.0
    """
    if not isinstance(check_finite, bool | np.bool_):
        raise TypeError(f"check_finite must be a bool, got {check_finite!r}.")
    state = fixed_state(Mode.STATIC if check_finite else Mode.STATIC_UNCHECKED, scale)
    return with_limit(state, max_consecutive_nonfinite, "static_scale")


def check_only(*, max_consecutive_nonfinite: int | float | None = None) -> LossScaleState:
    """No loss scale, but gradients checked and non-finite steps skipped.

    For bfloat16 and FP8 training, whose range needs no scaling but whose steps can
    still overflow: ``jaxamp.skip_nonfinite(tx, jaxamp.check_only())`` unscales
    nothing, checks every gradient, and skips a non-finite step as a whole (under
    ``pmap`` / ``shard_map`` add ``axis_name=``, so every device skips together).
    ``skip_nonfinite(tx)`` / ``skip_nonfinite(tx, None)`` is short for it.

    Args:
      max_consecutive_nonfinite: as in [`dynamic_scale`][jaxamp.dynamic_scale]; with
        no scale to lower, the default rule raises after more than 100 in a row.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState] of mode ``"check_only"``, scale 1.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.check_only())
      >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
      >>> grads = {"w": jnp.array([jnp.nan, 1.0], jnp.bfloat16)}
      >>> params, state = jaxamp.step(tx, grads, tx.init(params), params)
      >>> params["w"], bool(jaxamp.stepped(state))
      (Array([1, 1], dtype=bfloat16), False)
    """
    state = fixed_state(Mode.CHECK_ONLY, 1.0)
    return with_limit(state, max_consecutive_nonfinite, "check_only")


def with_limit(state: LossScaleState, limit: Any, fn: str) -> LossScaleState:
    """``state`` with ``max_consecutive_nonfinite=limit``: the state's own rule reads it
    (an integer N, NumPy's and JAX's included, or math.inf), for every constructor."""
    if limit is None:
        return state
    with named(fn, (TypeError, ValueError)):
        return state.replace(max_consecutive_nonfinite=limit)


def no_scale() -> LossScaleState:
    """Disabled loss scaling: scale 1, every function is a pass-through.

    Like ``torch.amp.GradScaler(enabled=False)``: [`scale`][jaxamp.scale] and
    [`unscale_and_check`][jaxamp.unscale_and_check] return their input unchanged (``finite`` is
    always True, nothing is checked, no step is skipped); [`update`][jaxamp.update] moves only the
    counters.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.scale(jaxamp.no_scale(), jnp.array(3.0))
      Array(3., dtype=float32, weak_type=True)
    """
    return fixed_state(Mode.DISABLED, 1.0)
