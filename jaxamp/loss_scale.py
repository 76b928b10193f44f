"""Loss scaling: an immutable state and the pure functions that drive it.

The state is a frozen dataclass registered as a pytree. Unlike jmp (whose
``min_loss_scale`` lives in pytree aux data and is lost through ``jit``), every
numeric setting is an array *leaf*: it survives ``jit``, ``scan`` and orbax
checkpoints together with the counters, and ``state.replace(growth_factor=4.0)``
changes it at run time without recompiling. Only the mode (dynamic, enabled,
whether non-finite steps are skipped) is static, because it changes the program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.tree import all_finite, map_float_leaves

__all__ = [
    "LossScaleState",
    "check_health",
    "dynamic_scale",
    "metrics",
    "no_scale",
    "scale",
    "static_scale",
    "unscale_and_check",
    "update",
]

# max_consecutive_nonfinite=None is stored as this sentinel so the field stays an int32 leaf.
_UNLIMITED = -1

_FLOAT_FIELDS = ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")
_INT_FIELDS = (
    "growth_tracker",
    "hysteresis_tracker",
    "nonfinite_streak",
    "skipped_steps",
    "growth_interval",
    "hysteresis",
    "max_consecutive_nonfinite",
)


def _is_python_number(x: Any) -> bool:
    return isinstance(x, int | float | np.number) and not isinstance(x, bool)


def _check_number(name: str, value: Any) -> None:
    """Validates one setting given as a Python number; arrays and tracers are trusted."""
    if isinstance(value, bool) or not (_is_python_number(value) or value is None):
        return
    if name == "max_consecutive_nonfinite":
        if value is not None and (int(value) != value or value < 0):
            raise ValueError(
                f"max_consecutive_nonfinite must be None or an integer >= 0, got {value!r}."
            )
        return
    v = float(value)
    if name == "scale" and not (math.isfinite(v) and v > 0):
        raise ValueError(f"init_scale must be finite and > 0, got {value!r}.")
    if name == "growth_factor" and not (math.isfinite(v) and v > 1):
        raise ValueError(f"growth_factor must be finite and > 1, got {value!r}.")
    if name == "backoff_factor" and not 0 < v < 1:
        raise ValueError(f"backoff_factor must be in (0, 1), got {value!r}.")
    if name in ("growth_interval", "hysteresis") and (v != int(v) or v < 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if name == "min_scale" and not (math.isfinite(v) and v >= 0):
        raise ValueError(f"min_scale must be finite and >= 0, got {value!r}.")
    if name == "max_scale" and not v > 0:
        raise ValueError(f"max_scale must be > 0 (inf allowed), got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """Loss-scale state: counters, run-time configuration and mode.

    Build it with :func:`dynamic_scale`, :func:`static_scale`, :func:`no_scale`
    or a :mod:`jaxamp.compat` constructor rather than directly.

    Attributes:
      scale: float32 scalar, the current loss scale.
      growth_tracker: int32, consecutive finite steps since the last growth or backoff.
      hysteresis_tracker: int32, non-finite steps still tolerated before the next backoff.
      nonfinite_streak: int32, consecutive non-finite steps (reset by a finite step).
      skipped_steps: int32, total steps whose update was skipped.
      growth_factor, backoff_factor, min_scale, max_scale: float32 scalars.
      growth_interval, hysteresis: int32 scalars.
      max_consecutive_nonfinite: int32 scalar; -1 means unlimited.
      dynamic: static; whether :func:`update` moves the scale.
      enabled: static; whether :func:`scale` and :func:`unscale_and_check` scale at all.
      skip_nonfinite: static; whether gradients are checked and non-finite steps skipped.
      scale_may_drop_below_one: static; derived from ``scale`` and ``min_scale``. Below 1,
        unscaling multiplies by more than 1 and can overflow, so the check must read
        the unscaled gradients; otherwise it reads the scaled ones (cheaper).
    """

    scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    nonfinite_streak: jax.Array
    skipped_steps: jax.Array
    growth_factor: jax.Array
    backoff_factor: jax.Array
    growth_interval: jax.Array
    hysteresis: jax.Array
    min_scale: jax.Array
    max_scale: jax.Array
    max_consecutive_nonfinite: jax.Array
    dynamic: bool = True
    enabled: bool = True
    skip_nonfinite: bool = True
    scale_may_drop_below_one: bool = False

    def replace(self, **updates: Any) -> LossScaleState:
        """A copy with some fields replaced, e.g. ``state.replace(growth_factor=4.0)``.

        Python numbers are validated like the constructors' arguments and stored as
        arrays of the field's dtype, so the new state keeps its leaf types through
        ``jit`` and ``scan`` (PyTorch's ``set_growth_factor`` and friends).
        """
        unknown = set(updates) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"LossScaleState has no field(s) {sorted(unknown)}.")
        if "scale" in updates or "min_scale" in updates:
            updates.setdefault(
                "scale_may_drop_below_one",
                self.scale_may_drop_below_one
                or any(_below_one(updates.get(k)) for k in ("scale", "min_scale")),
            )
        return dataclasses.replace(self, **_as_leaves(updates))


# The mode changes the program, so it is static (aux data, compared by jit's cache);
# every number is a leaf.
jax.tree_util.register_dataclass(
    LossScaleState,
    data_fields=list(_FLOAT_FIELDS + _INT_FIELDS),
    meta_fields=["dynamic", "enabled", "skip_nonfinite", "scale_may_drop_below_one"],
)


def _below_one(value: Any) -> bool:
    """Whether a new scale or min_scale may be below 1 (unknown values: assume so)."""
    if value is None:
        return False
    return not _is_python_number(value) or value < 1


def _as_leaves(fields: dict[str, Any]) -> dict[str, Any]:
    # Only construction and `replace` pass through here, never unflattening, so
    # tree maps that put other values in the leaves (None, sizes) are left alone.
    out = dict(fields)
    for name, value in fields.items():
        if name not in _FLOAT_FIELDS + _INT_FIELDS:
            continue
        if name == "max_consecutive_nonfinite" and value is None:
            value = _UNLIMITED
        elif _is_python_number(value):
            _check_number(name, value)
        else:
            continue
        dtype = jnp.float32 if name in _FLOAT_FIELDS else jnp.int32
        out[name] = jnp.asarray(value, dtype)
    return out


def _state(
    *,
    scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
    max_consecutive_nonfinite: int | None,
    dynamic: bool,
    enabled: bool,
    skip_nonfinite: bool,
) -> LossScaleState:
    # The bounds first, so a bad one is named before the cross-checks; `_as_leaves`
    # validates every other field.
    for name, value in (("scale", scale), ("min_scale", min_scale), ("max_scale", max_scale)):
        _check_number(name, value)
    if _is_python_number(min_scale) and _is_python_number(max_scale) and min_scale > max_scale:
        raise ValueError(f"min_scale ({min_scale}) must be <= max_scale ({max_scale}).")
    if _is_python_number(scale) and _is_python_number(min_scale) and dynamic:
        if not min_scale <= scale <= max_scale:
            raise ValueError(
                f"init_scale ({scale}) must lie in [min_scale, max_scale] = "
                f"[{min_scale}, {max_scale}]."
            )
    return LossScaleState(
        **_as_leaves(
            dict(
                scale=scale,
                growth_tracker=0,
                hysteresis_tracker=hysteresis,
                nonfinite_streak=0,
                skipped_steps=0,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                min_scale=min_scale,
                max_scale=max_scale,
                max_consecutive_nonfinite=max_consecutive_nonfinite,
                dynamic=dynamic,
                enabled=enabled,
                skip_nonfinite=skip_nonfinite,
                scale_may_drop_below_one=_below_one(scale) or (dynamic and _below_one(min_scale)),
            )
        )
    )


def dynamic_scale(
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    max_consecutive_nonfinite: int | None = None,
) -> LossScaleState:
    """Dynamic loss scaling: grow after clean stretches, back off on overflow.

    Args:
      init_scale: the starting scale; finite, > 0, within [min_scale, max_scale].
      growth_factor: multiplier (> 1) applied after ``growth_interval`` finite steps in a row.
      backoff_factor: multiplier in (0, 1) applied on overflow.
      growth_interval: finite steps in a row (>= 1) before each growth.
      hysteresis: non-finite steps (>= 1) tolerated before a backoff; a finite step
        restores the allowance (Megatron's and Paddle's ``decr_every_n_nan_or_inf``).
      min_scale: lower bound of the scale (>= 0); the default of 1 keeps the scale
        from ever reaching 0.
      max_scale: upper bound of the scale (inf allowed).
      max_consecutive_nonfinite: if set, more than this many non-finite steps in a
        row make :func:`check_health` raise.

    Returns:
      A :class:`LossScaleState`.

    Raises:
      ValueError: naming the first argument outside its allowed range.

    Example:
      >>> import jaxamp
      >>> state = jaxamp.dynamic_scale(init_scale=2.0**12, growth_interval=100)
      >>> float(jaxamp.update(state, False).scale)
      2048.0
    """
    return _state(
        scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        max_consecutive_nonfinite=max_consecutive_nonfinite,
        dynamic=True,
        enabled=True,
        skip_nonfinite=True,
    )


def static_scale(scale: float = 2.0**15, skip_nonfinite: bool = True) -> LossScaleState:
    """A fixed loss scale that never changes.

    Args:
      scale: the loss scale; finite and > 0.
      skip_nonfinite: if True, gradients are checked and non-finite steps skipped;
        if False, nothing is checked and every step is applied (MindSpore's
        ``drop_overflow_update=False``).

    Returns:
      A :class:`LossScaleState` whose :func:`update` moves only the counters.

    Example:
      >>> import jaxamp
      >>> float(jaxamp.update(jaxamp.static_scale(128.0), False).scale)
      128.0
    """
    return _fixed(scale, enabled=True, skip_nonfinite=bool(skip_nonfinite))


def no_scale() -> LossScaleState:
    """Disabled loss scaling: scale 1, every function is a pass-through.

    Like ``torch.amp.GradScaler(enabled=False)``: :func:`scale` and
    :func:`unscale_and_check` return their input unchanged (``finite`` is always
    True, nothing is checked, no step is skipped); :func:`update` moves only the
    counters.

    Returns:
      A :class:`LossScaleState`.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.scale(jaxamp.no_scale(), jnp.array(3.0))
      Array(3., dtype=float32, weak_type=True)
    """
    return _fixed(1.0, enabled=False, skip_nonfinite=False)


def _fixed(scale: float, *, enabled: bool, skip_nonfinite: bool) -> LossScaleState:
    # The growth settings are never used by a fixed scale; they only keep the leaves valid.
    return _state(
        scale=scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2**30,
        hysteresis=1,
        min_scale=0.0,
        max_scale=math.inf,
        max_consecutive_nonfinite=None,
        dynamic=False,
        enabled=enabled,
        skip_nonfinite=skip_nonfinite,
    )


def _check_state(state: Any, fn: str) -> None:
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"jaxamp.{fn} expects a LossScaleState as its first argument (from "
            f"jaxamp.dynamic_scale / static_scale / no_scale), got {type(state).__name__}."
        )


def _wide(dtype: Any) -> Any:
    """The dtype the scale arithmetic runs in for a leaf: float32 or wider."""
    return jnp.promote_types(dtype, jnp.float32)


def scale(state: LossScaleState, tree: Any) -> Any:
    """Multiplies every floating leaf of ``tree`` by the loss scale.

    Each leaf keeps its dtype; the product is computed in float32 (or wider), so a
    float16 loss is scaled without the scale itself overflowing float16.

    Args:
      state: the loss-scale state.
      tree: a loss or any pytree; non-floating leaves pass through.

    Returns:
      ``tree`` with floating leaves multiplied by ``state.scale``.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.scale(jaxamp.static_scale(8.0), jnp.array(0.5, jnp.float16))
      Array(4., dtype=float16)
    """
    _check_state(state, "scale")
    if not state.enabled:
        return tree

    def mul(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        return (x.astype(_wide(x.dtype)) * state.scale).astype(x.dtype)

    return map_float_leaves(mul, tree)


def _unscale(state: LossScaleState, tree: Any) -> Any:
    if not state.enabled:
        return tree

    def mul(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        wide = _wide(x.dtype)
        # The reciprocal is taken in float32 (or wider): 1/2**24 underflows float16.
        inv = 1.0 / state.scale.astype(wide)
        return (x.astype(wide) * inv).astype(x.dtype)

    return map_float_leaves(mul, tree)


def _check(state: LossScaleState, grads: Any, axis_name: Any) -> jax.Array:
    """Whether the *unscaled* gradients are finite, read from the scaled ones.

    Multiplying by 1/scale <= 1 cannot turn a finite value into an inf or NaN, so
    while the scale cannot drop below 1 the scaled gradients are checked as they
    are: the check then reads them once and fuses with nothing else. A state whose
    scale may fall below 1 (``min_scale`` or the scale itself under 1) checks the
    unscaled values, which can overflow.
    """
    if not state.skip_nonfinite:
        return jnp.array(True)
    if state.enabled and state.scale_may_drop_below_one:
        grads = _unscale(state, grads)
    return all_finite(grads, axis_name=axis_name)


def unscale_and_check(
    state: LossScaleState, grads: Any, *, axis_name: Any = None
) -> tuple[Any, jax.Array]:
    """Divides gradients by the loss scale and checks them for inf / NaN.

    Args:
      state: the loss-scale state the gradients were scaled with.
      grads: a pytree of (scaled) gradients. Non-floating leaves (ints, bools,
        ``float0``, ``None``) pass through; each leaf keeps its dtype.
      axis_name: a mapped axis name (``pmap`` / ``shard_map``) over which the
        answer is agreed: one non-finite value on any device gives ``False`` on all.

    Returns:
      ``(grads, finite)``: the unscaled gradients and a ``bool[]`` that is False if
      any floating leaf holds an inf or NaN. A state built with
      ``skip_nonfinite=False`` (or :func:`no_scale`) checks nothing and returns True.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> g, finite = jaxamp.unscale_and_check(jaxamp.static_scale(4.0), jnp.array([2.0, 8.0]))
      >>> g, bool(finite)
      (Array([0.5, 2. ], dtype=float32), True)
    """
    _check_state(state, "unscale_and_check")
    return _unscale(state, grads), _check(state, grads, axis_name)


def update(state: LossScaleState, finite: Any) -> LossScaleState:
    """Advances the loss-scale state by one step.

    Finite step: ``growth_tracker += 1``, ``nonfinite_streak = 0``, the hysteresis
    allowance is restored; after ``growth_interval`` finite steps in a row the scale
    grows to ``min(scale * growth_factor, max_scale)`` (only if that product is
    finite) and ``growth_tracker`` restarts at 0.

    Non-finite step: ``skipped_steps += 1``, ``nonfinite_streak += 1``,
    ``growth_tracker = 0``, ``hysteresis_tracker -= 1``; when it reaches 0 the scale
    backs off to ``max(scale * backoff_factor, min_scale)`` and the allowance is
    restored.

    A static or disabled state moves only the counters.

    Args:
      state: the current state.
      finite: a bool scalar (usually from :func:`unscale_and_check`).

    Returns:
      The next :class:`LossScaleState`.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(init_scale=4.0, growth_interval=1)
      >>> float(jaxamp.update(s, True).scale), float(jaxamp.update(s, False).scale)
      (8.0, 2.0)
    """
    _check_state(state, "update")
    finite = jnp.asarray(finite)
    if finite.shape != () or finite.dtype != jnp.bool_:
        raise ValueError(
            f"update: `finite` must be a scalar bool, got {finite.dtype}{list(finite.shape)}."
        )
    one = jnp.int32(1)
    growth_tracker = jnp.where(finite, state.growth_tracker + one, 0)
    grow = finite & (growth_tracker >= state.growth_interval)
    growth_tracker = jnp.where(grow, 0, growth_tracker)

    hysteresis_tracker = jnp.where(finite, state.hysteresis, state.hysteresis_tracker - one)
    backoff = ~finite & (hysteresis_tracker <= 0)
    hysteresis_tracker = jnp.where(backoff, state.hysteresis, hysteresis_tracker)

    new_scale = state.scale
    if state.dynamic:
        grown = state.scale * state.growth_factor
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, state.max_scale), state.scale)
        shrunk = jnp.maximum(state.scale * state.backoff_factor, state.min_scale)
        new_scale = jnp.where(grow, grown, jnp.where(backoff, shrunk, state.scale))

    # Not `state.replace`: the scale moves only within the configured bounds, so the
    # static `scale_may_drop_below_one` must not change (that would change the tree).
    return dataclasses.replace(
        state,
        scale=new_scale.astype(jnp.float32),
        growth_tracker=growth_tracker.astype(jnp.int32),
        hysteresis_tracker=hysteresis_tracker.astype(jnp.int32),
        nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + one).astype(jnp.int32),
        skipped_steps=(state.skipped_steps + (~finite).astype(jnp.int32)).astype(jnp.int32),
    )


def _find_state(obj: Any, fn: str) -> LossScaleState:
    if isinstance(obj, LossScaleState):
        return obj
    from jaxamp.transform import get_loss_scale  # the transform module imports this one

    try:
        return get_loss_scale(obj)
    except ValueError as e:
        raise ValueError(f"jaxamp.{fn}: {e}") from None


def metrics(opt_state_or_loss_scale_state: Any) -> dict[str, jax.Array]:
    """Scalars to log: ``loss_scale``, ``growth_tracker``, ``nonfinite_streak``, ``skipped_steps``.

    Jit-safe: returns arrays, never pulls them to the host.

    Args:
      opt_state_or_loss_scale_state: a :class:`LossScaleState` or an optax state
        containing one (from :func:`jaxamp.skip_nonfinite`).

    Returns:
      A dict of scalar arrays.

    Example:
      >>> import jaxamp
      >>> sorted(jaxamp.metrics(jaxamp.dynamic_scale()))
      ['growth_tracker', 'loss_scale', 'nonfinite_streak', 'skipped_steps']
    """
    s = _find_state(opt_state_or_loss_scale_state, "metrics")
    return {
        "loss_scale": s.scale,
        "growth_tracker": s.growth_tracker,
        "nonfinite_streak": s.nonfinite_streak,
        "skipped_steps": s.skipped_steps,
    }


def check_health(opt_state_or_loss_scale_state: Any) -> None:
    """Raises if more non-finite steps in a row than allowed were skipped.

    Host side: it reads two scalars from the device, so call it where you log,
    not inside a jitted step. Replicated states (a leading device axis, as with
    ``pmap``) are checked on every replica.

    Args:
      opt_state_or_loss_scale_state: a :class:`LossScaleState` or an optax state
        containing one.

    Raises:
      FloatingPointError: when ``nonfinite_streak`` exceeds the state's
        ``max_consecutive_nonfinite`` (set in :func:`dynamic_scale` or
        :func:`jaxamp.skip_nonfinite`).

    Example:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(max_consecutive_nonfinite=1)
      >>> jaxamp.check_health(jaxamp.update(s, False))  # one in a row: tolerated
    """
    s = _find_state(opt_state_or_loss_scale_state, "check_health")
    limit = int(np.max(jax.device_get(s.max_consecutive_nonfinite)))
    if limit == _UNLIMITED:
        return
    streak = int(np.max(jax.device_get(s.nonfinite_streak)))
    if streak > limit:
        scale_now = float(np.min(jax.device_get(s.scale)))
        raise FloatingPointError(
            f"{streak} steps in a row were skipped because their gradients held inf or NaN "
            f"(max_consecutive_nonfinite={limit}); the loss scale is now {scale_now:g}. "
            "Training is not recovering: look for a NaN in the loss or the data, lower the "
            "learning rate, or run the offending ops in float32 (jaxamp.full_precision)."
        )
