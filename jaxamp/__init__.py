"""jaxamp: automatic mixed precision for JAX, Flax and optax."""

from jaxamp import checkpoint, compat
from jaxamp._autocast import DEFAULT_RULES, autocast, full_precision
from jaxamp._policy import Policy
from jaxamp.loss_scale import (
    LossScaleState,
    check_health,
    dynamic_scale,
    metrics,
    no_scale,
    scale,
    static_scale,
    unscale_and_check,
    update,
)
from jaxamp.train_state import TrainState
from jaxamp.transform import SkipNonfiniteState, get_loss_scale, skip_nonfinite, step
from jaxamp.tree import all_finite, select_tree

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RULES",
    "LossScaleState",
    "Policy",
    "SkipNonfiniteState",
    "TrainState",
    "all_finite",
    "autocast",
    "check_health",
    "checkpoint",
    "compat",
    "dynamic_scale",
    "full_precision",
    "get_loss_scale",
    "metrics",
    "no_scale",
    "scale",
    "select_tree",
    "skip_nonfinite",
    "static_scale",
    "step",
    "unscale_and_check",
    "update",
]
