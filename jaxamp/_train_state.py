"""A Flax ``TrainState`` whose ``apply_gradients`` skips non-finite steps as a whole."""

from __future__ import annotations

from typing import Any

from flax.training import train_state

from jaxamp._loss_scale import LossScaleState, get_loss_scale
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
        """Applies (scaled) gradients; a non-finite step leaves params and opt state as they were.

        Args:
          grads: gradients of the scaled loss, shaped like ``params``.
          finite: as in :func:`jaxamp.step`: the gradients were already unscaled and
            checked, and this is the verdict.
          extra_args: keyword arguments forwarded to the optimizer (e.g. ``value=``).
          **kwargs: other fields to ``replace``, as in Flax.

        Returns:
          The next state; ``step`` counts calls, skipped or not.
        """
        fp8 = isinstance(grads, dict) and OVERWRITE_WITH_GRADIENT in grads
        grads_opt = grads["params"] if fp8 else grads
        params_opt = self.params["params"] if fp8 else self.params
        params, opt_state = step(
            self.tx, grads_opt, self.opt_state, params_opt, finite=finite, **(extra_args or {})
        )
        if fp8:
            params = {"params": params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
