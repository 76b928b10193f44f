"""The optax side: ``skip_nonfinite`` and the fused ``step`` (``multi_transform`` is beside it).

Each transformation is a plain ``optax.GradientTransformationExtraArgs`` whose
``update`` is a small object holding the transformation's parts as fields (equinox
style), so that ``tx._replace(...)`` and pytree round trips keep them and
[`step`][jaxamp.step] can run the same guarded core (``_guard.guarded``) with the
parameter update fused in.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp import _leaf_stats, _spikes
from jaxamp import _loss_scale as ls_lib
from jaxamp._conversion_checks import check_flax_train_state
from jaxamp._guard import Call, Outcome, Part, Spikes, cond_traced_once, guarded
from jaxamp._loss_scale import LossScaleState
from jaxamp._nnx_state import refuse_flax_optimizer
from jaxamp._tree import check_axis_name, is_float_leaf, like, render_path, zeros_of

__all__ = ["SkipNonfiniteState", "skip_nonfinite", "step"]


class SkipNonfiniteState(NamedTuple):
    """State of [`skip_nonfinite`][jaxamp.skip_nonfinite].

    Attributes:
      inner_state: the inner optimizer's state.
      loss_scale: the [`jaxamp.LossScaleState`][jaxamp.LossScaleState].
      acc: with ``every_k > 1``, the sum of the window's scaled gradients so far
        (``None`` otherwise).
      mini_step: with ``every_k > 1``, an int32 count of the calls in this window
        so far (``None`` otherwise).
      nonfinite_leaves: a [`jaxamp.NonfiniteLeaves`][jaxamp.NonfiniteLeaves]: which gradient leaves
        were non-finite on the last skipped step, and how often each has been
        (read it with [`jaxamp.explain`][jaxamp.explain]).
      spikes: with ``spikes=``, the [`jaxamp.SpikeState`][jaxamp.SpikeState] (``None`` otherwise).

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


class Window(NamedTuple):
    """An accumulation window's last call: the sum so far and the incoming gradients.

    ``every_k``'s guarded step reads the window's mean through ``Part.prepare``
    (``mean(Window)``), so the mean is never materialised as a tree of its own.
    """

    acc: Any
    grads: Any


def _loss_scale_arg(loss_scale: Any, max_consecutive_nonfinite: Any, fn: str) -> LossScaleState:
    if loss_scale is None:
        loss_scale = ls_lib.check_only()  # check and skip, never scale: the bfloat16 case
    elif not isinstance(loss_scale, LossScaleState):
        raise TypeError(
            f"{fn}: `loss_scale` must be a LossScaleState (jaxamp.dynamic_scale(), "
            f"jaxamp.static_scale(), jaxamp.no_scale()) or None, got {type(loss_scale).__name__}."
        )
    if max_consecutive_nonfinite is not None:
        # An int N, or math.inf to never raise (the loss-scale state's own spellings).
        limit = max_consecutive_nonfinite
        if isinstance(limit, bool) or not (isinstance(limit, int) or limit == float("inf")):
            raise TypeError(
                f"{fn}: max_consecutive_nonfinite must be None (check_health's default "
                "rule), an integer >= 0, or math.inf (never raise), got "
                f"{max_consecutive_nonfinite!r}."
            )
        try:
            loss_scale = loss_scale.replace(max_consecutive_nonfinite=max_consecutive_nonfinite)
        except ValueError as e:
            raise ValueError(f"{fn}: {e}") from None
    return loss_scale


def _check_inner(inner: Any, fn: str, what: str = "inner") -> optax.GradientTransformationExtraArgs:
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"{fn}: `{what}` must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
            f"got {type(inner).__name__}."
        )
    return optax.with_extra_args_support(inner)


def _check_grads(grads: Any, params: Any, fn: str) -> None:
    """Gradients must match the params leaf for leaf, shapes included (no broadcasting)."""
    if params is None:
        return
    g_def, p_def = jax.tree.structure(grads), jax.tree.structure(params)
    if g_def != p_def:
        raise ValueError(
            f"{fn}: the gradients' tree does not match the params' tree.\n  grads:  {g_def}\n"
            f"  params: {p_def}\nPass the gradients of the loss with respect to these params."
        )
    for (path, g), p in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(params), strict=True
    ):
        g_shape, p_shape = jnp.shape(g), jnp.shape(p)
        if g_shape != p_shape:
            raise ValueError(
                f"{fn}: the gradient at `{render_path(path)}` has shape {g_shape} but the "
                f"param has shape {p_shape}; gradients must have their params' shapes exactly."
            )


def _check_inner_state(inner: Any, state: Any, like_params: Any, fn: str, where: str) -> None:
    """The opt state must be the one ``inner.init`` builds (same tree), or a clear error."""
    expected = jax.tree.structure(jax.eval_shape(inner.init, like_params))
    got = jax.tree.structure(state)
    if expected != got:
        raise TypeError(
            f"{fn}: {where} does not match the inner optimizer: it was not made by this "
            f"transformation's init.\n  expected: {expected}\n  got:      {got}\n"
            "Pass the opt_state that tx.init(params) returned for this same tx."
        )


