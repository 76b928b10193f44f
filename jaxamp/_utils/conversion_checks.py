"""Warnings for conversions that run but train wrong, seen at trace time.

Two mistakes a user converting a script makes that no error catches, because each
call is valid on its own:

* the gradients were never scaled (``jax.grad`` of the plain loss) but the optimizer
  holds a loss scale (dynamic or static): jaxamp divides them by the scale before the
  update, so the run trains with no loss scaling and a learning rate off by the scale;
* Flax's own ``TrainState.apply_gradients`` given model state (``batch_stats=``) with
  a jaxamp ``tx``: Flax replaces those fields after ``tx.update`` returns, so a step
  jaxamp skips keeps the non-finite batch's statistics.

Three more PyTorch reflexes that run silently in a functional API:

* float16 autocast with an optimizer that holds no loss scale (``skip_nonfinite(inner)``
  alone): float16 gradients underflow, unscaled;
* ``jaxamp.update`` of the loss-scale state read out of an optimizer state: the guard
  updates its own on every step, and the new state is never seen by the optimizer;
* an optimizer state given to a second step (the new one dropped): its loss scale
  and the optimizer's moments never move. Seen on eager calls only (under ``jit`` each
  trace has its own state objects).

Each warns once per process (a ``ConversionWarning``, which users can filter) and
never touches a device value: the checks read Python state at trace time only.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import jax
import numpy as np

from jaxamp._utils.optional import OVERWRITE_WITH_GRADIENT
from jaxamp._utils.tree import is_tracer

__all__ = ["ConversionWarning"]


class ConversionWarning(UserWarning):
    """A jaxamp conversion that runs but trains wrong; the message says what to write.

    Issued once per process, at trace time. Silence it with
    ``warnings.filterwarnings("ignore", category=jaxamp.ConversionWarning)``.

    "No loss multiplied by the scale" is judged from what reached code that can
    multiply a loss: a call of ``jaxamp.scale`` (``value_and_grad`` and
    ``jaxamp.nnx.value_and_grad`` call it), or a read of the scale
    (``get_loss_scale``, ``TrainState.loss_scale``, ``nnx.Optimizer.loss_scale``)
    inside a JAX transformation (``jit``, ``grad``, ``nnx.jit``, ``nnx.grad``), where a
    hand-scaled loss reads it. A read outside any transformation is taken for logging
    (``float(state.loss_scale.scale)`` before the first step) and does not count. The
    limit: a run with no ``jit`` that reads the scale outside the function it
    differentiates and multiplies the loss by that value (``s = state.loss_scale.scale``,
    then ``jax.grad(lambda p: loss(p) * s)``) warns though it scaled; read the scale
    inside that function, or use ``jaxamp.scale``. A ``static_scale(1.0)`` under ``jit``
    warns too (its value is not known at trace time); ``skip_nonfinite(inner)`` with no
    loss scale is the same optimizer and stays silent.
    """


# Whether this process has handed a loss scale to anything that can scale a loss with
# it: `jaxamp.scale` (so `value_and_grad` and `jaxamp.nnx.value_and_grad`), or the
# accessors a hand-scaled loss reads (`get_loss_scale`, `TrainState.loss_scale`,
# `nnx.Optimizer.loss_scale`) inside a trace. One flag for the process, not one per
# trace: gradients are often taken in one jitted function and applied in another, so
# "not read in the trace that applies them" would be a false alarm there.
_scale_read = False
_warned: set[str] = set()

_OUR_PACKAGES = ("jaxamp", "jax", "jaxlib", "optax", "flax", "chex", "equinox")


def _tracing() -> bool:
    """Whether the caller runs inside a JAX transformation (jit, grad, vmap, nnx.*)."""
    try:
        from jax._src import core

        return not isinstance(core.trace_ctx.trace, core.EvalTrace)
    except (ImportError, AttributeError):  # private API moved: count every read (no false alarm)
        return True


def mark_loss_scaled() -> None:
    """Records that a loss (or a tree) was multiplied by a loss scale (`jaxamp.scale`)."""
    global _scale_read
    _scale_read = True


def mark_scale_read() -> None:
    """Records a read of the loss scale; one outside any trace is taken for logging (a
    hand-scaled loss is differentiated, so its read of the scale is traced)."""
    global _scale_read
    if _tracing():
        _scale_read = True


# Whether a float16 autocast has been traced since the last guarded step was: the step
# that follows it is the one its gradients reach (a train step traces its forward before
# its update), and a later run's step (bfloat16 after a float16 run in one process) is not.
_float16_autocast = False
# Loss-scale states get_loss_scale handed out of a guard's state, and those a guarded
# step was given outside any trace: by identity, never keeping one alive.
# (Keyed by id: a LossScaleState holds arrays, so it is not hashable.)
_owned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_consumed: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _holds(seen: weakref.WeakValueDictionary[int, Any], x: Any) -> bool:
    return seen.get(id(x)) is x


def reset() -> None:
    """Forgets what was read and warned (for tests)."""
    global _scale_read, _float16_autocast
    _scale_read = _float16_autocast = False
    _warned.clear()
    _owned.clear()
    _consumed.clear()


def mark_float16_autocast() -> None:
    """Records that a float16 autocast was traced (its gradients need a loss scale)."""
    global _float16_autocast
    _float16_autocast = True


def mark_owned(ls: Any) -> None:
    """Records a loss-scale state read out of a guard's state (``get_loss_scale``)."""
    _owned[id(ls)] = ls


