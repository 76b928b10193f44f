"""The loss-scale state: an immutable pytree, the table of its fields, its one validated builder.

The state is a frozen dataclass registered as a pytree. Every number in it, the
configuration included, is an array *leaf*: it survives ``jit``, ``scan`` and
orbax checkpoints with the counters, and ``state.replace(growth_factor=4.0)``
changes it at run time without recompiling (unlike jmp, whose ``min_loss_scale``
is aux data and is lost through ``jit``). Only the [`Mode`][jaxamp.types.Mode] is static, because
it changes the program; nothing static is derived from the leaves, so nothing can
go stale through ``replace``, unflattening or a checkpoint restore.

Every path that makes a state (the constructors, ``jaxamp.compat``, ``replace``)
goes through :func:`build`, which checks each field against one table (``FIELDS``).
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.errors import with_article
from jaxamp._utils.tree import INT32_MAX, is_tracer

__all__ = ["LossScaleState", "Mode"]

SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126
HYSTERESIS_REFILL = ("growth", "finite", "finite_and_backoff")
# max_consecutive_nonfinite, kept as an int32 leaf: None (check_health's default
# rule) is -1; "never" (math.inf) is INT32_MAX, a streak the saturating counter
# never exceeds.
DEFAULT_RULE = -1
NEVER = INT32_MAX
# check_health's default rule: more than this many non-finite steps in a row while
# the scale can go no lower (at its floor, or fixed). The parameters and optimizer
# state do not change during a streak; only the batches and the scale do, so once
# the scale is pinned, this many bad batches in a row means the run is stuck.
DEFAULT_PINNED_STREAK = 100


class Mode(enum.StrEnum):
    """How a [`LossScaleState`][jaxamp.LossScaleState] acts; each mode is one meaningful
    combination.

    A ``StrEnum``, so ``state.mode == "dynamic"`` works.

    Examples:
      >>> import jaxamp
      >>> jaxamp.static_scale(8.0).mode == "static", jaxamp.no_scale().mode.value
      (True, 'disabled')
    """

    DYNAMIC = "dynamic"  # scaled; the scale moves; non-finite steps are skipped
    STATIC = "static"  # scaled by a fixed scale; non-finite steps are skipped
    STATIC_UNCHECKED = "static_unchecked"  # fixed scale; nothing checked, every step applied
    CHECK_ONLY = "check_only"  # not scaled; non-finite steps are skipped (bfloat16)
    DISABLED = "disabled"  # not scaled, nothing checked: GradScaler(enabled=False)

    @property
    def scales(self) -> bool:
        return self in (Mode.DYNAMIC, Mode.STATIC, Mode.STATIC_UNCHECKED)

    @property
    def checks(self) -> bool:
        return self in (Mode.DYNAMIC, Mode.STATIC, Mode.CHECK_ONLY)


class _Field(NamedTuple):
    dtype: Any
    ok: Callable[[float], bool]
    wants: str


def _integer(ok: Callable[[float], bool]) -> Callable[[float], bool]:
    return lambda v: float(v).is_integer() and ok(v)


_counter = _integer(lambda v: 0 <= v <= INT32_MAX)
_COUNTER = "an integer in [0, 2**31 - 1]"

# The one table every path that builds a state validates against.
FIELDS: dict[str, _Field] = {
    "scale": _Field(
        jnp.float32,
        lambda v: SCALE_MIN <= v <= SCALE_MAX,
        "finite and in [2**-126, 2**126] (so that 1/scale is a normal float32)",
    ),
    "growth_tracker": _Field(jnp.int32, _counter, _COUNTER),
    "hysteresis_tracker": _Field(jnp.int32, _counter, _COUNTER),
    "nonfinite_streak": _Field(jnp.int32, _counter, _COUNTER),
    "skipped_steps": _Field(jnp.int32, _counter, _COUNTER),
    "min_scale_backoffs": _Field(jnp.int32, _counter, _COUNTER),
    "growth_factor": _Field(jnp.float32, lambda v: 1 < v < np.inf, "finite and > 1"),
    "backoff_factor": _Field(jnp.float32, lambda v: 0 < v < 1, "in (0, 1)"),
    "growth_interval": _Field(
        jnp.int32, _integer(lambda v: 1 <= v < 2**31), "an integer >= 1 (int32)"
    ),
    "hysteresis": _Field(jnp.int32, _integer(lambda v: 1 <= v < 2**31), "an integer >= 1 (int32)"),
    "hysteresis_refill": _Field(
        jnp.int32,
        _integer(lambda v: 0 <= v < len(HYSTERESIS_REFILL)),
        f"one of {HYSTERESIS_REFILL}",
    ),
    "min_scale": _Field(jnp.float32, lambda v: 0 <= v < np.inf, "finite and >= 0"),
    "max_scale": _Field(jnp.float32, lambda v: v > 0, "> 0 (inf allowed)"),
    "max_consecutive_nonfinite": _Field(
        jnp.int32,
        _integer(lambda v: 0 <= v < 2**31),
        "None (the default rule), an integer >= 0 or math.inf (never raise)",
    ),
    "raise_at_min_scale": _Field(jnp.bool_, lambda v: True, "a bool"),
}
FIELD_NAMES: tuple[str, ...] = tuple(FIELDS)


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """Loss-scale state: counters, run-time configuration and mode.

    Build it with [`dynamic_scale`][jaxamp.dynamic_scale], [`static_scale`][jaxamp.static_scale],
    [`no_scale`][jaxamp.no_scale] or a [`jaxamp.compat`][jaxamp.compat] constructor, and change it
    with [`replace`][jaxamp.LossScaleState.replace]; both validate every field. Unflattening
    (``jax.tree.map``, orbax placeholders) validates nothing, so trees of sizes or
    ``ShapeDtypeStruct`` work.

    Attributes:
      scale: float32, the current loss scale.
      growth_tracker: int32, consecutive finite steps since the last growth or backoff.
      hysteresis_tracker: int32, non-finite steps still tolerated before the next backoff.
      nonfinite_streak: int32, consecutive non-finite steps (reset by a finite step).
      skipped_steps: int32, total steps whose update was skipped.
      min_scale_backoffs: int32, backoffs that found the scale already at its floor.
      growth_factor: float32 configuration.
      backoff_factor: float32 configuration.
      min_scale: float32 configuration.
      max_scale: float32 configuration.
      growth_interval: int32 configuration.
      hysteresis: int32 configuration.
      hysteresis_refill: int32 index into ``("growth", "finite", "finite_and_backoff")``:
        what restores the hysteresis allowance (see [`dynamic_scale`][jaxamp.dynamic_scale]).
      max_consecutive_nonfinite: int32; -1 is None ([`check_health`][jaxamp.check_health]'s default
        rule), ``2**31 - 1`` is ``math.inf`` (never raise).
      raise_at_min_scale: bool; [`check_health`][jaxamp.check_health] raises once a backoff found
        the scale at its floor (DeepSpeed's ``raise_error_at_min_scale``).
      mode: static, a [`Mode`][jaxamp.types.Mode].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(init_scale=2.0**10).replace(growth_interval=500)
      >>> float(s.scale), int(s.growth_interval), s.mode
      (1024.0, 500, <Mode.DYNAMIC: 'dynamic'>)
    """

    scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    nonfinite_streak: jax.Array
    skipped_steps: jax.Array
    min_scale_backoffs: jax.Array
    growth_factor: jax.Array
    backoff_factor: jax.Array
    growth_interval: jax.Array
    hysteresis: jax.Array
    hysteresis_refill: jax.Array
    min_scale: jax.Array
    max_scale: jax.Array
    max_consecutive_nonfinite: jax.Array
    raise_at_min_scale: jax.Array
    mode: Mode = Mode.DYNAMIC

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _as_mode(self.mode, "mode"))

    @property
    def dynamic(self) -> bool:
        """Whether [`update`][jaxamp.update] moves the scale."""
        return self.mode is Mode.DYNAMIC

    @property
    def enabled(self) -> bool:
        """Whether [`scale`][jaxamp.scale] and [`unscale_and_check`][jaxamp.unscale_and_check] scale
        at all."""
        return self.mode.scales

    @property
    def check_finite(self) -> bool:
        """Whether gradients are checked and non-finite steps skipped: the constructors'
        ``check_finite`` (``jaxamp.static_scale(check_finite=)``)."""
        return self.mode.checks

    @property
    def skip_nonfinite(self) -> bool:
        """Deprecated: ``check_finite`` (the name of the function that guards an optimizer
        is not that of a flag). Until jaxamp 0.5, with a ``DeprecationWarning``."""
        warnings.warn(
            "LossScaleState.skip_nonfinite is deprecated and will be removed in jaxamp 0.5: "
            "read state.check_finite (as static_scale(check_finite=) sets it).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.check_finite

    def __float__(self) -> float:
        # PyTorch's scaler.get_scale() is a float; here the scale is one field of the state.
        raise TypeError(
            "float() of a LossScaleState: the state holds the scale and its counters. The "
            "scale is its .scale field: float(jaxamp.get_loss_scale(opt_state).scale)."
        )

    def replace(self, **updates: Any) -> LossScaleState:
        """A validated copy with some fields replaced, e.g. ``state.replace(growth_factor=4.0)``.

        PyTorch's ``set_growth_factor`` and friends. Each new value is checked like
        the constructors' arguments and stored as a fresh array of the field's
        dtype, so the state keeps its leaf types through ``jit`` and ``scan``; the
        result must be a consistent state (``min_scale <= max_scale``, the scale
        within its bounds, counters >= 0). ``mode=`` switches the [`Mode`][jaxamp.types.Mode].

        Raises:
          TypeError: an unknown field, or a value of the wrong type.
          ValueError: a value out of range, or an inconsistent result.
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(updates) - known)
        if unknown:
            hint = ""
            if set(unknown) & {"enabled", "dynamic", "skip_nonfinite"}:
                hint = f" Change the mode with mode=, one of {[m.value for m in Mode]}."
            raise TypeError(f"LossScaleState has no field(s) {unknown}.{hint}")
        mode = _as_mode(updates.pop("mode", self.mode), "mode")
        values = {name: getattr(self, name) for name in FIELDS}
        if mode is self.mode:
            return build(mode, values, updates, names={})
        try:
            return build(mode, values, updates, names={})
        except ValueError as e:
            raise ValueError(f"mode={mode.value!r} does not fit this state: {e}") from None


