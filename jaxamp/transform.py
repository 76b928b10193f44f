"""The optax side: skip non-finite steps, unscale, and drive the loss scale.

``skip_nonfinite(inner, loss_scale)`` is a plain optax transformation. A skipped
step is skipped as a whole: ``inner.update`` runs under ``lax.cond`` only when the
gradients are finite, instead of being computed and then selected away, which
would keep a second copy of the optimizer state alive.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp import loss_scale as ls_lib
from jaxamp.loss_scale import LossScaleState
from jaxamp.tree import is_float_leaf, select_tree

__all__ = ["SkipNonfiniteState", "get_loss_scale", "skip_nonfinite", "step"]


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`: the inner optimizer's state and the loss scale."""

    inner_state: optax.OptState
    loss_scale: LossScaleState


class _SkipNonfinite(optax.GradientTransformationExtraArgs):
    """A GradientTransformationExtraArgs that remembers its parts for :func:`step`."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: Any


def _like(old: Any, new_shapes: Any) -> Any:
    """Returns ``old`` with each leaf in the dtype of ``new_shapes`` (a no-op when they agree)."""

    def cast(o: Any, n: Any) -> Any:
        if o is None or getattr(o, "dtype", None) == n.dtype:
            return o
        return jnp.asarray(o).astype(n.dtype)

    return jax.tree.map(cast, old, new_shapes)


def _fresh(tree: Any) -> Any:
    # A donated opt state must never share buffers with the transformation's own copy.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def skip_nonfinite(
    inner: optax.GradientTransformation,
    loss_scale: LossScaleState | None = None,
    *,
    max_consecutive_nonfinite: int | None = None,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Unscales gradients, skips non-finite steps and updates the loss scale.

    ``update`` unscales the incoming gradients with the current loss scale, checks
    them, and runs ``inner.update`` on the unscaled gradients only if every value
    is finite. A skipped step returns all-zero updates and the inner state
    unchanged, bit for bit. The loss scale then advances with
    :func:`jaxamp.update`. Clipping, weight decay and schedules inside ``inner``
    therefore see true (unscaled) gradients, like ``scaler.unscale_(optimizer)``
    before clipping in PyTorch.

    Args:
      inner: the optimizer to protect (any optax transformation or chain).
      loss_scale: a :class:`LossScaleState`; ``None`` skips non-finite steps
        without scaling (the bfloat16 case).
      max_consecutive_nonfinite: if set, more than this many skipped steps in a
        row make :func:`jaxamp.check_health` raise ``FloatingPointError``. The
        step itself is always skipped: a non-finite update is never applied.
      axis_name: mapped axis name(s) (``pmap`` / ``shard_map``) over which the
        finiteness check is agreed, so every device skips together. Not needed
        under ``jax.jit`` with sharded arrays, where the check is a global reduction.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra arguments (``value=``,
      ...) are forwarded to ``inner``. Its state is a :class:`SkipNonfiniteState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.inf, 0.0])}
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"], int(jaxamp.metrics(state)["skipped_steps"])
      (Array([0., 0., 0.], dtype=float32), 1)
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            "skip_nonfinite: `inner` must be an optax.GradientTransformation (e.g. "
            f"optax.adam(1e-3)), got {type(inner).__name__}."
        )
    if loss_scale is None:
        # Check and skip, never scale: what bfloat16 training wants.
        loss_scale = ls_lib.static_scale(1.0).replace(enabled=False)
    elif not isinstance(loss_scale, LossScaleState):
        raise TypeError(
            "skip_nonfinite: `loss_scale` must be a LossScaleState (jaxamp.dynamic_scale(), "
            f"jaxamp.static_scale(), jaxamp.no_scale()) or None, got {type(loss_scale).__name__}."
        )
    if max_consecutive_nonfinite is not None:
        if isinstance(max_consecutive_nonfinite, bool) or not isinstance(
            max_consecutive_nonfinite, int
        ):
            raise ValueError(
                "skip_nonfinite: max_consecutive_nonfinite must be None or an integer >= 0, "
                f"got {max_consecutive_nonfinite!r}."
            )
        loss_scale = loss_scale.replace(max_consecutive_nonfinite=max_consecutive_nonfinite)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> SkipNonfiniteState:
        return SkipNonfiniteState(inner.init(params), _fresh(loss_scale))

    def update_fn(
        updates: optax.Updates,
        state: SkipNonfiniteState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipNonfiniteState]:
        _check_opt_state(state, "update")
        ls = state.loss_scale

        def apply() -> tuple[optax.Updates, optax.OptState]:
            grads = ls_lib._unscale(ls, updates)
            return inner.update(grads, state.inner_state, params, **extra_args)

        if not ls.skip_nonfinite:
            new_updates, inner_state = apply()
            return new_updates, SkipNonfiniteState(inner_state, ls_lib.update(ls, True))

        finite = ls_lib._check(ls, updates, axis_name)
        out_shapes = jax.eval_shape(apply)

        def skip() -> tuple[optax.Updates, optax.OptState]:
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes[0])
            return zeros, _like(state.inner_state, out_shapes[1])

        new_updates, inner_state = lax.cond(finite, apply, skip)
        return new_updates, SkipNonfiniteState(inner_state, ls_lib.update(ls, finite))

    tx = _SkipNonfinite(init_fn, update_fn)
    tx.inner, tx.axis_name = inner, axis_name
    return tx


def _check_opt_state(state: Any, fn: str) -> None:
    if not isinstance(state, SkipNonfiniteState):
        raise TypeError(
            f"jaxamp.{fn}: expected the state returned by the skip_nonfinite transformation's "
            f"init (a SkipNonfiniteState), got {type(state).__name__}. Pass the opt_state that "
            "tx.init(params) returned for this transformation."
        )


def get_loss_scale(opt_state: Any) -> LossScaleState:
    """Finds the :class:`LossScaleState` inside an optimizer state.

    Looks through any nesting (``optax.chain``, ``MultiSteps``,
    ``multi_transform``, ``inject_hyperparams``, Flax ``TrainState``).

    Args:
      opt_state: an optax state that contains exactly one :func:`skip_nonfinite` state.

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
            "optimizer in one jaxamp.skip_nonfinite, or pass the sub-state you mean."
        )
    return found[0]


