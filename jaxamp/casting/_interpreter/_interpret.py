"""The autocast interpreter: evaluates a jaxpr equation by equation with casts.

Each equation's floating inputs are cast to the dtype ``_rules.choose`` picks
and the primitive is bound on the cast values. Because only primitives are
bound, the evaluation runs under whatever transformation is active: ``grad``
differentiates the cast program, ``jit`` and ``vmap`` compose as usual.
Higher-order primitives (``jit``, ``scan``, ``custom_vjp_call``, ...) go to the
context's handlers, by kind (``_primitives``; the handlers are in ``_calls`` and
``_loops``), as ``jax.experimental.jet`` keeps its rules in a dict.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._interpreter._analysis import analyse, pointwise_region, starts_region
from jaxamp.casting._interpreter._casts import (
    bind,
    bind_opmath,
    bind_region,
    cast,
    host_cast,
    to_original,
)
from jaxamp.casting._interpreter._constants import const_facts, constant_marks, fill_marks
from jaxamp.casting._interpreter._context import Context
from jaxamp.casting._interpreter._decisions import note, note_outs, note_region
from jaxamp.casting._interpreter._opmath import FILL_POSITIONS, eval_opmath, opmath_reason
from jaxamp.casting._rules._primitives import has_subjaxprs, kind_of
from jaxamp.casting._rules._rules import (
    ACT,
    AS_WRITTEN,
    CONST,
    ELEMENTWISE,
    F32,
    FLOAT32,
    FLOAT32_DTYPE,
    FOLLOW,
    LOWER,
    NONE,
    OPMATH_OPS,
    PIN,
    FloatIn,
    choose,
    promote,
)
from jaxamp.casting._rules._scopes import KEEP_FLOAT32_SCOPE, join

Outs = tuple[list[Any], list[int]]  # an equation's outputs and their marks


class Ins(NamedTuple):
    """An equation's inputs as the interpreter holds them."""

    vals: list[Any]
    marks: list[int]
    dtypes: list[Any]  # each value's dtype now (a literal's as written)


#: A higher-order primitive's handler: ``(eqn, ins, ctx) -> outs``, ``ctx`` at the
#: equation's own name stack.
Handler = Callable[[Any, Ins, Context], Outs]


def eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Iterable[Any],
    args: Iterable[Any],
    ctx: Context,
    marks: Sequence[int] | None = None,
    float32_outputs: bool = False,
) -> Outs:
    """Evaluates `jaxpr` under ``ctx.position.stack`` with autocast rules; returns the outputs
    and their marks. ``float32_outputs``: the outputs are returned in float32 (the
    top level of ``f``), which counts as a float32 use (``_analysis.analyse``)."""
    env: dict[Any, Any] = {}
    mark: dict[Any, int] = {}
    args = list(args)
    marks = list(marks) if marks is not None else [NONE] * len(args)
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v], (mark[v], values) = x, const_facts(x, ctx.config.dtype)
        if values is not None:
            ctx.memo.known[id(x)] = (x, values)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v], mark[v] = x, m
    facts = analyse(jaxpr, ctx, float32_outputs)

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    def marks_of(vs: Sequence[Any]) -> list[int]:
        return [CONST if isinstance(v, Literal) else mark.get(v, NONE) for v in vs]

    done: set[int] = set()  # equations evaluated as part of a pointwise region
    for i, eqn in enumerate(jaxpr.eqns):
        if i in done:
            continue
        inmarks = marks_of(eqn.invars)
        region = _region(jaxpr, i, eqn, inmarks, ctx, i in facts.demanded)
        if region is not None:
            with jax_compat.eqn_context(eqn):
                outs = bind_region(jaxpr, region, read, not ctx.position.in_region)
            # An opmath root (silu's logistic) rounds its region once to the
            # activation's dtype, as torch's fused kernel does; a float32-list
            # root's results stay float32 (torch's type promotion).
            low = eqn.primitive.name in OPMATH_OPS
            outmarks = [(ACT if low else F32) if is_float_dtype(x.dtype) else NONE for x in outs]
            if low:
                outs = [
                    cast(ctx, x, ctx.config.dtype) if is_float_dtype(x.dtype) else x for x in outs
                ]
            note_region(jaxpr, region.eqns, ctx, low)
            outvars = region.outputs
            done.update(region.eqns)
        else:
            # Each equation binds under the context it was traced under (an
            # auto_axes body runs under another mesh than its caller).
            with jax_compat.eqn_context(eqn), _source_info(eqn, ctx):
                invals = [read(v) for v in eqn.invars]
                if eqn.primitive.name in FILL_POSITIONS:
                    ins = list(zip(eqn.invars, invals, inmarks, strict=True))
                    inmarks = fill_marks(ins, ctx.config.dtype, ctx.memo.known)
                demanded, layouts = i in facts.demanded, facts.layouts[i]
                outs, outmarks = eval_eqn(eqn, invals, inmarks, ctx, demanded, layouts)
            ins = list(zip(eqn.invars, invals, inmarks, strict=True))
            outmarks = constant_marks(eqn, ins, outs, outmarks, ctx.config.dtype, ctx.memo.known)
            outvars = eqn.outvars
        for v, x, m in zip(outvars, outs, outmarks, strict=True):
            env[v], mark[v] = x, m
    return [read(v) for v in jaxpr.outvars], marks_of(jaxpr.outvars)


