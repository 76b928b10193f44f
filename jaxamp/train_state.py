"""A Flax ``TrainState`` whose ``apply_gradients`` skips non-finite steps as a whole."""

from __future__ import annotations

from typing import Any

from flax.training import train_state

from jaxamp.loss_scale import LossScaleState
from jaxamp.transform import get_loss_scale, step

__all__ = ["TrainState"]


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` that steps with :func:`jaxamp.step`.

    Build it with ``TrainState.create(apply_fn=..., params=..., tx=tx)`` where
    ``tx`` is a :func:`jaxamp.skip_nonfinite` transformation; scale the loss with
    ``state.loss_scale`` and pass the scaled gradients to ``apply_gradients``.

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
        self, *, grads: Any, extra_args: dict[str, Any] | None = None, **kwargs: Any
    ) -> TrainState:
        """Applies (scaled) gradients; a non-finite step leaves params and opt state as they were.

        Args:
          grads: gradients of the scaled loss, shaped like ``params``.
          extra_args: keyword arguments forwarded to the optimizer (e.g. ``value=``).
          **kwargs: other fields to ``replace``, as in Flax.

        Returns:
          The next state; ``step`` counts calls, skipped or not.
        """
        params, opt_state = step(self.tx, grads, self.opt_state, self.params, **(extra_args or {}))
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
