"""jaxamp: automatic mixed precision for JAX, Flax and optax.

The functions a user calls are re-exported here from the subpackages, one per concept
(``loss_scale``, ``skip``, ``casting``, ``checkpoint``), with the three types a user builds
or annotates most (``LossScaleState``, ``TrainState``, ``Policy``) and the error and
warning a user catches; the types jaxamp's functions return or keep in a state are in
``jaxamp.types``, and the ``jaxamp.compat``, ``jaxamp.checkpoint`` and ``jaxamp.nnx``
namespaces hold the rest. The Flax adapters (``jaxamp.TrainState``, ``jaxamp.nnx``)
import Flax when first used: the rest of jaxamp (loss scaling, the optax guard,
``jaxamp.step``, ``autocast``) runs without it.
"""

from typing import TYPE_CHECKING

from jaxamp import checkpoint, compat, types
from jaxamp._utils.conversion_checks import ConversionWarning as ConversionWarning
from jaxamp._utils.deprecation import deprecated_aliases
from jaxamp._utils.optional import lazy_attributes
from jaxamp.casting import (
    DEFAULT_RULES,
    Policy,
    audit,
    autocast,
    find_overflow,
    fp8,
    fp8_health,
    fp8_select,
    full_precision,
    keep_float32,
)
from jaxamp.loss_scale import (
    LossScaleNotFound,
    LossScaleState,
    all_finite,
    check_health,
    check_in_sync,
    check_only,
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
    apply_with_kahan_summation,
    apply_with_stochastic_rounding,
    stochastic_round,
)
from jaxamp.low_precision_state import convert_state, low_precision_state
from jaxamp.skip import (
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
    "ConversionWarning",
    "DEFAULT_RULES",
    "LossScaleNotFound",
    "LossScaleState",
    "Policy",
    "TrainState",
    "all_finite",
    "apply_with_kahan_summation",
    "apply_with_stochastic_rounding",
    "audit",
    "autocast",
    "check_health",
    "check_in_sync",
    "check_only",
    "checkpoint",
    "compat",
    "convert_state",
    "dynamic_scale",
    "explain",
    "find_overflow",
    "fp8",
    "fp8_health",
    "fp8_select",
    "full_precision",
    "get_loss_scale",
    "keep_float32",
    "low_precision_state",
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
    "types",
    "unscale_and_check",
    "update",
    "value_and_grad",
    "where_stepped",
]

# The Flax adapters, imported on first use; then jaxamp 0.3's names that moved, served
# with a DeprecationWarning until 0.5 (not in __all__): the transformations renamed apart
# from the array op, and the types, now in jaxamp.types. Hidden from type checkers: a
# module `__getattr__` would make every unknown `jaxamp.x` type as Any; they see the
# adapters' imports and the 0.4 names only.
# (The types 0.4 added had no top-level name in 0.3.)
_NEW_IN_0_4 = (
    "AuditReport",
    "Fp8Config",
    "Fp8Selection",
    "LowPrecisionState",
    "Quantized8",
    "Rounded16",
    "Unscaled",
)
_MOVED_TYPES = tuple(n for n in types.__all__ if n not in _NEW_IN_0_4)
if TYPE_CHECKING:
    from jaxamp import nnx as nnx
    from jaxamp._train_state import TrainState as TrainState
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(
        "jaxamp",
        {"nnx": "jaxamp.nnx", "TrainState": "jaxamp._train_state"},
        deprecated_aliases(
            "jaxamp",
            {
                "stochastic_rounding": (
                    "jaxamp.apply_with_stochastic_rounding",
                    apply_with_stochastic_rounding,
                ),
                "kahan_summation": (
                    "jaxamp.apply_with_kahan_summation",
                    apply_with_kahan_summation,
                ),
                **{name: (f"jaxamp.types.{name}", getattr(types, name)) for name in _MOVED_TYPES},
            },
            removed_in="0.5",
        ),
    )

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
