"""Which values autocast treats as trace-time constants, whose casts down saturate.

Only sentinels known at trace time saturate (a mask's ``-1e9`` fill); a value of the
run (a tracer, a data array, a count of a mask) that leaves the low dtype's range
becomes inf, which the loss scale and ``find_overflow`` see.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._analysis import POINTWISE
from jaxamp.casting._rules import CONST, NONE, PIN


def const_mark(x: Any, low: np.dtype) -> int:
    """The mark of a value `f` closes over: ``CONST`` (its casts down saturate) only
    for a sentinel known at trace time.

    A tracer (a value of an outer ``jit``, ``grad``, ``vmap`` or ``scan`` that `f`
    closes over) is run-time data: clipped, it would be a wrong finite number no
    overflow check sees. A concrete floating array is a fill (a mask bias of
    ``-1e9`` or ``finfo.min``) only when every finite value beyond `low`'s range is
    one and the same value; a data array (features up to 3.5e5) has many and is
    data too. So is an array with a nonzero value below `low`'s smallest normal
    number (a layer scale of 1e-6 in float16): cast down, it would be rounded
    to a few digits or to 0, so it stays in float32 where it meets an activation.
    """
    if isinstance(x, jax.core.Tracer):
        return NONE
    dtype = getattr(x, "dtype", None)
    if dtype is None or not is_float_dtype(dtype) or np.size(x) <= 1 or low.itemsize >= 4:
        return CONST
    hi = float(jax.numpy.finfo(low).max)
    # Read once per trace, not per step; a train step traced under
    # jax.transfer_guard("disallow") must still be able to look.
    with jax.transfer_guard_device_to_host("allow"):
        a = np.asarray(x)
    if float(jax.numpy.finfo(a.dtype).max) <= hi:
        return CONST
    if np.any((a != 0) & (np.abs(a) < float(jax.numpy.finfo(low).tiny))):
        return NONE
    out = np.isfinite(a) & (np.abs(a) > hi)
    # A fill next to the values it masks: one value beyond the range, some within
    # (a vector of 1e5 everywhere is a scale, data).
    return CONST if not out.any() or (np.unique(a[out]).size == 1 and not out.all()) else NONE


# Ops whose every result element is a function of the same elements of their
# inputs (or a re-layout of them): of masks and constants, they give a fill with
# as few distinct values as the constants. A reduction, a cumulative sum or a product
# of a mask counts run-time data instead.
_FILL_OPS: frozenset[str] = POINTWISE | {
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "transpose", "copy", "copy_p", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
    "not", "xor", "select_n",
}  # fmt: skip


def constant_marks(eqn: Any, inmarks: list[int], outmarks: list[int], fills: set[Any]) -> list[int]:
    """``outmarks``, or all ``CONST`` for a value computed from constants and masks
    alone (``jnp.where(mask, 0.0, -1e9)``, ``(1 - mask) * -1e9``): still a
    constant (unless the user asked for float32: keep_float32, an explicit cast).

    A run-time boolean only selects between constants or scales them, element
    by element (``_FILL_OPS``): such a result is a fill, added to `fills`. What
    is counted or summed from a mask or a fill (``jnp.sum(mask)``) is run-time
    data, not a constant.
    """
    if eqn.effects or PIN in outmarks:
        return outmarks
    ins = list(zip(eqn.invars, inmarks, strict=True))
    masks = [m != CONST and _is_bool(v) for v, m in ins]
    derived = any(masks) or any(v in fills for v, _ in ins if not isinstance(v, Literal))
    if not all(m == CONST or mask for (_, m), mask in zip(ins, masks, strict=True)):
        return outmarks
    if not derived:
        return [CONST] * len(outmarks)
    if eqn.primitive.name in _FILL_OPS:
        fills.update(eqn.outvars)
        return [CONST] * len(outmarks)
    return outmarks


def _is_bool(v: Any) -> bool:
    return getattr(v.aval, "dtype", None) == np.dtype(bool)
