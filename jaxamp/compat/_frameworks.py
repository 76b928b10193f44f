"""``jaxamp.compat``: PyTorch, Paddle, MegEngine, MindSpore, Flax, jmp and Keras scalers."""

from __future__ import annotations

import math

import numpy as np

from jaxamp.compat._paddle import paddle_grad_scaler
from jaxamp.compat._table import SYSTEMS, check_bounds, check_whole, checked_args, system_state
from jaxamp.loss_scale import LossScaleState, Mode, no_scale, static_scale

__all__ = [
    "flax_dynamic_scale",
    "jmp_dynamic_loss_scale",
    "keras_loss_scale_optimizer",
    "megengine_grad_scaler",
    "mindspore_dynamic",
    "mindspore_fixed",
    "paddle_grad_scaler",
    "torch_grad_scaler",
]


@checked_args(
    "PyTorch",
    strings={
        "init_scale": "torch.amp.GradScaler's first argument is the device, which JAX "
        "chooses itself. Drop it and name the rest: "
        "jaxamp.compat.torch_grad_scaler(init_scale=2.0**16, growth_interval=2000)."
    },
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
      init_scale: as in PyTorch.
      growth_factor: as in PyTorch.
      backoff_factor: as in PyTorch.
      growth_interval: as in PyTorch.
      enabled: as in PyTorch.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState] (``no_scale()`` when ``enabled=False``).

    Examples:
      >>> import jaxamp
      >>> float(jaxamp.compat.torch_grad_scaler().scale)
      65536.0
    """
    if not enabled:
        return no_scale()
    check_bounds(
        "as in PyTorch",
        ("growth_factor", growth_factor, growth_factor > 1.0, "> 1.0"),
        ("backoff_factor", backoff_factor, backoff_factor < 1.0, "< 1.0"),
    )
    return system_state(
        "PyTorch",
        scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )


@checked_args("MegEngine")
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
      init_scale: as in MegEngine.
      growth_factor: as in MegEngine.
      backoff_factor: as in MegEngine.
      growth_interval: as in MegEngine.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> jaxamp.compat.megengine_grad_scaler(growth_factor=0).dynamic
      False
    """
    if growth_interval == 0:
        return static_scale(init_scale, check_finite=False)
    if growth_factor == 0:
        return static_scale(init_scale, check_finite=True)
    if growth_interval < 0:
        raise ValueError(f"growth_interval must be >= 0, got {growth_interval!r}.")
    return system_state(
        "MegEngine",
        scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )


@checked_args("MindSpore")
def mindspore_fixed(loss_scale: float = 128.0, drop_overflow_update: bool = True) -> LossScaleState:
    """``mindspore.FixedLossScaleManager``.

    Args:
      loss_scale: the fixed scale, >= 1.
      drop_overflow_update: skip the update of an overflowing step (True), or apply
        every step unchecked (False).

    Returns:
      A static [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> float(jaxamp.compat.mindspore_fixed().scale)
      128.0
    """
    check_bounds("as in MindSpore", ("loss_scale", loss_scale, loss_scale >= 1, ">= 1"))
    return static_scale(loss_scale, check_finite=bool(drop_overflow_update))


@checked_args("MindSpore")
def mindspore_dynamic(
    init_loss_scale: float = 2.0**24, scale_factor: int = 2, scale_window: int = 2000
) -> LossScaleState:
    """``mindspore.DynamicLossScaleManager``.

    Backs off by ``1/scale_factor`` (floor 1) on every overflow, grows by
    ``scale_factor`` after ``scale_window`` clean steps, and treats more than 1000
    overflows in a row as an error (``max_consecutive_nonfinite=1000``, reported by
    [`jaxamp.check_health`][jaxamp.check_health]). Unlike MindSpore's Python float, the float32
    scale stops growing before it would overflow.

    Args:
      init_loss_scale: at least 1.
      scale_factor: more than 1 (a factor of exactly 1 gives a fixed scale, as in MindSpore).
      scale_window: a positive integer.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> int(jaxamp.compat.mindspore_dynamic().max_consecutive_nonfinite)
      1000
    """
    check_bounds(
        "as in MindSpore",
        ("init_loss_scale", init_loss_scale, init_loss_scale >= 1.0, ">= 1"),
    )
    check_whole("MindSpore", "scale_window", scale_window, 1)
    check_bounds("as in MindSpore", ("scale_factor", scale_factor, scale_factor > 0, "> 0"))
    if scale_factor < 1:
        raise ValueError(
            f"scale_factor must be >= 1, got {scale_factor!r}: a factor below 1 would shrink "
            "the scale on clean steps and grow it on overflow."
        )
    if scale_factor == 1:
        state = static_scale(init_loss_scale)
        return state.replace(
            max_consecutive_nonfinite=SYSTEMS["MindSpore"][1]["max_consecutive_nonfinite"]
        )
    return system_state(
        "MindSpore",
        scale=init_loss_scale,
        growth_factor=float(scale_factor),
        backoff_factor=1.0 / scale_factor,
        growth_interval=scale_window,
    )


