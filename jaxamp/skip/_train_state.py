"""A Flax ``TrainState`` whose ``apply_gradients`` skips non-finite steps as a whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax.core import FrozenDict
from flax.training import train_state

from jaxamp._utils.optional import OVERWRITE_WITH_GRADIENT
from jaxamp.loss_scale import LossScaleState, get_loss_scale, select_tree
from jaxamp.skip._stepped import stepped, where_stepped
from jaxamp.skip._transformation import step

__all__ = ["TrainState"]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)  # a tracer is a jax.Array


def _keep_if_skipped(taken: jax.Array, name: str, new: Any, old: Any) -> Any:
    """``new``'s array leaves where the step was taken, ``old``'s where it was skipped.

    Returned in ``new``'s structure, as Flax's ``replace`` stores it: a ``dict`` for
    a ``FrozenDict`` (what ``model.apply(..., mutable=...)`` returns for what
    ``init`` froze) is the same model state, matched by key path. Leaves that are not
    arrays (a Python number, a string) are configuration and are stored as given.
    """
    new_flat, new_def = jax.tree_util.tree_flatten_with_path(new)
    old_flat = jax.tree_util.tree_flatten_with_path(old)[0]
    arrays = [i for i, (_, x) in enumerate(new_flat) if _is_array(x)]
    try:
        if [p for p, _ in new_flat] != [p for p, _ in old_flat]:
            raise ValueError(
                f"the key paths differ: {jax.tree.structure(new)} and {jax.tree.structure(old)}"
            )
        chosen = select_tree(
            taken, [new_flat[i][1] for i in arrays], [old_flat[i][1] for i in arrays]
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"TrainState.apply_gradients: `{name}=` must have the structure, shapes "
            f"and dtypes of state.{name}, so that a skipped step can keep the old "
            f"value: {e}"
        ) from None
    leaves = [x for _, x in new_flat]
    for i, x in zip(arrays, chosen, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(new_def, leaves)


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` that steps with [`jaxamp.step`][jaxamp.step].

    Build it with ``TrainState.create(apply_fn=..., params=..., tx=tx)`` where
    ``tx`` is a [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] (or
    [`jaxamp.multi_transform`][jaxamp.multi_transform]) transformation; take the gradients of the
    scaled loss with [`jaxamp.value_and_grad`][jaxamp.value_and_grad] (or scale it with
    ``jaxamp.get_loss_scale(state)``) and pass them to ``apply_gradients``. Flax's fp8 metadata
    (the ``_overwrite_with_gradient`` collection) is handled as Flax's own ``TrainState`` does:
    overwritten with its "gradients", never unscaled, checked or seen by the optimizer.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
      >>> state = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0])})
      >>> state.params["w"], float(jaxamp.get_loss_scale(state).scale)
      (Array([1., 1.], dtype=float32), 16384.0)
    """

    @property
    def loss_scale(self) -> LossScaleState:
        """The loss-scale state inside ``opt_state``: ``jaxamp.get_loss_scale(state)``."""
        return get_loss_scale(self.opt_state)

    def apply_gradients(
        self,
        *,
        grads: Any,
        finite: Any = None,
        extra_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """Applies (scaled) gradients; a skipped step writes nothing but its counters.

        Args:
          grads: gradients of the scaled loss, shaped like ``params``.
          finite: as in [`jaxamp.step`][jaxamp.step]: the gradients were already unscaled and
            checked, and this is the verdict.
          extra_args: keyword arguments forwarded to the optimizer (e.g. ``value=``).
          **kwargs: other fields to ``replace``, as in Flax (e.g. ``batch_stats=``):
            their array leaves are written only if the step is taken
            ([`jaxamp.where_stepped`][jaxamp.where_stepped]), so a skipped step keeps the old
            BatchNorm statistics. Static fields (``pytree_node=False``) and values with no array
            leaf are configuration: replaced as given, as Flax does. A plain ``dict`` for a
            ``FrozenDict`` field is stored as given, as Flax does.

        Returns:
          The next state. On a skipped step params, ``opt_state`` (but for its
          loss scale and counters), the fp8 metadata and every field in
          ``kwargs`` keep their values; ``step`` counts calls, skipped or not,
          as Flax's does (checkpoint managers key their files on it).
        """
        for name in kwargs:  # before the step, so a misplaced optimizer argument is named
            if not hasattr(self, name):
                hint = ""
                if name in ("value", "loss"):
                    hint = (
                        " To give the optimizer (e.g. a jaxamp.spike_rule) the loss, pass "
                        "extra_args={'value': loss}."
                    )
                raise TypeError(
                    f"TrainState.apply_gradients: TrainState has no field {name!r}.{hint}"
                )
        fp8 = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
        grads_opt = grads["params"] if fp8 else grads
        params_opt = self.params["params"] if fp8 else self.params
        params, opt_state = step(
            self.tx, grads_opt, self.opt_state, params_opt, finite=finite, **(extra_args or {})
        )
        if fp8:
            fp8_new = where_stepped(
                opt_state, grads[OVERWRITE_WITH_GRADIENT], self.params[OVERWRITE_WITH_GRADIENT]
            )
            merged = {**self.params, "params": params, OVERWRITE_WITH_GRADIENT: fp8_new}
            params = type(self.params)(merged) if isinstance(self.params, FrozenDict) else merged
        static = {
            f.name for f in dataclasses.fields(self) if not f.metadata.get("pytree_node", True)
        }
        taken = None
        for name, new in kwargs.items():
            if name in static or not any(map(_is_array, jax.tree.leaves(new))):
                continue  # configuration, not model state a step computes: as Flax, replaced
            if taken is None:
                taken = stepped(opt_state)
            kwargs[name] = _keep_if_skipped(taken, name, new, getattr(self, name))
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
