"""The table of compat constructors: each system's names and fixed settings, and the
checks every constructor runs on its arguments (``jaxamp.compat``'s plumbing)."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxamp.loss_scale import LossScaleState, Mode, fresh_state


def is_number(value: Any) -> bool:
    """A real, non-bool number: a Python int or float, a NumPy scalar or a 0-d array."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, int | float | np.integer | np.floating):
        return True
    if isinstance(value, jax.Array | np.ndarray):
        return value.shape == () and np.dtype(value.dtype).kind in "iuf"
    return False


def check_numbers(system: str, **args: Any) -> None:
    """Raises a TypeError naming the first argument that is not a real number.

    Bools, strings and None are refused here, before any comparison, so that a bad
    value is named in the original's vocabulary instead of failing deep inside.
    """
    for name, value in args.items():
        if not is_number(value):
            raise TypeError(
                f"{name} must be a real number ({system}), got {type(value).__name__} {value!r}."
            )


def check_flags(system: str, **args: Any) -> None:
    """Raises a TypeError naming the first argument that is not a bool."""
    for name, value in args.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(
                f"{name} must be a bool ({system}), got {type(value).__name__} {value!r}."
            )


def check_whole(system: str, name: str, value: Any, low: int) -> None:
    """Raises a ValueError unless ``value`` (already a number) is an integer >= ``low``."""
    v = float(np.asarray(value))
    if not (v.is_integer() and low <= v < 2**31 - 1):
        raise ValueError(f"{name} must be an integer >= {low} ({system}), got {value!r}.")


def check_bounds(source: str, *rules: tuple[str, Any, bool, str]) -> None:
    """Raises a ValueError for the first ``(name, value, ok, wants)`` rule not ``ok``:
    ``{name} must be {wants} ({source}), got {value!r}.``, ``source`` saying whose
    rule it is (``"as in PyTorch"``)."""
    for name, value, ok, wants in rules:
        if not ok:
            raise ValueError(f"{name} must be {wants} ({source}), got {value!r}.")


# One row per system: its argument name for each jaxamp field it takes (errors
# speak its words) and what it fixes without an argument. Every other field
# comes from the constructor's arguments.
SYSTEMS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "PyTorch": ({"scale": "init_scale"}, {"hysteresis": 1, "min_scale": 0.0}),
    "MegEngine": ({"scale": "init_scale"}, {"hysteresis": 1, "min_scale": 0.0}),
    "Paddle": (
        {
            "scale": "init_loss_scaling",
            "growth_factor": "incr_ratio",
            "backoff_factor": "decr_ratio",
            "growth_interval": "incr_every_n_steps",
            "hysteresis": "decr_every_n_nan_or_inf",
        },
        {"min_scale": 1.0},
    ),
    "MindSpore": (
        {"scale": "init_loss_scale", "growth_interval": "scale_window"},
        # MindSpore's DynamicLossScaleManager raises after more than 1000 overflows
        # in a row.
        {"hysteresis": 1, "min_scale": 1.0, "max_consecutive_nonfinite": 1000},
    ),
    "DeepSpeed": (
        {"scale": "init_scale", "growth_interval": "scale_window", "hysteresis": "delayed_shift"},
        {},
    ),
    "Megatron": ({"scale": "initial_scale"}, {"hysteresis_refill": "growth"}),
    "Apex": (
        {
            "scale": "init_scale",
            "growth_interval": "scale_window",
            "min_scale": "min_loss_scale",
            "max_scale": "max_loss_scale",
        },
        {"growth_factor": 2.0, "backoff_factor": 0.5, "hysteresis": 1},
    ),
    "Flax": ({"min_scale": "minimum_scale"}, {"hysteresis": 1}),
    "jmp": (
        {"scale": "loss_scale", "min_scale": "min_loss_scale", "growth_interval": "period"},
        {"hysteresis": 1},
    ),
    "Keras": (
        {"scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        {"growth_factor": 2.0, "backoff_factor": 0.5, "hysteresis": 1, "min_scale": 0.0},
    ),
}


def system_state(system: str, mode: Mode = Mode.DYNAMIC, **values: Any) -> LossScaleState:
    """A fresh state of ``system``'s row: its fixed settings, then ``values``.

    No system bounds the scale from above or stops after N overflows unless its
    row or its arguments say so.
    """
    names, fixed = SYSTEMS[system]
    config = {"max_scale": math.inf, "max_consecutive_nonfinite": None, **fixed, **values}
    return fresh_state(mode, names, **config)


def checked_args(system: str, strings: dict[str, str] | None = None) -> Callable[[Any], Any]:
    """Checks every argument against its annotation before the body runs: a
    ``float`` / ``int`` must be a real number, a ``bool`` a bool (``X | None``: or
    None), each named in ``system``'s words; a bad value never gets further.
    ``strings``: per argument, what a string there means in the original (PyTorch's
    device, where jaxamp's first argument is ``init_scale``) and what to write."""

    def wrap(f: Any) -> Any:
        signature = inspect.signature(f)

        @functools.wraps(f)
        def checked(*args: Any, **kwargs: Any) -> LossScaleState:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            for name, value in bound.arguments.items():
                kind = str(signature.parameters[name].annotation)
                if value is None and kind.endswith("| None"):
                    continue
                if isinstance(value, str) and name in (strings or {}):
                    raise TypeError(
                        f"jaxamp.compat.{f.__name__}: got {value!r} as {name}: {strings[name]}"
                    )
                if kind.startswith(("float", "int")) and "str" not in kind:
                    check_numbers(system, **{name: value})
                elif kind.startswith("bool"):
                    check_flags(system, **{name: value})
            return f(*args, **kwargs)

        return checked

    return wrap
