"""What autocast reads from a jaxpr's structure before evaluating it.

One backward pass per jaxpr decides which equations run in float32 because
everything they feed is float32 (``demanded``); one forward pass finds how
each input is laid out into an equation's result (``layouts``, ``_layouts``); and
``pointwise_region`` finds the equations that compute a pointwise function of
one activation from a float32-list op on (run in float32, rematerialised from
the activation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._rules._layouts import input_layouts
from jaxamp.casting._rules._primitives import has_subjaxprs
from jaxamp.casting._rules._rules import AS_WRITTEN, ELEMENTWISE, FLOAT32, FOLLOW, LOWER

if TYPE_CHECKING:
    from jaxamp.casting._interpreter._context import Context


# Ops whose backward pass keeps no floating residual: computing them in
# float32 costs no memory (``mul`` too when its other operand is a literal).
_RESIDUAL_FREE: frozenset[str] = frozenset(
    {
        "add", "sub", "neg", "select_n", "copy", "convert_element_type",
        "reduce_precision", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
        "transpose", "slice", "dynamic_slice", "pad", "rev", "concatenate",
    }
)  # fmt: skip

#: Elementwise ops a pointwise region may hold: each result element is a
#: function of the same element of the inputs (and scalars).
POINTWISE: frozenset[str] = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "abs", "sign", "max", "min", "pow",
        "integer_pow", "square", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log", "log1p",
        "expm1", "tanh", "logistic", "sin", "cos", "tan", "sinh", "cosh", "asin", "acos",
        "atan", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma",
        "floor", "ceil", "round", "select_n", "clamp",
    }
)  # fmt: skip


def residual_free(eqn: Any) -> bool:
    name = eqn.primitive.name
    return name in _RESIDUAL_FREE or (
        name == "mul" and any(isinstance(v, Literal) for v in eqn.invars)
    )


class Analysis(NamedTuple):
    """Per-equation facts read from a jaxpr's structure, before it is evaluated."""

    #: "elementwise" equations whose results only feed float32 (they run in float32).
    demanded: frozenset[int]
    #: per equation, per input: how it is laid out into the result (``OWN``,
    #: ``SCALAR``, ``VECTOR``, ``BIAS``; ``input_layouts``).
    layouts: tuple[tuple[int, ...], ...]


def analyse(jaxpr: Jaxpr, ctx: Context, float32_outputs: bool = False) -> Analysis:
    """The facts of ``Analysis`` for `jaxpr`, once per jaxpr in a trace.

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
            v
            for v in outs
            if float32_outputs
            and is_float_dtype(v.aval.dtype)
            and np.dtype(v.aval.dtype).itemsize >= 4
        }
        sinks: set[int] = set()  # float32 ops and equations demanded by them
        free: set[int] = set()  # residual-free equations feeding only float32 / lower ops
        demanded: set[int] = set()
        for i in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[i]
            rule = ctx.config.rules.get(eqn.primitive.name, FOLLOW)
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
        return Analysis(frozenset(demanded), input_layouts(jaxpr))

    return ctx.memoized(("analysis", id(jaxpr), float32_outputs), jaxpr, make)


class Region(NamedTuple):
    """Equations that compute a pointwise function of one activation."""

    eqns: tuple[int, ...]  # indices into the jaxpr's equations, in order
    outputs: tuple[Any, ...]  # the region's values used after it (or returned)


def pointwise_region(
    jaxpr: Jaxpr, root: int, rule_of: Callable[[Any], str], ctx: Context
) -> Region:
    """The equations from `root` on that compute a pointwise function of the
    activation `root` reads (gelu's ``x ** 3`` and the chain after it).

    `rule_of` gives an equation's rule where it stands (its module's rules
    under the outer name stack ``ctx.position.stack``). An equation joins when it is
    ``POINTWISE``, its rule lets it run in float32 (not ``"lower"`` nor
    ``"as_written"``), it reads a value of the region, and its other inputs
    are the activation, literals or non-floating values already computed
    before `root` (a ``where``'s mask). So the region is a function of the
    activation alone, evaluated where `root` stands.
    """

    def make() -> Region:
        eqns = jaxpr.eqns
        (x,) = [v for v in eqns[root].invars if not isinstance(v, Literal)]
        later = {v for e in eqns[root:] for v in e.outvars}
        inside = [root]
        values = set(eqns[root].outvars)
        for j in range(root + 1, len(eqns)):
            e = eqns[j]
            if e.primitive.name not in POINTWISE or rule_of(e) in (LOWER, AS_WRITTEN):
                continue
            reads = False
            for v in e.invars:
                if isinstance(v, Literal) or v is x:
                    continue
                if v in values:
                    reads = True
                elif is_float_dtype(v.aval.dtype) or v in later:
                    break
            else:
                if reads:
                    inside.append(j)
                    values.update(e.outvars)
        members = set(inside)
        used = {
            v for j, e in enumerate(eqns) if j not in members for v in e.invars
            if not isinstance(v, Literal)
        } | {v for v in jaxpr.outvars if not isinstance(v, Literal)}  # fmt: skip
        outputs = tuple(v for j in inside for v in eqns[j].outvars if v in used)
        return Region(tuple(inside), outputs)

    return ctx.memoized(("region", id(jaxpr), root, ctx.position.stack), jaxpr, make)


def starts_region(eqn: Any) -> bool:
    """An op of one non-literal input that carries no jaxpr: a region's root
    when its rule is ``"float32"`` and that input an activation (the caller
    checks both). A root need not be pointwise (a ``reduce_max``, an
    ``eigh``): checkpointed alone, it keeps its low-precision input too."""
    inputs = [v for v in eqn.invars if not isinstance(v, Literal)]
    return len(inputs) == 1 and not eqn.effects and not has_subjaxprs(eqn.params)
