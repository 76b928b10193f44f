"""Flax NNX: an ``nnx.Optimizer`` that skips a non-finite step as a whole.

``jaxamp.nnx.Optimizer`` is ``flax.nnx.Optimizer`` with :func:`jaxamp.step` inside
``update``: one ``lax.cond`` around the inner update and the parameter write, so
a skipped step leaves the ``wrt`` Variables and the optimizer state as they were,
and ``optimizer.step`` counts only the steps taken. The model state the forward
pass wrote (``BatchStat`` and every other Variable outside ``wrt``) is put back
on a skipped step too: :func:`value_and_grad` records it before the forward, and
``update`` restores it where the step was skipped. The loss scale is
``optimizer.loss_scale``.

Requires the Flax NNX optimizer interface of flax >= 0.11
(``Optimizer(model, tx, wrt=...)``, ``update(model, grads)``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxamp import _metrics as ls_lib
from jaxamp._guard import Call
from jaxamp._loss_scale import LossScaleState
from jaxamp._model_state import applied_calls, stepped
from jaxamp._nnx_state import forward_written
from jaxamp._transform import _GuardedUpdate
from jaxamp._tree import select_tree
from jaxamp._value_and_grad import scaled_loss

__all__ = ["Optimizer", "value_and_grad"]


def _flax_version() -> tuple[int, ...]:
    import flax

    return tuple(int(p) for p in flax.__version__.split(".")[:2] if p.isdigit())


def _pure(tree: Any) -> Any:
    return nnx.as_pure(tree) if hasattr(nnx, "as_pure") else nnx.to_pure_dict(tree)


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose ``update`` skips a non-finite step as a whole.

    Build it as Flax's, with a :func:`jaxamp.skip_nonfinite` (or
    :func:`jaxamp.multi_transform`) transformation; take the gradients of the
    scaled loss with :func:`jaxamp.nnx.value_and_grad` (or Flax's own
    ``nnx.value_and_grad`` of ``loss * optimizer.loss_scale.scale``); then
    ``optimizer.update(model, grads)``.

    On a skipped step the ``wrt`` Variables, the optimizer state (but for its
    loss-scale counters), ``optimizer.step`` and the model state a forward writes
    keep their values. That model state is every Variable outside ``wrt`` that is
    neither an ``nnx.Param`` nor an ``nnx.Intermediate`` (``BatchStat``, RNG
    counters and keys, caches): the optimizer holds a copy of it as it was after
    its last update, and a skipped update puts the model back to that copy, however
    many forwards ran since and whatever other modules the loss was given. Params
    outside ``wrt`` (a frozen base under LoRA) are not copied: a forward does not
    write them. ``optimizer.step`` counts the calls applied: with ``every_k=k`` it
    moves by k when a window is applied, not at all for a skipped window.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
      >>> loss, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, jnp.ones((4, 2)))
      >>> _ = optimizer.update(model, grads)
      >>> int(optimizer.step), float(optimizer.loss_scale.scale)
      (1, 32768.0)
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        graph: bool | None = None,
    ) -> None:
        if _flax_version() < (0, 11):
            import flax

            raise RuntimeError(
                "jaxamp.nnx.Optimizer needs flax >= 0.11 (nnx.Optimizer(model, tx, wrt=...) "
                f"and update(model, grads)); this is flax {flax.__version__}. The rest of "
                "jaxamp works with it: use jaxamp.step on nnx.split states."
            )
        if not isinstance(getattr(tx, "update", None), _GuardedUpdate):
            raise TypeError(
                "jaxamp.nnx.Optimizer: `tx` must come from jaxamp.skip_nonfinite(...) or "
                f"jaxamp.multi_transform(...), got {type(tx).__name__}. For a plain optax "
                "optimizer wrap it: jaxamp.skip_nonfinite(optax.adamw(1e-3), "
                "jaxamp.dynamic_scale())."
            )
        kwargs = {} if graph is None else {"graph": graph}
        super().__init__(model, tx, wrt=wrt, **kwargs)
        # The model state a skipped update puts back: as it was after the last update.
        self.kept = nnx.data(_as_kept(self._written(model)))

    def _written(self, model: nnx.Module) -> Any:
        """The model state a forward can write, as plain arrays."""
        graph = getattr(self, "graph", None)
        kw = {} if graph is None else {"graph": graph}
        return _pure(nnx.state(model, forward_written(self.wrt), **kw))

    @property
    def loss_scale(self) -> LossScaleState:
        """The loss-scale state inside the optimizer state (plain arrays)."""
        return ls_lib.get_loss_scale(_pure(self.opt_state))

    def keep(self, model: nnx.Module) -> None:
        """Deprecated: does nothing. The optimizer records the model state at every update.

        0.3 recorded the state here, before the forward; the record of the last update
        is right however many forwards ran since, so there is nothing left to call.
        """
        del model
        warnings.warn(
            "jaxamp.nnx.Optimizer.keep is no longer needed and does nothing: the optimizer "
            "keeps the model state as it was after its last update. Remove the call.",
            DeprecationWarning,
            stacklevel=2,
        )

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
        """One fused, guarded step (:func:`jaxamp.step`); a skip changes nothing but counters.

        Args:
          model: the model; its ``wrt`` Variables are updated in place.
          grads: gradients of the *scaled* loss, e.g. from :func:`value_and_grad`.
          **kwargs: extra arguments for the inner optimizer (``value=``, ...).

        Returns:
          The change applied to the ``wrt`` Variables (new minus old; zeros on a
          skipped step). Unused under ``jit``, it costs nothing.
        """
        graph = getattr(self, "graph", None)
        kw = {} if graph is None else {"graph": graph}
        written = self._written(model)
        kept = _pure(self.kept)
        if jax.tree.structure(written) != jax.tree.structure(kept):
            raise ValueError(
                "jaxamp.nnx.Optimizer.update: `model` is not the model this optimizer was "
                "built for: its Variables outside `wrt` differ. Pass the trained model, the "
                "one given to jaxamp.nnx.Optimizer(model, tx, wrt=...)."
            )
        params = _pure(nnx.state(model, self.wrt, **kw))
        grads = _pure(nnx.state(grads, self.wrt, **kw))
        opt_state = _pure(self.opt_state)
        new_params, new_opt_state = self.tx.update.run(
            grads, opt_state, params, Call(_pure(kwargs), None, to_params=True)
        )
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, **kw))
        self.step[...] += applied_calls(opt_state, new_opt_state).astype(self.step.dtype)
        # What the forwards since the last update wrote stays only if this step was taken.
        state = select_tree(stepped(new_opt_state), written, kept)
        nnx.update(model, state)
        nnx.update(self.kept, nnx.state(_as_kept(state)))
        return jax.tree.map(lambda n, o: n - o, new_params, params)


def _as_kept(tree: Any) -> Any:
    """A copy of plain arrays as optimizer-state Variables (not the model's own arrays)."""
    return jax.tree.map(lambda x: nnx.OptArray(jnp.array(x, copy=True)), tree)


def value_and_grad(
    f: Callable[..., Any], argnums: Any = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of the *scaled* loss, returning the loss as ``f`` computed it.

    The returned function takes the :class:`Optimizer` (or an optimizer state /
    ``LossScaleState``) first, then ``f``'s arguments; ``argnums`` (ints or
    ``nnx.DiffState``) and ``has_aux`` mean what they mean to ``nnx.value_and_grad``.

    Args:
      f: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      argnums: which of ``f``'s arguments to differentiate: an int, a sequence of
        ints or an ``nnx.DiffState`` (as in ``nnx.value_and_grad``).
      has_aux: whether ``f`` returns ``(loss, aux)``.

    Returns:
      ``(optimizer, *args, **kwargs) -> (loss, grads)`` (``((loss, aux), grads)``
      with ``has_aux``), the gradients of the scaled loss, for ``optimizer.update``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(4.0))
      >>> optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> loss, grads = jaxamp.nnx.value_and_grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(
      ...     optimizer, model)
      >>> float(grads["bias"][...][0])  # the gradient of 4 * loss
      4.0
    """
    if not callable(f):
        raise TypeError(f"jaxamp.nnx.value_and_grad: `f` must be callable, got {type(f)}.")

    def wrapped(optimizer: Any, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, Optimizer):
            ls = optimizer.loss_scale
        else:
            ls = ls_lib.find_state(_pure(optimizer), "nnx.value_and_grad")
        scaled = functools.wraps(f)(scaled_loss(f, has_aux, ls, "jaxamp.nnx.value_and_grad"))
        grad_fn = nnx.value_and_grad(scaled, argnums=argnums, has_aux=True)
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped
