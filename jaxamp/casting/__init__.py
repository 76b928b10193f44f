"""``autocast``: run any JAX function in mixed precision without editing it.

Modules, one concept each:

* ``_rules``: the op table (``DEFAULT_RULES``) and ``choose``, the pure
  function that picks an equation's dtype and its results' mark;
* ``_interpret``: the jaxpr interpreter, saturating casts, the handler registry;
* ``_calls``: handlers for nested ``jit``, ``remat``, custom derivatives, ``shard_map``;
* ``_loops``: handlers for ``scan``, ``while``, ``cond``;
* ``_flax``: naming Flax module calls for ``modules=`` rules;
* ``_api``: ``autocast``, ``full_precision``, ``keep_float32``.

Every access to JAX internals lives in ``jaxamp._jax_compat``.
"""

from jaxamp.casting import _calls, _loops  # noqa: F401  (register handlers)
from jaxamp.casting._api import autocast, full_precision, keep_float32
from jaxamp.casting._find_overflow import OverflowReport, find_overflow
from jaxamp.casting._policy import Policy
from jaxamp.casting._rules import (
    AS_WRITTEN_OPS,
    DEFAULT_RULES,
    ELEMENTWISE_OPS,
    FLOAT32_OPS,
    LOWER_PRECISION_OPS,
    WIDEST_OPS,
)

__all__ = [
    "AS_WRITTEN_OPS",
    "DEFAULT_RULES",
    "ELEMENTWISE_OPS",
    "FLOAT32_OPS",
    "LOWER_PRECISION_OPS",
    "OverflowReport",
    "Policy",
    "WIDEST_OPS",
    "autocast",
    "find_overflow",
    "full_precision",
    "keep_float32",
]
