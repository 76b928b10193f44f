"""Skipping loss and gradient-norm spikes, decided inside the guarded step's one ``lax.cond``.

The rule (OLMo-core's and MaxText's ``skip_step_on_spikes``, as a predicate of the
step jaxamp already guards)::

    history = the last `window` finite steps' losses and gradient norms
    spike   = finite and len(history) >= warmup and (
                  loss      > limit(losses)                                  [loss=True]
               or grad_norm > limit(grad_norms))                             [grad_norm=True]
    limit(h) = mean(h) + sigmas * max(std(h), 1e-4 * |mean(h)|)
    take    = finite and not spike
    then every finite step, spike or not, enters the history

``std`` is the population standard deviation; its floor of 1e-4 of the mean keeps a
history that never moved (std 0) from calling the next rounding-level wobble a
spike. A spike enters the history so that
a lasting change of level is accepted after a few steps instead of skipping
forever (OLMo-core does the same). A non-finite step is never a spike: it is a
non-finite skip, it moves the loss scale, and it does not enter the history. A
step with finite gradients but a non-finite loss enters no history either; an
infinite loss is above any limit, so it is skipped as a spike (a NaN loss compares
false and is not). A
spike never moves the loss scale. The gradient norm is the global L2 norm of the
unscaled gradients (of a window's mean under ``every_k``), the loss the ``value=``
passed to the update (a window's mean loss under ``every_k``); both are averaged
over ``axis_name`` so that every device decides, and remembers, the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils.dtypes import is_inexact
from jaxamp._utils.tree import is_tracer, saturating_inc

__all__ = ["SpikeRule", "SpikeState", "spike_rule"]

# The standard deviation's floor, relative to the mean (see the module docstring).
_STD_FLOOR = 1e-4


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpikeRule:
    """When a finite step is a spike; build it with [`jaxamp.spike_rule`][jaxamp.spike_rule].

    Static configuration (it shapes the state): part of the transformation, not of
    its state.
    """

    window: int
    sigmas: float
    warmup: int
    loss: bool
    grad_norm: bool


class SpikeState(NamedTuple):
    """The history a [`SpikeRule`][jaxamp.types.SpikeRule] decides from, and its counters.

    Attributes:
      losses: float32[window], a ring of the last finite steps' losses.
      grad_norms: float32[window], their gradient norms.
      count: int32, values recorded, kept in ``[0, 2 * window)``: the next slot is
        ``count % window`` and the ring holds ``min(count, window)`` values.
      skips: int32, steps skipped as spikes so far.
      skipped: bool, whether the last step was skipped as a spike.
      pending: with ``every_k > 1``, float32, the sum of this window's losses so
        far (``None`` otherwise).

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), spikes=jaxamp.spike_rule(window=8))
      >>> s = tx.init({"w": jnp.ones(2)}).spikes
      >>> s.losses.shape, int(s.count), int(s.skips)
      ((8,), 0, 0)
    """

    losses: jax.Array
    grad_norms: jax.Array
    count: jax.Array
    skips: jax.Array
    skipped: jax.Array
    pending: Any = None


def spike_rule(
    *,
    window: int = 128,
    sigmas: float = 6.0,
    warmup: int | None = None,
    loss: bool = True,
    grad_norm: bool = True,
) -> SpikeRule:
    """A rule that skips a step whose loss or gradient norm spikes (see below).

    Pass it as ``spikes=`` to [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] or
    [`jaxamp.multi_transform`][jaxamp.multi_transform], and the (unscaled) loss as ``value=`` to
    each update (``tx.update(grads, state, params, value=loss)``, ``jaxamp.step(..., value=loss)``).
    A step is a spike when, with at least ``warmup`` finite steps in the history of the last
    ``window``, its loss exceeds the history's mean by more than ``sigmas`` standard deviations (at
    least 1e-4 of the mean: a history that never moved has none), or its gradient norm does.
    Defaults are OLMo-core's (128 steps, 6 sigmas, half a window of warm-up). A spike is skipped as
    a whole, like a non-finite step, in the same ``lax.cond``, but never moves the loss scale; it is
    counted apart in [`jaxamp.metrics`][jaxamp.metrics] (``spike_skipped_steps``).

    Numbers may be Python, NumPy or 0-d JAX scalars (integers for ``window`` and ``warmup``, reals
    for ``sigmas``), concrete (not traced); they are stored as Python numbers.

    Args:
      window: steps of history (an int >= 2). It shapes the optimizer state;
        [`jaxamp.checkpoint.restore`][jaxamp.checkpoint.restore] moves a history saved with another
        window into this one, keeping its newest values.
      sigmas: how many standard deviations above the mean is a spike (> 0).
      warmup: finite steps recorded before any step can be a spike; default
        ``max(2, window // 2)``; at most ``window``.
      loss: judge the loss (then every update needs ``value=``).
      grad_norm: judge the global gradient norm.

    Returns:
      A [`SpikeRule`][jaxamp.types.SpikeRule].

    Raises:
      TypeError: an argument of the wrong type, named.
      ValueError: an argument out of range, named.

    Examples:
      >>> import jaxamp
      >>> jaxamp.spike_rule(window=64, sigmas=5.0)
      SpikeRule(window=64, sigmas=5.0, warmup=32, loss=True, grad_norm=True)
    """
    fn = "spike_rule"
    window = _number(fn, "window", window, "an int", "iu")
    warmup = None if warmup is None else _number(fn, "warmup", warmup, "an int", "iu")
    sigmas = _number(fn, "sigmas", sigmas, "a real number", "iuf")
    if window < 2:
        raise ValueError(
            f"{fn}: window must be >= 2 (a standard deviation needs two), got {window}."
        )
    if not (0 < sigmas < math.inf):
        raise ValueError(f"{fn}: sigmas must be finite and > 0, got {sigmas!r}.")
    warmup = max(2, window // 2) if warmup is None else warmup
    if not 2 <= warmup <= window:
        raise ValueError(f"{fn}: warmup must be in [2, window={window}], got {warmup}.")
    for name, v in (("loss", loss), ("grad_norm", grad_norm)):
        if not isinstance(v, bool | np.bool_):
            raise TypeError(f"{fn}: {name} must be a bool, got {v!r}.")
    loss, grad_norm = bool(loss), bool(grad_norm)
    if not (loss or grad_norm):
        raise ValueError(f"{fn}: judge at least one of loss and grad_norm (both are False).")
    return SpikeRule(
        window=window, sigmas=float(sigmas), warmup=warmup, loss=loss, grad_norm=grad_norm
    )


def _number(fn: str, name: str, value: Any, wants: str, kinds: str) -> Any:
    """``value`` as a Python number: a Python, NumPy or 0-d JAX number of dtype kind ``kinds``.

    The rule is static configuration (it shapes the state and is hashed with the
    transformation), so the value must be concrete and is stored as a Python number.
    """
    if isinstance(value, bool | np.bool_) or getattr(value, "dtype", None) == np.bool_:
        raise TypeError(f"{fn}: {name} must be {wants}, got the bool {value!r}.")
    if is_tracer(value):
        raise TypeError(
            f"{fn}: {name} must be a concrete number, got a traced value: the rule is static "
            "configuration, build it outside jit."
        )
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        if value.shape != ():
            raise TypeError(
                f"{fn}: {name} must be {wants} (a scalar), got an array of shape {value.shape}."
            )
        if np.dtype(value.dtype).kind not in kinds:
            raise TypeError(f"{fn}: {name} must be {wants}, got an array of dtype {value.dtype}.")
        return np.asarray(value).item()
    if isinstance(value, int) or ("f" in kinds and isinstance(value, float)):
        return value
    raise TypeError(f"{fn}: {name} must be {wants}, got {type(value).__name__} {value!r}.")


def check_rule(spikes: Any, fn: str) -> SpikeRule | None:
    if spikes is not None and not isinstance(spikes, SpikeRule):
        raise TypeError(
            f"{fn}: spikes must be None or a jaxamp.spike_rule(...), got {type(spikes).__name__}."
        )
    return spikes


def init(rule: SpikeRule, every_k: int = 1) -> SpikeState:
    zeros = jnp.zeros((rule.window,), jnp.float32)
    return SpikeState(
        zeros,
        jnp.zeros((rule.window,), jnp.float32),
        jnp.zeros((), jnp.int32),
        jnp.zeros((), jnp.int32),
        jnp.zeros((), jnp.bool_),
        jnp.zeros((), jnp.float32) if every_k > 1 else None,
    )


def loss_value(rule: SpikeRule, extra_args: dict[str, Any], fn: str) -> jax.Array:
    """The step's loss as a float32 scalar (0 when the rule does not judge it)."""
    if not rule.loss:
        return jnp.zeros((), jnp.float32)
    if "value" not in extra_args:
        raise TypeError(
            f"{fn}: spike_rule(loss=True) judges the loss: pass it as value=loss "
            "(tx.update(grads, state, params, value=loss), jaxamp.step(..., value=loss), "
            "jaxamp.TrainState.apply_gradients(grads=grads, extra_args={'value': loss}) or "
            "jaxamp.nnx.Optimizer.update(model, grads, value=loss)), or build the rule with "
            "loss=False (flax's own TrainState passes no optimizer arguments)."
        )
    value = jnp.asarray(extra_args["value"])
    if value.shape != () or not is_inexact(value):
        raise ValueError(
            f"{fn}: value= must be the scalar floating loss, got {value.dtype}{list(value.shape)}."
        )
    return value.astype(jnp.float32)


def sum_of_squares(tree: Any) -> jax.Array:
    """Sum of squares of a tree's floating leaves in float32 (one read per leaf)."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        if is_inexact(x):
            x = jnp.asarray(x)
            x = jnp.abs(x) if jnp.iscomplexobj(x) else x
            total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return total


def agree_values(values: jax.Array, axis_name: Any) -> jax.Array:
    return values if axis_name is None else lax.pmean(values, axis_name)


def _limit(values: jax.Array, filled: jax.Array, sigmas: float) -> jax.Array:
    valid = jnp.arange(values.shape[-1]) < filled
    n = jnp.maximum(filled, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / n
    var = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0)) / n
    return mean + sigmas * jnp.maximum(jnp.sqrt(var), _STD_FLOOR * jnp.abs(mean))


def decide(
    rule: SpikeRule, state: SpikeState, loss: jax.Array, norm: jax.Array, finite: jax.Array
) -> jax.Array:
    """Whether this (finite) step is a spike, from the history before it."""
    filled = jnp.minimum(state.count, rule.window)
    high = jnp.array(False)
    if rule.loss:
        high = high | (loss > _limit(state.losses, filled, rule.sigmas))
    if rule.grad_norm:
        high = high | (norm > _limit(state.grad_norms, filled, rule.sigmas))
    return finite & (filled >= rule.warmup) & high


def record(
    rule: SpikeRule,
    state: SpikeState,
    loss: jax.Array,
    norm: jax.Array,
    finite: jax.Array,
    spike: jax.Array,
) -> SpikeState:
    """The state after a step: a finite step's values enter the ring, spike or not."""
    # A non-finite loss with finite gradients (a NaN in an unused branch) is not recorded.
    keep = finite & jnp.isfinite(loss) & jnp.isfinite(norm)
    slot = state.count % rule.window
    nxt = state.count + 1
    nxt = jnp.where(nxt >= 2 * rule.window, nxt - rule.window, nxt)

    def put(ring: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.where(keep, ring.at[slot].set(v), ring)

    skips = saturating_inc(state.skips, spike.astype(jnp.int32))
    return state._replace(
        losses=put(state.losses, loss),
        grad_norms=put(state.grad_norms, norm),
        count=jnp.where(keep, nxt, state.count).astype(jnp.int32),
        skips=skips,
        skipped=jnp.asarray(spike, jnp.bool_),
    )
