"""Loss scaling: an immutable state and the pure functions that drive it.

The state is a frozen dataclass registered as a pytree. Every number in it, the
configuration included, is an array *leaf*: it survives ``jit``, ``scan`` and
orbax checkpoints with the counters, and ``state.replace(growth_factor=4.0)``
changes it at run time without recompiling (unlike jmp, whose ``min_loss_scale``
is aux data and is lost through ``jit``). Only the :class:`Mode` is static, because
it changes the program; nothing static is derived from the leaves, so nothing can
go stale through ``replace``, unflattening or a checkpoint restore.

The dynamic rule, applied by :func:`update` once per step::

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

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp import _jax_compat
from jaxamp._spikes import SpikeState
from jaxamp._tree import agree, is_float_leaf, leaf_finite, map_float_leaves, wide_dtype

__all__ = [
    "LossScaleState",
    "Mode",
    "check_health",
    "dynamic_scale",
    "get_loss_scale",
    "metrics",
    "no_scale",
    "scale",
    "static_scale",
    "unscale_and_check",
    "update",
]

SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126
HYSTERESIS_REFILL = ("growth", "finite", "finite_and_backoff")
_UNLIMITED = -1  # max_consecutive_nonfinite=None, kept as an int32 leaf


class Mode(enum.StrEnum):
    """How a :class:`LossScaleState` acts; each mode is one meaningful combination.

    A ``StrEnum``, so ``state.mode == "dynamic"`` works.

    Example:
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


_INT32_MAX = 2**31 - 1
_counter = _integer(lambda v: 0 <= v <= _INT32_MAX)
_COUNTER = "an integer in [0, 2**31 - 1]"

# The one table every path that builds a state validates against.
_FIELDS: dict[str, _Field] = {
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
        jnp.int32, _integer(lambda v: 0 <= v < 2**31), "None or an integer >= 0"
    ),
    "raise_at_min_scale": _Field(jnp.bool_, lambda v: True, "a bool"),
}
FIELD_NAMES: tuple[str, ...] = tuple(_FIELDS)


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """Loss-scale state: counters, run-time configuration and mode.

    Build it with :func:`dynamic_scale`, :func:`static_scale`, :func:`no_scale` or a
    :mod:`jaxamp.compat` constructor, and change it with :meth:`replace`; both
    validate every field. Unflattening (``jax.tree.map``, orbax placeholders)
    validates nothing, so trees of sizes or ``ShapeDtypeStruct`` work.

    Attributes:
      scale: float32, the current loss scale.
      growth_tracker: int32, consecutive finite steps since the last growth or backoff.
      hysteresis_tracker: int32, non-finite steps still tolerated before the next backoff.
      nonfinite_streak: int32, consecutive non-finite steps (reset by a finite step).
      skipped_steps: int32, total steps whose update was skipped.
      min_scale_backoffs: int32, backoffs that found the scale already at its floor.
      growth_factor, backoff_factor, min_scale, max_scale: float32 configuration.
      growth_interval, hysteresis: int32 configuration.
      hysteresis_refill: int32 index into ``("growth", "finite", "finite_and_backoff")``:
        what restores the hysteresis allowance (see :func:`dynamic_scale`).
      max_consecutive_nonfinite: int32; -1 means unlimited.
      raise_at_min_scale: bool; :func:`check_health` raises once a backoff found the
        scale at its floor (DeepSpeed's ``raise_error_at_min_scale``).
      mode: static, a :class:`Mode`.

    Example:
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
        """Whether :func:`update` moves the scale."""
        return self.mode is Mode.DYNAMIC

    @property
    def enabled(self) -> bool:
        """Whether :func:`scale` and :func:`unscale_and_check` scale at all."""
        return self.mode.scales

    @property
    def skip_nonfinite(self) -> bool:
        """Whether gradients are checked and non-finite steps skipped."""
        return self.mode.checks

    def replace(self, **updates: Any) -> LossScaleState:
        """A validated copy with some fields replaced, e.g. ``state.replace(growth_factor=4.0)``.

        PyTorch's ``set_growth_factor`` and friends. Each new value is checked like
        the constructors' arguments and stored as a fresh array of the field's
        dtype, so the state keeps its leaf types through ``jit`` and ``scan``; the
        result must be a consistent state (``min_scale <= max_scale``, the scale
        within its bounds, counters >= 0). ``mode=`` switches the :class:`Mode`.

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
        values = {name: getattr(self, name) for name in _FIELDS}
        if mode is self.mode:
            return _build(mode, values, updates, names={})
        try:
            return _build(mode, values, updates, names={})
        except ValueError as e:
            raise ValueError(f"mode={mode.value!r} does not fit this state: {e}") from None


