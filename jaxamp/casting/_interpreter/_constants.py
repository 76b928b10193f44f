"""Which values autocast treats as trace-time constants, whose casts down saturate.

Only sentinels known at trace time saturate (a mask's ``-1e9`` fill); a value of the
run (a tracer, a data array, a count of a mask, a vector computed from an ``arange``)
that leaves the low dtype's range becomes inf, which the loss scale and
``find_overflow`` see, or promotes the op it meets.

A value is ``CONST`` when its cast down loses nothing but rounding or saturates a
sentinel (``cast_safe``): a literal, a concrete constant `f` closes over that
passes that check, what layout ops and ``select_n`` make of constants, and a value
computed element by element whose possible values are known at trace time (the
values of literals and of boolean masks, ``(1 - mask) * -1e9``) and pass it. The
check is on the values, never on the op that built them: ``jnp.full((n,), 1e-8)``,
``jnp.ones(n) * 1e-8`` and a closed-over ``np.full`` are the same data.

A constant array whose known values fail the check is ``F32``: float32 data that
promotes what it meets, as a float32 tensor does in torch. One that holds only
sentinels (``jnp.full(shape, -1e9)``, ``finfo.min``) saturates where an op picks it
instead of the data (``fill_marks``: the cases of a ``where``, a bound of
``maximum`` / ``minimum`` / ``clip``), as a scalar fill does.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from jaxamp._utils.dtypes import is_float_dtype, narrows
from jaxamp._utils.tree import is_tracer
from jaxamp.casting._rules._rules import CONST, F32, NONE, PIN

#: The most distinct values a known value set holds (a fill has a few).
_MAX_VALUES = 16


def cast_safe(values: np.ndarray, low: np.dtype) -> bool:
    """Whether casting `values` down to `low` (saturating) loses nothing but rounding
    or turns sentinels into `low`'s largest value: a sentinel fill.

    A fill is an array whose values within `low`'s range are all 0, beside some
    beyond it (a mask bias of ``{0, -1e9}`` or ``{0, finfo(float32).min}``).
    Anything else with a value beyond the range is data (``[1, 2, 1e5]``, a scale
    of 1e5 everywhere): saturated, it would be a wrong finite number no overflow
    check sees. So is an array with a nonzero value below `low`'s smallest normal
    number (a layer scale of 1e-6 in float16): cast down, it would keep a few
    digits or become 0.
    """
    if low.itemsize >= 4 or not is_float_dtype(values.dtype):
        return True
    if not narrows(values.dtype, low):
        return True
    a = np.asarray(values, np.float64)
    a = np.abs(a[np.isfinite(a)])
    if np.any((a > 0) & (a < float(jax.numpy.finfo(low).tiny))):
        return False
    out = a > float(jax.numpy.finfo(low).max)
    if not out.any():
        return True
    within = a[~out]
    return within.size > 0 and not within.any()


def sentinels_only(values: np.ndarray, low: np.dtype) -> bool:
    """Whether every value of `values` is 0, infinite or beyond `low`'s range, and
    one is beyond it: ``{-1e9}``, ``{finfo(float32).min}``, a fill that ``where``
    picks instead of the data (``fill_marks``)."""
    if low.itemsize >= 4 or not is_float_dtype(values.dtype):
        return False
    a = np.asarray(values, np.float64)
    a = np.abs(a[np.isfinite(a)])
    beyond = a > float(jax.numpy.finfo(low).max)
    return bool(beyond.any()) and not a[~beyond].any()


def distinct(a: Any) -> np.ndarray | None:
    """The distinct values of a concrete array, or None for more than a few."""
    a = np.asarray(a).reshape(-1)
    if a.size > 64 * _MAX_VALUES:
        return None
    u = np.unique(a)
    return u if u.size <= _MAX_VALUES else None


def const_facts(x: Any, low: np.dtype) -> tuple[int, np.ndarray | None]:
    """The mark of a value `f` closes over (``CONST`` only for a value ``cast_safe``
    holds), and its distinct values when there are a few.

    A tracer (a value of an outer ``jit``, ``grad``, ``vmap`` or ``scan`` that `f`
    closes over) is run-time data: clipped, it would be a wrong finite number no
    overflow check sees. A concrete 0-d value is a constant either way (an op
    runs in float32 where the low dtype cannot hold it: ``_opmath``). A constant
    that fails the check still has its values known (a fill of ``-1e9`` alone is
    a sentinel where ``where`` picks it: ``fill_marks``).
    """
    if is_tracer(x):
        return NONE, None
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    if not isinstance(dtype, np.dtype):  # a PRNG key: never cast
        return CONST, None
    if (
        low.itemsize >= 4 or not is_float_dtype(dtype) or np.ndim(x) == 0 or not narrows(dtype, low)
    ):  # nothing a cast down could clip or flush
        return CONST, distinct(_read(x)) if np.size(x) <= 64 * _MAX_VALUES else None
    a = _read(x)
    return CONST if cast_safe(a, low) else NONE, distinct(a)


def _read(x: Any) -> np.ndarray:
    # Read once per trace, not per step; a train step traced under
    # jax.transfer_guard("disallow") must still be able to look.
    with jax.transfer_guard_device_to_host("allow"):
        return np.asarray(x)


# Ops that hand on the values of one operand (the first), laid out again: a
# constant stays a constant with the same values.
_CARRY: frozenset[str] = frozenset(
    {
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
        "slice", "dynamic_slice", "gather", "copy", "copy_p",
    }
)  # fmt: skip

# Ops whose result holds values of several operands: which ones (of how many).
_UNION = {
    "select_n": lambda n: range(1, n),  # the cases, not the predicate
    "concatenate": range,
    "pad": lambda n: range(min(n, 2)),  # the operand and the padding value
}

# Element-by-element arithmetic a fill is built with, evaluated on its operands'
# possible values at trace time: ``(1 - mask) * finfo.min``.
_ARITHMETIC = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,  # results are floating: true division, as lax.div of floats
    "neg": np.negative,
    "abs": np.abs,
    "max": np.maximum,
    "min": np.minimum,
}


def known_values(v: Any, x: Any, known: dict[int, tuple[Any, np.ndarray]]) -> np.ndarray | None:
    """The values variable `v` (now `x`) can hold, when known at trace time: a
    literal's, a boolean's, those `known` records for `x`, or a small concrete
    value's (a literal handed to a nested ``jit``)."""
    if isinstance(v, Literal):
        return np.asarray(v.val, np.dtype(v.aval.dtype)).reshape(-1)
    dtype = getattr(v.aval, "dtype", None)
    if dtype == np.dtype(bool):
        return np.array([False, True])
    recorded = _recorded(x, known)
    if recorded is not None:
        return recorded
    if not is_tracer(x) and np.size(x) <= _MAX_VALUES:
        return distinct(x)
    return None


def call_values(
    invars: list[Any], invals: list[Any], known: dict[int, tuple[Any, np.ndarray]]
) -> list[np.ndarray | None]:
    """The values each floating input of a call can hold, where known, for its
    body to record for its own inputs (``record``): a fill built outside a nested
    ``jit`` (``jnp.where`` is one) is still known to be a fill inside it."""
    return [
        known_values(v, x, known) if is_float_dtype(v.aval.dtype) else None
        for v, x in zip(invars, invals, strict=True)
    ]


def record(
    xs: list[Any], values: list[np.ndarray | None], known: dict[int, tuple[Any, np.ndarray]]
) -> None:
    """Records in `known` the values ``call_values`` found for `xs`, a body's inputs."""
    for x, vals in zip(xs, values, strict=True):
        if vals is not None:
            known[id(x)] = (x, vals)


def _recorded(x: Any, known: dict[int, tuple[Any, np.ndarray]]) -> np.ndarray | None:
    hit = known.get(id(x))
    return hit[1] if hit is not None and hit[0] is x else None


def fill_marks(
    ins: list[tuple[Any, Any, int]], low: np.dtype, known: dict[int, tuple[Any, np.ndarray]]
) -> list[int]:
    """The marks of an op's inputs (``(var, value, mark)`` each) where the op picks
    one of its operands (``_opmath.FILL_POSITIONS``): ``CONST`` for a constant that
    holds only sentinels (``sentinels_only``), so its cast down saturates as a
    scalar fill's does (``jnp.where(mask, s, jnp.full(shape, -1e9))``)."""
    marks = []
    for v, x, m in ins:
        if m in (NONE, F32) and is_float_dtype(v.aval.dtype):
            vals = known_values(v, x, known)
            m = CONST if vals is not None and sentinels_only(vals, low) else m
        marks.append(m)
    return marks


