"""How each floating input of an equation is laid out into its result.

``_rules.choose`` promotes an op where a float32 value meets an activation,
unless that value is a scalar (torch does not promote with a 0-dim tensor) or
the bias of a Linear or convolution layer (torch's ``Linear`` and ``conv`` cast
theirs with the product). Which of the two an input is, is read here from the
program's structure, once per jaxpr (``_analysis.analyse``).
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend.core import Jaxpr, Literal

from jaxamp.casting._rules._rules import BIAS, OWN, SCALAR, VECTOR

# Ops that hand on their operand's values, only laid out again: a value they
# make is broadcast from what their operand is broadcast from.
RELAYOUT: frozenset[str] = frozenset(
    {
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type",
        "copy", "copy_p", "transpose",
    }
)  # fmt: skip

# Ops whose broadcast operand is a target or a threshold, not a parameter: a
# per-row target in ``pred - y[:, None]`` or a comparison's bound. Laid out as
# the result's own values, so a wider one promotes (torch's type promotion)
# and a small difference is not rounded to 0.
_TARGET_OPS: frozenset[str] = frozenset({"sub", "eq", "ne", "lt", "le", "gt", "ge"})


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(v.aval, "shape", ()))


def _size(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _varying(shape: tuple[int, ...]) -> int | None:
    """The one axis of `shape` longer than 1, if there is exactly one."""
    axes = [k for k, d in enumerate(shape) if d > 1]
    return axes[0] if len(axes) == 1 else None


def map_axis(eqn: Any, axis: int) -> int | None:
    """The axis of `eqn`'s result that axis `axis` of its first operand becomes,
    intact (same length, same values along it), or None: merged, split, or an
    op this does not read."""
    name = eqn.primitive.name
    src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if name in ("convert_element_type", "copy", "copy_p"):
        return axis
    if name == "broadcast_in_dim":
        return int(eqn.params["broadcast_dimensions"][axis])
    if name == "transpose":
        return list(eqn.params["permutation"]).index(axis)
    if name == "squeeze":
        dims = [int(d) % len(src) for d in eqn.params["dimensions"]]
        return None if axis in dims else axis - sum(d < axis for d in dims)
    if name == "reshape" and eqn.params.get("dimensions") is None:
        # Row-major: an axis stays intact where its length and the product of
        # the lengths after it (its stride) are the same on both sides.
        stride = _size(src[axis + 1 :])
        for j, n in enumerate(dst):
            if n == src[axis] and _size(dst[j + 1 :]) == stride:
                return j
    return None


def _linear_features(eqn: Any) -> tuple[frozenset[int], bool] | None:
    """``(axes, conv)``: the axes of a Linear layer's product along which its bias
    varies, or None when `eqn` is no Linear's product.

    A ``dot_general`` without batch dimensions (a Dense, a Linear, ``x @ W`` or
    ``W @ x``; not ``q @ k.T`` per batch): its free axes, of which the sum's last
    axis must be the bias's (``conv`` False). A ``conv_general_dilated``: its
    output feature axis from its dimension numbers (``conv`` True).
    """
    name = eqn.primitive.name
    ndim = len(_shape(eqn.outvars[0]))
    if name == "dot_general":
        (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
        if lhs_batch or rhs_batch or ndim == 0:
            return None
        return frozenset(range(ndim)), False
    if name == "conv_general_dilated":
        numbers = eqn.params["dimension_numbers"]
        out_spec = getattr(numbers, "out_spec", None)
        return (frozenset({int(out_spec[1])}), True) if out_spec is not None else None
    return None


def input_layouts(jaxpr: Jaxpr) -> tuple[tuple[int, ...], ...]:
    """Per equation, per input: how its values are laid out into the result.

    An input is broadcast when the values it was laid out from (through
    ``broadcast_in_dim``, ``reshape``, ... in this jaxpr) have fewer elements
    than the equation's result and at most one axis longer than 1: ``SCALAR``
    when those values are 0-dimensional (a Python or 0-d constant, a scalar
    parameter, ``jnp.full(shape, -1e9)``), else ``VECTOR`` (a norm scale, a
    per-channel or per-row weight). A value with two such axes (a padding mask
    of ``(batch, 1, length)``, a positional table), of the result's size, or an
    operand of a subtraction or comparison is ``OWN``. A jaxpr's inputs count
    as laid out from themselves.

    ``BIAS``: a ``VECTOR`` added to a Linear layer's product, laid out again at
    most (``RELAYOUT``), that varies along the product's output features, as
    the bias of torch's ``Linear`` and ``conv`` does: the sum's last axis, a
    free axis of a ``dot_general`` without batch dimensions (Flax's Dense, NNX
    and equinox Linear, vmapped too, HF's Conv1D), or the output feature axis of
    a ``conv_general_dilated`` (any layout); of more than one element. A
    per-row or per-token input added after a matmul varies along another axis
    and is no bias, whatever the batch size.
    """
    source: dict[Any, tuple[int, ...]] = {}  # what a value was laid out from
    vary: dict[Any, int | None] = {}  # the axis its source's one long axis lies along
    feats: dict[Any, tuple[frozenset[int], bool]] = {}  # Linear products, relaid

    def src(v: Any) -> tuple[int, ...]:
        return _shape(v) if isinstance(v, Literal) else source.get(v, _shape(v))

    def varies(v: Any) -> int | None:
        if isinstance(v, Literal):
            return None
        return vary[v] if v in source else _varying(_shape(v))

    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        size = max((_size(_shape(v)) for v in eqn.outvars), default=0)
        kinds = []
        for v in eqn.invars:
            s = src(v)
            broadcast = _size(s) < size and sum(d > 1 for d in s) <= 1
            kinds.append(OWN if name in _TARGET_OPS or not broadcast else VECTOR if s else SCALAR)
        if name == "add" and len(kinds) == 2:
            ndim = len(_shape(eqn.outvars[0]))
            for k in (0, 1):
                act = eqn.invars[1 - k]
                lin = None if isinstance(act, Literal) else feats.get(act)
                axis = varies(eqn.invars[k])
                if kinds[k] == VECTOR and lin is not None and axis is not None:
                    axes, conv = lin
                    if axis in axes and (conv or axis == ndim - 1):
                        kinds[k] = BIAS
        out.append(tuple(kinds))
        lin = _linear_features(eqn) if eqn.outvars else None
        if lin is not None:
            feats[eqn.outvars[0]] = lin
        if name in RELAYOUT and eqn.invars and len(eqn.outvars) == 1:
            x, y = eqn.invars[0], eqn.outvars[0]
            if not isinstance(x, Literal) and x in feats:
                axes, conv = feats[x]
                mapped = {map_axis(eqn, a) for a in axes} - {None}
                if mapped:
                    feats[y] = frozenset(mapped), conv  # type: ignore[arg-type]
            s = src(x)
            if _size(s) <= _size(_shape(y)):
                source[y] = s
                axis = varies(x)
                vary[y] = None if axis is None else map_axis(eqn, axis)
    return tuple(out)