def _region(
    jaxpr: Jaxpr, i: int, eqn: Any, inmarks: list[int], ctx: Context, demanded: bool
) -> Any:
    """The pointwise region `eqn` starts (``_analysis.pointwise_region``), or None.

    A float32-list op of one activation in the compute dtype starts one. Not
    with ``source_info`` (``find_overflow`` reads each op where it was written;
    the values are the same without the checkpoint).
    """
    if ctx.config.source_info or not starts_region(eqn):
        return None
    (k,) = [j for j, v in enumerate(eqn.invars) if not isinstance(v, Literal)]
    x = eqn.invars[k]
    if inmarks[k] != ACT or not is_float_dtype(x.aval.dtype) or ctx.config.dtype.itemsize >= 4:
        return None

    def rule_of(e: Any) -> str:
        full, rules = ctx.rules_at(join(ctx.position.stack, jax_compat.name_stack(e)))
        return AS_WRITTEN if full else rules.get(e.primitive.name, FOLLOW)

    rule = rule_of(eqn)
    # An opmath op (logistic) too, unless it runs in float32 anyway (`demanded`):
    # silu's ``x * logistic(x)`` in float32, so a logistic below float16's
    # smallest subnormal is not 0 before the product.
    opmath = eqn.primitive.name in OPMATH_OPS and rule in (ELEMENTWISE, FOLLOW) and not demanded
    if rule != FLOAT32 and not opmath:
        return None
    return pointwise_region(jaxpr, i, rule_of, ctx)


def _source_info(eqn: Any, ctx: Context) -> Any:
    return jax_compat.source_info_context(eqn) if ctx.config.lines else contextlib.nullcontext()


def _dtype_of(x: Any, v: Any) -> Any:
    # Not np.dtype(...): extended dtypes (PRNG keys) have no numpy equivalent.
    return v.aval.dtype if isinstance(v, Literal) else x.dtype


def eval_eqn(
    eqn: Any,
    invals: list[Any],
    inmarks: list[int],
    ctx: Context,
    demanded: bool,
    layouts: Sequence[int],
) -> Outs:
    """One equation: by its handler, as written, or in the dtype its rule chooses.

    ``demanded`` and ``layouts`` are the analysis's facts about it (``_analysis``).
    """
    ctx = ctx.at(join(ctx.position.stack, jax_compat.name_stack(eqn)))
    ins = Ins(invals, inmarks, [_dtype_of(x, v) for x, v in zip(invals, eqn.invars, strict=True)])
    name, nout = eqn.primitive.name, len(eqn.outvars)
    full, rules = ctx.rules_at()
    rule = AS_WRITTEN if full else rules.get(name, FOLLOW)
    why, origin = "runs in the dtypes f gives it", None
    if rule != AS_WRITTEN and has_subjaxprs(eqn.params):
        handler = ctx.config.handlers.get(kind_of(name))
        if handler is not None:
            return handler(eqn, ins, ctx.inside(eqn))
        _unknown_higher_order(name, ctx)
        rule, why = AS_WRITTEN, "a higher-order primitive autocast does not enter"
        origin = (AS_WRITTEN, "unknown_higher_order=")
    if rule == AS_WRITTEN:
        outs = bind(eqn, to_original(invals, ins.dtypes, eqn.invars, ctx), cached=ctx.config.cached)
        note_outs(eqn, ctx, outs, why, origin)
        return outs, [NONE] * nout
    floats = [i for i, d in enumerate(ins.dtypes) if is_float_dtype(d)]
    if not floats:  # integer / bool / key ops are never touched
        return bind(eqn, invals, cached=ctx.config.cached), [NONE] * nout
    if name == "convert_element_type":
        return _eval_convert(eqn, ins, ctx, demanded)
    if name == "reduce_precision" and KEEP_FLOAT32_SCOPE in ctx.position.stack:
        x = invals[0]  # the keep_float32 marker: an identity in float32
        note(eqn, ctx, FLOAT32_DTYPE, "keep_float32: float32 until a matrix product")
        return [x if ins.dtypes[0] == FLOAT32_DTYPE else cast(ctx, x, FLOAT32_DTYPE)], [PIN]
    float_ins = [
        FloatIn(np.dtype(ins.dtypes[i]), ins.marks[i], not eqn.invars[i].aval.weak_type, layouts[i])
        for i in floats
    ]
    target, out_mark, why = choose(rule, float_ins, ctx.config.dtype, demanded)
    fp8 = ctx.fp8 is not None and name == "dot_general" and rule == LOWER
    return _eval_in(eqn, ins, ctx, floats, target, out_mark, layouts, rules if fp8 else None, why)


