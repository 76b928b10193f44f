"""Casting: ``autocast`` (each op in its class's dtype, FP8 products), policies, find / audit."""

from jaxamp.casting._audit._audit import AuditReport, audit
from jaxamp.casting._autocast._api import autocast, full_precision, keep_float32
from jaxamp.casting._find_overflow._find_overflow import OverflowReport, find_overflow
from jaxamp.casting._fp8._fp8 import Fp8Config, fp8
from jaxamp.casting._rules._policy import Policy
from jaxamp.casting._rules._rules import (
    AS_WRITTEN_OPS,
    DEFAULT_RULES,
    ELEMENTWISE_OPS,
    FLOAT32_FUNCTIONS,
    FLOAT32_OPS,
    LOWER_PRECISION_OPS,
    WIDEST_OPS,
)

__all__ = [
    "AS_WRITTEN_OPS",
    "AuditReport",
    "DEFAULT_RULES",
    "ELEMENTWISE_OPS",
    "FLOAT32_FUNCTIONS",
    "FLOAT32_OPS",
    "Fp8Config",
    "LOWER_PRECISION_OPS",
    "OverflowReport",
    "Policy",
    "WIDEST_OPS",
    "audit",
    "autocast",
    "find_overflow",
    "fp8",
    "full_precision",
    "keep_float32",
]