# The float32 tiny that Flax's DynamicScale uses as its default minimum_scale (2**-126).
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


@checked_args("Flax")
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
    ``2**-126``, jaxamp's own floor) and restarts the count.

    Deviations: Flax caps the scale at float32's max; here it stops at ``2**126``.
    With ``minimum_scale=None`` (or below ``2**-126``) Flax can shrink the scale to 0;
    here it stops at ``2**-126``. Flax takes any values; here ``growth_factor <= 1``,
    ``backoff_factor`` outside (0, 1), a negative ``growth_interval`` (Flax would
    never grow), ``fin_steps`` outside [0, growth_interval] and ``scale <
    minimum_scale`` raise.

    Args:
      growth_factor: as in Flax.
      backoff_factor: as in Flax.
      growth_interval: as in Flax.
      fin_steps: as in Flax.
      scale: as in Flax.
      minimum_scale: as in Flax.

    Returns:
      A dynamic [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.flax_dynamic_scale(growth_interval=1, scale=2.0)
      >>> tuple(float((s := jaxamp.update(s, True)).scale) for _ in range(4))
      (2.0, 4.0, 4.0, 8.0)
    """
    check_whole("Flax", "growth_interval", growth_interval, 0)
    check_whole("Flax", "fin_steps", fin_steps, 0)
    if fin_steps > growth_interval:
        raise ValueError(
            f"fin_steps ({fin_steps!r}) must be <= growth_interval ({growth_interval!r}) (Flax)."
        )
    state = system_state(
        "Flax",
        scale=scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=int(growth_interval) + 1,
        min_scale=0.0 if minimum_scale is None else minimum_scale,
    )
    return state.replace(growth_tracker=int(fin_steps))


@checked_args("jmp")
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
    can reach ``2**127``); here it stops at ``2**126``, and with ``min_loss_scale`` below
    ``2**-126`` it stops shrinking at ``2**-126``. A ``factor`` that is not a power of two
    backs off by multiplying with float32 ``1 / factor``, which can differ from
    jmp's division in the last bit. ``period < 1``, ``counter`` outside [0, period),
    ``factor < 1`` and ``loss_scale < min_loss_scale`` raise.

    Args:
      loss_scale: as in jmp.
      counter: as in jmp.
      period: as in jmp.
      factor: as in jmp.
      min_loss_scale: as in jmp.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.jmp_dynamic_loss_scale(2.0**15, period=1)
      >>> float(jaxamp.update(s, True).scale), float(jaxamp.update(s, False).scale)
      (65536.0, 16384.0)
    """
    check_whole("jmp", "period", period, 1)
    check_whole("jmp", "counter", counter, 0)
    if counter >= period:
        raise ValueError(f"counter ({counter!r}) must be < period ({period!r}) (jmp).")
    if not 1 <= factor < math.inf:
        raise ValueError(
            f"factor must be finite and >= 1 (jmp multiplies the scale by it on growth and "
            f"divides by it on overflow), got {factor!r}."
        )
    config = {"scale": loss_scale, "growth_interval": period, "min_scale": min_loss_scale}
    if factor == 1:
        # The scale never moves; only the check remains (jaxamp's static mode).
        state = system_state("jmp", Mode.STATIC, growth_factor=2.0, backoff_factor=0.5, **config)
        if not float(min_loss_scale) <= float(np.asarray(loss_scale)):
            raise ValueError(
                f"loss_scale ({loss_scale!r}) must be >= min_loss_scale ({min_loss_scale!r})."
            )
        return state
    state = system_state(
        "jmp", growth_factor=float(factor), backoff_factor=1.0 / float(factor), **config
    )
    return state.replace(growth_tracker=int(counter))


@checked_args("Keras")
def keras_loss_scale_optimizer(
    initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000
) -> LossScaleState:
    """Keras 3's ``LossScaleOptimizer`` (``keras/src/optimizers/loss_scale_optimizer.py``).

    Mapping: the scale doubles after ``dynamic_growth_steps`` clean steps in a row
    and halves on every overflow, which restarts the count. Wrap the inner optax
    optimizer with [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] for the rest of what Keras's
    wrapper does (skip the step, unscale the gradients).

    Deviations: Keras has no floor and no ceiling: its float32 scale can halve
    down to 0 (after which every unscaled gradient is inf or NaN and training
    cannot recover) or double up to inf. jaxamp keeps the scale in
    ``[2**-126, 2**126]`` and so never reaches 0. Keras checks the scaled gradients and
    jaxamp the unscaled ones; the two agree unless the scale is below 1.
    ``dynamic_growth_steps < 1`` (Keras would then never grow) raises.

    Args:
      initial_scale: as in Keras.
      dynamic_growth_steps: as in Keras.

    Returns:
      A dynamic [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.compat.keras_loss_scale_optimizer(initial_scale=2.0**-126)
      >>> float(jaxamp.update(s, False).scale) == 2.0**-126  # Keras would reach 0
      True
    """
    check_whole("Keras", "dynamic_growth_steps", dynamic_growth_steps, 1)
    return system_state("Keras", scale=initial_scale, growth_interval=dynamic_growth_steps)