def check_update_owned(ls: Any) -> None:
    """Warns if ``jaxamp.update`` is given a loss-scale state an optimizer owns."""
    if _holds(_owned, ls):
        _warn_once(
            "update_owned",
            "jaxamp.update: this loss-scale state was read out of an optimizer state "
            "(jaxamp.get_loss_scale(opt_state)), whose guard updates it on every step "
            "itself; the state jaxamp.update returns is never seen by the optimizer. Drop "
            "the call: jaxamp.step / tx.update already advanced the scale. (For a loop of "
            "your own, keep a jaxamp.dynamic_scale() beside a plain optax optimizer.)",
        )


def check_step_input(ls: Any) -> None:
    """Warns if a guarded step is given, outside any trace, a state a step was given
    before (the new ``opt_state`` dropped), and if float16 autocast gradients reach a
    guard that holds no loss scale. ``ls`` is the step's loss-scale state."""
    global _float16_autocast
    mode = getattr(ls, "mode", None)
    float16_traced = _float16_autocast and mode is not None
    if mode is not None:
        _float16_autocast = False  # this step consumed the float16 gradients, if any
    if float16_traced and not mode.scales:
        _warn_once(
            "float16_no_scale",
            "jaxamp: a float16 autocast was traced, but this optimizer holds no loss scale "
            "(jaxamp.skip_nonfinite(inner) alone, or no_scale()): small float16 gradients "
            "underflow to 0, and nothing scales them up (PyTorch pairs float16 "
            "autocast with a GradScaler). Pass one: jaxamp.skip_nonfinite(inner, "
            "jaxamp.dynamic_scale()). bfloat16 needs none.",
        )
    if _tracing() or mode is None:
        return
    if _holds(_consumed, ls):
        _warn_once(
            "state_reused",
            "jaxamp: this optimizer state was already given to a step. Each step returns "
            "the next state: params, opt_state = jaxamp.step(tx, grads, opt_state, params) "
            "(or updates, opt_state = tx.update(...)); stepping the old one again leaves the "
            "loss scale, its counters and the optimizer's moments where they were.",
        )
    _consumed[id(ls)] = ls


# Standard-library frames between a user's line and jaxamp's: a decorator's and a context
# manager's.
_PLUMBING = ("contextlib", "functools")


def _stacklevel() -> int:
    """The stack level of the first frame outside jaxamp, JAX, optax and Flax: the
    user's line, so the warning points at the call they wrote."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _OUR_PACKAGES and module not in _PLUMBING:
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, ConversionWarning, stacklevel=_stacklevel())


def check_scale_read(ls: Any) -> None:
    """Warns if a loss scale is stepped before any loss could have been scaled by it."""
    mode = getattr(ls, "mode", None)
    if _scale_read or "unscaled" in _warned or mode is None or not mode.scales:
        return
    scale = getattr(ls, "scale", None)
    if not is_tracer(scale):
        with jax.transfer_guard("allow"):  # eager only: a scale fixed at 1 scales nothing
            if np.all(np.asarray(jax.device_get(scale)) == 1):
                return
    kind = "dynamic" if mode.value == "dynamic" else "static"
    _warn_once(
        "unscaled",
        f"jaxamp: this optimizer holds a {kind} loss scale, but no loss has been "
        "multiplied by it (nothing called jaxamp.value_and_grad or jaxamp.scale, or read "
        "get_loss_scale / .loss_scale inside a jit or grad, before this step). The "
        "gradients were taken without loss scaling, and the step divides them by the "
        "scale before the update: float16 gradients underflow and the updates come out "
        "too small. Take them with jaxamp.value_and_grad(loss_fn)(opt_state, params, ...) "
        "(NNX: jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, ...)), or "
        "differentiate jaxamp.scale(jaxamp.get_loss_scale(opt_state), loss). A bfloat16 "
        "run needs no scale: jaxamp.skip_nonfinite(inner) with no loss_scale.",
    )


def _has_array(tree: Any) -> bool:
    # What jaxamp.TrainState keeps on a skip: array leaves (a tracer is a jax.Array).
    return any(isinstance(x, jax.Array | np.ndarray) for x in jax.tree.leaves(tree))


def warn_flax_train_state(local: dict[str, Any]) -> None:
    """Warns if Flax's own ``TrainState.apply_gradients``, whose locals are ``local``,
    will write model state (``batch_stats=``, fp8 metadata) on a skipped step."""
    if "flax_train_state" in _warned:
        return
    state, kwargs, grads = local.get("self"), local.get("kwargs") or {}, local.get("grads")
    written = [f"{name}=" for name, value in kwargs.items() if _has_array(value)]
    if isinstance(grads, dict) and OVERWRITE_WITH_GRADIENT in grads:
        written.append("the fp8 metadata (_overwrite_with_gradient)")
    if not written:
        return
    cls = type(state).__name__
    _warn_once(
        "flax_train_state",
        f"jaxamp: Flax's TrainState.apply_gradients (of your {cls}) writes "
        f"{', '.join(written)} even on a step jaxamp skips: Flax replaces those fields "
        "after tx.update returns, so a non-finite batch's values (NaN BatchNorm "
        "statistics) stay. Derive the state class from jaxamp.TrainState instead of "
        "flax.training.train_state.TrainState (the same create / apply_gradients; a "
        "skipped step keeps those fields).",
    )
