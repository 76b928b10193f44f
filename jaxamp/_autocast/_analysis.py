"""What autocast reads from a jaxpr's uses before evaluating it.

One backward pass per jaxpr decides which equations run in float32 because
everything they feed is float32 (``demanded``) and where a float32-list
result may promote an activation at no memory cost (``promote``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._autocast._rules import ELEMENTWISE, FLOAT32, FOLLOW, LOWER, is_float

if TYPE_CHECKING:
    from jaxamp._autocast._interpret import Context


# Ops whose backward pass keeps no floating residual: computing them in
# float32 costs no memory (``mul`` too when its other operand is a literal).
_RESIDUAL_FREE: frozenset[str] = frozenset(
    {
        "add", "sub", "neg", "select_n", "copy", "convert_element_type",
        "reduce_precision", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
        "transpose", "slice", "dynamic_slice", "pad", "rev", "concatenate",
    }
)  # fmt: skip


def residual_free(eqn: Any) -> bool:
    name = eqn.primitive.name
    return name in _RESIDUAL_FREE or (
        name == "mul" and any(isinstance(v, Literal) for v in eqn.invars)
    )


class Analysis(NamedTuple):
    """Per-equation facts read from a jaxpr's uses, before it is evaluated."""

    #: "elementwise" equations whose results only feed float32 (they run in float32).
    demanded: frozenset[int]
    #: equations where a float32 input promotes an activation: the results
    #: reach only float32 ops, matmuls / convolutions or ``f``'s float32
    #: outputs, through ops that keep no residual, so float32 there costs no
    #: memory. Elsewhere the activation's dtype wins (a gelu's ``x ** 3``
    #: meeting ``x``): promoting there stores float32 residuals.
    promote: frozenset[int]


def analyse(jaxpr: Jaxpr, ctx: Context, float32_outputs: bool = False) -> Analysis:
    """One backward pass over `jaxpr`'s uses (see ``Analysis``).

    A value is float32-demanded when every use of it is a ``"float32"`` op or
    a demanded equation (and it is not an output); an ``"elementwise"``
    equation is demanded when all its results are. With `float32_outputs`
    (the top level of ``f``, whose floating outputs are returned in float32),
    an output also counts as a float32 use for residual-free equations: a bias
    add before the output runs in float32 at no memory cost.
    """

    def make() -> Analysis:
        uses: dict[Any, list[int]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    uses.setdefault(v, []).append(i)
        outs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        wide = {
            v for v in outs
            if float32_outputs and is_float(v.aval.dtype) and np.dtype(v.aval.dtype).itemsize >= 4
        }  # fmt: skip
        sinks: set[int] = set()  # float32 ops and equations demanded by them
        free: set[int] = set()  # residual-free equations feeding only float32 / lower ops
        demanded: set[int] = set()
        for i in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[i]
            rule = ctx.rules.get(eqn.primitive.name, FOLLOW)
            if rule in (FLOAT32, LOWER):
                sinks.add(i) if rule == FLOAT32 else free.add(i)
                continue
            if not eqn.outvars:
                continue
            by_float32 = rule == ELEMENTWISE
            by_free = residual_free(eqn)
            for v in eqn.outvars:
                vuses = uses.get(v, [])
                if (v in outs and v not in wide) or not (vuses or v in outs):
                    by_float32 = by_free = False
                    break
                by_float32 &= v not in outs and all(u in sinks for u in vuses)
                by_free &= all(u in sinks or u in free for u in vuses)
            if by_float32:
                sinks.add(i)
                demanded.add(i)
            elif by_free:
                free.add(i)
                if rule == ELEMENTWISE and all(v in wide or not uses.get(v) for v in eqn.outvars):
                    demanded.add(i)  # feeds f's float32 outputs only
        promote = frozenset(
            demanded
            | {i for i in free if ctx.rules.get(jaxpr.eqns[i].primitive.name, FOLLOW) != LOWER}
        )
        return Analysis(frozenset(demanded), promote)

    return ctx.memo(("analysis", id(jaxpr), float32_outputs), jaxpr, make)
