"""``skip_nonfinite``: an optax transformation that unscales, checks, and skips a
non-finite step as a whole."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._utils.deprecation import deprecated_parameter
from jaxamp._utils.tree import check_axis_name, static_int
from jaxamp.loss_scale import LossScaleState
from jaxamp.skip import _record, _spikes
from jaxamp.skip._every_k import accumulate
from jaxamp.skip._guard import Call, Part, Spikes, guarded
from jaxamp.skip._transformation import (
    MOVED_LIMIT,
    GuardedUpdate,
    check_grads,
    check_inner,
    check_inner_state,
    check_spike_state,
    check_state_type,
    loss_scale_arg,
    record_of,
    refuse_narrow,
    refuse_nested,
    restore_fields,
    with_outcome,
)

__all__ = ["SkipNonfiniteState", "skip_nonfinite"]


class SkipNonfiniteState(NamedTuple):
    """State of [`skip_nonfinite`][jaxamp.skip_nonfinite].

    Attributes:
      inner_state: the inner optimizer's state.
      loss_scale: the [`jaxamp.LossScaleState`][jaxamp.LossScaleState].
      acc: with ``every_k > 1``, the sum of the window's scaled gradients so far
        (``None`` otherwise).
      mini_step: with ``every_k > 1``, an int32 count of the calls in this window
        so far (``None`` otherwise).
      nonfinite_leaves: a [`jaxamp.types.NonfiniteLeaves`][jaxamp.types.NonfiniteLeaves]: which
        gradient leaves
        were non-finite on the last skipped step, and how often each has been
        (read it with [`jaxamp.explain`][jaxamp.explain]).
      spikes: with ``spikes=``, the [`jaxamp.types.SpikeState`][jaxamp.types.SpikeState] (``None``
        otherwise).

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), every_k=2)
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> type(state).__name__, int(state.mini_step), float(state.loss_scale.scale)
      ('SkipNonfiniteState', 0, 32768.0)
    """

    inner_state: optax.OptState
    loss_scale: LossScaleState
    acc: Any = None
    mini_step: Any = None
    nonfinite_leaves: Any = None
    spikes: Any = None


# eq=False: hashed by identity, as a plain function is, so that `jax.jit(tx.update)`
# works (a field such as multi_transform's dict of transforms is unhashable).
@dataclasses.dataclass(frozen=True, eq=False)
class _SkipNonfiniteUpdate(GuardedUpdate):
    """``skip_nonfinite``'s update function; its parts are its fields."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: Any
    every_k: int
    spikes: _spikes.SpikeRule | None = None

    def run(
        self, grads: Any, state: SkipNonfiniteState, params: Any, call: Call
    ) -> tuple[Any, SkipNonfiniteState]:
        fn = "jaxamp.step" if call.to_params else "skip_nonfinite.update"
        check_state_type(state, SkipNonfiniteState, fn)
        check_spike_state(self.spikes, state, fn)
        # An equinox model passed whole: its non-array fields set aside, put back at the end.
        given, params = params, check_grads(grads, params, fn)
        refuse_narrow(params, state.inner_state, fn)
        check_inner_state(
            self.inner,
            state.inner_state,
            grads if params is None else params,
            fn,
            "opt_state.inner_state",
        )

        loss = None if self.spikes is None else _spikes.loss_value(self.spikes, call.extra_args, fn)

        def window_step(
            grads: Any, state: SkipNonfiniteState, prepare: Any = None, loss: Any = loss
        ) -> tuple[Any, SkipNonfiniteState]:
            part = Part(self.inner, state.inner_state, grads, params, prepare)
            spikes = None if self.spikes is None else Spikes(self.spikes, state.spikes, loss)
            record = record_of(state)
            got = guarded(state.loss_scale, [part], call, self.axis_name, spikes, record)
            new = with_outcome(state, got)
            return got.outs[0], new._replace(inner_state=got.inner_states[0])

        if self.every_k == 1:
            out, state = window_step(grads, state)
        elif call.verdict is not None or call.unscaled:
            raise ValueError(
                f"{fn}: unscaled gradients (finite=, or what jaxamp.unscale_and_check "
                "returned) cannot be combined with every_k > 1: the window accumulates the "
                "scaled gradients inside the optimizer state and unscales and checks them at "
                "its end. Pass the scaled gradients."
            )
        else:
            out, state = accumulate(
                self.every_k,
                grads,
                state,
                params,
                window_step,
                call.to_params,
                loss,
                self.axis_name,
            )
        if call.to_params and params is not given:
            out = restore_fields(out, given)
        return out, state


