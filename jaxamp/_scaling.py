"""Loss scaling's pure functions: scale, unscale, check for inf / NaN, update.

Each takes a [`LossScaleState`][jaxamp.LossScaleState] and returns arrays or a new state;
XLA compiles them into the step. The finite check reads each large gradient leaf
on its own and the small ones joined per dtype (one reduction each).

The dynamic rule, applied by [`update`][jaxamp.update] once per step::

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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp import _jax_compat
from jaxamp._conversion_checks import mark_loss_scaled
from jaxamp._loss_scale import (
    _CONFIG_FIELDS,
    HYSTERESIS_REFILL,
    SCALE_MAX,
    SCALE_MIN,
    LossScaleState,
    Mode,
    _check_state,
)
from jaxamp._tree import (
    agree,
    is_float_leaf,
    leaf_finite,
    map_float_leaves,
    saturating_inc,
    wide_dtype,
)

__all__ = ["scale", "unscale_and_check", "update"]


def scale(state: LossScaleState, tree: Any) -> Any:
    """Multiplies every floating leaf of ``tree`` by the loss scale.

    Each leaf keeps its dtype; the product is computed in float32 (or wider), so a
    float16 loss is scaled without the scale itself overflowing float16.

    Args:
      state: the loss-scale state.
      tree: a loss or any pytree; non-floating leaves pass through.

    Returns:
      ``tree`` with floating leaves multiplied by ``state.scale``.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.scale(jaxamp.static_scale(8.0), jnp.array(0.5, jnp.float16))
      Array(4., dtype=float16)
    """
    _check_state(state, "scale")
    mark_loss_scaled()
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
    """``local_finite`` per check group: ``(flags, owners)``.

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

    # Both branches return a value derived from `flags`, so they have one type under
    # shard_map too (varying over the mapped axes). `scale > 0` always holds (states
    # are validated); it gives `flags` the state's type as well, which the re-check
    # reads: a per-device (stacked) state varies where replicated gradients do not.
    flags = flags & (state.scale > 0)
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


def _self_difference_sum(x: jax.Array) -> jax.Array:
    # float8 is reduced in float32, as in leaf_finite.
    x = x.astype(jnp.float32) if x.dtype.itemsize == 1 else x
    return jnp.sum(x - x)


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
            small.setdefault(leaf.dtype, []).append(leaf)
    # A joined group is each small leaf's own ``sum(x - x)`` (NaN iff the leaf has an
    # inf or NaN), stacked: no array joins the leaves themselves, whose shardings may
    # differ (a concatenation let XLA's propagation on an Auto mesh shard a replicated
    # bias's outputs after it).
    groups.extend(
        jnp.stack([_self_difference_sum(x) for x in xs]) if len(xs) > 1 else xs[0]
        for xs in small.values()
    )
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
      (``static_scale(..., skip_nonfinite=False)``, [`no_scale`][jaxamp.no_scale]) returns True.

    Examples:
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

    The scale stays within ``[2**-126, 2**126]``. A static or disabled state moves only
    the counters. Every leaf of the result is a new array (none is shared with
    ``state``), so either may be donated.

    Args:
      state: the current state.
      finite: a bool scalar (usually from [`unscale_and_check`][jaxamp.unscale_and_check]).

    Returns:
      The next [`LossScaleState`][jaxamp.LossScaleState].

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(init_scale=4.0, growth_interval=1)
      >>> float(jaxamp.update(s, True).scale), float(jaxamp.update(s, False).scale)
      (8.0, 2.0)
    """
    _check_state(state, "update")
    finite = as_finite(finite, "update")
    s = state
    growth_tracker = jnp.where(finite, saturating_inc(s.growth_tracker), 0)
    grow = finite & (growth_tracker >= s.growth_interval)
    growth_tracker = jnp.where(grow, 0, growth_tracker)

    refill_on_finite = grow | (s.hysteresis_refill >= HYSTERESIS_REFILL.index("finite"))
    refill_on_backoff = s.hysteresis_refill == HYSTERESIS_REFILL.index("finite_and_backoff")
    tracker = jnp.where(
        finite,
        jnp.where(refill_on_finite, s.hysteresis, s.hysteresis_tracker),
        s.hysteresis_tracker - 1,
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
        nonfinite_streak=i32(jnp.where(finite, 0, saturating_inc(s.nonfinite_streak))),
        skipped_steps=i32(saturating_inc(s.skipped_steps, (~finite).astype(jnp.int32))),
        min_scale_backoffs=i32(saturating_inc(s.min_scale_backoffs, stuck.astype(jnp.int32))),
        **config,
        mode=s.mode,
    )
