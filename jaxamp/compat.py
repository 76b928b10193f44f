"""Constructors that reproduce other frameworks' loss scalers, with their names and defaults.

Each returns a :class:`jaxamp.LossScaleState` whose :func:`jaxamp.update` follows the
original's rule step for step, and validates its arguments as the original does
(raising ``ValueError`` where the original asserts).
"""

from __future__ import annotations

import math

from jaxamp._loss_scale import LossScaleState, Mode, _fresh_state, no_scale, static_scale

__all__ = [
    "megengine_grad_scaler",
    "mindspore_dynamic",
    "mindspore_fixed",
    "paddle_grad_scaler",
    "torch_grad_scaler",
]

# MindSpore's DynamicLossScaleManager raises after more than this many overflows in a row.
_MINDSPORE_BAD_STEP_MAX = 1000


def _unbounded(
    init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
) -> LossScaleState:
    """PyTorch's rule, shared by MegEngine: no bounds, back off on every overflow."""
    return _fresh_state(
        Mode.DYNAMIC,
        {"scale": "init_scale"},
        scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=1,
        min_scale=0.0,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
    )


def torch_grad_scaler(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
) -> LossScaleState:
    """``torch.amp.GradScaler``: unbounded scale, back off on every overflow.

    Args:
      init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in PyTorch.

    Returns:
      A :class:`LossScaleState` (``no_scale()`` when ``enabled=False``).

    Example:
      >>> import jaxamp
      >>> float(jaxamp.compat.torch_grad_scaler().scale)
      65536.0
    """
    if not enabled:
        return no_scale()
    if growth_factor <= 1.0:
        raise ValueError(f"growth_factor must be > 1.0 (as in PyTorch), got {growth_factor!r}.")
    if backoff_factor >= 1.0:
        raise ValueError(f"backoff_factor must be < 1.0 (as in PyTorch), got {backoff_factor!r}.")
    return _unbounded(init_scale, growth_factor, backoff_factor, growth_interval)


def paddle_grad_scaler(
    enable: bool = True,
    init_loss_scaling: float = 32768.0,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    use_dynamic_loss_scaling: bool = True,
) -> LossScaleState:
    """``paddle.amp.GradScaler``: back off after ``decr_every_n_nan_or_inf`` bad steps, floor 1.

    Paddle's bad-step counter restarts on a clean step, which is jaxamp's hysteresis.

    Args:
      enable, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
      decr_every_n_nan_or_inf, use_dynamic_loss_scaling: as in Paddle.

    Returns:
      A :class:`LossScaleState`: dynamic, static (``use_dynamic_loss_scaling=False``)
      or ``no_scale()`` (``enable=False``).

    Example:
      >>> import jaxamp
      >>> int(jaxamp.compat.paddle_grad_scaler().hysteresis)
      2
    """
    if not enable:
        return no_scale()
    if incr_ratio <= 1.0:
        raise ValueError(f"incr_ratio must be > 1.0 (as in Paddle), got {incr_ratio!r}.")
    if decr_ratio >= 1.0:
        raise ValueError(f"decr_ratio must be < 1.0 (as in Paddle), got {decr_ratio!r}.")
    if not use_dynamic_loss_scaling:
        return static_scale(init_loss_scaling)
    return _fresh_state(
        Mode.DYNAMIC,
        _PADDLE_NAMES,
        scale=init_loss_scaling,
        growth_factor=incr_ratio,
        backoff_factor=decr_ratio,
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
        min_scale=1.0,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
    )


def megengine_grad_scaler(
    init_scale: float = 2.0**4,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> LossScaleState:
    """``megengine.amp.GradScaler``.

    ``growth_factor=0`` (MegEngine's documented switch) keeps the scale fixed and
    still skips non-finite steps; ``growth_interval=0`` (its code's switch) keeps
    the scale fixed and never checks, so no step is ever skipped.

    Args:
      init_scale, growth_factor, backoff_factor, growth_interval: as in MegEngine.

    Returns:
      A :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> jaxamp.compat.megengine_grad_scaler(growth_factor=0).dynamic
      False
    """
    if growth_interval == 0:
        return static_scale(init_scale, skip_nonfinite=False)
    if growth_factor == 0:
        return static_scale(init_scale, skip_nonfinite=True)
    if growth_interval < 0:
        raise ValueError(f"growth_interval must be >= 0, got {growth_interval!r}.")
    return _unbounded(init_scale, growth_factor, backoff_factor, growth_interval)


def mindspore_fixed(loss_scale: float = 128.0, drop_overflow_update: bool = True) -> LossScaleState:
    """``mindspore.FixedLossScaleManager``.

    Args:
      loss_scale: the fixed scale, >= 1.
      drop_overflow_update: skip the update of an overflowing step (True), or apply
        every step unchecked (False).

    Returns:
      A static :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> float(jaxamp.compat.mindspore_fixed().scale)
      128.0
    """
    if loss_scale < 1:
        raise ValueError(f"loss_scale must be >= 1 (as in MindSpore), got {loss_scale!r}.")
    return static_scale(loss_scale, skip_nonfinite=bool(drop_overflow_update))


def mindspore_dynamic(
    init_loss_scale: float = 2.0**24, scale_factor: int = 2, scale_window: int = 2000
) -> LossScaleState:
    """``mindspore.DynamicLossScaleManager``.

    Backs off by ``1/scale_factor`` (floor 1) on every overflow, grows by
    ``scale_factor`` after ``scale_window`` clean steps, and treats more than 1000
    overflows in a row as an error (``max_consecutive_nonfinite=1000``, reported by
    :func:`jaxamp.check_health`). Unlike MindSpore's Python float, the float32 scale
    stops growing before it would overflow.

    Args:
      init_loss_scale: >= 1.
      scale_factor: > 1 (a factor of exactly 1 gives a fixed scale, as in MindSpore).
      scale_window: a positive integer.

    Returns:
      A :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> int(jaxamp.compat.mindspore_dynamic().max_consecutive_nonfinite)
      1000
    """
    if init_loss_scale < 1.0:
        raise ValueError(
            f"init_loss_scale must be >= 1 (as in MindSpore), got {init_loss_scale!r}."
        )
    if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window <= 0:
        raise ValueError(f"scale_window must be a positive int, got {scale_window!r}.")
    if scale_factor <= 0:
        raise ValueError(f"scale_factor must be > 0 (as in MindSpore), got {scale_factor!r}.")
    if scale_factor < 1:
        raise ValueError(
            f"scale_factor must be >= 1, got {scale_factor!r}: a factor below 1 would shrink "
            "the scale on clean steps and grow it on overflow."
        )
    if scale_factor == 1:
        state = static_scale(init_loss_scale)
        return state.replace(max_consecutive_nonfinite=_MINDSPORE_BAD_STEP_MAX)
    return _fresh_state(
        Mode.DYNAMIC,
        {"scale": "init_loss_scale", "growth_interval": "scale_window"},
        scale=init_loss_scale,
        growth_factor=float(scale_factor),
        backoff_factor=1.0 / scale_factor,
        growth_interval=scale_window,
        hysteresis=1,
        min_scale=1.0,
        max_scale=math.inf,
        max_consecutive_nonfinite=_MINDSPORE_BAD_STEP_MAX,
    )


# jaxamp's field names in Paddle's vocabulary, so errors name Paddle's arguments.
_PADDLE_NAMES = {
    "scale": "init_loss_scaling",
    "growth_factor": "incr_ratio",
    "backoff_factor": "decr_ratio",
    "growth_interval": "incr_every_n_steps",
    "hysteresis": "decr_every_n_nan_or_inf",
}
