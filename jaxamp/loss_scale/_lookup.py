"""Reading the loss-scale state out of an optimizer state, and judging its health."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxamp._utils.conversion_checks import mark_owned, mark_scale_read
from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.errors import NamedError, named, with_article
from jaxamp._utils.tree import find_one, holds_tracer
from jaxamp._utils.variables import held_value
from jaxamp.loss_scale._placement import check_state
from jaxamp.loss_scale._state import (
    DEFAULT_PINNED_STREAK,
    DEFAULT_RULE,
    FIELDS,
    SCALE_MIN,
    LossScaleState,
    Mode,
)

__all__ = ["LossScaleNotFound", "check_health", "get_loss_scale"]


class LossScaleNotFound(NamedError, ValueError):
    """Raised where a loss-scale state is looked up in a tree that holds none.

    By [`jaxamp.get_loss_scale`][jaxamp.get_loss_scale] and every function that reads
    the loss scale out of an optimizer state (``metrics``, ``stepped``,
    ``check_health``, ``value_and_grad``, ...): the optimizer was not built with
    [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] (or
    [`jaxamp.multi_transform`][jaxamp.multi_transform]), or another tree was passed in
    its place. A ``ValueError``, so that ``except ValueError`` catches it too.

    Attributes:
      got: the object that was searched.
      fn: the public function that looked, as its message names it
        (``"jaxamp.get_loss_scale"``).
      detail: the message without that name: what was found instead, and what to pass.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> opt_state = optax.sgd(0.1).init({"w": jnp.ones(2)})
      >>> try:
      ...     jaxamp.get_loss_scale(opt_state)
      ... except jaxamp.LossScaleNotFound as e:
      ...     print(type(e.got).__name__)
      tuple
    """

    def __init__(self, detail: str, fn: str | None = None, *, got: Any = None) -> None:
        super().__init__(detail, fn)
        self.got = got


@renamed_parameter("opt_state", "state", removed_in="0.5")
def get_loss_scale(state: Any, /) -> LossScaleState:
    """The [`LossScaleState`][jaxamp.LossScaleState] inside an optimizer state: read the scale here.

    ``jaxamp.get_loss_scale(opt_state).scale`` is the loss scale the next step
    multiplies the loss by (PyTorch's ``scaler.get_scale()``); the state's other
    fields are its counters. It takes whatever holds the optimizer state: the
    state itself, inside the structures safe around the guard (an ``optax.chain``
    or ``named_chain`` of it alone, ``optax.flatten``, ``inject_hyperparams``), a
    [`jaxamp.TrainState`][jaxamp.TrainState], a
    [`jaxamp.nnx.Optimizer`][jaxamp.nnx.Optimizer], or a ``LossScaleState`` itself
    (returned as it is). [`jaxamp.metrics`][jaxamp.metrics] puts the same scale in
    the dict it returns for logging, as ``"loss_scale"``.

    Args:
      state: an optax state that contains exactly one loss-scale
        state (from [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] or
        [`jaxamp.multi_transform`][jaxamp.multi_transform]), what holds it, or a
        ``LossScaleState``; positional-only.

    Returns:
      The loss-scale state, with plain array fields; ``.scale`` is the scale.

    Raises:
      LossScaleNotFound: if there is none (a ``ValueError``).
      ValueError: if there is more than one (naming where each is), or the guard sits
        inside a structure unsafe around it (``optax.MultiSteps``, a chain with other
        members, ...: naming what to write instead).

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = optax.chain(jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale()))
      >>> float(jaxamp.get_loss_scale(tx.init({"w": jnp.ones(2)})).scale)
      32768.0
    """
    mark_scale_read()  # the scale handed out: a loss may be multiplied by it by hand
    with named("get_loss_scale"):
        found, owned = _find(state)
    plain = _plain(found)
    if owned:
        mark_owned(plain)  # jaxamp.update of it would be lost: warned there
    return plain


def _find(x: Any) -> tuple[LossScaleState, bool]:
    """The one loss-scale state in ``x``, and whether a guard's state owns it."""
    found = find_one(
        x,
        LossScaleState,
        what="LossScaleStates",
        hint="wrap the whole optimizer in one jaxamp.skip_nonfinite (or use "
        "jaxamp.multi_transform), or pass the sub-state you mean.",
    )
    if found is None:
        # Every public function that reads the state takes it first, by position
        # (their errors say `jaxamp.<fn>: ` in place of get_loss_scale's).
        raise LossScaleNotFound(
            "no LossScaleState found in the state passed (got "
            f"{with_article(type(x).__name__)}). Build the optimizer with "
            "jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale()) and pass its state.",
            got=x,
        )
    return found, check_state(x, "jaxamp.get_loss_scale")


def _plain(state: LossScaleState) -> LossScaleState:
    """The state with array fields: a Flax nnx optimizer wraps each in a Variable
    (``nnx.OptArray``), a pytree of one leaf; logged or JSON-encoded, that fails."""
    fields = {f: getattr(state, f) for f in FIELDS}
    plain = {f: held_value(v) for f, v in fields.items()}
    if all(plain[f] is v for f, v in fields.items()):
        return state
    return dataclasses.replace(state, **plain)


