"""Casting: ``autocast`` (each op in its class's dtype, FP8 products), policies, find / audit."""

from jaxamp.casting._audit._audit import AuditReport, audit
from jaxamp.casting._autocast._api import autocast, full_precision, keep_float32
from jaxamp.casting._find_overflow._find_overflow import OverflowReport, find_overflow
from jaxamp.casting._fp8._fp8_config import Fp8Config, fp8
from jaxamp.casting._fp8._fp8_health import fp8_health
from jaxamp.casting._fp8_select._fp8_select import fp8_select
from jaxamp.casting._fp8_select._selection import Fp8Selection
from jaxamp.casting._rules._policy import Policy
from jaxamp.casting._rules._rules import DEFAULT_RULES

# What jaxamp re-exports; the op tables DEFAULT_RULES is built from stay internal
# (jaxamp.casting._rules._rules), DEFAULT_RULES being their documented view.
__all__ = [
    "AuditReport",
    "DEFAULT_RULES",
    "Fp8Config",
    "Fp8Selection",
    "OverflowReport",
    "Policy",
    "audit",
    "autocast",
    "find_overflow",
    "fp8",
    "fp8_health",
    "fp8_select",
    "full_precision",
    "keep_float32",
]