def _check_state_type(state: Any, cls: type, fn: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{fn}: expected the state returned by this transformation's init (a "
            f"{cls.__name__}), got {type(state).__name__}. Pass the opt_state that "
            "tx.init(params) returned for this transformation."
        )


def _record(state: Any, positions: list[list[int]] | None = None) -> Any:
    """``guarded``'s ``record=``: the state's per-leaf record and the parts' positions
    (None: one part holding every leaf, in order)."""
    if state.nonfinite_leaves is None:
        return None
    return state.nonfinite_leaves, positions


def _recorded(state: Any, got: Outcome) -> Any:
    """``state`` with the guarded step's loss scale, non-finite leaves and spike history."""
    new = state._replace(loss_scale=got.loss_scale)
    if got.nonfinite_leaves is not None:
        new = new._replace(nonfinite_leaves=got.nonfinite_leaves)
    if got.spikes is not None:
        new = new._replace(spikes=got.spikes)
    return new


def _check_spike_state(rule: Any, state: Any, fn: str) -> None:
    if rule is not None and not isinstance(state.spikes, _spikes.SpikeState):
        raise TypeError(
            f"{fn}: this transformation skips spikes but opt_state.spikes is "
            f"{type(state.spikes).__name__}: pass the opt_state that tx.init(params) returned "
            "for this same tx."
        )


class _GuardedUpdate:
    """An update function that [`step`][jaxamp.step] can also run with the param update fused in."""

    def __call__(
        self,
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, Any]:
        refuse_flax_optimizer(sys._getframe(1))
        check_flax_train_state(sys._getframe(1))
        return self.run(updates, state, params, Call(extra_args, None, to_params=False))

    def run(self, grads: Any, state: Any, params: Any, call: Call) -> tuple[Any, Any]:
        raise NotImplementedError