jax.tree_util.register_dataclass(LossScaleState, data_fields=list(FIELDS), meta_fields=["mode"])


def _as_mode(value: Any, label: str) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(
            f"{label} must be one of {[m.value for m in Mode]}, got {value!r}."
        ) from None


def _concrete(x: Any) -> float | None:
    """The Python number behind a scalar leaf, or None for a tracer."""
    if is_tracer(x):
        return None
    return np.asarray(jax.device_get(x)).item()


def _concrete_all(leaves: dict[str, Any]) -> dict[str, float | None]:
    """Every leaf as a Python number (one transfer), tracers as None."""
    host = jax.device_get({f: x for f, x in leaves.items() if not is_tracer(x)})
    return {f: np.asarray(host[f]).item() if f in host else None for f in leaves}


def _coerce(name: str, value: Any, label: str) -> jax.Array:
    """One field's new value, checked against the table and copied into a fresh array."""
    spec = FIELDS[name]
    if name == "max_consecutive_nonfinite":
        if value is None:
            return jnp.array(DEFAULT_RULE, spec.dtype)
        if isinstance(value, float | np.floating) and value == np.inf:
            return jnp.array(NEVER, spec.dtype)
    if name == "hysteresis_refill" and isinstance(value, str):
        if value not in HYSTERESIS_REFILL:
            raise ValueError(f"{label} must be one of {HYSTERESIS_REFILL}, got {value!r}.")
        value = HYSTERESIS_REFILL.index(value)
    if isinstance(value, bool | np.bool_) or getattr(value, "dtype", None) == np.bool_:
        if spec.dtype is not jnp.bool_:
            raise TypeError(f"{label} must be a number ({spec.wants}), got the bool {value!r}.")
    elif spec.dtype is jnp.bool_:
        raise TypeError(f"{label} must be a bool, got {value!r}.")
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        if value.shape != ():
            raise ValueError(f"{label} must be a scalar, got an array of shape {value.shape}.")
        kind = np.dtype(value.dtype).kind
        if kind not in "biuf" or (kind == "f" and spec.dtype is jnp.int32):
            raise TypeError(f"{label} must be {spec.wants}, got an array of dtype {value.dtype}.")
    elif not isinstance(value, int | float | bool):
        raise TypeError(f"{label} must be {spec.wants}, got {type(value).__name__} {value!r}.")
    v = _concrete(value)
    # Checked as given and as stored: 1e39 is inf in float32, 1e-50 is 0.
    ok = v is None or spec.ok(v) and spec.ok(np.asarray(v).astype(np.dtype(spec.dtype)).item())
    if not ok:
        raise ValueError(f"{label} must be {spec.wants}, got {value!r}.")
    return jnp.array(value, spec.dtype)


