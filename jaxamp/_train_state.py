"""``jaxamp.TrainState`` (a Flax ``TrainState``): ``jaxamp`` serves it on first use."""

from jaxamp.skip._train_state import TrainState

__all__ = ["TrainState"]
