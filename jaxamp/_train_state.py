"""A Flax ``TrainState`` whose ``apply_gradients`` skips non-finite steps as a whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax.core import FrozenDict
from flax.training import train_state

from jaxamp._loss_scale import LossScaleState
from jaxamp._metrics import get_loss_scale
from jaxamp._model_state import where_stepped
from jaxamp._transform import step

__all__ = ["TrainState"]

# Flax's fp8 metadata collection (nn.Fp8DotGeneralOp, fp8 einsum): its "gradients"
# are the new values of the fp8 scales and amax histories.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` that steps with :func:`jaxamp.step`.

    Build it with ``TrainState.create(apply_fn=..., params=..., tx=tx)`` where
    ``tx`` is a :func:`jaxamp.skip_nonfinite` (or :func:`jaxamp.multi_transform`)
    transformation; scale the loss with ``state.loss_scale`` (or use
    :func:`jaxamp.value_and_grad`) and pass the scaled gradients to
    ``apply_gradients``. Flax's fp8 metadata (the ``_overwrite_with_gradient``
    collection) is handled as Flax's own ``TrainState`` does: overwritten with its
    "gradients", never unscaled, checked or seen by the optimizer.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
      >>> state = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0])})
      >>> state.params["w"], float(state.loss_scale.scale)
      (Array([1., 1.], dtype=float32), 16384.0)
    """

    @property
    def loss_scale(self) -> LossScaleState:
        """The loss-scale state inside ``opt_state``."""
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
          finite: as in :func:`jaxamp.step`: the gradients were already unscaled and
            checked, and this is the verdict.
          extra_args: keyword arguments forwarded to the optimizer (e.g. ``value=``).
          **kwargs: other fields to ``replace``, as in Flax (e.g. ``batch_stats=``):
            written only if the step is taken (:func:`jaxamp.where_stepped`), so a
            skipped step keeps the old BatchNorm statistics.

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
        for name, new in kwargs.items():
            try:
                kwargs[name] = where_stepped(opt_state, new, getattr(self, name))
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"TrainState.apply_gradients: `{name}=` must have the structure, shapes "
                    f"and dtypes of state.{name}, so that a skipped step can keep the old "
                    f"value: {e}"
                ) from None
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
