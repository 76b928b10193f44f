"""Flax NNX: an ``nnx.Optimizer`` that skips a non-finite step as a whole."""

from jaxamp.skip._nnx import Optimizer, value_and_grad

__all__ = ["Optimizer", "value_and_grad"]