def build(
    mode: Mode, values: dict[str, Any], updates: Mapping[str, Any], names: Mapping[str, str]
) -> LossScaleState:
    """The one validated constructor: new ``updates`` over ``values``, then cross-checks.

    ``names`` maps field names to the caller's argument names, so errors speak the
    caller's vocabulary (``init_scale``, ``incr_ratio``, ...).
    """
    label = lambda f: names.get(f, f)
    leaves = {f: jnp.array(v, copy=True) for f, v in values.items() if f not in updates}
    leaves.update({f: _coerce(f, v, label(f)) for f, v in updates.items()})
    v = _concrete_all(leaves)
    lo, hi, s = v["min_scale"], v["max_scale"], v["scale"]
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{label('min_scale')} ({lo}) must be <= {label('max_scale')} ({hi}).")
    if mode is Mode.DYNAMIC and None not in (lo, hi, s) and not lo <= s <= hi:
        raise ValueError(
            f"{label('scale')} ({s}) must lie in [{label('min_scale')}, {label('max_scale')}]"
            f" = [{lo}, {hi}]."
        )
    if not mode.scales and s is not None and s != 1:
        raise ValueError(f"{label('scale')} must be 1 in mode {mode.value!r}, got {s}.")
    h, t = v["hysteresis"], v["hysteresis_tracker"]
    if h is not None and t is not None and t > h:
        raise ValueError(
            f"{label('hysteresis_tracker')} ({t}) must be <= {label('hysteresis')} ({h})."
        )
    return LossScaleState(**leaves, mode=mode)


