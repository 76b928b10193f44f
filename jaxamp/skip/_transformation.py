"""What ``skip_nonfinite`` and ``multi_transform`` share: the update function's base,
``step`` that runs it with the parameter update fused in, and their argument checks.

Each transformation is a plain ``optax.GradientTransformationExtraArgs`` whose
``update`` is a small object holding the transformation's parts as fields (equinox
style), so that ``tx._replace(...)`` and pytree round trips keep them and
[`step`][jaxamp.step] can run the same guarded core (``_guard.guarded``) with the
parameter update fused in.
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._utils.dtypes import is_narrow_range
from jaxamp._utils.optional import loaded
from jaxamp._utils.tree import is_none, render_path
from jaxamp.loss_scale import (
    LossScaleState,
    check_callers,
    check_only,
    check_state,
    holds_loss_scale,
    unwrap,
    with_limit,
)
from jaxamp.low_precision_state import is_stored
from jaxamp.skip import _spikes
from jaxamp.skip._flax_callers import check_flax_callers
from jaxamp.skip._guard import Call, Outcome

__all__ = ["step"]


class GuardedUpdate:
    """An update function that [`step`][jaxamp.step] can also run with the param update fused in."""

    def __call__(
        self,
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, Any]:
        check_callers(sys._getframe(1), state, "skip_nonfinite.update")
        check_flax_callers(sys._getframe(1))
        grads, marked = unwrap(updates)
        verdict, given = None, _GIVEN.get()
        if given is not None:  # jaxamp.step through a structure safe around the guard
            verdict, marked = given.verdict, marked or given.unscaled
            _GIVEN.set(given._replace(reached=True))
        return self.run(grads, state, params, Call(extra_args, verdict, False, marked))

    def run(self, grads: Any, state: Any, params: Any, call: Call) -> tuple[Any, Any]:
        raise NotImplementedError


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
    other transformation takes the plain ``update`` + ``apply_updates`` path, but
    one that puts the guard inside a structure unsafe around it (an ``optax.chain``
    with other members, ``optax.MultiSteps``, ...: the guard must be the outermost
    transformation) is refused, naming what to write instead.

    Args:
      tx: the optimizer, ideally one [`skip_nonfinite`][jaxamp.skip_nonfinite] or
        [`multi_transform`][jaxamp.multi_transform] returned.
      grads: the (scaled) gradients, or the [`jaxamp.types.Unscaled`][jaxamp.types.Unscaled] ones
        [`jaxamp.unscale_and_check`][jaxamp.unscale_and_check] returned (checked, not
        unscaled again).
      opt_state: ``tx``'s state.
      params: the parameters.
      finite: PyTorch's ``unscale_`` then ``step``: a bool scalar saying that
        ``grads`` were already unscaled and checked (by
        [`jaxamp.unscale_and_check`][jaxamp.unscale_and_check], then clipped or edited). They are
        not unscaled or checked again; the step is skipped where ``finite`` is False, and the scale
        updates with it. Without it, ``Unscaled`` gradients are checked here (an edit that
        made one non-finite is caught too).
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
    grads, marked = unwrap(grads)
    update = getattr(tx, "update", None)
    if isinstance(update, GuardedUpdate):
        return update.run(grads, opt_state, params, Call(extra_args, finite, True, marked))
    guarded = check_state(opt_state, "jaxamp.step / TrainState.apply_gradients")
    if finite is not None and not guarded:
        raise TypeError(
            "jaxamp.step: finite= needs a transformation from jaxamp.skip_nonfinite or "
            f"jaxamp.multi_transform, got {type(tx).__name__}."
        )
    # A guard inside a structure safe around it (a chain of one, flatten, ...): what
    # the gradients are (unscaled, a verdict) travels beside them, not on them
    # (optax.flatten ravels the Unscaled mark away).
    token = _GIVEN.set(_Given(finite, marked, False))
    try:
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        reached = _GIVEN.get().reached
    finally:
        _GIVEN.reset(token)
    if (finite is not None or marked) and not reached:
        raise TypeError(
            "jaxamp.step: unscaled gradients (finite=, or what jaxamp.unscale_and_check "
            f"returned) need a jaxamp guard in tx, and this {type(tx).__name__}'s update "
            "called none. Pass tx = jaxamp.skip_nonfinite(inner, loss_scale)."
        )
    return optax.apply_updates(params, updates), opt_state


class _Given(NamedTuple):
    """What ``jaxamp.step`` was told of its gradients, for the guard a structure safe
    around it calls: ``finite=`` (or None), whether they were ``Unscaled``, and whether
    a guard has read this (so that it is never dropped)."""

    verdict: Any
    unscaled: bool
    reached: bool


_GIVEN: contextvars.ContextVar[_Given | None] = contextvars.ContextVar("jaxamp_step", default=None)


# What skip_nonfinite's and multi_transform's deprecated max_consecutive_nonfinite= says
# to write instead: the limit is the loss-scale state's, set where it is built.
MOVED_LIMIT = (
    "pass it to the loss-scale state's constructor (jaxamp.dynamic_scale(..., "
    "max_consecutive_nonfinite=N), jaxamp.static_scale, jaxamp.check_only)"
)


def loss_scale_arg(loss_scale: Any, max_consecutive_nonfinite: Any, fn: str) -> LossScaleState:
    if loss_scale is None:
        loss_scale = check_only()
    elif not isinstance(loss_scale, LossScaleState):
        # The two usual slips: the scale as a number (find_overflow's scale= takes
        # one), and the optimizer state that holds the loss-scale state.
        number = isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool)
        if getattr(loss_scale, "shape", None) == () and not number:
            number = jnp.issubdtype(loss_scale.dtype, jnp.integer) or jnp.issubdtype(
                loss_scale.dtype, jnp.floating
            )
        if number:
            fixed = loss_scale if isinstance(loss_scale, int | float) else float(loss_scale)
            hint = (
                f" For a fixed scale of {fixed!r}, pass jaxamp.static_scale({fixed!r}); for one "
                "that adapts, jaxamp.dynamic_scale()."
            )
        elif holds_loss_scale(loss_scale):
            hint = (
                " It holds one: to go on with its scale and counters, pass "
                "jaxamp.get_loss_scale(opt_state)."
            )
        else:
            hint = ""
        raise TypeError(
            f"jaxamp.{fn}: `loss_scale` must be a LossScaleState (jaxamp.dynamic_scale(), "
            "jaxamp.static_scale(...), jaxamp.check_only(), jaxamp.no_scale()) or None, got "
            f"{type(loss_scale).__name__}.{hint}"
        )
    return with_limit(loss_scale, max_consecutive_nonfinite, fn)


def check_inner(inner: Any, fn: str, what: str = "inner") -> optax.GradientTransformationExtraArgs:
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"{fn}: `{what}` must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
            f"got {type(inner).__name__}."
        )
    return optax.with_extra_args_support(inner)


def _array_like(x: Any) -> bool:
    """A leaf a gradient can update: anything with a shape and a dtype, or a number."""
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, int | float | complex)


def _equinox_hint(grads: Any, params: Any) -> str:
    """Advice for an equinox model's trees, if either tree is one (or the params hold
    non-array leaves, as a whole model does)."""
    eqx = loaded("equinox")
    module = eqx is not None and (isinstance(grads, eqx.Module) or isinstance(params, eqx.Module))
    if not (module or any(not _array_like(x) for x in jax.tree.leaves(params))):
        return ""
    return (
        "\nFor an equinox model: take the gradients with eqx.filter_value_and_grad (or "
        "jaxamp.value_and_grad(loss_fn, inexact_only=True)), give tx.init "
        "eqx.filter(model, eqx.is_inexact_array) (is_array keeps integer arrays, which get "
        "no gradient), and pass here that same filtered model or the whole model (a None "
        "gradient leaves its field as it is)."
    )


def check_grads(grads: Any, params: Any, fn: str) -> Any:
    """Gradients must match the params leaf for leaf, shapes included (no broadcasting).

    As optax reads the two trees: a ``None`` gradient (what ``eqx.filter_grad`` gives
    every field it does not differentiate) stands for the whole param subtree at its
    place, which is not updated. Returns the params the inner optimizer is given:
    ``params``, or, where a ``None`` gradient stands for a param (an equinox model
    passed whole: its activation functions, flags, names), ``params`` with ``None``
    there, the tree ``tx.init`` was given (``eqx.filter(model, eqx.is_array)``).
    ``restore_fields`` puts those params back into the new params ``jaxamp.step`` returns.
    """
    if params is None:
        return None
    g_def = jax.tree.structure(grads, is_leaf=is_none)
    try:
        under = g_def.flatten_up_to(params)  # per gradient (or None), its param subtree
    except (ValueError, TypeError):
        p_def = jax.tree.structure(params)
        raise ValueError(
            f"{fn}: the gradients' tree does not match the params' tree.\n"
            f"  grads:  {jax.tree.structure(grads)}\n  params: {p_def}\n"
            "Pass the gradients of the loss with respect to these params."
            + _equinox_hint(grads, params)
        ) from None
    flat = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
    trained, fields = [], False
    for (path, g), p in zip(flat, under, strict=True):
        if g is None:
            fields = fields or p is not None
            trained.append(None)
            continue
        if not _array_like(p):  # a subtree, None, or a field such as a function
            what = "nothing" if p is None else f"a {type(p).__name__}"
            raise ValueError(
                f"{fn}: the gradient at `{render_path(path)}` is a "
                f"{type(g).__name__} but the params hold {what} there: pass the gradients "
                "of the loss with respect to these params." + _equinox_hint(grads, params)
            )
        g_shape, p_shape = jnp.shape(g), jnp.shape(p)
        if g_shape != p_shape:
            raise ValueError(
                f"{fn}: the gradient at `{render_path(path)}` has shape {g_shape} but the "
                f"param has shape {p_shape}; gradients must have their params' shapes exactly."
            )
        trained.append(p)
    return g_def.unflatten(trained) if fields else params


def restore_fields(new_params: Any, params: Any) -> Any:
    """``jaxamp.step``'s result for ``params``: ``new_params`` (the update of what
    ``check_grads`` returned) with ``params``' leaves back where it holds ``None``."""
    return jax.tree.map(lambda n, p: p if n is None else n, new_params, params, is_leaf=is_none)


