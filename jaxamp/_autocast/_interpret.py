"""The autocast interpreter: evaluates a jaxpr equation by equation with casts.

Each equation's floating inputs are cast to the dtype ``_rules.choose`` picks
and the primitive is bound on the cast values. Because only primitives are
bound, the evaluation runs under whatever transformation is active: ``grad``
differentiates the cast program, ``jit`` and ``vmap`` compose as usual.
Higher-order primitives (``jit``, ``scan``, ``custom_vjp_call``, ...) are
handled by the functions registered in ``HANDLERS`` (see ``_calls`` and
``_loops``), as ``jax.experimental.jet`` keeps its rules in a dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxamp import _jax_compat
from jaxamp._autocast import _rules
from jaxamp._autocast._analysis import (
    Analysis,
    analyse,
    broadcast_inputs,
    pointwise_region,
    starts_region,
)
from jaxamp._autocast._casts import (
    bind,
    bind_opmath,
    bind_region,
    cast_jit,
    host_cast,
    to_original,
)
from jaxamp._autocast._rules import (
    ACT,
    AS_WRITTEN,
    CONST,
    F32,
    FLOAT32,
    FLOAT32_DTYPE,
    FOLLOW,
    NONE,
    PIN,
    is_float,
)

# `jax.named_scope` markers, read from each equation's name stack.
#: Equations traced under it run as written (``full_precision``).
FULL_PRECISION_SCOPE = "jaxamp_full_precision"
#: Equations of a nested ``autocast``: it already applied its own rules.
AUTOCAST_SCOPE = "jaxamp_autocast"
#: The ``reduce_precision`` identity that ``keep_float32`` leaves in a jaxpr.
KEEP_FLOAT32_SCOPE = "jaxamp_keep_float32"

Outs = tuple[list[Any], list[int]]  # a handler's outputs and their marks
Handler = Callable[[Any, list[Any], list[int], list[Any], "Context", str], Outs]

#: Higher-order primitive name -> handler(eqn, invals, inmarks, dtypes, ctx, stack).
HANDLERS: dict[str, Handler] = {}


def register(*names: str) -> Callable[[Handler], Handler]:
    """Registers a handler for the higher-order primitives `names`."""

    def deco(fn: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = fn
        return fn

    return deco


@dataclasses.dataclass
class Context:
    """One autocast trace: its configuration and per-trace memo tables.

    Every memo is keyed by the object it describes (with that object kept
    alive and checked by identity) plus everything else its answer depends on,
    and lives only as long as this trace.
    """

    dtype: np.dtype
    rules: Mapping[str, str]
    unknown_higher_order: str
    modules: tuple[tuple[str, Any], ...] = ()
    axis_env: tuple[tuple[Any, int], ...] = ()
    # False inside a custom_jvp rule, whose tangent ops must stay linear
    # (JAX transposes them): even its constants' casts are plain casts.
    saturate: bool = True
    # Re-bind every equation under its own traceback and name stack (what
    # ``jax.core.eval_jaxpr`` does), so the result's equations point at the
    # user's source lines and module scopes (``find_overflow``).
    source_info: bool = False
    # True inside a loop body or a cond branch. There the forward and the backward
    # pass land in different HLO computations, so XLA cannot CSE a rematerialised
    # op into the forward and its checkpoint needs no optimisation barriers
    # (``prevent_cse=False``, as JAX advises for remat inside scan): less to
    # compile. Outside, the barriers stay (without them XLA merged bfloat16 upcasts
    # of the forward and the backward: 4% more temp on bench_autocast).
    in_region: bool = False
    # Inner jaxprs already autocast during this trace (key -> (jaxpr, result)).
    cache: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Casts already made: (id(value), dtype, saturating) -> (value, cast).
    casts: dict[tuple[int, Any], tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Resolved per-module rules per name stack.
    scoped: dict[str, tuple[bool, Mapping[str, str]]] = dataclasses.field(default_factory=dict)
    # The FP8 plan of this trace (``_fp8.Plan``), or None: no FP8.
    fp8: Any = None

    def sub(self, **changes: Any) -> Context:
        """A context for an inner trace: the same caches, no casts (other tracers)."""
        return dataclasses.replace(self, casts={}, **changes)

    def memo(self, key: Any, owner: Any, make: Callable[[], Any]) -> Any:
        """``make()``, once per (key, owner) and everything in this context
        that changes how an inner jaxpr is evaluated."""
        key = (key, self.axis_env, self.saturate, self.in_region)
        hit = self.cache.get(key)
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = make()
        self.cache[key] = (owner, value)
        return value

    def cast(self, x: Any, dtype: Any, const: bool = False) -> Any:
        """A cast, made once per (value, dtype) in this trace; saturating for a
        trace-time constant (`const`), plain (inf beyond the range) otherwise."""
        dtype = np.dtype(dtype)
        saturate = const and self.saturate
        key = (id(x), dtype, saturate)
        hit = self.casts.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        src = np.dtype(x.dtype)
        y = cast_jit(src, dtype, saturate)(x)
        self.casts[key] = (x, y)
        if dtype.itemsize > src.itemsize:
            # An exact upcast: casting the result back down gives `x` again.
            for s in (False, True):
                self.casts[(id(y), src, s)] = (y, x)
        return y


# --------------------------------------------------------------------------
# Evaluation.
# --------------------------------------------------------------------------


def eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Iterable[Any],
    args: Iterable[Any],
    ctx: Context,
    marks: Sequence[int] | None = None,
    stack: str = "",
    as_written: bool = False,
    float32_outputs: bool = False,
) -> Outs:
    """Evaluates `jaxpr` with autocast rules; returns the outputs and their marks."""
    env: dict[Any, Any] = {}
    mark: dict[Any, int] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
        mark[v] = CONST
    args = list(args)
    marks = list(marks) if marks is not None else [NONE] * len(args)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v] = x
        mark[v] = m
    facts = (
        Analysis(frozenset(), broadcast_inputs(jaxpr))
        if as_written
        else analyse(jaxpr, ctx, float32_outputs)
    )

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    done: set[int] = set()  # equations evaluated as part of a pointwise region
    for i, eqn in enumerate(jaxpr.eqns):
        if i in done:
            continue
        invals = [read(v) for v in eqn.invars]
        inmarks = [CONST if isinstance(v, Literal) else mark.get(v, NONE) for v in eqn.invars]
        region = None if as_written else _region(jaxpr, i, eqn, inmarks, ctx, stack)
        if region is not None:
            with _jax_compat.eqn_context(eqn):
                outs = bind_region(jaxpr, region, read, not ctx.in_region)
            for v, x in zip(region.outputs, outs, strict=True):
                env[v] = x
                mark[v] = F32 if is_float(x.dtype) else NONE
            done.update(region.eqns)
            continue
        # Each equation binds under the context it was traced under (an
        # auto_axes body runs under another mesh than its caller).
        with _jax_compat.eqn_context(eqn), _source_info(eqn, ctx):
            outs, outmarks = eval_eqn(
                eqn,
                invals,
                inmarks,
                ctx,
                i in facts.demanded,
                facts.broadcast[i],
                stack,
                as_written,
            )
        if (
            not eqn.effects
            and PIN not in outmarks
            and all(m == CONST or _is_mask(v) for v, m in zip(eqn.invars, inmarks, strict=True))
        ):
            # Computed from constants and masks alone: still a constant (unless
            # the user asked for float32: keep_float32, an explicit cast).
            outmarks = [CONST] * len(outs)
        for v, x, m in zip(eqn.outvars, outs, outmarks, strict=True):
            env[v] = x
            mark[v] = m
    outvals = [read(v) for v in jaxpr.outvars]
    outmarks = [CONST if isinstance(v, Literal) else mark.get(v, NONE) for v in jaxpr.outvars]
    return outvals, outmarks


def _is_mask(v: Any) -> bool:
    """A boolean value: what it selects between is known at trace time."""
    return getattr(v.aval, "dtype", None) == np.dtype(bool)


def _region(jaxpr: Jaxpr, i: int, eqn: Any, inmarks: list[int], ctx: Context, stack: str) -> Any:
    """The pointwise region `eqn` starts (``_analysis.pointwise_region``), or None.

    A float32-list op of one activation in the compute dtype starts one. Not
    with ``source_info`` (``find_overflow`` reads each op where it was written;
    the values are the same without the checkpoint).
    """
    if ctx.source_info or not starts_region(eqn):
        return None
    (k,) = [j for j, v in enumerate(eqn.invars) if not isinstance(v, Literal)]
    x = eqn.invars[k]
    if inmarks[k] != ACT or not is_float(x.aval.dtype) or ctx.dtype.itemsize >= 4:
        return None

    def rule_of(e: Any) -> str:
        full, rules = scope_rules(ctx, _join(stack, _jax_compat.name_stack(e)))
        return AS_WRITTEN if full else rules.get(e.primitive.name, FOLLOW)

    if rule_of(eqn) != FLOAT32:
        return None
    return pointwise_region(jaxpr, i, rule_of, ctx, stack)


def _join(outer: str, inner: str) -> str:
    return f"{outer}/{inner}" if outer and inner else outer or inner


def _source_info(eqn: Any, ctx: Context) -> Any:
    return _jax_compat.source_info_context(eqn) if ctx.source_info else contextlib.nullcontext()


def _dtype_of(x: Any, v: Any) -> Any:
    # Not np.dtype(...): extended dtypes (PRNG keys) have no numpy equivalent.
    return v.aval.dtype if isinstance(v, Literal) else x.dtype


def scope_rules(ctx: Context, stack: str) -> tuple[bool, Mapping[str, str]]:
    """(run as written?, rules) for equations traced under name stack `stack`."""
    hit = ctx.scoped.get(stack)
    if hit is not None:
        return hit
    parts = [p for p in stack.split("/") if p]
    full = any(p.startswith((FULL_PRECISION_SCOPE, AUTOCAST_SCOPE)) for p in parts)
    rules = ctx.rules
    if ctx.modules and not full:
        for pattern, value in ctx.modules:
            if _rules.module_match(pattern, parts):
                if value == FLOAT32:
                    full = True
                    break
                rules = {**rules, **value}
    if ctx.fp8 is not None and not full:
        rules = ctx.fp8.scope_rules(parts, stack, rules)
    ctx.scoped[stack] = (full, rules)
    return full, rules


def has_subjaxprs(params: Mapping[str, Any]) -> bool:
    for value in params.values():
        if isinstance(value, (ClosedJaxpr, Jaxpr)):
            return True
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value
        ):
            return True
    return False


def eval_eqn(
    eqn: Any,
    invals: list[Any],
    inmarks: list[int],
    ctx: Context,
    demanded: bool,
    broadcast: Sequence[bool],
    outer_stack: str,
    as_written: bool,
) -> Outs:
    name = eqn.primitive.name
    dtypes = [_dtype_of(x, v) for x, v in zip(invals, eqn.invars, strict=True)]
    stack = _jax_compat.name_stack(eqn)
    if outer_stack:
        stack = f"{outer_stack}/{stack}" if stack else outer_stack
    rules = ctx.rules
    if not as_written:
        as_written, rules = scope_rules(ctx, stack)
    nout = len(eqn.outvars)
    rule = AS_WRITTEN if as_written else rules.get(name, FOLLOW)
    cached = not ctx.source_info

    if rule != AS_WRITTEN and has_subjaxprs(eqn.params):
        handler = HANDLERS.get(name)
        if handler is not None:
            return handler(eqn, invals, inmarks, dtypes, ctx, stack)
        _unknown_higher_order(name, ctx)
        rule = AS_WRITTEN

    if rule == AS_WRITTEN:
        outs = bind(eqn, to_original(invals, dtypes, eqn.invars, ctx), cached=cached)
        return outs, [NONE] * nout

    floats = [i for i, d in enumerate(dtypes) if is_float(d)]
    if not floats:  # integer / bool / key ops are never touched
        return bind(eqn, invals, cached=cached), [NONE] * nout
    if name == "convert_element_type":
        return _eval_convert(eqn, invals, inmarks, dtypes, ctx, demanded, cached)
    if name == "reduce_precision" and KEEP_FLOAT32_SCOPE in stack:
        x = invals[0]  # the keep_float32 marker: an identity in float32
        return [x if dtypes[0] == FLOAT32_DTYPE else ctx.cast(x, FLOAT32_DTYPE)], [PIN]

    target, out_mark = _rules.choose(
        rule,
        [np.dtype(dtypes[i]) for i in floats],
        [inmarks[i] for i in floats],
        [not eqn.invars[i].aval.weak_type for i in floats],
        [broadcast[i] for i in floats],
        ctx.dtype,
        demanded,
    )
    if name in _rules.OPMATH_OPS and target == ctx.dtype and target.itemsize < 4:
        return bind_opmath(eqn, invals[floats[0]], target, ctx, cached), [out_mark] * nout
    args = list(invals)
    for i in floats:
        if dtypes[i] != target:
            if isinstance(eqn.invars[i], Literal):
                args[i] = host_cast(invals[i], target)
            else:
                args[i] = ctx.cast(invals[i], target, const=inmarks[i] == CONST)
    params = eqn.params
    pref = params.get("preferred_element_type")
    if pref is not None and is_float(pref) and np.dtype(pref) != target:
        # jnp sets preferred_element_type to its inputs' dtype: follow the cast,
        # unless `f` asked for another accumulation type than its inputs'.
        orig = functools.reduce(
            _rules.promote, [np.dtype(eqn.invars[i].aval.dtype) for i in floats]
        )
        if np.dtype(pref) == orig:
            params = dict(params, preferred_element_type=target)
        elif np.dtype(pref).itemsize >= 4:
            out_mark = F32
    if ctx.fp8 is not None and name == "dot_general" and rule == _rules.LOWER:
        fp8_outs = ctx.fp8.dot(eqn, args, params, target, rules, stack)
        if fp8_outs is not None:
            return fp8_outs, [out_mark] * nout
    return bind(eqn, args, params, cached), [out_mark] * nout


def _unknown_higher_order(name: str, ctx: Context) -> None:
    if ctx.unknown_higher_order == "error":
        raise NotImplementedError(
            f"jaxamp.autocast does not know the higher-order primitive {name!r}. "
            "Pass unknown_higher_order='as_written' to run it in its original "
            f"dtypes, or rules={{{name!r}: 'as_written'}}."
        )
    if ctx.unknown_higher_order == "warn":
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


def _eval_convert(
    eqn: Any,
    invals: list[Any],
    inmarks: list[int],
    dtypes: list[Any],
    ctx: Context,
    demanded: bool,
    cached: bool = True,
) -> Outs:
    new = eqn.params["new_dtype"]
    x = invals[0]
    if not is_float(new):  # float -> int / bool: from the value `f` had
        return bind(eqn, to_original([x], dtypes, eqn.invars, ctx), cached=cached), [NONE]
    new = np.dtype(new)
    # An explicit cast to float32 or wider (`x.astype(jnp.float32)` of a
    # lower-precision value) marks the value float32 for the ops after it. A
    # weak -> strong retyping is not a cast.
    src = eqn.invars[0].aval
    retype = bool(src.weak_type) != bool(eqn.params.get("weak_type", False))
    pinned = new.itemsize >= 4 and not demanded and not retype
    if dtypes[0] == new:
        return [x], [PIN if pinned else inmarks[0]]
    return [ctx.cast(x, new)], [PIN if pinned else NONE]