@deprecated_parameter("max_consecutive_nonfinite", MOVED_LIMIT, removed_in="0.5")
def skip_nonfinite(
    inner: optax.GradientTransformation,
    loss_scale: LossScaleState | None = None,
    *,
    every_k: int = 1,
    max_consecutive_nonfinite: int | float | None = None,
    axis_name: Any = None,
    spikes: _spikes.SpikeRule | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Unscales gradients, skips non-finite steps and updates the loss scale.

    ``update`` unscales the incoming gradients with the current loss scale, checks
    them, and runs ``inner.update`` on the unscaled gradients only if every value
    is finite. A skipped step returns all-zero updates and the inner state
    unchanged, bit for bit (so optax schedules and step counts do not advance). The
    loss scale then advances with [`jaxamp.update`][jaxamp.update]. Clipping, weight decay and
    schedules inside ``inner`` see true (unscaled) gradients, like
    ``scaler.unscale_(optimizer)`` before clipping in PyTorch.

    With ``every_k=k > 1`` this is PyTorch's gradient accumulation: calls 1..k-1 of
    a window add the scaled gradients to an accumulator and change nothing else
    (zero updates, scale unchanged); call k averages the window, then unscales,
    checks, applies or skips it as one step and updates the scale once, and resets
    the accumulator by replacement, so an overflowing micro-batch costs exactly one
    window.

    Args:
      inner: the optimizer to protect (any optax transformation or chain).
      loss_scale: a [`LossScaleState`][jaxamp.LossScaleState]: how the loss is scaled, and
        when [`jaxamp.check_health`][jaxamp.check_health] calls a streak of skipped steps a failure
        (its ``max_consecutive_nonfinite``). [`jaxamp.check_only`][jaxamp.check_only]
        checks and skips without scaling (bfloat16, FP8); ``None`` is short for
        ``jaxamp.check_only()``.
      every_k: micro-batches per optimizer step (an int >= 1).
      axis_name: mapped axis name(s) (``pmap`` / ``shard_map``) over which the
        finiteness check is agreed, so every device skips together. Not needed
        under ``jax.jit`` with sharded arrays, where the check is a global reduction.
      spikes: a [`jaxamp.spike_rule`][jaxamp.spike_rule]: also skip a finite step whose loss
        (``value=``) or gradient norm spikes, in the same ``lax.cond``; the scale
        does not move for it. With ``every_k``, a window's mean loss is judged.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra arguments (``value=``,
      ...) are forwarded to ``inner``. Its state is a
      [`SkipNonfiniteState`][jaxamp.types.SkipNonfiniteState]; after a skipped step
      [`jaxamp.explain`][jaxamp.explain] names the non-finite leaves.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.inf, 0.0])}
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"], int(jaxamp.metrics(state)["skipped_steps"])
      (Array([0., 0., 0.], dtype=float32), 1)
    """
    fn = "skip_nonfinite"
    inner = check_inner(inner, fn)
    loss_scale = loss_scale_arg(loss_scale, max_consecutive_nonfinite, fn)
    every_k = static_int(every_k, "every_k", fn, 1)
    axis_name = check_axis_name(axis_name, fn)
    spikes = _spikes.check_rule(spikes, fn)

    def init_fn(params: optax.Params) -> SkipNonfiniteState:
        # Fresh arrays throughout, so a donated opt state never frees these leaves.
        ls = jax.tree.map(lambda x: jnp.array(x, copy=True), loss_scale)
        acc = mini_step = None
        if every_k > 1:
            acc = jax.tree.map(jnp.zeros_like, params)
            mini_step = jnp.zeros((), jnp.int32)
        spike_state = None if spikes is None else _spikes.init(spikes, every_k)
        leaves = _record.init(params)
        inner_state = inner.init(params)
        refuse_narrow(params, inner_state, f"jaxamp.{fn}")
        refuse_nested(inner_state, f"jaxamp.{fn}")
        return SkipNonfiniteState(inner_state, ls, acc, mini_step, leaves, spike_state)

    return optax.GradientTransformationExtraArgs(
        init_fn, _SkipNonfiniteUpdate(inner, axis_name, every_k, spikes)
    )