def refuse_nested(inner_state: Any, fn: str) -> None:
    """Raises for a guard inside a guard: the gradients would be unscaled twice (the
    outer guard hands the inner one unscaled gradients as if scaled)."""
    if holds_loss_scale(inner_state):
        raise ValueError(
            f"{fn}: the inner optimizer holds a jaxamp guard of its own (skip_nonfinite or "
            "multi_transform inside another): its gradients would be unscaled twice. Use "
            "one guard, outermost: jaxamp.skip_nonfinite(optax.adam(1e-3), loss_scale), or "
            "jaxamp.multi_transform({...plain optax transformations...}, labels, loss_scale)."
        )


def refuse_narrow(params: Any, inner_state: Any, fn: str) -> None:
    """Raises for float16 (or float8) params or inner optimizer state: finite, checked
    gradients overflow an optimizer step computed or kept there (AdamW's update, a
    squared gradient), which the finite check on the gradients cannot see. PyTorch's
    GradScaler refuses float16 params likewise ("Attempting to unscale FP16 gradients").

    A moment ``jaxamp.low_precision_state`` stores counts as its ``dtype``, the one the
    wrapped optimizer built it in: that optimizer still computes it there (optax.adam
    casts ``mu`` to ``mu_dtype``), whatever the stored form."""
    for tree, where in ((params, "params"), (inner_state, "opt_state.inner_state")):
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_stored)[0]
        narrow = [
            f"`{render_path(p)}` ({x.dtype if is_stored(x) else jnp.result_type(x)})"
            for p, x in flat
            if hasattr(x, "dtype") and is_narrow_range(x.dtype)
        ]
        if not narrow:
            continue
        shown = ", ".join(narrow[:3]) + (f" and {len(narrow) - 3} more" if len(narrow) > 3 else "")
        fix = (
            "Keep float32 master params and compute in float16 with jaxamp.autocast(fn, "
            "dtype=jnp.float16); for low-precision params, bfloat16 ones (float32's range) "
            "with jaxamp.apply_with_stochastic_rounding or jaxamp.apply_with_kahan_summation "
            "last in the inner chain."
            if where == "params"
            else "Keep the optimizer's state in float32 or bfloat16 (e.g. "
            "optax.adam(..., mu_dtype=jnp.bfloat16) instead of jnp.float16)."
        )
        raise TypeError(
            f"{fn}: the {where} hold leaves of float16's range or narrower ({shown}). The "
            "guard checks the "
            "gradients, but an optimizer step computed or kept in float16 overflows from "
            "finite gradients (AdamW's update, a squared gradient) and would write inf or "
            f"NaN (PyTorch's GradScaler refuses float16 params too). {fix}"
        )


