"""Handlers for call-like higher-order primitives: nested ``jit``, ``remat``,
custom derivatives and ``shard_map``.

Each re-issues the primitive through public JAX (``jax.jit``-compatible
params, ``jax.checkpoint``, ``jax.custom_jvp`` / ``jax.custom_vjp``,
``jax.shard_map``) around an autocast evaluation of its inner jaxpr, so the
transformations JAX applies later see an ordinary program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._fp8 import _fp8_health
from jaxamp.casting._interpreter._casts import bind, cast, cast_all, to_original
from jaxamp.casting._interpreter._constants import call_values, record
from jaxamp.casting._interpreter._context import Context
from jaxamp.casting._interpreter._decisions import note
from jaxamp.casting._interpreter._interpret import Ins, Outs, eval_jaxpr
from jaxamp.casting._rules import _primitives
from jaxamp.casting._rules._primitives import Kind, kind_of, open_jaxpr, subjaxprs
from jaxamp.casting._rules._rules import F32, FLOAT32_DTYPE, FLOAT32_FUNCTIONS, NONE, promote
from jaxamp.casting._rules._scopes import join


def eval_to_original(
    jaxpr: Jaxpr, consts: Iterable[Any], args: Iterable[Any], ctx: Context
) -> list[Any]:
    """Like `eval_jaxpr`, with outputs cast back to the jaxpr's output dtypes."""
    outs, _ = eval_jaxpr(jaxpr, consts, args, ctx, None)
    return [
        cast(ctx, x, v.aval.dtype) if is_float_dtype(x.dtype) and x.dtype != v.aval.dtype else x
        for x, v in zip(outs, jaxpr.outvars, strict=True)
    ]


def traced(body: Callable[..., Any], avals: Sequence[Any], ctx: Context) -> ClosedJaxpr:
    """``jax.make_jaxpr(body)`` with the trace's axis environment."""
    return jax.make_jaxpr(body, axis_env=list(ctx.position.axis_env) or None)(*avals)


def autocast_subjaxpr(sub: ClosedJaxpr | Jaxpr, ctx: Context) -> ClosedJaxpr | Jaxpr:
    """An autocast version of `sub` with the same input and output types."""

    def make() -> ClosedJaxpr | Jaxpr:
        jaxpr, consts = open_jaxpr(sub)
        if not isinstance(sub, ClosedJaxpr) and jaxpr.constvars:
            raise NotImplementedError("open inner jaxpr with constvars")
        sub_ctx = ctx.sub()
        new = traced(
            lambda *args: eval_to_original(jaxpr, consts, args, sub_ctx),
            [v.aval for v in jaxpr.invars],
            ctx,
        )
        if isinstance(sub, ClosedJaxpr):
            return new
        if new.consts:
            raise NotImplementedError("autocast introduced constants in an open inner jaxpr")
        return new.jaxpr

    return ctx.memoized(("sub", id(sub)), sub, make)


def _closed(inner: Any) -> ClosedJaxpr:
    return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