def _eval_in(
    eqn: Any,
    ins: Ins,
    ctx: Context,
    floats: list[int],
    target: np.dtype,
    out_mark: int,
    layouts: Sequence[int],
    fp8_rules: Mapping[str, str] | None = None,
    why: str = "",
) -> Outs:
    """An equation with its floating inputs (at ``floats``) cast to ``target``; with
    ``fp8_rules`` (the rules in force for a ``"lower"`` ``dot_general`` under FP8), as
    an FP8 product where the trace's FP8 plan wants one. `why`: ``choose``'s reason.
    In float32, rounded once to ``target``, where a scalar operand ``target`` would
    change (``_opmath``)."""
    nout = len(eqn.outvars)
    opmath = "; in float32, rounded once (torch's opmath)"
    if eqn.primitive.name in OPMATH_OPS and target == ctx.config.dtype and target.itemsize < 4:
        note(eqn, ctx, FLOAT32_DTYPE, why + opmath)
        outs = bind_opmath(eqn, ins.vals[floats[0]], target, ctx, ctx.config.cached)
        return outs, [out_mark] * nout
    if target == ctx.config.dtype:
        reason = opmath_reason(eqn, *ins, floats, layouts, target)
        if reason is not None:
            note(eqn, ctx, FLOAT32_DTYPE, f"{why}; {reason}{opmath}")
            outs = eval_opmath(eqn, *ins, floats, ctx, target)
            return outs, [out_mark] * nout
    args = list(ins.vals)
    for i in floats:
        if ins.dtypes[i] != target:
            if isinstance(eqn.invars[i], Literal):
                args[i] = host_cast(ins.vals[i], target)
            else:
                args[i] = cast(ctx, ins.vals[i], target, const=ins.marks[i] == CONST)
    params, out_mark = _accumulation(eqn, floats, target, out_mark)
    layer = ""
    if fp8_rules is not None:
        pos = ctx.position
        layer = ctx.fp8.layer(eqn, pos.site, pos.stack)
        fp8_outs, fp8_why = ctx.fp8.dot(
            eqn, args, params, target, fp8_rules, pos.site, pos.stack, ctx.config.lines
        )
        if fp8_outs is not None:
            note(eqn, ctx, "float8_e4m3fn", fp8_why, layer=layer)
            return fp8_outs, [out_mark] * nout
        why = f"{why}; {fp8_why}" if fp8_why else why
    note(eqn, ctx, target, why, layer=layer)
    return bind(eqn, args, params, ctx.config.cached), [out_mark] * nout


def _accumulation(eqn: Any, floats: list[int], target: np.dtype, mark: int) -> tuple[dict, int]:
    """``eqn``'s params with its ``preferred_element_type`` following the cast, and
    the results' mark.

    jnp sets ``preferred_element_type`` to its inputs' dtype: it follows the cast,
    unless `f` asked for another accumulation type than its inputs' (then it is
    kept, and a float32 one marks the results float32).
    """
    params = eqn.params
    pref = params.get("preferred_element_type")
    if pref is None or not is_float_dtype(pref) or np.dtype(pref) == target:
        return params, mark
    orig = functools.reduce(promote, [np.dtype(eqn.invars[i].aval.dtype) for i in floats])
    if np.dtype(pref) == orig:
        return dict(params, preferred_element_type=target), mark
    return params, F32 if np.dtype(pref).itemsize >= 4 else mark


def _unknown_higher_order(name: str, ctx: Context) -> None:
    if ctx.config.unknown_higher_order == "error":
        raise NotImplementedError(
            f"jaxamp.autocast does not know the higher-order primitive {name!r}. "
            "Pass unknown_higher_order='as_written' to run it in its original "
            f"dtypes, or rules={{{name!r}: 'as_written'}}."
        )
    if ctx.config.unknown_higher_order == "warn":
        why = ""
        if name == "custom_vjp_call_jaxpr":
            why = (
                f" On JAX {jax.__version__} a jax.custom_vjp function appears in "
                "jaxprs in a form autocast does not enter; newer JAX (tested: "
                "0.10) writes it as custom_vjp_call, which autocast enters."
            )
        warnings.warn(
            f"jaxamp.autocast: higher-order primitive {name!r} is not entered; it "
            f"runs in the dtypes of the original function.{why}",
            stacklevel=2,
        )


def _eval_convert(eqn: Any, ins: Ins, ctx: Context, demanded: bool) -> Outs:
    new = eqn.params["new_dtype"]
    x = ins.vals[0]
    if not is_float_dtype(new):  # float -> int / bool: from the value `f` had
        outs = bind(eqn, to_original([x], ins.dtypes, eqn.invars, ctx), cached=ctx.config.cached)
        return outs, [NONE]
    new = np.dtype(new)
    # An explicit cast to float32 or wider (`x.astype(jnp.float32)` of a
    # lower-precision value) marks the value float32 for the ops after it. A
    # weak -> strong retyping is not a cast.
    src = eqn.invars[0].aval
    retype = bool(src.weak_type) != bool(eqn.params.get("weak_type", False))
    pinned = new.itemsize >= 4 and not demanded and not retype
    note(eqn, ctx, new, "a cast in f" + (": float32 from here until a matrix product" * pinned))
    if ins.dtypes[0] == new:
        return [x], [PIN if pinned else ins.marks[0]]
    return [cast(ctx, x, new)], [PIN if pinned else NONE]