_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _rounded(updates: Any, zero: jax.Array) -> Any:
    """The updates as ``tx.update`` hands them out: each rounded to its dtype.

    ``tx.update`` returns its updates out of a ``lax.cond``, so the parameter add
    that follows sees rounded values. Fused into the update, ``p + u`` would let the
    compiler contract u's last multiply and the add into one FMA and differ in the
    last bit. Adding to u's bits a zero the compiler cannot see (``zero``, an int32
    run-time value; free, in registers, no memory traffic) keeps the two forms equal
    bit for bit.
    """

    def opaque(u: Any) -> Any:
        if not is_float_leaf(u) or jnp.iscomplexobj(u) or u.dtype.itemsize not in _BITS:
            return u
        bits = _BITS[u.dtype.itemsize]
        return lax.bitcast_convert_type(
            lax.bitcast_convert_type(u, bits) + zero.astype(bits), u.dtype
        )

    return jax.tree.map(opaque, updates)


def _fused_step(
    tx: _SkipNonfinite,
    grads: Any,
    opt_state: SkipNonfiniteState,
    params: Any,
    extra_args: dict[str, Any],
    use_cond: bool = True,
) -> tuple[Any, SkipNonfiniteState]:
    ls = opt_state.loss_scale
    # The tracker is never negative, but XLA cannot know: a zero it cannot fold.
    opaque_zero = jnp.minimum(ls.growth_tracker, 0)

    def apply(params: Any, inner_state: Any, grads: Any) -> tuple[Any, Any]:
        updates, inner_state = tx.inner.update(
            ls_lib._unscale(ls, grads), inner_state, params, **extra_args
        )
        if ls.skip_nonfinite:  # tx.update hands these out of a cond: keep its rounding
            updates = _rounded(updates, opaque_zero)
        return optax.apply_updates(params, updates), inner_state

    if not ls.skip_nonfinite:  # nothing is checked: tx.update has no cond either
        params, inner_state = apply(params, opt_state.inner_state, grads)
        return params, SkipNonfiniteState(inner_state, ls_lib.update(ls, True))

    finite = ls_lib._check(ls, grads, tx.axis_name)
    operands = (params, opt_state.inner_state, grads)
    if use_cond:
        out_shapes = jax.eval_shape(apply, *operands)

        def skip(params: Any, inner_state: Any, grads: Any) -> tuple[Any, Any]:
            return _like((params, inner_state), out_shapes)

        new_params, inner_state = lax.cond(finite, apply, skip, *operands)
    else:  # compute, then select: kept for the benchmark that compares the two designs
        new = apply(*operands)
        new_params, inner_state = select_tree(finite, new, _like(operands[:2], new))
    return new_params, SkipNonfiniteState(inner_state, ls_lib.update(ls, finite))


def step(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    **extra_args: Any,
) -> tuple[Any, Any]:
    """One optimizer step: ``tx.update`` and ``optax.apply_updates`` fused.

    PyTorch's ``scaler.step(optimizer)``. For a :func:`skip_nonfinite`
    transformation the results equal ``tx.update`` followed by
    ``optax.apply_updates`` bit for bit, but a non-finite step is skipped as a
    whole (params and inner state are passed through a ``lax.cond``), so no zero
    updates and no second copy of the optimizer state are materialised. Any other
    transformation takes the plain ``update`` + ``apply_updates`` path.

    Args:
      tx: the optimizer, ideally the one :func:`skip_nonfinite` returned.
      grads: the (scaled) gradients.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: forwarded to the inner optimizer (e.g. ``value=`` for
        ``optax.contrib.reduce_on_plateau``).

    Returns:
      ``(new_params, new_opt_state)``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.5), jaxamp.static_scale(2.0))
      >>> params = {"w": jnp.ones(2)}
      >>> params, state = jaxamp.step(tx, {"w": jnp.array([2.0, 4.0])}, tx.init(params), params)
      >>> params["w"]
      Array([0.5, 0. ], dtype=float32)
    """
    if isinstance(tx, _SkipNonfinite):
        _check_opt_state(opt_state, "step")
        return _fused_step(tx, grads, opt_state, params, extra_args)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state
