"""Skipping a step as a whole: the guarded optimizer step and everything built on it."""

from jaxamp.skip._explain import Explanation, explain
from jaxamp.skip._metrics import metrics
from jaxamp.skip._multi_transform import MultiTransformState, multi_transform
from jaxamp.skip._record import NonfiniteLeaves
from jaxamp.skip._skip_nonfinite import SkipNonfiniteState, skip_nonfinite
from jaxamp.skip._spikes import SpikeRule, SpikeState, spike_rule
from jaxamp.skip._stepped import stepped, where_stepped
from jaxamp.skip._transformation import step
from jaxamp.skip._value_and_grad import value_and_grad

__all__ = [
    "Explanation",
    "MultiTransformState",
    "NonfiniteLeaves",
    "SkipNonfiniteState",
    "SpikeRule",
    "SpikeState",
    "explain",
    "metrics",
    "multi_transform",
    "skip_nonfinite",
    "spike_rule",
    "step",
    "stepped",
    "value_and_grad",
    "where_stepped",
]
