"""jaxamp: automatic mixed precision for JAX, Flax and optax.

Everything public is re-exported here from the subpackages, one per concept
(``loss_scale``, ``skip``, ``casting``, ``checkpoint``), and in the ``jaxamp.compat``,
``jaxamp.checkpoint`` and ``jaxamp.nnx`` namespaces.
"""

from typing import TYPE_CHECKING

from jaxamp import checkpoint, compat, nnx
from jaxamp._utils.conversion_checks import ConversionWarning as ConversionWarning
from jaxamp._utils.deprecation import deprecated_aliases
from jaxamp.casting import (
    DEFAULT_RULES,
    AuditReport,
    Fp8Config,
    OverflowReport,
    Policy,
    audit,
    autocast,
    find_overflow,
    fp8,
    full_precision,
    keep_float32,
)
from jaxamp.loss_scale import (
    LossScaleState,
    Mode,
    Unscaled,
    all_finite,
    check_health,
    check_in_sync,
    dynamic_scale,
    get_loss_scale,
    no_scale,
    scale,
    select_tree,
    static_scale,
    unscale_and_check,
    update,
)
from jaxamp.low_precision_params import (
    KahanSummationState,
    StochasticRoundingState,
    apply_with_kahan_summation,
    apply_with_stochastic_rounding,
    stochastic_round,
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
    metrics,
    multi_transform,
    skip_nonfinite,
    spike_rule,
    step,
    stepped,
    value_and_grad,
    where_stepped,
)

__version__ = "0.4.0"

__all__ = [
    "AuditReport",
    "ConversionWarning",
    "DEFAULT_RULES",
    "Explanation",
    "Fp8Config",
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
    "Unscaled",
    "all_finite",
    "apply_with_kahan_summation",
    "apply_with_stochastic_rounding",
    "audit",
    "autocast",
    "check_health",
    "check_in_sync",
    "checkpoint",
    "compat",
    "dynamic_scale",
    "explain",
    "find_overflow",
    "fp8",
    "full_precision",
    "get_loss_scale",
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
    "unscale_and_check",
    "update",
    "value_and_grad",
    "where_stepped",
]

# Deprecated spellings, served with a DeprecationWarning until 0.5 (not in __all__).
# Hidden from type checkers: a module `__getattr__` would make every unknown `jaxamp.x`
# type as Any; they see the 0.4 names only.
if not TYPE_CHECKING:
    __getattr__ = deprecated_aliases(
        "jaxamp",
        {
            "stochastic_rounding": (
                "jaxamp.apply_with_stochastic_rounding",
                apply_with_stochastic_rounding,
            ),
            "kahan_summation": ("jaxamp.apply_with_kahan_summation", apply_with_kahan_summation),
        },
        removed_in="0.5",
    )
