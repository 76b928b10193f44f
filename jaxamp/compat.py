"""Constructors that reproduce other frameworks' loss scalers, with their names and defaults.

Each returns a :class:`jaxamp.LossScaleState` whose :func:`jaxamp.update` follows the
original's rule step for step, and validates its arguments as the original does
(raising ``ValueError`` where the original asserts). An argument of the wrong type
(a string, a bool for a number, ``None`` where the original takes none) raises
``TypeError`` naming it at once. Systems: PyTorch, Paddle, MegEngine, MindSpore,
DeepSpeed, Megatron-LM, NVIDIA Apex, Flax, jmp, Keras 3. Where an original has no
floor or ceiling, the scale still stays in [2**-126, 2**126] (see each docstring).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxamp._loss_scale import (
    LossScaleState,
    Mode,
    _fixed,
    _fresh_state,
    no_scale,
    static_scale,
)

__all__ = [
    "apex_loss_scaler",
    "deepspeed_fp16_config",
    "deepspeed_loss_scaler",
    "flax_dynamic_scale",
    "jmp_dynamic_loss_scale",
    "keras_loss_scale_optimizer",
    "megatron_grad_scaler",
    "megengine_grad_scaler",
    "mindspore_dynamic",
    "mindspore_fixed",
    "paddle_grad_scaler",
    "torch_grad_scaler",
]


def _is_number(value: Any) -> bool:
    """A real, non-bool number: a Python int or float, a NumPy scalar or a 0-d array."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, int | float | np.integer | np.floating):
        return True
    if isinstance(value, jax.Array | np.ndarray):
        return value.shape == () and np.dtype(value.dtype).kind in "iuf"
    return False


def _numbers(system: str, **args: Any) -> None:
    """Raises a TypeError naming the first argument that is not a real number.

    Bools, strings and None are refused here, before any comparison, so that a bad
    value is named in the original's vocabulary instead of failing deep inside.
    """
    for name, value in args.items():
        if not _is_number(value):
            raise TypeError(
                f"{name} must be a real number ({system}), got {type(value).__name__} {value!r}."
            )


def _flags(system: str, **args: Any) -> None:
    """Raises a TypeError naming the first argument that is not a bool."""
    for name, value in args.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(
                f"{name} must be a bool ({system}), got {type(value).__name__} {value!r}."
            )


def _whole(system: str, name: str, value: Any, low: int) -> None:
    """Raises a ValueError unless ``value`` (already a number) is an integer >= ``low``."""
    v = float(np.asarray(value))
    if not (v.is_integer() and low <= v < 2**31 - 1):
        raise ValueError(f"{name} must be an integer >= {low} ({system}), got {value!r}.")


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
    _flags("PyTorch", enabled=enabled)
    _numbers(
        "PyTorch",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    if not enabled:
        return no_scale()
    if growth_factor <= 1.0:
        raise ValueError(f"growth_factor must be > 1.0 (as in PyTorch), got {growth_factor!r}.")
    if backoff_factor >= 1.0:
        raise ValueError(f"backoff_factor must be < 1.0 (as in PyTorch), got {backoff_factor!r}.")
    return _unbounded(init_scale, growth_factor, backoff_factor, growth_interval)


# Paddle 3's GradScaler also takes PyTorch's names for its settings.
_PADDLE_ALIASES = {
    "init_scale": "init_loss_scaling",
    "growth_factor": "incr_ratio",
    "backoff_factor": "decr_ratio",
    "growth_interval": "incr_every_n_steps",
    "enabled": "enable",
}
# Paddle 3's GradScaler defaults; its AmpScaler (and Paddle 2's GradScaler) keep the
# signature's (2**15, 1000, 2).
_PADDLE3_DEFAULTS = {
    "init_loss_scaling": 2.0**16,
    "incr_every_n_steps": 2000,
    "decr_every_n_nan_or_inf": 1,
}


def _paddle_spellings(f: Any) -> Any:
    """Reads which names the caller gave (the signature's defaults stay Paddle 2's):
    a setting given under both spellings is refused, PyTorch's spelling maps to
    Paddle's, and ``defaults="paddle3"`` fills what was not given."""
    signature = inspect.signature(f)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> LossScaleState:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"paddle_grad_scaler() {e}") from None
        defaults = given.pop("defaults", "paddle2")
        if defaults not in ("paddle2", "paddle3"):
            raise ValueError(
                f"paddle_grad_scaler: defaults must be 'paddle2' (the signature's, Paddle's "
                f"AmpScaler) or 'paddle3' (Paddle 3's GradScaler), got {defaults!r}."
            )
        for torch_name, paddle_name in _PADDLE_ALIASES.items():
            if torch_name not in given:
                continue
            if paddle_name in given:
                raise ValueError(
                    f"paddle_grad_scaler: {torch_name} and {paddle_name} name the same "
                    "setting; pass one of them."
                )
            given[paddle_name] = given.pop(torch_name)
        if defaults == "paddle3":
            given = {**_PADDLE3_DEFAULTS, **given}
        return f(**given)

    return wrapper


