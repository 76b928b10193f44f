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
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxamp import _jax_compat
from jaxamp._autocast import _rules
from jaxamp._autocast._analysis import Analysis, analyse, residual_free
from jaxamp._autocast._casts import bind, cast_jit, host_cast
from jaxamp._autocast._rules import (
    AS_WRITTEN,
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
    # (JAX transposes them): its casts are plain casts.
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
    # Casts already made: (id(value), dtype) -> (value, cast).
    casts: dict[tuple[int, Any], tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Resolved per-module rules per name stack.
    scoped: dict[str, tuple[bool, Mapping[str, str]]] = dataclasses.field(default_factory=dict)

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

    def cast(self, x: Any, dtype: Any) -> Any:
        """A (saturating) cast, made once per (value, dtype) in this trace."""
        dtype = np.dtype(dtype)
        key = (id(x), dtype)
        hit = self.casts.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        src = np.dtype(x.dtype)
        y = cast_jit(src, dtype, self.saturate)(x)
        self.casts[key] = (x, y)
        if dtype.itemsize > src.itemsize:
            # An exact upcast: casting the result back down gives `x` again.
            self.casts[(id(y), src)] = (y, x)
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
    args = list(args)
    marks = list(marks) if marks is not None else [NONE] * len(args)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v] = x
        mark[v] = m
    facts = (
        Analysis(frozenset(), frozenset()) if as_written else analyse(jaxpr, ctx, float32_outputs)
    )

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        inmarks = [NONE if isinstance(v, Literal) else mark.get(v, NONE) for v in eqn.invars]
        # Each equation binds under the context it was traced under (an
        # auto_axes body runs under another mesh than its caller).
        with _jax_compat.eqn_context(eqn), _source_info(eqn, ctx):
            outs, outmarks = eval_eqn(
                eqn,
                invals,
                inmarks,
                ctx,
                i in facts.demanded,
                i in facts.promote,
                stack,
                as_written,
            )
        for v, x, m in zip(eqn.outvars, outs, outmarks, strict=True):
            env[v] = x
            mark[v] = m
    outvals = [read(v) for v in jaxpr.outvars]
    outmarks = [NONE if isinstance(v, Literal) else mark.get(v, NONE) for v in jaxpr.outvars]
    return outvals, outmarks


def _source_info(eqn: Any, ctx: Context) -> Any:
    return _jax_compat.source_info_context(eqn) if ctx.source_info else contextlib.nullcontext()


def _dtype_of(x: Any, v: Any) -> Any:
    # Not np.dtype(...): extended dtypes (PRNG keys) have no numpy equivalent.
    return v.aval.dtype if isinstance(v, Literal) else x.dtype


def to_original(vals: list[Any], dtypes: list[Any], invars: list[Any], ctx: Context) -> list[Any]:
    """Casts floating values back to the dtypes the un-autocast program had."""
    out = []
    for x, cur, v in zip(vals, dtypes, invars, strict=True):
        want = v.aval.dtype
        if cur != want and is_float(cur) and is_float(want):
            x = host_cast(x, want) if isinstance(v, Literal) else ctx.cast(x, want)
        out.append(x)
    return out


def cast_all(xs: Sequence[Any], dtypes: Sequence[Any], ctx: Context) -> list[Any]:
    return [
        ctx.cast(x, d) if is_float(d) and is_float(x.dtype) and x.dtype != d else x
        for x, d in zip(xs, dtypes, strict=True)
    ]


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
    promote: bool,
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

    target, out_mark, hand_on = _rules.choose(
        rule,
        [np.dtype(dtypes[i]) for i in floats],
        [inmarks[i] for i in floats],
        [not eqn.invars[i].aval.weak_type for i in floats],
        ctx.dtype,
        demanded,
        promote_f32=promote,
        residual_free=residual_free(eqn),
        reduction=name in _rules.REDUCTIONS,
    )
    remat = _stores_upcast(rule, eqn, floats, dtypes, target)
    args = list(invals)
    for i in [] if remat else floats:
        if dtypes[i] != target:
            literal = isinstance(eqn.invars[i], Literal)
            args[i] = host_cast(invals[i], target) if literal else ctx.cast(invals[i], target)
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
    if remat:
        outs = _from_low_precision(
            eqn, invals[floats[0]], target, params, cached, prevent_cse=not ctx.in_region
        )
    else:
        outs = bind(eqn, args, params, cached)
    if hand_on is not None:
        outs = [ctx.cast(o, hand_on) if is_float(o.dtype) else o for o in outs]
    return outs, [out_mark] * nout


def _stores_upcast(rule: str, eqn: Any, floats: list[int], dtypes: Any, target: Any) -> bool:
    """A float32-list op of one lower-precision input (gelu's ``x ** 3``, a norm's
    ``square``): its derivative would keep the float32 copy of the input."""
    return (
        rule == FLOAT32
        and len(eqn.invars) == 1
        and floats == [0]
        and not isinstance(eqn.invars[0], Literal)
        and np.dtype(dtypes[0]).itemsize < np.dtype(target).itemsize
    )


def _from_low_precision(
    eqn: Any, x: Any, target: Any, params: Any, cached: bool = True, prevent_cse: bool = True
) -> list[Any]:
    """The op on ``x`` cast up, rematerialised from ``x`` in the backward pass.

    The result is the same float32 value; the residual is ``x`` in its lower
    precision (usually kept anyway, as the matmul output it is) instead of a
    float32 copy: an exact cast up costs nothing to redo. torch.autocast keeps
    the float32 input of ``pow``; a fused GELU kernel keeps none.
    """

    def op(low: Any) -> list[Any]:
        return bind(eqn, [lax.convert_element_type(low, target)], params, cached)

    if not cached:
        return jax.checkpoint(op, prevent_cse=prevent_cse)(x)
    try:
        key = (eqn.primitive, tuple(sorted(params.items())), np.dtype(target), prevent_cse)
        hash(key)
    except TypeError:  # unhashable params: traced afresh
        return jax.checkpoint(op, prevent_cse=prevent_cse)(x)
    with _jax_compat.eqn_context(eqn):
        return _upcast_op(*key)(x)


@functools.lru_cache(maxsize=512)
def _upcast_op(primitive: Any, params: tuple[Any, ...], target: np.dtype, prevent_cse: bool) -> Any:
    """One checkpointed function per (primitive, params, dtype, prevent_cse):
    everything that changes its answer. JAX caches the trace of a function object,
    so a model's 48 layers of gelu trace it once, not 48 times (trace + compile)."""

    def op(low: Any) -> Any:
        out = primitive.bind(lax.convert_element_type(low, target), **dict(params))
        return list(out) if primitive.multiple_results else [out]

    return jax.checkpoint(op, prevent_cse=prevent_cse)


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


def eval_to_original(
    jaxpr: Jaxpr, consts: Iterable[Any], args: Iterable[Any], ctx: Context, stack: str = ""
) -> list[Any]:
    """Like `eval_jaxpr`, with outputs cast back to the jaxpr's output dtypes."""
    outs, _ = eval_jaxpr(jaxpr, consts, args, ctx, None, stack)
    return [
        ctx.cast(x, v.aval.dtype) if is_float(x.dtype) and x.dtype != v.aval.dtype else x
        for x, v in zip(outs, jaxpr.outvars, strict=True)
    ]


def traced(body: Callable[..., Any], avals: Sequence[Any], ctx: Context) -> ClosedJaxpr:
    """``jax.make_jaxpr(body)`` with the trace's axis environment."""
    return jax.make_jaxpr(body, axis_env=list(ctx.axis_env) or None)(*avals)


def autocast_subjaxpr(sub: ClosedJaxpr | Jaxpr, ctx: Context, stack: str) -> ClosedJaxpr | Jaxpr:
    """An autocast version of `sub` with the same input and output types."""

    def make() -> ClosedJaxpr | Jaxpr:
        if isinstance(sub, ClosedJaxpr):
            jaxpr, consts = sub.jaxpr, sub.consts
        else:
            jaxpr, consts = sub, ()
            if jaxpr.constvars:
                raise NotImplementedError("open inner jaxpr with constvars")
        sub_ctx = ctx.sub()
        new = traced(
            lambda *args: eval_to_original(jaxpr, consts, args, sub_ctx, stack),
            [v.aval for v in jaxpr.invars],
            ctx,
        )
        if isinstance(sub, ClosedJaxpr):
            return new
        if new.consts:
            raise NotImplementedError("autocast introduced constants in an open inner jaxpr")
        return new.jaxpr

    return ctx.memo(("sub", id(sub), stack), sub, make)