@renamed_parameter("opt_state_or_loss_scale_state", "state", removed_in="0.5")
def check_health(state: Any, /) -> None:
    """Raises if training stopped recovering from non-finite gradients.

    A non-finite step is skipped as a whole, so during a streak of them nothing
    changes but the batches and the loss scale. Training has stopped recovering
    when the streak outlasts what the scale can do about it:

    - ``max_consecutive_nonfinite=None`` (the default, in [`dynamic_scale`][jaxamp.dynamic_scale],
      the ``compat`` constructors and [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite]): more than
      100 non-finite steps in a row while the scale can go no lower, at its floor
      ``max(min_scale, 2**-126)`` (PyTorch's scale, with no floor, stops at
      ``2**-126 ~ 1.2e-38``) or fixed ([`static_scale`][jaxamp.static_scale], the bfloat16 case).
      While the scale is still backing off, a streak is the scale searching.
    - ``max_consecutive_nonfinite=N``: more than N in a row, whatever the scale
      (MindSpore's ``DynamicLossScaleManager`` is ``N=1000``).
    - ``max_consecutive_nonfinite=math.inf`` (or ``2**31 - 1``): never.
    - ``raise_at_min_scale=True`` (DeepSpeed): also once an overflow asked for a
      backoff while the scale was at ``min_scale``.

    Host side: it reads a few scalars from the device, so call it where you log,
    not inside a jitted step. Replicated states (a leading device axis, as with
    ``pmap``) are checked on every replica.

    Args:
      state: a [`LossScaleState`][jaxamp.LossScaleState] or an optax state
        containing one, or what holds that (a ``TrainState``, an nnx optimizer);
        positional-only.

    Raises:
      FloatingPointError: saying how many steps in a row were skipped and what the
        scale is, by the rules above.

    Examples:
      >>> import jaxamp
      >>> s = jaxamp.dynamic_scale(max_consecutive_nonfinite=1)
      >>> jaxamp.check_health(jaxamp.update(s, False))  # one in a row: tolerated
      >>> s = jaxamp.dynamic_scale(init_scale=4.0)
      >>> for _ in range(102):  # 4 -> 2 -> 1, then 100 more at the floor
      ...     s = jaxamp.update(s, False)
      >>> jaxamp.check_health(s)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      FloatingPointError: 102 steps in a row were skipped ... scale is now 1, at its floor, ...
    """
    with named("check_health"):
        s = get_loss_scale(state)
    if holds_tracer(s):
        raise TypeError(
            "jaxamp.check_health reads the loss-scale counters on the host, so it cannot run "
            "inside jax.jit (or another transformation): call it where you log, outside the "
            "jitted step, on the opt_state the step returned. Inside the step, return "
            "jaxamp.metrics(opt_state) and check it outside."
        )
    host = jax.device_get(
        (
            s.max_consecutive_nonfinite,
            s.nonfinite_streak,
            s.scale,
            s.min_scale,
            s.raise_at_min_scale,
            s.min_scale_backoffs,
        )
    )
    limit, streak, scale_now, floor, at_min, stuck = (np.asarray(x) for x in host)
    if np.any(at_min) and np.max(stuck) > 0:
        raise FloatingPointError(
            f"an overflow asked for a backoff while the loss scale was already at its minimum "
            f"({float(np.min(scale_now)):g}), {int(np.max(stuck))} time(s) "
            "(raise_at_min_scale, DeepSpeed's raise_error_at_min_scale). Look for a NaN in the "
            "loss or the data, or run the offending ops in float32 (jaxamp.full_precision)."
        )
    # Element-wise, so that a replicated state is judged replica by replica.
    if s.mode is Mode.DYNAMIC:
        pinned = scale_now <= np.maximum(floor, np.float32(SCALE_MIN))
    else:
        pinned = np.ones_like(streak, bool)
    default = limit == DEFAULT_RULE
    over = np.where(default, pinned & (streak > DEFAULT_PINNED_STREAK), streak > limit)
    if not np.any(over):
        return
    worst = np.unravel_index(np.argmax(np.where(over, streak, -1)), np.shape(streak))
    n, now = int(streak[worst]), float(scale_now[worst])
    # A run without loss scaling (bfloat16: skip_nonfinite(inner)) has no scale to name.
    scale = f"the loss scale is now {now:g}" if s.mode.scales else "the run has no loss scale"
    if default[worst]:
        where = "at its floor" if s.mode is Mode.DYNAMIC else "fixed"
        stuck = f"{scale}, {where}, so backing off cannot help" if s.mode.scales else scale
        why = (
            f"; {stuck} (check_health's default: more than {DEFAULT_PINNED_STREAK} in a row "
            "with the scale at its floor, fixed or absent; set max_consecutive_nonfinite=N to "
            "choose N, or math.inf to never raise)"
        )
    else:
        why = f" (max_consecutive_nonfinite={int(limit[worst])}); {scale}"
    raise FloatingPointError(
        f"{n} steps in a row were skipped because their gradients held inf or NaN{why}. "
        "Training is not recovering: look for a NaN in the loss or the data, lower the "
        "learning rate, or run the offending ops in float32 (jaxamp.full_precision)."
    )
