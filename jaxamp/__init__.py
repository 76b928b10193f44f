"""jaxamp: automatic mixed precision for JAX, Flax and optax."""

from jaxamp import compat
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
    "LossScaleState",
    "SkipNonfiniteState",
    "TrainState",
    "all_finite",
    "check_health",
    "compat",
    "dynamic_scale",
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
