"""Optimizer state in 8 and 16 bits: any optax optimizer's moments, stored small."""

from jaxamp.low_precision_state._convert import convert_state
from jaxamp.low_precision_state._stored import Quantized8, Rounded16
from jaxamp.low_precision_state._stored import is_stored as is_stored
from jaxamp.low_precision_state._transformation import LowPrecisionState, low_precision_state

__all__ = [
    "LowPrecisionState",
    "Quantized8",
    "Rounded16",
    "convert_state",
    "low_precision_state",
]