def constant_marks(
    eqn: Any,
    ins: list[tuple[Any, Any, int]],
    outs: list[Any],
    outmarks: list[int],
    low: np.dtype,
    known: dict[int, tuple[Any, np.ndarray]],
) -> list[int]:
    """``outmarks``, or ``CONST`` for a constant `eqn` makes of constants; records in
    `known` the values each such result can hold, when they are known.

    `ins`: ``(var, value, mark)`` of each input. A layout op (``_CARRY``) of a
    constant is a constant with its values; ``select_n``, ``concatenate`` and
    ``pad`` of constants hold the union of their values; element-by-element
    arithmetic (``_ARITHMETIC``, ``convert_element_type``) of operands whose values
    are known (literals, booleans, such results) is evaluated on those values at
    trace time. A value counts as a constant here when its mark is ``CONST`` or its
    values are known (a fill of sentinels alone, data until ``fill_marks`` sees it
    picked). Each new set of values must pass ``cast_safe``, or the result is data
    (however the set was made: a layout op of a literal too). Anything else is
    data: an ``iota``, a sum, a product of an ``arange`` (``jnp.arange(16) *
    1e-9``, ``jnp.linspace``), a count of a mask.
    """
    if eqn.effects or PIN in outmarks or len(outs) != 1:
        return outmarks
    name, (y,) = eqn.primitive.name, outs

    def values(k: int) -> np.ndarray | None:
        v, x, _ = ins[k]
        return known_values(v, x, known)

    def settle(vals: np.ndarray | None, const: bool) -> list[int]:
        if vals is not None and vals.size <= _MAX_VALUES:
            known[id(y)] = (y, vals)
        if const:
            return [CONST]
        if vals is not None and np.ndim(y) > 0:
            # An array of values the low dtype cannot hold is float32 data and
            # promotes what it meets, as a float32 tensor does in torch; laid out
            # from one scalar (``jnp.full``), it would otherwise be rounded as a
            # scalar is (``_opmath``).
            return [F32]
        # Data, also where the op hands on its input's mark (a weak -> strong
        # retyping of a constant).
        return [NONE if m == CONST else m for m in outmarks]

    def is_const(k: int) -> bool:
        v, x, m = ins[k]
        return m == CONST or isinstance(v, Literal) or _recorded(x, known) is not None

    floats = [k for k, (v, _, _) in enumerate(ins) if is_float_dtype(v.aval.dtype)]
    convert_float = name == "convert_element_type" and floats == [0]
    if name in _CARRY or (convert_float and values(0) is None):
        if not ins or not is_const(0):
            return outmarks
        vals = values(0)
        if vals is None:  # a constant with many values, each checked
            return settle(None, True)
        vals = vals.astype(y.dtype)
        return settle(vals, cast_safe(vals, low))
    if name in _UNION:
        picks = list(_UNION[name](len(ins)))
        if not all(is_const(k) for k in picks):
            return outmarks
        sets = [values(k) for k in picks]
        if any(s is None for s in sets):
            # Some values unknown (a constant with many values, each checked):
            # still a constant when the known ones pass on their own.
            return settle(None, all(cast_safe(s, low) for s in sets if s is not None))
        vals = np.unique(np.concatenate([np.asarray(s, y.dtype) for s in sets]))
        return settle(vals, cast_safe(vals, low))
    if name in _ARITHMETIC or name == "convert_element_type":
        if not is_float_dtype(y.dtype):
            return outmarks
        sets = [values(k) for k in range(len(ins))]
        if any(s is None for s in sets) or np.prod([s.size for s in sets]) > 64:
            return outmarks
        return settle(vals := _evaluate(eqn, sets), cast_safe(vals, low))
    if all(is_const(k) for k in floats):
        # Computed from constants and integers alone (an arange, a scale
        # ``1 / sqrt(d)``): data known at trace time, neither a sentinel nor a
        # float32-list result that promotes what it meets (a scalar of it meets
        # an activation at float32 precision: ``_opmath``).
        return [NONE if m == F32 else m for m in outmarks]
    return outmarks


def _evaluate(eqn: Any, sets: list[np.ndarray]) -> np.ndarray:
    """`eqn` on every combination of its operands' possible values, in numpy."""
    combos = list(itertools.product(*sets))
    cols = [
        np.array([c[k] for c in combos], dtype=np.dtype(v.aval.dtype))
        for k, v in enumerate(eqn.invars)
    ]
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    with np.errstate(all="ignore"):
        if eqn.primitive.name == "convert_element_type":
            res = cols[0].astype(out_dtype)
        else:
            res = np.asarray(_ARITHMETIC[eqn.primitive.name](*cols)).astype(out_dtype)
    return np.unique(res)
