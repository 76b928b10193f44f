"""Loss scaling: the state and its constructors, the functions that drive it, reading it back."""

from jaxamp._utils.finite import all_finite
from jaxamp._utils.tree import select_tree
from jaxamp.loss_scale._constructors import check_only, dynamic_scale, no_scale, static_scale
from jaxamp.loss_scale._constructors import with_limit as with_limit
from jaxamp.loss_scale._lookup import LossScaleNotFound, check_health, get_loss_scale
from jaxamp.loss_scale._placement import check_callers as check_callers
from jaxamp.loss_scale._placement import check_state as check_state
from jaxamp.loss_scale._rule import advance as advance
from jaxamp.loss_scale._rule import scale, unscale_and_check, update
from jaxamp.loss_scale._state import LossScaleState, Mode
from jaxamp.loss_scale._state import fixed_state as fixed_state
from jaxamp.loss_scale._state import fresh_state as fresh_state
from jaxamp.loss_scale._state import holds_loss_scale as holds_loss_scale
from jaxamp.loss_scale._sync import check_in_sync
from jaxamp.loss_scale._unscaled import Unscaled
from jaxamp.loss_scale._unscaled import unwrap as unwrap

__all__ = [
    "LossScaleNotFound",
    "LossScaleState",
    "Mode",
    "Unscaled",
    "all_finite",
    "check_health",
    "check_in_sync",
    "check_only",
    "dynamic_scale",
    "get_loss_scale",
    "no_scale",
    "scale",
    "select_tree",
    "static_scale",
    "unscale_and_check",
    "update",
]