def fresh_state(
    mode: Mode, names: Mapping[str, str] | None = None, **config: Any
) -> LossScaleState:
    """A state with zeroed counters and a full hysteresis allowance."""
    config.setdefault("hysteresis_refill", "finite_and_backoff")
    config.setdefault("raise_at_min_scale", False)
    counters = dict.fromkeys(
        ("growth_tracker", "nonfinite_streak", "skipped_steps", "min_scale_backoffs"), 0
    )
    # Configuration first, so that a bad argument is named before anything derived from it.
    updates = {**config, **counters, "hysteresis_tracker": config["hysteresis"]}
    return build(mode, {}, updates, names or {})


def fixed_state(mode: Mode, scale: Any, names: Mapping[str, str] | None = None) -> LossScaleState:
    # A fixed scale never uses the growth settings; they only keep the leaves valid.
    return fresh_state(
        mode,
        names,
        scale=scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2**30,
        hysteresis=1,
        min_scale=0.0,
        max_scale=np.inf,
        max_consecutive_nonfinite=None,
    )


def holds_loss_scale(tree: Any) -> bool:
    """Whether ``tree`` is or holds (at any depth) a LossScaleState."""
    is_state = lambda x: isinstance(x, LossScaleState)  # noqa: E731
    return any(map(is_state, jax.tree.leaves(tree, is_leaf=is_state)))


def check_state(state: Any, fn: str) -> LossScaleState:
    """``state`` if it is a LossScaleState; else an error saying what to pass instead."""
    if isinstance(state, LossScaleState):
        return state
    got = type(state).__name__
    holds = holds_loss_scale(state)
    instead = (
        "pass the loss-scale state inside it: jaxamp.get_loss_scale(opt_state)"
        if holds
        else "make one with jaxamp.dynamic_scale / static_scale / no_scale"
    )
    raise TypeError(
        f"jaxamp.{fn}: `loss_scale` must be a LossScaleState, got {with_article(got)}"
        + (", which holds one" if holds else "")
        + f"; {instead}."
    )


COUNTER_FIELDS = (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "nonfinite_streak",
    "skipped_steps",
    "min_scale_backoffs",
)
CONFIG_FIELDS = tuple(f for f in FIELDS if f not in COUNTER_FIELDS)