def eval_call(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    params = eqn.params
    inner = _closed(_primitives.body(eqn))
    if params.get("name") in FLOAT32_FUNCTIONS:
        # torch runs softmax / log_softmax / logsumexp in float32 and returns
        # float32: the whole function does, whatever its inputs.
        ups = [promote(np.dtype(d), FLOAT32_DTYPE) if is_float_dtype(d) else None for d in dtypes]
        args = [
            x if u is None or d == u else cast(ctx, x, u)
            for x, d, u in zip(invals, dtypes, ups, strict=True)
        ]
        marks = [F32 if u is not None else m for u, m in zip(ups, inmarks, strict=True)]
        why = "torch runs this function in float32, whatever its inputs"
        note(eqn, ctx, FLOAT32_DTYPE, why, ("float32", f"{params['name']} (FLOAT32_FUNCTIONS)"))
        return eval_jaxpr(inner.jaxpr, inner.consts, args, ctx, marks)
    if jax_compat.inlinable_call(params):
        # Activations keep their dtype across the boundary (jax.nn.relu, silu,
        # jnp.cross, jnp.tril are nested jits). Under ``fp8_health`` inlined: its
        # FP8 products then run in the caller's trace and are measured (the same
        # values: XLA inlines a nested call anyway).
        if kind_of(eqn.primitive.name) is Kind.JIT and not _fp8_health.collecting():
            hit = _eval_nested_jit(eqn, inner, invals, inmarks, ctx)
            if hit is not None:
                return hit
        return eval_jaxpr(inner.jaxpr, inner.consts, invals, ctx, inmarks)
    # A jit with shardings, donation or its own mesh keeps its signature:
    # inputs go back to their original dtypes and the inner jaxpr is replaced
    # by an autocast jaxpr of exactly the same types.
    new = autocast_subjaxpr(params["jaxpr"], ctx)
    args = to_original(invals, dtypes, eqn.invars, ctx)
    return bind(eqn, args, dict(params, jaxpr=new)), [NONE] * len(eqn.outvars)


def _marked_body(
    closed: ClosedJaxpr, inmarks: list[int], ctx: Context, values: list[np.ndarray | None]
) -> tuple[Any, list[int]]:
    """``(body, out_marks)``: `closed` as a function of its inputs under autocast;
    `out_marks` is filled in each time ``body`` is traced. `values`: what each
    input can hold, where known (``_constants.call_values``)."""
    out_marks: list[int] = []
    sub_ctx = ctx.sub()

    def body(*xs: Any) -> list[Any]:
        record(list(xs), values, sub_ctx.memo.known)
        outs, marks = eval_jaxpr(closed.jaxpr, closed.consts, xs, sub_ctx, inmarks)
        out_marks[:] = marks
        return outs

    return body, out_marks


def _inner_stacks(jaxpr: Jaxpr, ctx: Context) -> tuple[str, ...]:
    """The distinct name stacks of `jaxpr`'s equations, sub-jaxprs included."""

    def make() -> tuple[str, ...]:
        found: dict[str, None] = {}
        for eqn in jaxpr.eqns:
            here = jax_compat.name_stack(eqn)
            found[here] = None
            for _, sub in subjaxprs(eqn.params):
                for inner in _inner_stacks(open_jaxpr(sub)[0], ctx):
                    found[f"{here}/{inner}" if here and inner else here or inner] = None
        return tuple(found)

    return ctx.memoized(("stacks", id(jaxpr)), jaxpr, make)


def _eval_nested_jit(
    eqn: Any, closed: ClosedJaxpr, invals: list[Any], inmarks: list[int], ctx: Context
) -> Outs | None:
    """A nested ``jit`` re-issued as a ``jit`` of its autocast jaxpr, or None to inline.

    The autocast jaxpr takes and returns values in their autocast dtypes, so
    activations cross the boundary unchanged, as when inlined. It is built
    once per (jaxpr, input types, input marks, rules in force, axis
    environment) in a trace and the same object is bound at every call site:
    JAX then differentiates, partially evaluates and lowers it once (a
    ``jnp.tril`` in every layer of a model costs one trace, not one per layer).
    """
    if closed.effects:
        return None
    try:
        avals = [jax_compat.aval_of(x) for x in invals]
    except TypeError:
        return None
    if any(not hasattr(a, "shape") or not hasattr(a, "dtype") for a in avals):
        return None
    # The rules that the inner equations will see (module rules match on the
    # name stack): identical rules, identical program.
    scopes = tuple(
        (full, id(rules))
        for full, rules in (
            ctx.rules_at(join(ctx.position.stack, s)) for s in _inner_stacks(closed.jaxpr, ctx)
        )
    )
    values = call_values(eqn.invars, invals, ctx.memo.known)
    known = tuple(None if v is None else (v.dtype.str, v.tobytes()) for v in values)
    key = ("jit", id(closed), tuple(avals), tuple(inmarks), known, scopes)

    def make() -> tuple[ClosedJaxpr, list[int]] | None:
        body, out_marks = _marked_body(closed, inmarks, ctx, values)
        try:
            new = traced(body, avals, ctx)
        except Exception:  # e.g. an axis name bound outside: inline instead
            return None
        if new.consts or new.effects:
            return None
        return new, list(out_marks)

    hit = ctx.memoized(key, closed, make)
    if hit is None:
        return None
    new, out_marks = hit
    return bind(eqn, list(invals), dict(eqn.params, jaxpr=new)), list(out_marks)


def eval_remat(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    # Re-issued through the public jax.checkpoint so the rematerialised region
    # takes and returns activations in their autocast dtypes.
    params = eqn.params
    values = call_values(eqn.invars, invals, ctx.memo.known)
    body, out_marks = _marked_body(_closed(params["jaxpr"]), inmarks, ctx, values)
    remat = functools.partial(
        jax.checkpoint, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    if _fp8_health.collecting():
        return _measured_remat(remat, body, invals, ctx), out_marks
    return list(remat(body)(*invals)), out_marks


def _measured_remat(
    remat: Callable[..., Any], body: Callable[..., Any], invals: list[Any], ctx: Context
) -> list[Any]:
    """`body` on `invals` through `remat` under an ``fp8_health`` trace: its FP8
    products take their probes as extra inputs of the region and return their
    forward statistics as extra outputs (the rematerialised forward recomputes
    them; the backward statistics leave once, as the probes' cotangents)."""
    counted, found = _fp8_health.counting(body)
    if _fp8_health.probes_for(0) is None:  # counting: the remat's own trace counts
        outs = list(remat(counted)(*invals))
        _fp8_health.adopt(found[0], ())
        return outs
    # Measuring: the region's inputs need its products' count first.
    traced(counted, [jax_compat.aval_of(x) for x in invals], ctx)
    products = found[0]
    probes = _fp8_health.probes_for(len(products.names))
    if not probes:
        outs = list(remat(body)(*invals))
        _fp8_health.adopt(products, ())
        return outs

    def measured(*xs: Any) -> list[Any]:
        with _fp8_health.apart(xs[len(invals) :]) as sub:
            outs = body(*xs[: len(invals)])
        return [*outs, *sub.forward]

    res = list(remat(measured)(*invals, *probes))
    n = len(res) - len(probes)
    _fp8_health.adopt(products, (), res[n:])
    return res[:n]


def _custom_primal(
    eqn: Any, invals: list[Any], inmarks: list[int], ctx: Context
) -> tuple[Any, list[Any], list[int], list[int], list[Any]]:
    """A custom derivative's primal, run under autocast: ``(primal, xs, xmarks,
    out_marks, out_dtypes)``; the last two are filled in when ``primal`` runs."""
    params = eqn.params
    call = params["call_jaxpr"]
    nconst = params["num_consts"]
    consts, xs = invals[:nconst], invals[nconst:]
    cmarks, xmarks = inmarks[:nconst], inmarks[nconst:]
    out_marks: list[int] = []
    out_dtypes: list[Any] = []

    def primal(*ys: Any) -> list[Any]:
        outs, marks = eval_jaxpr(
            call.jaxpr, call.consts, [*consts, *ys], ctx.sub(), [*cmarks, *xmarks]
        )
        out_marks[:] = marks
        out_dtypes[:] = [o.dtype for o in outs]
        return outs

    return primal, xs, xmarks, out_marks, out_dtypes


def eval_custom_jvp(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    # A new jax.custom_jvp whose primal and jvp rule are both the autocast
    # evaluations of the user's: the primal has the same dtypes whether or not
    # it is differentiated (PyTorch's custom_fwd / custom_bwd).
    params = eqn.params
    primal, xs, xmarks, out_marks, out_dtypes = _custom_primal(eqn, invals, inmarks, ctx)
    fn = jax.custom_jvp(primal)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        rule, rconsts, out_zeros = jax_compat.custom_jvp_rule(params, len(primals))
        sub = ctx.sub(saturate=False)
        outs, _ = eval_jaxpr(
            open_jaxpr(rule)[0],
            rconsts,
            [*primals, *tangents],
            sub,
            [*xmarks, *xmarks],
        )
        if not out_dtypes:
            primal(*primals)  # the primal's dtypes decide the rule's output dtypes
        p_out = cast_all(outs[: len(out_zeros)], out_dtypes, sub)
        nz = iter(outs[len(out_zeros) :])
        t_out = [
            jnp.zeros(p.shape, p.dtype) if z else next(nz)
            for p, z in zip(p_out, out_zeros, strict=True)
        ]
        return p_out, cast_all(t_out, out_dtypes, sub)

    fn.defjvp(jvp)
    outs = fn(*xs)
    return list(outs), list(out_marks) or [NONE] * len(outs)


def eval_custom_vjp(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    params = eqn.params
    in_avals = params["call_jaxpr"].in_avals[params["num_consts"] :]
    primal, xs, xmarks, out_marks, out_dtypes = _custom_primal(eqn, invals, inmarks, ctx)
    fn = jax.custom_vjp(primal)
    res_types: list[Any] = []  # the original fwd's residual types (static)

    def fwd(*ys: Any) -> tuple[list[Any], tuple[Any, ...]]:
        nonzeros = [is_float_dtype(a.dtype) for a in in_avals]
        fwd_jaxpr, fconsts, out_trees = jax_compat.custom_vjp_fwd(params, nonzeros)
        sub = ctx.sub()
        jaxpr, _ = open_jaxpr(fwd_jaxpr)
        outs, _ = eval_jaxpr(jaxpr, fconsts, list(ys), sub, xmarks)
        out_tree, res_tree, forwards = out_trees()
        nres = len(outs) - out_tree.num_leaves
        pruned, p_out = outs[:nres], outs[nres:]
        if not out_dtypes:
            primal(*ys)
        p_out = cast_all(p_out, out_dtypes, sub)
        it = iter(pruned)
        res = [ys[f] if f is not None else next(it) for f in forwards]
        # Residuals as the user's fwd produced them under autocast; bwd is
        # traced at the residual types of the original fwd, then autocast.
        orig_res_it = iter([v.aval for v in jaxpr.outvars[:nres]])
        res_types[:] = [in_avals[f] if f is not None else next(orig_res_it) for f in forwards]
        return p_out, tuple(res)

    def bwd(res: tuple[Any, ...], cts: Sequence[Any]) -> tuple[Any, ...]:
        ct_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in params["call_jaxpr"].out_avals]
        rule = jax_compat.custom_vjp_bwd(params)
        closed = jax.make_jaxpr(rule)(
            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res_types], *ct_avals
        )
        sub = ctx.sub()
        outs, _ = eval_jaxpr(closed.jaxpr, closed.consts, [*res, *cts], sub, None)
        return tuple(cast_all(outs, [y.dtype for y in xs], sub))

    fn.defvjp(fwd, bwd)
    outs = fn(*xs)
    return list(outs), list(out_marks) or [NONE] * len(outs)


def eval_shard_map(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    # A shard_map body can only be traced inside the manual-axes context
    # that jax.shard_map sets up: re-issue it with the equation's own mesh
    # and specs, in the original signature.
    params = eqn.params
    sub_ctx = ctx.sub(axis_env=ctx.position.axis_env + tuple(params["mesh"].shape.items()))
    body = params["jaxpr"]
    outs = jax_compat.shard_map_call(
        lambda *xs: eval_to_original(body, (), xs, sub_ctx),
        to_original(ins.vals, ins.dtypes, eqn.invars, ctx),
        params,
    )
    return outs, [NONE] * len(eqn.outvars)