jax.tree_util.register_dataclass(LossScaleState, data_fields=list(_FIELDS), meta_fields=["mode"])


def _as_mode(value: Any, label: str) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(
            f"{label} must be one of {[m.value for m in Mode]}, got {value!r}."
        ) from None


def _concrete(x: Any) -> float | None:
    """The Python number behind a scalar leaf, or None for a tracer."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(jax.device_get(x)).item()


def _concrete_all(leaves: dict[str, Any]) -> dict[str, float | None]:
    """Every leaf as a Python number (one transfer), tracers as None."""
    host = jax.device_get({f: x for f, x in leaves.items() if not isinstance(x, jax.core.Tracer)})
    return {f: np.asarray(host[f]).item() if f in host else None for f in leaves}


def _coerce(name: str, value: Any, label: str) -> jax.Array:
    """One field's new value, checked against the table and copied into a fresh array."""
    spec = _FIELDS[name]
    if name == "max_consecutive_nonfinite" and value is None:
        value = _UNLIMITED
        return jnp.array(value, spec.dtype)
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


def _build(
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


def _fresh_state(
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
    return _build(mode, {}, updates, names or {})


def dynamic_scale(
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    max_consecutive_nonfinite: int | None = None,
    *,
    hysteresis_refill: str = "finite_and_backoff",
    raise_at_min_scale: bool = False,
) -> LossScaleState:
    """Dynamic loss scaling: grow after clean stretches, back off on overflow.

    Args:
      init_scale: the starting scale; within [min_scale, max_scale] and [2**-126, 2**126].
      growth_factor: multiplier (> 1) applied after ``growth_interval`` finite steps in a row.
      backoff_factor: multiplier in (0, 1) applied on overflow.
      growth_interval: finite steps in a row (>= 1) before each growth.
      hysteresis: non-finite steps (>= 1) tolerated before a backoff (Megatron's and
        DeepSpeed's ``hysteresis``, Paddle's ``decr_every_n_nan_or_inf``).
      min_scale: lower bound of the scale (>= 0); the default of 1 keeps the scale
        from ever going below 1. The scale never drops below 2**-126 in any case.
      max_scale: upper bound of the scale (inf allowed; the scale never exceeds 2**126).
      max_consecutive_nonfinite: if set, more than this many non-finite steps in a
        row make :func:`check_health` raise.
      hysteresis_refill: what restores the hysteresis allowance:
        ``"finite_and_backoff"`` (every finite step and every backoff: only
        consecutive overflows count; Paddle), ``"finite"`` (every finite step, not a
        backoff: DeepSpeed's ``consecutive_hysteresis=True``) or ``"growth"`` (only
        a growth: Megatron-LM, DeepSpeed's default). Irrelevant when ``hysteresis=1``.
      raise_at_min_scale: if True, :func:`check_health` raises once an overflow asks
        for a backoff while the scale is already at ``min_scale`` (DeepSpeed).

    Returns:
      A :class:`LossScaleState`.

    Raises:
      ValueError / TypeError: naming the first argument outside its allowed range or type.

    Example:
      >>> import jaxamp
      >>> state = jaxamp.dynamic_scale(init_scale=2.0**12, growth_interval=100)
      >>> float(jaxamp.update(state, False).scale)
      2048.0
    """
    return _fresh_state(
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


def static_scale(scale: float = 2.0**15, skip_nonfinite: bool = True) -> LossScaleState:
    """A fixed loss scale that never changes.

    Args:
      scale: the loss scale, in [2**-126, 2**126].
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
    if not isinstance(skip_nonfinite, bool | np.bool_):
        raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}.")
    return _fixed(Mode.STATIC if skip_nonfinite else Mode.STATIC_UNCHECKED, scale)


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
    return _fixed(Mode.DISABLED, 1.0)


def check_only() -> LossScaleState:
    """No scaling, but non-finite steps are skipped: what bfloat16 training wants."""
    return _fixed(Mode.CHECK_ONLY, 1.0)


def _fixed(mode: Mode, scale: Any, names: Mapping[str, str] | None = None) -> LossScaleState:
    # A fixed scale never uses the growth settings; they only keep the leaves valid.
    return _fresh_state(
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


def _check_state(state: Any, fn: str) -> None:
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"jaxamp.{fn} expects a LossScaleState as its first argument (from "
            f"jaxamp.dynamic_scale / static_scale / no_scale), got {type(state).__name__}."
        )


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
    if not state.mode.scales:
        return tree

    def mul(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        wide = wide_dtype(x.dtype)
        return (x.astype(wide) * state.scale.astype(wide)).astype(x.dtype)

    return map_float_leaves(mul, tree)


def unscale(state: LossScaleState, tree: Any) -> Any:
    """Multiplies floating leaves by ``1 / scale`` (taken in float32 or wider)."""
    if not state.mode.scales:
        return tree

    def mul(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        wide = wide_dtype(x.dtype)
        # The reciprocal is taken in float32 (or wider): 1/2**24 underflows float16.
        inv = 1.0 / state.scale.astype(wide)
        return (x.astype(wide) * inv).astype(x.dtype)

    return map_float_leaves(mul, tree)


def local_finite(
    state: LossScaleState, grads: Any, prepare: Callable[[Any], Any] | None = None
) -> jax.Array | None:
    """Whether the *unscaled* gradients are finite on this device; None if unchecked.

    ``sum(x - x)`` is finite iff every ``x`` is: one fused read of the scaled
    gradients. While the scale is >= 1, unscaling multiplies by at most 1 and
    cannot overflow, so that is the answer. Below 1 it can (60000 / 0.5 overflows
    float16), so a ``lax.cond`` on the scale, a run-time fact rather than a
    configuration flag, then also checks the unscaled values. That branch is taken
    only while the scale is below 1; XLA's cost analysis counts its bytes anyway.
    ``prepare`` maps ``grads`` to the scaled gradients inside each reduction (an
    accumulation window's mean), so the cond's operand is never a derived tree.
    """
    flags, _ = local_finite_groups(state, grads, prepare)
    return None if flags is None else jnp.all(flags)


def local_finite_groups(
    state: LossScaleState, grads: Any, prepare: Callable[[Any], Any] | None = None
) -> tuple[jax.Array | None, list[int | None]]:
    """:func:`local_finite` per check group: ``(flags, owners)``.

    ``flags`` is bool[n_groups] (None if unchecked); ``owners[k]`` is the index (in
    ``jax.tree.leaves(prepare(grads))``) of the one large leaf group ``k`` checks,
    or None for a group of small leaves joined per dtype. The per-leaf record of
    non-finite gradients takes the large leaves' flags from here, at no cost.
    """
    if not state.mode.checks:
        return None, []
    prepare = prepare or (lambda g: g)
    groups, owners = _check_groups(prepare(grads))
    flags = jnp.stack([leaf_finite(g) for g in groups]) if groups else jnp.ones((0,), bool)
    if not state.mode.scales:
        return flags, owners

    def also_unscaled(flags: jax.Array, grads: Any) -> jax.Array:
        groups, _ = _check_groups(unscale(state, prepare(grads)))
        if not groups:
            return flags
        return flags & jnp.stack([leaf_finite(g) for g in groups])

    # Both branches return a value derived from `flags`, so they have one type
    # under shard_map too (varying over the mapped axes).
    return lax.cond(state.scale >= 1, lambda f, g: f, also_unscaled, flags, grads), owners


# Leaves up to this many elements (biases, norm scales) are checked together, one
# reduction per dtype: on a GPU each reduction is a kernel launch, and a model's many
# small leaves would cost more in launches than in reading. At worst the small leaves
# are copied once (kilobytes); large leaves are each read once, in place.
SMALL_LEAF = 2**14


def _typed_sharded(leaf: jax.Array) -> bool:
    # Sharded in its type (an Explicit mesh): flattening it has no one sharding
    # (JAX refuses the reshape), so it is checked alone.
    spec = getattr(getattr(_jax_compat.aval_of(leaf), "sharding", None), "spec", None)
    return spec is not None and any(p is not None for p in spec)


def checked_alone(leaf: Any) -> bool:
    """Whether the finite check reads this floating leaf on its own (not joined)."""
    leaf = jnp.asarray(leaf)
    return leaf.size > SMALL_LEAF or jnp.iscomplexobj(leaf) or _typed_sharded(leaf)


def _check_groups(grads: Any) -> tuple[list[jax.Array], list[int | None]]:
    """The floating leaves to check: large ones alone, small ones joined per dtype;
    and each group's leaf index (None for a joined group)."""
    groups: list[jax.Array] = []
    owners: list[int | None] = []
    small: dict[Any, list[jax.Array]] = {}
    for i, leaf in enumerate(jax.tree.leaves(grads)):
        if not is_float_leaf(leaf):
            continue
        leaf = jnp.asarray(leaf)
        if checked_alone(leaf):
            groups.append(leaf)
            owners.append(i)
        else:
            small.setdefault(leaf.dtype, []).append(leaf.reshape(-1))
    groups.extend(jnp.concatenate(xs) if len(xs) > 1 else xs[0] for xs in small.values())
    owners.extend([None] * len(small))
    return groups, owners


def unscale_and_check(
    state: LossScaleState, grads: Any, *, axis_name: Any = None
) -> tuple[Any, jax.Array]:
    """Divides gradients by the loss scale and checks them for inf / NaN.

    Args:
      state: the loss-scale state the gradients were scaled with.
      grads: a pytree of (scaled) gradients. Non-floating leaves (ints, bools,
        ``float0``, ``None``) pass through; each leaf keeps its dtype (float8 too).
      axis_name: a mapped axis name (``pmap`` / ``shard_map``) over which the
        answer is agreed: one non-finite value on any device gives ``False`` on all.

    Returns:
      ``(grads, finite)``: the unscaled gradients and a ``bool[]`` that is False if
      any unscaled floating leaf holds an inf or NaN. A state that checks nothing
      (``static_scale(..., skip_nonfinite=False)``, :func:`no_scale`) returns True.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> g, finite = jaxamp.unscale_and_check(jaxamp.static_scale(4.0), jnp.array([2.0, 8.0]))
      >>> g, bool(finite)
      (Array([0.5, 2. ], dtype=float32), True)
    """
    _check_state(state, "unscale_and_check")
    unscaled = unscale(state, grads)
    finite = local_finite(state, grads)
    if finite is None:
        return unscaled, jnp.array(True)
    return unscaled, agree(finite, axis_name)


def as_finite(finite: Any, fn: str) -> jax.Array:
    """``finite`` as a bool[] array, or a clear error naming it."""
    finite = jnp.asarray(finite)
    if finite.shape != () or finite.dtype != jnp.bool_:
        raise ValueError(
            f"{fn}: `finite` must be a scalar bool (as unscale_and_check returns it), got "
            f"{finite.dtype}{list(finite.shape)}."
        )
    return finite


def update(state: LossScaleState, finite: Any) -> LossScaleState:
    """Advances the loss-scale state by one step (the rule is in the module docstring).

    Finite step: ``growth_tracker += 1``, ``nonfinite_streak = 0``, the hysteresis
    allowance is restored; after ``growth_interval`` finite steps in a row the scale
    grows to ``min(scale * growth_factor, max_scale)`` and ``growth_tracker``
    restarts at 0.

    Non-finite step: ``skipped_steps += 1``, ``nonfinite_streak += 1``,
    ``growth_tracker = 0``, ``hysteresis_tracker -= 1``; when it reaches 0 the scale
    backs off to ``max(scale * backoff_factor, min_scale)`` and the allowance is
    restored.

    The scale stays within [2**-126, 2**126]. A static or disabled state moves only
    the counters. Every leaf of the result is a new array (none is shared with
    ``state``), so either may be donated.

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
    finite = as_finite(finite, "update")
    s = state
    one = jnp.int32(1)
    # Counters saturate at the int32 maximum instead of wrapping to negative values.
    inc = lambda x, by=one: jnp.where(x < _INT32_MAX, x + by, x)
    growth_tracker = jnp.where(finite, inc(s.growth_tracker), 0)
    grow = finite & (growth_tracker >= s.growth_interval)
    growth_tracker = jnp.where(grow, 0, growth_tracker)

    refill_on_finite = grow | (s.hysteresis_refill >= HYSTERESIS_REFILL.index("finite"))
    refill_on_backoff = s.hysteresis_refill == HYSTERESIS_REFILL.index("finite_and_backoff")
    tracker = jnp.where(
        finite,
        jnp.where(refill_on_finite, s.hysteresis, s.hysteresis_tracker),
        s.hysteresis_tracker - one,
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
    config = {f: jnp.array(getattr(s, f), copy=True) for f in _CONFIG_FIELDS}
    return LossScaleState(
        scale=jnp.array(new_scale, jnp.float32, copy=True),
        growth_tracker=i32(growth_tracker),
        hysteresis_tracker=i32(tracker),
        nonfinite_streak=i32(jnp.where(finite, 0, inc(s.nonfinite_streak))),
        skipped_steps=i32(inc(s.skipped_steps, (~finite).astype(jnp.int32))),
        min_scale_backoffs=i32(inc(s.min_scale_backoffs, stuck.astype(jnp.int32))),
        **config,
        mode=s.mode,
    )


_COUNTER_FIELDS = (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "nonfinite_streak",
    "skipped_steps",
    "min_scale_backoffs",
)
_CONFIG_FIELDS = tuple(f for f in _FIELDS if f not in _COUNTER_FIELDS)


def get_loss_scale(opt_state: Any) -> LossScaleState:
    """Finds the :class:`LossScaleState` inside an optimizer state.

    Looks through any nesting (``optax.chain``, ``MultiSteps``,
    ``multi_transform``, ``inject_hyperparams``, Flax ``TrainState``).

    Args:
      opt_state: an optax state that contains exactly one loss-scale state (from
        :func:`jaxamp.skip_nonfinite` or :func:`jaxamp.multi_transform`).

    Returns:
      The loss-scale state; use ``.scale`` to scale the loss of the next step.

    Raises:
      ValueError: if there is none, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = optax.MultiSteps(jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale()), 4)
      >>> float(jaxamp.get_loss_scale(tx.init({"w": jnp.ones(2)})).scale)
      32768.0
    """
    if isinstance(opt_state, LossScaleState):
        return _plain(opt_state)
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))
        if isinstance(x, LossScaleState)
    ]
    if not found:
        raise ValueError(
            "no LossScaleState found in the optimizer state. Build the optimizer with "
            "jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale()) and pass its state."
        )
    if len(found) > 1:
        raise ValueError(
            f"found {len(found)} LossScaleStates in the optimizer state; wrap the whole "
            "optimizer in one jaxamp.skip_nonfinite (or use jaxamp.multi_transform), or "
            "pass the sub-state you mean."
        )
    return _plain(found[0])


def _plain(state: LossScaleState) -> LossScaleState:
    """The state with array fields: a Flax nnx optimizer wraps each in a Variable
    (``nnx.OptArray``), a pytree of one leaf; logged or JSON-encoded, that fails."""
    fields = {f: getattr(state, f) for f in _FIELDS}
    wrapped = {f: v for f, v in fields.items() if not isinstance(v, jax.Array | np.ndarray)}
    if not wrapped:
        return state
    plain = {}
    for f, v in wrapped.items():
        leaves = jax.tree.leaves(v)
        plain[f] = leaves[0] if len(leaves) == 1 else v
    return dataclasses.replace(state, **plain)


def find_state(obj: Any, fn: str) -> LossScaleState:
    try:
        return get_loss_scale(obj)
    except ValueError as e:
        raise ValueError(f"jaxamp.{fn}: {e}") from None


def metrics(opt_state_or_loss_scale_state: Any) -> dict[str, jax.Array]:
    """Scalars to log: loss scale, counters and whether the last step was skipped.

    Jit-safe: returns arrays, never pulls them to the host.

    Args:
      opt_state_or_loss_scale_state: a :class:`LossScaleState` or an optax state
        containing one (from :func:`jaxamp.skip_nonfinite`).

    Returns:
      A dict of scalar arrays: ``loss_scale``, ``growth_tracker``,
      ``nonfinite_streak``, ``skipped_steps`` (steps skipped for non-finite
      gradients) and ``skipped`` (bool: the last step was skipped). With a
      :func:`jaxamp.spike_rule`, also ``spike_skipped_steps`` (steps skipped as
      spikes, counted apart) and ``spike_skipped`` (the last step was one);
      ``skipped`` is then True for either reason.

    Example:
      >>> import jaxamp
      >>> sorted(jaxamp.metrics(jaxamp.dynamic_scale()))
      ['growth_tracker', 'loss_scale', 'nonfinite_streak', 'skipped', 'skipped_steps']
    """
    s = find_state(opt_state_or_loss_scale_state, "metrics")
    out = {
        "loss_scale": s.scale,
        "growth_tracker": s.growth_tracker,
        "nonfinite_streak": s.nonfinite_streak,
        "skipped_steps": s.skipped_steps,
        # streak != 0 without a Python constant: eagerly, that would be a host transfer.
        "skipped": s.nonfinite_streak.astype(jnp.bool_),
    }
    spikes = find_spike_state(opt_state_or_loss_scale_state)
    if spikes is not None:
        out["spike_skipped_steps"] = jnp.asarray(spikes.skips)
        out["spike_skipped"] = jnp.asarray(spikes.skipped)
        out["skipped"] = out["skipped"] | out["spike_skipped"]
    return out


def find_spike_state(opt_state: Any) -> SpikeState | None:
    """The one :class:`jaxamp.SpikeState` inside an optimizer state, or None."""
    if isinstance(opt_state, LossScaleState):
        return None
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SpikeState))
        if isinstance(x, SpikeState)
    ]
    return found[0] if len(found) == 1 else None


def check_health(opt_state_or_loss_scale_state: Any) -> None:
    """Raises if training stopped recovering from non-finite gradients.

    Host side: it reads a few scalars from the device, so call it where you log,
    not inside a jitted step. Replicated states (a leading device axis, as with
    ``pmap``) are checked on every replica.

    Args:
      opt_state_or_loss_scale_state: a :class:`LossScaleState` or an optax state
        containing one.

    Raises:
      FloatingPointError: when ``nonfinite_streak`` exceeds the state's
        ``max_consecutive_nonfinite`` (set in :func:`dynamic_scale` or
        :func:`jaxamp.skip_nonfinite`), or, with ``raise_at_min_scale``, once an
        overflow asked for a backoff below ``min_scale``.

    Example:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(max_consecutive_nonfinite=1)
      >>> jaxamp.check_health(jaxamp.update(s, False))  # one in a row: tolerated
    """
    s = find_state(opt_state_or_loss_scale_state, "check_health")
    host = jax.device_get(
        (
            s.max_consecutive_nonfinite,
            s.nonfinite_streak,
            s.scale,
            s.raise_at_min_scale,
            s.min_scale_backoffs,
        )
    )
    limit, streak, scale_now, at_min, stuck = (np.asarray(x) for x in host)
    if np.any(at_min) and np.max(stuck) > 0:
        raise FloatingPointError(
            f"an overflow asked for a backoff while the loss scale was already at its minimum "
            f"({float(np.min(scale_now)):g}), {int(np.max(stuck))} time(s) "
            "(raise_at_min_scale, DeepSpeed's raise_error_at_min_scale). Look for a NaN in the "
            "loss or the data, or run the offending ops in float32 (jaxamp.full_precision)."
        )
    limit = int(np.max(limit))
    if limit != _UNLIMITED and int(np.max(streak)) > limit:
        raise FloatingPointError(
            f"{int(np.max(streak))} steps in a row were skipped because their gradients held "
            f"inf or NaN (max_consecutive_nonfinite={limit}); the loss scale is now "
            f"{float(np.min(scale_now)):g}. Training is not recovering: look for a NaN in the "
            "loss or the data, lower the learning rate, or run the offending ops in float32 "
            "(jaxamp.full_precision)."
        )


def validate(state: LossScaleState, where: str) -> LossScaleState:
    """Checks a state built outside the constructors (a restored checkpoint) in full."""
    values = {name: getattr(state, name) for name in _FIELDS}
    if _concrete(values["max_consecutive_nonfinite"]) == _UNLIMITED:
        values["max_consecutive_nonfinite"] = None
    try:
        return _build(state.mode, {}, values, names={})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} holds an invalid loss-scale state: {e}") from None
