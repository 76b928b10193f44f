"""jaxamp: automatic mixed precision for JAX, Flax and optax.

The modules are private; everything public is re-exported here (and in the
``jaxamp.compat``, ``jaxamp.checkpoint`` and ``jaxamp.nnx`` namespaces).
"""

from jaxamp import checkpoint, compat, nnx
from jaxamp._audit import AuditReport, audit
from jaxamp._autocast import (
    DEFAULT_RULES,
    Fp8Config,
    autocast,
    fp8,
    full_precision,
    keep_float32,
)
from jaxamp._conversion_checks import ConversionWarning as ConversionWarning
from jaxamp._distributed import check_in_sync
from jaxamp._explain import Explanation, explain
from jaxamp._find_overflow import OverflowReport, find_overflow
from jaxamp._leaf_stats import NonfiniteLeaves
from jaxamp._loss_scale import LossScaleState, Mode, dynamic_scale, no_scale, static_scale
from jaxamp._low_precision_params import (
    KahanSummationState,
    StochasticRoundingState,
    kahan_summation,
    stochastic_round,
    stochastic_rounding,
)
from jaxamp._metrics import check_health, get_loss_scale, metrics
from jaxamp._model_state import stepped, where_stepped
from jaxamp._multi_transform import MultiTransformState, multi_transform
from jaxamp._policy import Policy
from jaxamp._scaling import scale, unscale_and_check, update
from jaxamp._spikes import SpikeRule, SpikeState, spike_rule
from jaxamp._train_state import TrainState
from jaxamp._transform import SkipNonfiniteState, skip_nonfinite, step
from jaxamp._tree import all_finite, select_tree
from jaxamp._value_and_grad import value_and_grad

__version__ = "0.3.0"

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
    "all_finite",
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
