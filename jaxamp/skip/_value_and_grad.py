"""``jaxamp.value_and_grad``: the gradients of the scaled loss, the loss as computed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._utils.dtypes import is_inexact
from jaxamp._utils.errors import named
from jaxamp._utils.tree import is_float_array, is_none, render_path
from jaxamp.loss_scale import LossScaleNotFound, LossScaleState, get_loss_scale, scale

__all__ = ["scaled_loss", "value_and_grad"]


def scaled_loss(
    fun: Callable[..., Any], has_aux: bool, ls: LossScaleState, where: str = "value_and_grad"
) -> Callable[..., Any]:
    """``fun`` returning ``(loss * scale, (loss, aux))``, its loss checked to be a float scalar."""

    def scaled(*args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise TypeError(
                    f"{where}: with has_aux=True, `fun` must return a pair (loss, aux), "
                    f"got {type(out).__name__}."
                )
            loss, aux = out
        else:
            loss, aux = out, None
        if jnp.shape(loss) != () or not is_inexact(jnp.asarray(loss)):
            raise TypeError(
                f"{where}: `fun` must return a scalar floating loss"
                + (" as the first element of its pair" if has_aux else "")
                + f", got {jnp.asarray(loss).dtype}{list(jnp.shape(loss))}. Use has_aux=True "
                "to return (loss, aux)."
            )
        return scale(ls, loss), (loss, aux)

    return scaled


_LOSS_SCALE_KWARG = "__jaxamp_loss_scale_state__"
_FIELDS_KWARG = "__jaxamp_fields__"


def _split(tree: Any) -> tuple[Any, Any]:
    """``tree``'s floating arrays (other leaves None), and its other leaves (arrays None)."""
    arrays = jax.tree.map(lambda x: x if is_float_array(x) else None, tree)
    fields = jax.tree.map(lambda x: None if is_float_array(x) else x, tree)
    return arrays, fields


def _join(arrays: Any, fields: Any) -> Any:
    return jax.tree.map(lambda a, f: f if a is None else a, arrays, fields, is_leaf=is_none)


def _positions(argnums: int | Sequence[int], n_args: int) -> list[int]:
    """The in-range indices ``argnums`` names (JAX itself refuses the others)."""
    nums = [argnums] if isinstance(argnums, int) else list(argnums)
    return sorted({n % n_args for n in nums if isinstance(n, int) and -n_args <= n < n_args})


def _not_differentiable(args: tuple[Any, ...], positions: list[int]) -> str | None:
    """``argument i's `path` (a T)`` for the first leaf ``jax.grad`` refuses, if any."""
    for i in positions:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            if not is_inexact(leaf):
                what = f"{leaf.dtype} array" if hasattr(leaf, "dtype") else type(leaf).__name__
                where = f"argument {i}" + ("" if not path else f"'s leaf `{render_path(path)}`")
                return f"{where} (a {what})"
    return None