# eq=False: hashed by identity, as a plain function is, so that `jax.jit(tx.update)`
# works (a field such as multi_transform's dict of transforms is unhashable).
@dataclasses.dataclass(frozen=True, eq=False)
class _SkipNonfiniteUpdate(_GuardedUpdate):
    """``skip_nonfinite``'s update function; its parts are its fields."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: Any
    every_k: int
    spikes: _spikes.SpikeRule | None = None

    def run(
        self, grads: Any, state: SkipNonfiniteState, params: Any, call: Call
    ) -> tuple[Any, SkipNonfiniteState]:
        fn = "jaxamp.step" if call.to_params else "skip_nonfinite.update"
        _check_state_type(state, SkipNonfiniteState, fn)
        _check_spike_state(self.spikes, state, fn)
        _check_grads(grads, params, fn)
        _check_inner_state(
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
            record = _record(state)
            got = guarded(state.loss_scale, [part], call, self.axis_name, spikes, record)
            new = _recorded(state, got)
            return got.outs[0], new._replace(inner_state=got.inner_states[0])

        if self.every_k == 1:
            return window_step(grads, state)
        if call.verdict is not None:
            raise ValueError(
                "jaxamp.step: finite= cannot be combined with every_k > 1: the window's "
                "gradients are accumulated inside the optimizer state and checked at its end."
            )
        return self._accumulate(grads, state, params, window_step, call.to_params, loss)

    def _accumulate(
        self,
        grads: Any,
        state: SkipNonfiniteState,
        params: Any,
        window_step: Any,
        to_params: bool,
        loss: Any,
    ) -> tuple[Any, SkipNonfiniteState]:
        k = self.every_k

        def add(a: Any, g: Any) -> Any:
            return a + g.astype(a.dtype) if is_float_leaf(a) else a

        def finish(grads: Any, state: SkipNonfiniteState) -> tuple[Any, SkipNonfiniteState]:
            # The window's mean over the micro-batches it holds: k, or more when a
            # window saved under a larger every_k is restored here (it ends now, as
            # one step of the right size, never k-times too large).
            count = state.mini_step + 1

            def mean(window: Window) -> Any:
                return jax.tree.map(
                    lambda a, g: (
                        (add(a, g) / count.astype(a.dtype)).astype(a.dtype)
                        if is_float_leaf(a)
                        else g
                    ),
                    window.acc,
                    window.grads,
                )

            # One guarded step on the mean, computed where it is read.
            window_loss = None
            if self.spikes is not None:
                window_loss = (state.spikes.pending + loss) / count.astype(jnp.float32)
                state = state._replace(spikes=state.spikes._replace(pending=jnp.zeros_like(loss)))
            out, state = window_step(Window(state.acc, grads), state, mean, window_loss)
            # Reset by replacement: `acc * 0` would keep an overflowed micro-batch's NaN.
            zeros = jax.tree.map(jnp.zeros_like, state.acc)
            # zeros_like keeps the counter's type: per-device (varying) under shard_map.
            return out, state._replace(acc=zeros, mini_step=jnp.zeros_like(state.mini_step))

        def accumulate(
            shapes: Any, grads: Any, state: SkipNonfiniteState
        ) -> tuple[Any, SkipNonfiniteState]:
            if to_params:
                out = params
            else:
                out = zeros_of(shapes[0])
            acc = jax.tree.map(add, state.acc, grads)
            state = state._replace(acc=acc, mini_step=state.mini_step + 1)
            if self.spikes is not None:
                state = state._replace(
                    spikes=state.spikes._replace(pending=state.spikes.pending + loss)
                )
            return like((out, state), shapes)

        return cond_traced_once(state.mini_step >= k - 1, finish, accumulate, grads, state)


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
      loss_scale: a [`LossScaleState`][jaxamp.LossScaleState]; ``None`` skips non-finite steps
        without scaling (the bfloat16 case).
      every_k: micro-batches per optimizer step (an int >= 1).
      max_consecutive_nonfinite: more than this many skipped steps in a row make
        [`jaxamp.check_health`][jaxamp.check_health] raise ``FloatingPointError``; ``None`` keeps
        the loss-scale state's setting (by default: more than 100 in a row once the scale can go no
        lower), ``math.inf`` never raises. The step itself is always skipped: a non-finite update is
        never applied.
      axis_name: mapped axis name(s) (``pmap`` / ``shard_map``) over which the
        finiteness check is agreed, so every device skips together. Not needed
        under ``jax.jit`` with sharded arrays, where the check is a global reduction.
      spikes: a [`jaxamp.spike_rule`][jaxamp.spike_rule]: also skip a finite step whose loss
        (``value=``) or gradient norm spikes, in the same ``lax.cond``; the scale
        does not move for it. With ``every_k``, a window's mean loss is judged.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra arguments (``value=``,
      ...) are forwarded to ``inner``. Its state is a
      [`SkipNonfiniteState`][jaxamp.SkipNonfiniteState]; after a skipped step
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
    inner = _check_inner(inner, fn)
    loss_scale = _loss_scale_arg(loss_scale, max_consecutive_nonfinite, fn)
    if isinstance(every_k, bool) or not isinstance(every_k, int):
        raise TypeError(f"{fn}: every_k must be an int >= 1, got {every_k!r}.")
    if every_k < 1:
        raise ValueError(f"{fn}: every_k must be >= 1, got {every_k}.")
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
        leaves = _leaf_stats.init(params)
        return SkipNonfiniteState(inner.init(params), ls, acc, mini_step, leaves, spike_state)

    return optax.GradientTransformationExtraArgs(
        init_fn, _SkipNonfiniteUpdate(inner, axis_name, every_k, spikes)
    )


def step(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    finite: Any = None,
    **extra_args: Any,
) -> tuple[Any, Any]:
    """One optimizer step: ``tx.update`` and ``optax.apply_updates`` fused.

    PyTorch's ``scaler.step(optimizer)``. For a [`skip_nonfinite`][jaxamp.skip_nonfinite] or
    [`multi_transform`][jaxamp.multi_transform] transformation the results equal ``tx.update``
    followed by ``optax.apply_updates`` bit for bit, but a non-finite step is
    skipped as a whole (params and inner state pass through a ``lax.cond``), so no
    zero updates and no second copy of the optimizer state are materialised. Any
    other transformation takes the plain ``update`` + ``apply_updates`` path.

    Args:
      tx: the optimizer, ideally one [`skip_nonfinite`][jaxamp.skip_nonfinite] or
        [`multi_transform`][jaxamp.multi_transform] returned.
      grads: the (scaled) gradients; with ``finite=``, already unscaled.
      opt_state: ``tx``'s state.
      params: the parameters.
      finite: PyTorch's ``unscale_`` then ``step``: a bool scalar saying that
        ``grads`` were already unscaled and checked (by
        [`jaxamp.unscale_and_check`][jaxamp.unscale_and_check], then clipped or edited). They are
        not unscaled or checked again; the step is skipped where ``finite`` is False, and the scale
        updates with it.
      **extra_args: forwarded to the inner optimizer (e.g. ``value=`` for
        ``optax.contrib.reduce_on_plateau``).

    Returns:
      ``(new_params, new_opt_state)``.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.5), jaxamp.static_scale(2.0))
      >>> params = {"w": jnp.ones(2)}
      >>> params, state = jaxamp.step(tx, {"w": jnp.array([2.0, 4.0])}, tx.init(params), params)
      >>> params["w"]
      Array([0.5, 0. ], dtype=float32)
    """
    if params is None:
        raise ValueError(
            "jaxamp.step needs the params (it returns the new params); to get updates "
            "instead, call tx.update(grads, opt_state, params)."
        )
    update = getattr(tx, "update", None)
    if isinstance(update, _GuardedUpdate):
        return update.run(grads, opt_state, params, Call(extra_args, finite, to_params=True))
    if finite is not None:
        raise TypeError(
            "jaxamp.step: finite= needs a transformation from jaxamp.skip_nonfinite or "
            f"jaxamp.multi_transform, got {type(tx).__name__}."
        )
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state
