"""``autocast``: run any JAX function in mixed precision without editing it.

Modules, one concept each:

* ``_rules``: the op table (``DEFAULT_RULES``) and ``choose``, the pure
  function that picks an equation's dtype and its results' mark;
* ``_interpret``: the jaxpr interpreter, saturating casts, the handler registry;
* ``_calls``: handlers for nested ``jit``, ``remat``, custom derivatives, ``shard_map``;
* ``_loops``: handlers for ``scan``, ``while``, ``cond``;
* ``_flax``: naming Flax module calls for ``modules=`` rules;
* ``_api``: ``autocast``, ``full_precision``, ``keep_float32``;
* ``_fp8``: ``jaxamp.fp8`` and which products run in FP8; ``_fp8_gemm``: one FP8
  product with current scaling and its custom VJP.

Every access to JAX internals lives in ``jaxamp._jax_compat``.
"""

from jaxamp._autocast import _calls, _loops  # noqa: F401  (register handlers)
from jaxamp._autocast._api import autocast, full_precision, keep_float32
from jaxamp._autocast._fp8 import Fp8Config, fp8
from jaxamp._autocast._rules import (
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
    "WIDEST_OPS",
    "Fp8Config",
    "autocast",
    "fp8",
    "full_precision",
    "keep_float32",
]
