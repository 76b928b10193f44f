"""``jaxamp.compat``: the large-scale trainers' scalers (DeepSpeed, Megatron-LM, NVIDIA Apex)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxamp.compat._table import (
    check_bounds,
    check_flags,
    check_numbers,
    check_whole,
    checked_args,
    system_state,
)
from jaxamp.loss_scale import LossScaleState, Mode, fixed_state, no_scale


@checked_args("DeepSpeed")
def deepspeed_loss_scaler(
    init_scale: float = 2**32,
    scale_factor: float = 2.0,
    scale_window: int = 1000,
    min_scale: float = 1,
    delayed_shift: int = 1,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
) -> LossScaleState:
    """DeepSpeed's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``).

    The scaler ZeRO stages 1-3 build. Mapping: grow by ``scale_factor`` after
    ``scale_window`` clean steps in a row, back off by ``1 / scale_factor`` (floor
    ``min_scale``) once ``delayed_shift`` overflows have used up the hysteresis.
    The hysteresis (``delayed_shift``) is refilled only when the scale grows
    (``hysteresis_refill="growth"``), or on every clean step with
    ``consecutive_hysteresis=True`` (``"finite"``); a backoff never refills it, so
    once it is spent every further overflow backs off until a refill.

    DeepSpeed raises when an overflow asks for a backoff while the scale already
    equals ``min_scale`` (``raise_error_at_min_scale=True``). A jitted step cannot
    raise, so here that overflow counts in ``min_scale_backoffs`` (the scale
    stays at ``min_scale``) and [`jaxamp.check_health`][jaxamp.check_health] raises
    ``FloatingPointError`` from then on: call it where you log.

    Deviations: DeepSpeed's scale is an unbounded Python float; here it stays in
    ``[2**-126, 2**126]`` (it stops growing at ``2**126``, and with ``min_scale=0`` stops
    shrinking at ``2**-126``). A ``scale_factor`` that is not a power of two backs off
    by multiplying with float32 ``1 / scale_factor`` rather than dividing, which can
    differ in the last bit. DeepSpeed accepts values it cannot run with; here they
    raise: ``scale_factor <= 1`` (growth would not grow), ``scale_window < 1``
    (DeepSpeed divides by zero), ``delayed_shift < 1`` (DeepSpeed would never back
    off), ``init_scale < min_scale``. The ``dtype`` argument (logging only) is not
    taken.

    Args:
      init_scale: as in DeepSpeed.
      scale_factor: as in DeepSpeed.
      scale_window: as in DeepSpeed.
      min_scale: as in DeepSpeed.
      delayed_shift: as in DeepSpeed.
      consecutive_hysteresis: as in DeepSpeed.
      raise_error_at_min_scale: as in DeepSpeed.

    Returns:
      A dynamic [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.deepspeed_loss_scaler(init_scale=1.0)
      >>> jaxamp.check_health(s)
      >>> jaxamp.check_health(jaxamp.update(s, False))
      Traceback (most recent call last):
      ...
      FloatingPointError: an overflow asked for a backoff while the loss scale was already ...
    """
    if not 1 < scale_factor < math.inf:
        raise ValueError(
            f"scale_factor must be finite and > 1 (DeepSpeed multiplies the scale by it on "
            f"growth and divides by it on overflow), got {scale_factor!r}."
        )
    check_whole("DeepSpeed", "scale_window", scale_window, 1)
    check_whole("DeepSpeed", "delayed_shift", delayed_shift, 1)
    return system_state(
        "DeepSpeed",
        scale=init_scale,
        growth_factor=float(scale_factor),
        backoff_factor=1.0 / float(scale_factor),
        growth_interval=scale_window,
        hysteresis=delayed_shift,
        min_scale=min_scale,
        hysteresis_refill="finite" if consecutive_hysteresis else "growth",
        raise_at_min_scale=bool(raise_error_at_min_scale),
    )


# The dynamic-scaling keys of DeepSpeed's "fp16" config block, with their config defaults.
_DEEPSPEED_FP16_DYNAMIC = {
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


def deepspeed_fp16_config(fp16: Mapping[str, Any]) -> LossScaleState:
    """The ``"fp16"`` block of a DeepSpeed config, as ZeRO stages 1-3 build their scaler.

    Follows ``deepspeed/runtime/config.py``: ``enabled`` (default False) off gives
    [`jaxamp.no_scale`][jaxamp.no_scale]; a non-zero ``loss_scale`` gives a fixed scale whose
    overflowing steps are still skipped (ZeRO checks every step); ``loss_scale=0``
    (the default) gives [`deepspeed_loss_scaler`][jaxamp.compat.deepspeed_loss_scaler] with
    ``init_scale = 2**initial_scale_power``, ``scale_window = loss_scale_window``, ``delayed_shift =
    hysteresis``, ``consecutive_hysteresis`` and ``min_scale = min_loss_scale``. As in DeepSpeed,
    the config defaults (``initial_scale_power=16``, ``loss_scale_window=1000``, ``hysteresis=2``,
    ``min_loss_scale=1``) apply only when at least one of those keys is in the block; a block with
    none of them gets ``DynamicLossScaler``'s own defaults (``2**32``, window 1000, no hysteresis).
    Other keys are ignored. DeepSpeed's optimizer without ZeRO (``FP16_Optimizer``) uses a different
    rule (no hysteresis, first growth one step later), which this does not reproduce.

    Args:
      fp16: the mapping under ``"fp16"`` in a DeepSpeed config.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.deepspeed_fp16_config({"enabled": True, "loss_scale_window": 500})
      >>> float(s.scale), int(s.growth_interval), int(s.hysteresis)
      (65536.0, 500, 2)
    """
    if not isinstance(fp16, Mapping):
        raise TypeError(
            f"fp16 must be the mapping under 'fp16' in a DeepSpeed config, got "
            f"{type(fp16).__name__} {fp16!r}."
        )
    enabled, loss_scale = fp16.get("enabled", False), fp16.get("loss_scale", 0)
    check_flags("DeepSpeed config", enabled=enabled)
    check_numbers("DeepSpeed config", loss_scale=loss_scale)
    if not enabled:
        return no_scale()
    if loss_scale != 0:
        if not loss_scale > 0:
            raise ValueError(
                f"loss_scale must be 0 (dynamic) or > 0 (DeepSpeed), got {loss_scale!r}."
            )
        return fixed_state(Mode.STATIC, loss_scale, {"scale": "loss_scale"})
    if not any(key in fp16 for key in _DEEPSPEED_FP16_DYNAMIC):
        return deepspeed_loss_scaler()
    c = {key: fp16.get(key, default) for key, default in _DEEPSPEED_FP16_DYNAMIC.items()}
    check_numbers(
        "DeepSpeed config",
        initial_scale_power=c["initial_scale_power"],
        loss_scale_window=c["loss_scale_window"],
        hysteresis=c["hysteresis"],
        min_loss_scale=c["min_loss_scale"],
    )
    check_flags("DeepSpeed config", consecutive_hysteresis=c["consecutive_hysteresis"])
    if not -126 <= c["initial_scale_power"] <= 126:
        raise ValueError(
            f"initial_scale_power must be in [-126, 126], got {c['initial_scale_power']!r}."
        )
    names = {"loss_scale_window": "scale_window", "hysteresis": "delayed_shift"}
    for key, arg in names.items():
        try:
            check_whole("DeepSpeed config", key, c[key], 1)
        except ValueError as e:
            raise ValueError(f"{e} ({arg} of DynamicLossScaler)") from None
    try:
        return deepspeed_loss_scaler(
            init_scale=2.0 ** c["initial_scale_power"],
            scale_window=c["loss_scale_window"],
            min_scale=c["min_loss_scale"],
            delayed_shift=c["hysteresis"],
            consecutive_hysteresis=c["consecutive_hysteresis"],
        )
    except ValueError as e:
        raise ValueError(
            f"{e} (config keys: init_scale = 2**initial_scale_power, min_scale = min_loss_scale)"
        ) from None


@checked_args("Megatron-LM")
def megatron_grad_scaler(
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
) -> LossScaleState:
    """Megatron-LM's ``DynamicGradScaler`` (``megatron/core/optimizer/grad_scaler.py``).

    The class has no defaults; these are what Megatron builds it with:
    ``OptimizerConfig``'s ``initial_loss_scale=2**32``, ``min_loss_scale=1.0``,
    ``loss_scale_window=1000``, ``hysteresis=2`` (also the ``--initial-loss-scale``,
    ``--min-loss-scale``, ``--loss-scale-window``, ``--hysteresis`` flags), and the
    ``growth_factor=2.0``, ``backoff_factor=0.5`` that ``get_megatron_optimizer``
    passes.

    Mapping: grow after ``growth_interval`` clean steps in a row (unbounded), back
    off (floor ``min_scale``) once ``hysteresis`` overflows have used up the
    allowance. The allowance is refilled only when the scale grows
    (``hysteresis_refill="growth"``): after a backoff every overflow backs off
    again until the next growth. Megatron's own hysteresis tracker keeps counting
    below zero; jaxamp's stops at 0, which is the same rule.

    Deviations: Megatron's float32 scale can grow to inf; here it stops at
    ``2**126``. A non-integral ``growth_interval`` (which Megatron would never reach)
    raises.

    Args:
      initial_scale: as in Megatron-LM; its asserts raise ``ValueError`` here.
      min_scale: as in Megatron-LM; its asserts raise ``ValueError`` here.
      growth_factor: as in Megatron-LM; its asserts raise ``ValueError`` here.
      backoff_factor: as in Megatron-LM; its asserts raise ``ValueError`` here.
      growth_interval: as in Megatron-LM; its asserts raise ``ValueError`` here.
      hysteresis: as in Megatron-LM; its asserts raise ``ValueError`` here.

    Returns:
      A dynamic [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.megatron_grad_scaler(initial_scale=8.0)
      >>> [float((s := jaxamp.update(s, False)).scale) for _ in range(3)]  # hysteresis=2
      [8.0, 4.0, 2.0]
    """
    check_bounds(
        "as Megatron-LM asserts",
        ("initial_scale", initial_scale, initial_scale > 0, "> 0"),
        ("min_scale", min_scale, min_scale > 0, "> 0"),
        (
            "min_scale",
            min_scale,
            min_scale <= initial_scale,
            f"<= initial_scale ({initial_scale!r})",
        ),
        ("growth_factor", growth_factor, growth_factor > 1, "> 1"),
        ("backoff_factor", backoff_factor, 0 < backoff_factor < 1, "in (0, 1)"),
        ("growth_interval", growth_interval, growth_interval > 0, "> 0"),
        ("hysteresis", hysteresis, hysteresis > 0, "> 0"),
    )
    check_whole("Megatron-LM", "growth_interval", growth_interval, 1)
    check_whole("Megatron-LM", "hysteresis", hysteresis, 1)
    return system_state(
        "Megatron",
        scale=initial_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
    )


@checked_args("Apex")
def apex_loss_scaler(
    loss_scale: float | str = "dynamic",
    init_scale: float = 2.0**16,
    scale_factor: float = 2.0,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> LossScaleState:
    """NVIDIA Apex amp's ``LossScaler`` (``apex/amp/scaler.py``, removed from Apex in 2025).

    ``loss_scale="dynamic"`` (the default of ``amp.initialize`` at opt levels O1
    and O2; the class itself has none): start at ``min(max_loss_scale,
    init_scale)``, halve on every overflow (floor ``min_loss_scale`` when it is set
    and non-zero), double after ``scale_window`` clean steps in a row, never above
    ``max_loss_scale``. As in Apex, the factor is always 2: ``scale_factor`` is
    accepted (and type-checked) but unused.

    ``loss_scale=<number>``: a fixed scale, and, as in Apex, nothing is checked and
    no step is skipped (``static_scale(loss_scale, check_finite=False)``).

    Deviations: with ``min_loss_scale=None`` the scale stops shrinking at ``2**-126``
    (Apex's Python float goes on to 0). ``amp.initialize`` turns a numeric string
    such as ``"128.0"`` into a float; here pass the number. ``scale_window < 1`` and
    ``init_scale < min_loss_scale`` raise.

    Args:
      loss_scale: ``"dynamic"`` or a fixed scale.
      init_scale: as in Apex.
      scale_factor: as in Apex.
      scale_window: as in Apex.
      min_loss_scale: as in Apex.
      max_loss_scale: as in Apex.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState], dynamic or static.

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.apex_loss_scaler()
      >>> float(s.scale), int(s.growth_interval), float(s.max_scale)
      (65536.0, 2000, 16777216.0)
    """
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(
                f'loss_scale must be "dynamic" or a number (Apex), got {loss_scale!r}; '
                "pass a fixed scale as a number."
            )
    else:
        check_numbers("Apex", loss_scale=loss_scale)
    check_bounds("Apex", ("max_loss_scale", max_loss_scale, max_loss_scale > 0, "> 0"))
    if not isinstance(loss_scale, str):
        return fixed_state(Mode.STATIC_UNCHECKED, loss_scale, {"scale": "loss_scale"})
    check_whole("Apex", "scale_window", scale_window, 1)
    return system_state(
        "Apex",
        scale=min(max_loss_scale, init_scale),
        growth_interval=scale_window,
        min_scale=min_loss_scale or 0.0,
        max_scale=max_loss_scale,
    )
