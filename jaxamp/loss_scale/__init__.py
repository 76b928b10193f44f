"""Loss scaling: the loss-scale state, the functions that drive it, and reading it back."""

from jaxamp.loss_scale._lookup import check_health, get_loss_scale, metrics
from jaxamp.loss_scale._rule import scale, unscale_and_check, update
from jaxamp.loss_scale._state import LossScaleState, Mode, dynamic_scale, no_scale, static_scale
from jaxamp.loss_scale._sync import check_in_sync

__all__ = [
    "LossScaleState",
    "Mode",
    "check_health",
    "check_in_sync",
    "dynamic_scale",
    "get_loss_scale",
    "metrics",
    "no_scale",
    "scale",
    "static_scale",
    "unscale_and_check",
    "update",
]
