"""``jaxamp.compat.paddle_grad_scaler``: Paddle's GradScaler, under its names or PyTorch's."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

from jaxamp.compat._table import SYSTEMS, check_bounds, check_flags, check_numbers
from jaxamp.loss_scale import LossScaleState, Mode, fresh_state, no_scale

__all__ = ["paddle_grad_scaler"]

# PyTorch's names for Paddle's settings (Paddle's PyTorch conversion table).
_PADDLE_ALIASES = {
    "init_scale": "init_loss_scaling",
    "growth_factor": "incr_ratio",
    "backoff_factor": "decr_ratio",
    "growth_interval": "incr_every_n_steps",
    "enabled": "enable",
}
# Paddle 3's GradScaler defaults; Paddle 2's GradScaler has the signature's (2**15,
# 1000, 2), the contract's.
_PADDLE3_DEFAULTS = {
    "init_loss_scaling": 2.0**16,
    "incr_every_n_steps": 2000,
    "decr_every_n_nan_or_inf": 1,
}


def _paddle_spellings(f: Any) -> Any:
    """Reads which names the caller gave (the signature's defaults stay Paddle 2's):
    a setting given under both spellings is refused, PyTorch's spelling maps to
    Paddle's (and errors keep the caller's spelling), and ``defaults="paddle3"``
    fills what was not given."""
    signature = inspect.signature(f)
    paddle_names = [n for n in signature.parameters if n not in {*_PADDLE_ALIASES, "defaults"}]

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> LossScaleState:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"paddle_grad_scaler() {e}") from None
        defaults = given.pop("defaults", "paddle2")
        if defaults not in ("paddle2", "paddle3"):
            raise ValueError(
                f"paddle_grad_scaler: defaults must be 'paddle2' (the signature's, Paddle 2's "
                f"GradScaler) or 'paddle3' (Paddle 3's GradScaler), got {defaults!r}."
            )
        said = {}  # Paddle's name -> how the caller wrote it, where that differs
        for torch_name, paddle_name in _PADDLE_ALIASES.items():
            if torch_name not in given:
                continue
            if paddle_name in given:
                raise ValueError(
                    f"paddle_grad_scaler: {torch_name} and {paddle_name} name the same "
                    "setting; pass one of them."
                )
            given[paddle_name] = given.pop(torch_name)
            said[paddle_name] = f"{torch_name} (Paddle's {paddle_name})"
        if defaults == "paddle3":
            given = {**_PADDLE3_DEFAULTS, **given}
        values = {n: given.get(n, signature.parameters[n].default) for n in paddle_names}
        return _paddle(said, **values)

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
    It also takes PyTorch's names (``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``enabled``), mapped as Paddle's
    PyTorch conversion table maps them, refuses a setting given under both
    spellings, and names an argument in its errors as the caller spelled it.

    Paddle's getters read the state's fields: ``get_init_loss_scaling()`` is
    ``scale`` (before the first update), ``get_incr_ratio()`` ``growth_factor``,
    ``get_decr_ratio()`` ``backoff_factor``, ``get_incr_every_n_steps()``
    ``growth_interval``, ``get_decr_every_n_nan_or_inf()`` ``hysteresis``,
    ``is_use_dynamic_loss_scaling()`` ``dynamic`` and ``is_enable()`` ``enabled``.
    With ``use_dynamic_loss_scaling=False`` the scale is fixed and every setting is
    kept, readable as Paddle keeps it; a disabled scaler (``enable=False``) is
    ``no_scale()``, and Paddle keeps no settings for one either.

    Args:
      enable: as in Paddle.
      init_loss_scaling: as in Paddle.
      incr_ratio: as in Paddle.
      decr_ratio: as in Paddle.
      incr_every_n_steps: as in Paddle.
      decr_every_n_nan_or_inf: as in Paddle.
      use_dynamic_loss_scaling: as in Paddle.
      init_scale: PyTorch's name for ``init_loss_scaling``.
      growth_factor: PyTorch's name for ``incr_ratio``.
      backoff_factor: PyTorch's name for ``decr_ratio``.
      growth_interval: PyTorch's name for ``incr_every_n_steps``.
      enabled: PyTorch's name for ``enable``.
      defaults: ``"paddle2"`` (the signature's defaults, Paddle 2's ``GradScaler``
        ones: ``2**15`` / 1000 / 2) or ``"paddle3"``
        (Paddle 3's ``GradScaler``: ``init_loss_scaling=2**16``,
        ``incr_every_n_steps=2000``, ``decr_every_n_nan_or_inf=1``). Values you
        pass always win.

    Returns:
      A [`LossScaleState`][jaxamp.LossScaleState]: dynamic, static
      (``use_dynamic_loss_scaling=False``) or ``no_scale()`` (``enable=False``).

    Examples:
      >>> import jaxamp
      >>> int(jaxamp.compat.paddle_grad_scaler().hysteresis)
      2
      >>> s = jaxamp.compat.paddle_grad_scaler(init_scale=1024.0, defaults="paddle3")
      >>> float(s.scale), int(s.growth_interval), int(s.hysteresis)
      (1024.0, 2000, 1)
      >>> s = jaxamp.compat.paddle_grad_scaler(decr_every_n_nan_or_inf=3,
      ...                                      use_dynamic_loss_scaling=False)
      >>> s.dynamic, int(s.hysteresis), float(s.growth_factor)
      (False, 3, 2.0)
    """
    # Never runs: _paddle_spellings binds the call to this signature and builds the
    # state with _paddle, naming each argument as the caller spelled it.
    raise AssertionError("paddle_grad_scaler is built by _paddle_spellings")


def _paddle(
    said: dict[str, str],
    enable: Any,
    init_loss_scaling: Any,
    incr_ratio: Any,
    decr_ratio: Any,
    incr_every_n_steps: Any,
    decr_every_n_nan_or_inf: Any,
    use_dynamic_loss_scaling: Any,
) -> LossScaleState:
    """``paddle_grad_scaler`` on Paddle's names; ``said`` spells them as the caller did."""
    name = lambda n: said.get(n, n)
    check_flags("Paddle", **{name("enable"): enable})
    check_flags("Paddle", use_dynamic_loss_scaling=use_dynamic_loss_scaling)
    numbers = {
        "init_loss_scaling": init_loss_scaling,
        "incr_ratio": incr_ratio,
        "decr_ratio": decr_ratio,
        "incr_every_n_steps": incr_every_n_steps,
        "decr_every_n_nan_or_inf": decr_every_n_nan_or_inf,
    }
    check_numbers("Paddle", **{name(n): v for n, v in numbers.items()})
    if not enable:
        return no_scale()
    check_bounds(
        "as in Paddle",
        (name("incr_ratio"), incr_ratio, incr_ratio > 1.0, "> 1.0"),
        (name("decr_ratio"), decr_ratio, decr_ratio < 1.0, "< 1.0"),
    )
    fields, fixed = SYSTEMS["Paddle"]
    return fresh_state(
        Mode.DYNAMIC if use_dynamic_loss_scaling else Mode.STATIC,
        {field: name(paddle) for field, paddle in fields.items()},
        **{"max_scale": math.inf, "max_consecutive_nonfinite": None, **fixed},
        scale=init_loss_scaling,
        growth_factor=incr_ratio,
        backoff_factor=decr_ratio,
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
    )
