"""The types jaxamp's functions return or keep in a state: for annotations, ``isinstance``
and checkpoints. None of them is built by hand; each comes from the function named in its
docstring (``jaxamp.explain`` returns an ``Explanation``, ``tx.init`` of
``jaxamp.skip_nonfinite`` a ``SkipNonfiniteState``, ...)."""

from jaxamp.casting import AuditReport, Fp8Config, Fp8Selection, OverflowReport
from jaxamp.loss_scale import Mode, Unscaled
from jaxamp.low_precision_params import KahanSummationState, StochasticRoundingState
from jaxamp.low_precision_state import LowPrecisionState, Quantized8, Rounded16
from jaxamp.skip import (
    Explanation,
    MultiTransformState,
    NonfiniteLeaves,
    SkipNonfiniteState,
    SpikeRule,
    SpikeState,
)

__all__ = [
    "AuditReport",
    "Explanation",
    "Fp8Config",
    "Fp8Selection",
    "KahanSummationState",
    "LowPrecisionState",
    "Mode",
    "MultiTransformState",
    "NonfiniteLeaves",
    "OverflowReport",
    "Quantized8",
    "Rounded16",
    "SkipNonfiniteState",
    "SpikeRule",
    "SpikeState",
    "StochasticRoundingState",
    "Unscaled",
]