def _looks_like_opt_state(state: Any) -> bool:
    """Whether ``state`` holds optax states (NamedTuples such as ScaleByAdamState)."""
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, tuple) and hasattr(x, "_fields"))
    return any(isinstance(x, tuple) and hasattr(x, "_fields") for x in nodes)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    inexact_only: bool = False,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` of the *scaled* loss, returning the *unscaled* loss.

    Flax ``DynamicScale.value_and_grad`` users' habit, without a ``jaxamp.scale``
    lambda in every train step: the returned function takes the loss-scale state
    (or an optimizer state / ``TrainState`` holding one) first, then ``fun``'s
    arguments. ``argnums`` counts ``fun``'s arguments, as in JAX.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      argnums: which of ``fun``'s positional arguments to differentiate: an int
        or a sequence of ints, negative ones counted from the end, exactly as
        ``jax.value_and_grad`` reads them (the leading state is not counted).
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      inexact_only: differentiate only the array leaves of a floating (or complex) dtype
        of the ``argnums`` arguments, and give every other leaf a ``None`` gradient, as
        ``eqx.filter_value_and_grad`` does: for an equinox model, whose activation
        functions, flags (``eqx.nn.Dropout``'s ``inference``), integers and Python
        numbers are fields, not params. ``skip_nonfinite`` / ``jaxamp.step`` take these
        gradients with ``eqx.filter(model, eqx.is_array)`` or the whole model as params.
        ``False`` (the default): every leaf is differentiated, as ``jax.value_and_grad``
        does (it refuses a leaf that is not floating).

    Returns:
      A function ``(state, /, *args, **kwargs) -> (value, grads)``
      (``((value, aux), grads)`` with ``has_aux``): the loss as ``fun`` computed it and
      the gradients of the scaled loss, ready for [`jaxamp.step`][jaxamp.step] or ``tx.update``.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> loss_fn = lambda w, x: jnp.sum(w * x)
      >>> value, grads = jaxamp.value_and_grad(loss_fn)(jaxamp.static_scale(8.0), jnp.ones(2), 3.0)
      >>> value, grads
      (Array(6., dtype=float32), Array([24., 24.], dtype=float32))

      A model holding a non-float field, as an equinox module does:

      >>> model = {"w": jnp.ones(2), "double": True}
      >>> loss_fn = lambda m, x: jnp.sum(m["w"] * x) * (2.0 if m["double"] else 1.0)
      >>> grad_fn = jaxamp.value_and_grad(loss_fn, inexact_only=True)
      >>> grad_fn(jaxamp.static_scale(8.0), model, 3.0)[1]
      {'double': None, 'w': Array([48., 48.], dtype=float32)}
    """
    if not callable(fun):
        raise TypeError(f"value_and_grad: `fun` must be callable, got {type(fun).__name__}.")
    nums = argnums if isinstance(argnums, tuple | list) else (argnums,)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
        # The usual slip: the state passed to value_and_grad instead of the function it returns.
        raise TypeError(
            "jaxamp.value_and_grad: `argnums` must be an int or a sequence of ints, got "
            f"{type(argnums).__name__}. The optimizer state goes to the function it returns, "
            "not to value_and_grad: jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)."
        )

    def scaled_fun(*args: Any, **kwargs: Any) -> Any:
        # inexact_only: the differentiated arguments come as their floating arrays only,
        # their other leaves (functions, flags) as a keyword: never traced, never differentiated.
        fields = kwargs.pop(_FIELDS_KWARG, {})
        args = tuple(_join(a, fields[i]) if i in fields else a for i, a in enumerate(args))
        return scaled_loss(fun, has_aux, kwargs.pop(_LOSS_SCALE_KWARG))(*args, **kwargs)

    # jax.value_and_grad itself reads argnums (negative, tuple, list) against
    # `fun`'s own arguments; the loss-scale state reaches `scaled_fun` as a keyword
    # no user function has, so it is neither counted nor differentiated.
    grad_fn = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

    def wrapped(
        opt_state_or_loss_scale_state: Any, /, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        state = opt_state_or_loss_scale_state
        try:
            with named("value_and_grad"):
                ls = get_loss_scale(state)
        except LossScaleNotFound as e:
            # The usual slip: the loss's own arguments passed with no state in front.
            raise LossScaleNotFound(
                "the first argument must be the optimizer state "
                "(or a LossScaleState) that holds the loss scale, then the loss's own "
                "arguments: jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y). "
                f"Got a {type(state).__name__} with no LossScaleState in it"
                + (
                    "; if it is the optimizer state, build the optimizer with "
                    "jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale())."
                    if _looks_like_opt_state(state)
                    else "."
                ),
                e.fn,
                got=state,
            ) from None
        positions = _positions(argnums, len(args)) if args else []
        if inexact_only:
            split = {i: _split(args[i]) for i in positions}
            args = tuple(split[i][0] if i in split else a for i, a in enumerate(args))
            kwargs = {**kwargs, _FIELDS_KWARG: {i: fields for i, (_, fields) in split.items()}}
        try:
            (_, (loss, aux)), grads = grad_fn(*args, **kwargs, **{_LOSS_SCALE_KWARG: ls})
        except TypeError as e:
            # jax.grad refuses a leaf that is not floating before it calls `fun`.
            where = None if inexact_only else _not_differentiable(args, positions)
            if where is None:
                raise
            raise TypeError(
                f"jaxamp.value_and_grad: {where} cannot be differentiated: jax.grad takes "
                "floating leaves only. For a model "
                "holding fields that are not floating arrays (an equinox module: activation "
                "functions, eqx.nn.Dropout's `inference` flag), pass inexact_only=True: its "
                "floating arrays are differentiated and the other leaves get None gradients, "
                "as with eqx.filter_value_and_grad."
            ) from e
        return ((loss, aux) if has_aux else loss), grads

    return wrapped