def check_inner_state(inner: Any, state: Any, like_params: Any, fn: str, where: str) -> None:
    """The opt state must be the one ``inner.init`` builds (same tree), or a clear error."""
    expected = jax.tree.structure(jax.eval_shape(inner.init, like_params))
    got = jax.tree.structure(state)
    if expected != got:
        raise TypeError(
            f"{fn}: {where} does not match the inner optimizer: it was not made by this "
            f"transformation's init.\n  expected: {expected}\n  got:      {got}\n"
            "Pass the opt_state that tx.init(params) returned for this same tx."
        )


def check_state_type(state: Any, cls: type, fn: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{fn}: expected the state returned by this transformation's init (a "
            f"{cls.__name__}), got {type(state).__name__}. Pass the opt_state that "
            "tx.init(params) returned for this transformation."
        )


def check_spike_state(rule: Any, state: Any, fn: str) -> None:
    if rule is not None and not isinstance(state.spikes, _spikes.SpikeState):
        raise TypeError(
            f"{fn}: this transformation skips spikes but opt_state.spikes is "
            f"{type(state.spikes).__name__}: pass the opt_state that tx.init(params) returned "
            "for this same tx."
        )


def record_of(state: Any, positions: list[list[int]] | None = None) -> Any:
    """``guarded``'s ``record=``: the state's per-leaf record and the parts' positions
    (None: one part holding every leaf, in order)."""
    if state.nonfinite_leaves is None:
        return None
    return state.nonfinite_leaves, positions


def with_outcome(state: Any, got: Outcome) -> Any:
    """``state`` with the guarded step's loss scale, non-finite leaves and spike history."""
    new = state._replace(loss_scale=got.loss_scale)
    if got.nonfinite_leaves is not None:
        new = new._replace(nonfinite_leaves=got.nonfinite_leaves)
    if got.spikes is not None:
        new = new._replace(spikes=got.spikes)
    return new