@_paddle_spellings
def paddle_grad_scaler(
    enable: bool = True,
    init_loss_scaling: float = 32768.0,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    use_dynamic_loss_scaling: bool = True,
    *,
    init_scale: float | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
    enabled: bool | None = None,
    defaults: str = "paddle2",
) -> LossScaleState:
    """``paddle.amp.GradScaler``: back off after ``decr_every_n_nan_or_inf`` bad steps, floor 1.

    Paddle's bad-step counter restarts on a clean step, which is jaxamp's hysteresis.
    As Paddle 3's ``GradScaler``, it also takes PyTorch's names (``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``) and
    refuses a setting given under both spellings.

    Args:
      enable, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
      decr_every_n_nan_or_inf, use_dynamic_loss_scaling: as in Paddle.
      init_scale, growth_factor, backoff_factor, growth_interval, enabled:
        PyTorch's names for the first five, as Paddle 3 takes them.
      defaults: ``"paddle2"`` (the signature's defaults: Paddle 2's ``GradScaler``
        and every version's ``AmpScaler``, 2**15 / 1000 / 2) or ``"paddle3"``
        (Paddle 3's ``GradScaler``: ``init_loss_scaling=2**16``,
        ``incr_every_n_steps=2000``, ``decr_every_n_nan_or_inf=1``). Values you
        pass always win.

    Returns:
      A :class:`LossScaleState`: dynamic, static (``use_dynamic_loss_scaling=False``)
      or ``no_scale()`` (``enable=False``).

    Example:
      >>> import jaxamp
      >>> int(jaxamp.compat.paddle_grad_scaler().hysteresis)
      2
      >>> s = jaxamp.compat.paddle_grad_scaler(init_scale=1024.0, defaults="paddle3")
      >>> float(s.scale), int(s.growth_interval), int(s.hysteresis)
      (1024.0, 2000, 1)
    """
    _flags("Paddle", enable=enable, use_dynamic_loss_scaling=use_dynamic_loss_scaling)
    _numbers(
        "Paddle",
        init_loss_scaling=init_loss_scaling,
        incr_ratio=incr_ratio,
        decr_ratio=decr_ratio,
        incr_every_n_steps=incr_every_n_steps,
        decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
    )
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
    _numbers(
        "MegEngine",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
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
    _numbers("MindSpore", loss_scale=loss_scale)
    _flags("MindSpore", drop_overflow_update=drop_overflow_update)
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
    _numbers(
        "MindSpore",
        init_loss_scale=init_loss_scale,
        scale_factor=scale_factor,
        scale_window=scale_window,
    )
    if init_loss_scale < 1.0:
        raise ValueError(
            f"init_loss_scale must be >= 1 (as in MindSpore), got {init_loss_scale!r}."
        )
    _whole("MindSpore", "scale_window", scale_window, 1)
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


# The float32 tiny that Flax's DynamicScale uses as its default minimum_scale (2**-126).
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


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
    stays at ``min_scale``) and :func:`jaxamp.check_health` raises
    ``FloatingPointError`` from then on: call it where you log.

    Deviations: DeepSpeed's scale is an unbounded Python float; here it stays in
    [2**-126, 2**126] (it stops growing at 2**126, and with ``min_scale=0`` stops
    shrinking at 2**-126). A ``scale_factor`` that is not a power of two backs off
    by multiplying with float32 ``1 / scale_factor`` rather than dividing, which can
    differ in the last bit. DeepSpeed accepts values it cannot run with; here they
    raise: ``scale_factor <= 1`` (growth would not grow), ``scale_window < 1``
    (DeepSpeed divides by zero), ``delayed_shift < 1`` (DeepSpeed would never back
    off), ``init_scale < min_scale``. The ``dtype`` argument (logging only) is not
    taken.

    Args:
      init_scale, scale_factor, scale_window, min_scale, delayed_shift,
      consecutive_hysteresis, raise_error_at_min_scale: as in DeepSpeed.

    Returns:
      A dynamic :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.compat.deepspeed_loss_scaler(init_scale=1.0)
      >>> jaxamp.check_health(s)
      >>> jaxamp.check_health(jaxamp.update(s, False))
      Traceback (most recent call last):
      ...
      FloatingPointError: an overflow asked for a backoff while the loss scale was already ...
    """
    _numbers(
        "DeepSpeed",
        init_scale=init_scale,
        scale_factor=scale_factor,
        scale_window=scale_window,
        min_scale=min_scale,
        delayed_shift=delayed_shift,
    )
    _flags(
        "DeepSpeed",
        consecutive_hysteresis=consecutive_hysteresis,
        raise_error_at_min_scale=raise_error_at_min_scale,
    )
    if not 1 < scale_factor < math.inf:
        raise ValueError(
            f"scale_factor must be finite and > 1 (DeepSpeed multiplies the scale by it on "
            f"growth and divides by it on overflow), got {scale_factor!r}."
        )
    _whole("DeepSpeed", "scale_window", scale_window, 1)
    _whole("DeepSpeed", "delayed_shift", delayed_shift, 1)
    return _fresh_state(
        Mode.DYNAMIC,
        {"scale": "init_scale", "growth_interval": "scale_window", "hysteresis": "delayed_shift"},
        scale=init_scale,
        growth_factor=float(scale_factor),
        backoff_factor=1.0 / float(scale_factor),
        growth_interval=scale_window,
        hysteresis=delayed_shift,
        min_scale=min_scale,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
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
    :func:`jaxamp.no_scale`; a non-zero ``loss_scale`` gives a fixed scale whose
    overflowing steps are still skipped (ZeRO checks every step); ``loss_scale=0``
    (the default) gives :func:`deepspeed_loss_scaler` with ``init_scale =
    2**initial_scale_power``, ``scale_window = loss_scale_window``, ``delayed_shift =
    hysteresis``, ``consecutive_hysteresis`` and ``min_scale = min_loss_scale``.
    As in DeepSpeed, the config defaults (``initial_scale_power=16``,
    ``loss_scale_window=1000``, ``hysteresis=2``, ``min_loss_scale=1``) apply only
    when at least one of those keys is in the block; a block with none of them
    gets ``DynamicLossScaler``'s own defaults (``2**32``, window 1000, no
    hysteresis). Other keys are ignored. DeepSpeed's optimizer without ZeRO
    (``FP16_Optimizer``) uses a different rule (no hysteresis, first growth one
    step later), which this does not reproduce.

    Args:
      fp16: the mapping under ``"fp16"`` in a DeepSpeed config.

    Returns:
      A :class:`LossScaleState`.

    Example:
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
    _flags("DeepSpeed config", enabled=enabled)
    _numbers("DeepSpeed config", loss_scale=loss_scale)
    if not enabled:
        return no_scale()
    if loss_scale != 0:
        if not loss_scale > 0:
            raise ValueError(
                f"loss_scale must be 0 (dynamic) or > 0 (DeepSpeed), got {loss_scale!r}."
            )
        return _fixed(Mode.STATIC, loss_scale, {"scale": "loss_scale"})
    if not any(key in fp16 for key in _DEEPSPEED_FP16_DYNAMIC):
        return deepspeed_loss_scaler()
    c = {key: fp16.get(key, default) for key, default in _DEEPSPEED_FP16_DYNAMIC.items()}
    _numbers(
        "DeepSpeed config",
        initial_scale_power=c["initial_scale_power"],
        loss_scale_window=c["loss_scale_window"],
        hysteresis=c["hysteresis"],
        min_loss_scale=c["min_loss_scale"],
    )
    _flags("DeepSpeed config", consecutive_hysteresis=c["consecutive_hysteresis"])
    if not -126 <= c["initial_scale_power"] <= 126:
        raise ValueError(
            f"initial_scale_power must be in [-126, 126], got {c['initial_scale_power']!r}."
        )
    names = {"loss_scale_window": "scale_window", "hysteresis": "delayed_shift"}
    for key, arg in names.items():
        try:
            _whole("DeepSpeed config", key, c[key], 1)
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
    2**126. A non-integral ``growth_interval`` (which Megatron would never reach)
    raises.

    Args:
      initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
      hysteresis: as in Megatron-LM; its asserts raise ``ValueError`` here.

    Returns:
      A dynamic :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.compat.megatron_grad_scaler(initial_scale=8.0)
      >>> [float((s := jaxamp.update(s, False)).scale) for _ in range(3)]  # hysteresis=2
      [8.0, 4.0, 2.0]
    """
    _numbers(
        "Megatron-LM",
        initial_scale=initial_scale,
        min_scale=min_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )
    asserts = (
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
    for name, value, ok, wants in asserts:
        if not ok:
            raise ValueError(f"{name} must be {wants} (as Megatron-LM asserts), got {value!r}.")
    _whole("Megatron-LM", "growth_interval", growth_interval, 1)
    _whole("Megatron-LM", "hysteresis", hysteresis, 1)
    return _fresh_state(
        Mode.DYNAMIC,
        {"scale": "initial_scale"},
        scale=initial_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
        hysteresis_refill="growth",
    )


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
    no step is skipped (``static_scale(loss_scale, skip_nonfinite=False)``).

    Deviations: with ``min_loss_scale=None`` the scale stops shrinking at 2**-126
    (Apex's Python float goes on to 0). ``amp.initialize`` turns a numeric string
    such as ``"128.0"`` into a float; here pass the number. ``scale_window < 1`` and
    ``init_scale < min_loss_scale`` raise.

    Args:
      loss_scale: ``"dynamic"`` or a fixed scale.
      init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale: as in Apex.

    Returns:
      A :class:`LossScaleState`, dynamic or static.

    Example:
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
        _numbers("Apex", loss_scale=loss_scale)
    _numbers(
        "Apex",
        init_scale=init_scale,
        scale_factor=scale_factor,
        scale_window=scale_window,
        max_loss_scale=max_loss_scale,
    )
    if min_loss_scale is not None:
        _numbers("Apex", min_loss_scale=min_loss_scale)
    if not max_loss_scale > 0:
        raise ValueError(f"max_loss_scale must be > 0 (Apex), got {max_loss_scale!r}.")
    if not isinstance(loss_scale, str):
        return _fixed(Mode.STATIC_UNCHECKED, loss_scale, {"scale": "loss_scale"})
    _whole("Apex", "scale_window", scale_window, 1)
    return _fresh_state(
        Mode.DYNAMIC,
        {
            "scale": "init_scale",
            "growth_interval": "scale_window",
            "min_scale": "min_loss_scale",
            "max_scale": "max_loss_scale",
        },
        scale=min(max_loss_scale, init_scale),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=scale_window,
        hysteresis=1,
        min_scale=min_loss_scale or 0.0,
        max_scale=max_loss_scale,
        max_consecutive_nonfinite=None,
    )


def flax_dynamic_scale(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    fin_steps: int = 0,
    scale: float = 65536.0,
    minimum_scale: float | None = _FLOAT32_TINY,
) -> LossScaleState:
    """Flax's ``flax.training.dynamic_scale.DynamicScale``, one-step-late growth included.

    Flax grows when a clean step finds ``fin_steps == growth_interval`` *before*
    counting itself, so the scale grows on the ``growth_interval + 1``-th clean step
    in a row, and that step is not counted towards the next growth. This is
    reproduced on purpose, so that a run moved from Flax keeps its trajectory:
    jaxamp's ``growth_interval`` is Flax's plus one. ``fin_steps`` is jaxamp's
    ``growth_tracker`` (pass a ``DynamicScale``'s ``fin_steps`` and ``scale`` to
    carry its state over). An overflow multiplies by ``backoff_factor`` (floor
    ``minimum_scale``; Flax's default, float32's smallest normal number, is
    2**-126, jaxamp's own floor) and restarts the count.

    Deviations: Flax caps the scale at float32's max; here it stops at 2**126.
    With ``minimum_scale=None`` (or below 2**-126) Flax can shrink the scale to 0;
    here it stops at 2**-126. Flax takes any values; here ``growth_factor <= 1``,
    ``backoff_factor`` outside (0, 1), a negative ``growth_interval`` (Flax would
    never grow), ``fin_steps`` outside [0, growth_interval] and ``scale <
    minimum_scale`` raise.

    Args:
      growth_factor, backoff_factor, growth_interval, fin_steps, scale,
      minimum_scale: as in Flax.

    Returns:
      A dynamic :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.compat.flax_dynamic_scale(growth_interval=1, scale=2.0)
      >>> [float((s := jaxamp.update(s, True)).scale) for _ in range(4)]
      [2.0, 4.0, 4.0, 8.0]
    """
    _numbers(
        "Flax",
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        fin_steps=fin_steps,
        scale=scale,
    )
    if minimum_scale is not None:
        _numbers("Flax", minimum_scale=minimum_scale)
    _whole("Flax", "growth_interval", growth_interval, 0)
    _whole("Flax", "fin_steps", fin_steps, 0)
    if fin_steps > growth_interval:
        raise ValueError(
            f"fin_steps ({fin_steps!r}) must be <= growth_interval ({growth_interval!r}) (Flax)."
        )
    state = _fresh_state(
        Mode.DYNAMIC,
        {"min_scale": "minimum_scale"},
        scale=scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=int(growth_interval) + 1,
        hysteresis=1,
        min_scale=0.0 if minimum_scale is None else minimum_scale,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
    )
    return state.replace(growth_tracker=int(fin_steps))


def jmp_dynamic_loss_scale(
    loss_scale: float,
    counter: int = 0,
    period: int = 2000,
    factor: int = 2,
    min_loss_scale: float = 1.0,
) -> LossScaleState:
    """jmp's ``DynamicLossScale`` (``jmp/_src/loss_scale.py``).

    ``loss_scale`` is required, as in jmp (its docstring starts from
    ``2.0**15``). Mapping: after ``period`` clean steps in a row the scale is
    multiplied by ``factor``; an overflow divides it by ``factor`` (floor
    ``min_loss_scale``) and restarts the count; ``counter`` is jaxamp's
    ``growth_tracker``. ``factor=1`` gives a fixed scale, as in jmp.

    Unlike jmp, whose ``min_loss_scale`` is dropped when the state passes through
    ``jit`` (it is left out of the pytree and comes back as 1), the floor here is
    an array leaf and survives ``jit``, ``scan`` and checkpoints.

    Deviations: jmp keeps the scale when growing would overflow float32 (so it
    can reach 2**127); here it stops at 2**126, and with ``min_loss_scale`` below
    2**-126 it stops shrinking at 2**-126. A ``factor`` that is not a power of two
    backs off by multiplying with float32 ``1 / factor``, which can differ from
    jmp's division in the last bit. ``period < 1``, ``counter`` outside [0, period),
    ``factor < 1`` and ``loss_scale < min_loss_scale`` raise.

    Args:
      loss_scale, counter, period, factor, min_loss_scale: as in jmp.

    Returns:
      A :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.compat.jmp_dynamic_loss_scale(2.0**15, period=1)
      >>> float(jaxamp.update(s, True).scale), float(jaxamp.update(s, False).scale)
      (65536.0, 16384.0)
    """
    _numbers(
        "jmp",
        loss_scale=loss_scale,
        counter=counter,
        period=period,
        factor=factor,
        min_loss_scale=min_loss_scale,
    )
    _whole("jmp", "period", period, 1)
    _whole("jmp", "counter", counter, 0)
    if counter >= period:
        raise ValueError(f"counter ({counter!r}) must be < period ({period!r}) (jmp).")
    if not 1 <= factor < math.inf:
        raise ValueError(
            f"factor must be finite and >= 1 (jmp multiplies the scale by it on growth and "
            f"divides by it on overflow), got {factor!r}."
        )
    names = {
        "scale": "loss_scale",
        "min_scale": "min_loss_scale",
        "growth_interval": "period",
    }
    config = {
        "scale": loss_scale,
        "growth_interval": period,
        "hysteresis": 1,
        "min_scale": min_loss_scale,
        "max_scale": math.inf,
        "max_consecutive_nonfinite": None,
    }
    if factor == 1:
        # The scale never moves; only the check remains (jaxamp's static mode).
        state = _fresh_state(Mode.STATIC, names, growth_factor=2.0, backoff_factor=0.5, **config)
        if not float(min_loss_scale) <= float(np.asarray(loss_scale)):
            raise ValueError(
                f"loss_scale ({loss_scale!r}) must be >= min_loss_scale ({min_loss_scale!r})."
            )
        return state
    state = _fresh_state(
        Mode.DYNAMIC,
        names,
        growth_factor=float(factor),
        backoff_factor=1.0 / float(factor),
        **config,
    )
    return state.replace(growth_tracker=int(counter))


def keras_loss_scale_optimizer(
    initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000
) -> LossScaleState:
    """Keras 3's ``LossScaleOptimizer`` (``keras/src/optimizers/loss_scale_optimizer.py``).

    Mapping: the scale doubles after ``dynamic_growth_steps`` clean steps in a row
    and halves on every overflow, which restarts the count. Wrap the inner optax
    optimizer with :func:`jaxamp.skip_nonfinite` for the rest of what Keras's
    wrapper does (skip the step, unscale the gradients).

    Deviations: Keras has no floor and no ceiling: its float32 scale can halve
    down to 0 (after which every unscaled gradient is inf or NaN and training
    cannot recover) or double up to inf. jaxamp keeps the scale in
    [2**-126, 2**126] and so never reaches 0. Keras checks the scaled gradients and
    jaxamp the unscaled ones; the two agree unless the scale is below 1.
    ``dynamic_growth_steps < 1`` (Keras would then never grow) raises.

    Args:
      initial_scale, dynamic_growth_steps: as in Keras.

    Returns:
      A dynamic :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.compat.keras_loss_scale_optimizer(initial_scale=2.0**-126)
      >>> float(jaxamp.update(s, False).scale) == 2.0**-126  # Keras would reach 0
      True
    """
    _numbers("Keras", initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps)
    _whole("Keras", "dynamic_growth_steps", dynamic_growth_steps, 1)
    return _fresh_state(
        Mode.DYNAMIC,
        {"scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        scale=initial_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=dynamic_growth_steps,
        hysteresis=1,
        min_scale=0.0,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
    )
