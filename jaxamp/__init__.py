"""jaxamp: automatic mixed precision for JAX, Flax and optax.

Everything public is re-exported here from the subpackages, one per concept
(``loss_scale``, ``skip``, ``casting``, ``checkpoint``), and in the ``jaxamp.compat``,
``jaxamp.checkpoint`` and ``jaxamp.nnx`` namespaces.
"""

from jaxamp import checkpoint, compat, nnx
from jaxamp._utils.tree import all_finite, select_tree
from jaxamp.casting import (
    DEFAULT_RULES,
    OverflowReport,
    Policy,
    autocast,
    find_overflow,
    full_precision,
    keep_float32,
)
from jaxamp.loss_scale import (
    LossScaleState,
    Mode,
    check_health,
    check_in_sync,
    dynamic_scale,
    get_loss_scale,
    metrics,
    no_scale,
    scale,
    static_scale,
    unscale_and_check,
    update,
)
from jaxamp.low_precision_params import (
    KahanSummationState,
    StochasticRoundingState,
    kahan_summation,
    stochastic_round,
    stochastic_rounding,
)
from jaxamp.skip import (
    Explanation,
    MultiTransformState,
    NonfiniteLeaves,
    SkipNonfiniteState,
    SpikeRule,
    SpikeState,
    TrainState,
    explain,
    multi_transform,
    skip_nonfinite,
    spike_rule,
    step,
    stepped,
    value_and_grad,
    where_stepped,
)

__version__ = "0.3.0"

__all__ = [
    "DEFAULT_RULES",
    "Explanation",
    "KahanSummationState",
    "LossScaleState",
    "Mode",
    "MultiTransformState",
    "NonfiniteLeaves",
    "OverflowReport",
    "Policy",
    "SkipNonfiniteState",
    "SpikeRule",
    "SpikeState",
    "StochasticRoundingState",
    "TrainState",
    "all_finite",
    "autocast",
    "check_health",
    "check_in_sync",
    "checkpoint",
    "compat",
    "dynamic_scale",
    "explain",
    "find_overflow",
    "full_precision",
    "get_loss_scale",
    "kahan_summation",
    "keep_float32",
    "metrics",
    "multi_transform",
    "nnx",
    "no_scale",
    "scale",
    "select_tree",
    "skip_nonfinite",
    "spike_rule",
    "static_scale",
    "step",
    "stepped",
    "stochastic_round",
    "stochastic_rounding",
    "unscale_and_check",
    "update",
    "value_and_grad",
    "where_stepped",
]
