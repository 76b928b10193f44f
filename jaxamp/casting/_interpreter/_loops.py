"""Handlers for ``scan``, ``while`` and ``cond``: activations stay in the
compute dtype across loop iterations and branches.

Loop-invariant inputs (constants, scanned ``xs``, branch operands) enter in
the form they have. A scan carry must leave each iteration in the form it
entered, so its form is a fixed point, and it may differ from the unrolled
loop's only towards more precision: an activation carry stays one if the body
returns it as one; a float32 carry that the body returns as an activation and
reads only through casts down to the compute dtype (an RNN's hidden state)
enters cast down, which changes nothing the body computes; any other carry
runs in its original dtype. A ``while`` loop's carry enters in its original
dtype, marked float32: its trip count depends on it (``t += 1e-4`` never
reaches 1 in float16). Scanned outputs leave in the form the body gives them,
branch outputs too when all branches agree; a carry the body returns marked
float32 leaves marked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._fp8 import _fp8_health
from jaxamp.casting._interpreter._calls import traced
from jaxamp.casting._interpreter._casts import SATURATING_CAST_OPS, bind, cast
from jaxamp.casting._interpreter._context import Context
from jaxamp.casting._interpreter._interpret import Ins, Outs, eval_jaxpr
from jaxamp.casting._rules._primitives import open_jaxpr
from jaxamp.casting._rules._rules import ACT, CONST, NONE, PIN

_Form = tuple[Any, int]  # (dtype, mark) of a value entering or leaving a region
_FREE = "free"  # an output form: whatever the region gives


@dataclasses.dataclass(frozen=True)
class _Region:
    jaxpr: ClosedJaxpr  # the autocast region
    got: list[_Form]  # each output's form before the exit cast
    cast_only: list[bool]  # each input: is it only ever read cast to the compute dtype?
    # The FP8 products an ``fp8_health`` trace counted in it (``_fp8_health.apart``).
    products: Any = None


def _is_cast_down(eqn: Any, dtype: np.dtype) -> bool:
    name = eqn.primitive.name
    if name == "convert_element_type":
        return eqn.params["new_dtype"] == dtype
    if name != "custom_jvp_call" or eqn.outvars[0].aval.dtype != dtype:
        return False
    # The saturating cast (_casts.cast_jit), known by its body's ops.
    inner = eqn.params["call_jaxpr"]
    return [e.primitive.name for e in open_jaxpr(inner)[0].eqns] == SATURATING_CAST_OPS


def _region_body(
    closed: ClosedJaxpr,
    in_forms: Sequence[_Form | None],
    out_forms: Sequence[_Form | str | None],
    ctx: Context,
    got: list[_Form],
) -> Callable[..., list[Any]]:
    """`closed` under autocast as a function of its inputs in their entry forms,
    returning its outputs in their exit forms; `got` is filled in with the forms
    before the exit casts each time it runs."""
    jaxpr = closed.jaxpr
    marks = [NONE if f is None else f[1] for f in in_forms]
    sub_ctx = ctx.sub(in_region=True)

    def body(*xs: Any) -> list[Any]:
        outs, out_marks = eval_jaxpr(jaxpr, closed.consts, xs, sub_ctx, marks)
        got[:] = [(o.dtype, m) for o, m in zip(outs, out_marks, strict=True)]
        final = []
        for o, f, v in zip(outs, out_forms, jaxpr.outvars, strict=True):
            want = o.dtype if f == _FREE else v.aval.dtype if f is None else f[0]
            if o.dtype != want and is_float_dtype(o.dtype) and is_float_dtype(want):
                o = cast(sub_ctx, o, want)
            final.append(o)
        return final

    return body


def _trace_region(
    closed: ClosedJaxpr,
    in_forms: Sequence[_Form | None],
    out_forms: Sequence[_Form | str | None],
    ctx: Context,
    count: bool = False,
) -> _Region:
    """Autocasts `closed` (a loop body, a branch) for given entry and exit forms.

    An input whose form is None enters in its original dtype, unmarked. An
    output whose form is None leaves in its original dtype, ``_FREE`` as the
    region gives it, and a form in that form's dtype. `count`: under
    ``fp8_health``, the region counts its FP8 products (a scan hands them out).
    """
    count = count and _fp8_health.collecting()

    def make() -> _Region:
        jaxpr = closed.jaxpr
        avals = [
            v.aval if f is None else v.aval.update(dtype=f[0], weak_type=False)
            for v, f in zip(jaxpr.invars, in_forms, strict=True)
        ]
        got: list[_Form] = []
        body = _region_body(closed, in_forms, out_forms, ctx, got)
        counted, products = _fp8_health.counting(body)
        region = traced(counted if count else body, avals, ctx)
        # Which inputs the autocast region reads only through a cast down to
        # the compute dtype (the casts are inlined).
        cast_only = [True] * len(region.jaxpr.invars)
        index = {v: k for k, v in enumerate(region.jaxpr.invars)}
        for v in region.jaxpr.outvars:
            if not isinstance(v, Literal) and v in index:
                cast_only[index[v]] = False
        for e in region.jaxpr.eqns:
            down = _is_cast_down(e, ctx.config.dtype)
            for v in e.invars:
                if not down and not isinstance(v, Literal) and v in index:
                    cast_only[index[v]] = False
        return _Region(region, list(got), cast_only, products[0] if products else None)

    key = ("region", id(closed), ctx.position.stack, tuple(in_forms), tuple(out_forms), count)
    return ctx.memoized(key, closed, make)


def _entry(
    invals: list[Any],
    inmarks: list[int],
    dtypes: list[Any],
    orig: list[Any],
    forms: list[Any],
    ctx: Context,
) -> list[Any]:
    args = []
    for x, m, d, o, f in zip(invals, inmarks, dtypes, orig, forms, strict=True):
        want = o if f is None else f[0]
        differs = want is not None and d != want
        args.append(cast(ctx, x, want, const=m == CONST) if differs else x)
    return args


def _forms(eqn: Any, inmarks: list[int], dtypes: list[Any]) -> tuple[list[Any], list[Any]]:
    orig = [np.dtype(v.aval.dtype) if is_float_dtype(v.aval.dtype) else None for v in eqn.invars]
    forms: list[_Form | None] = [
        (dtypes[i], m) if m != NONE and is_float_dtype(dtypes[i]) else None
        for i, m in enumerate(inmarks)
    ]
    return orig, forms


def eval_cond(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    params = eqn.params
    orig, forms = _forms(eqn, inmarks, dtypes)
    branches = params["branches"]
    ops = forms[1:]
    nout = len(branches[0].out_avals)
    free = [_trace_region(b, ops, [_FREE] * nout, ctx) for b in branches]
    decided: list[_Form | None] = []
    for j in range(nout):
        seen = {r.got[j] for r in free}
        one = next(iter(seen))
        decided.append(one if len(seen) == 1 and one[1] != NONE else None)
    avals = branches[0].out_avals
    out_dtypes = [a.dtype if d is None else d[0] for a, d in zip(avals, decided, strict=True)]
    new = tuple(
        r.jaxpr if all(d == g[0] for d, g in zip(out_dtypes, r.got, strict=True))
        else _trace_region(b, ops, decided, ctx).jaxpr
        for b, r in zip(branches, free, strict=True)
    )  # fmt: skip
    marks = [NONE if d is None else d[1] for d in decided]
    args = _entry(invals, inmarks, dtypes, orig, forms, ctx)
    return bind(eqn, args, dict(params, branches=new)), marks


def eval_while(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    params = eqn.params
    orig, forms = _forms(eqn, inmarks, dtypes)
    first = params["cond_nconsts"]  # body inputs: the body consts and the carry
    carry0 = first + params["body_nconsts"]
    carry = range(carry0, len(invals))
    # The carry decides the trip count: it enters in its dtype, marked float32,
    # so `t + dt` with an activation `dt` runs in float32 (in float16 it would
    # stall at 0.25 for dt = 1e-4 and the loop would never end), and leaves
    # in its original dtype.
    for i in carry:
        pinned = orig[i] is not None and orig[i].itemsize >= 4
        forms[i] = (orig[i], PIN) if pinned else None
    exits = [forms[i] for i in carry]
    region = _trace_region(params["body_jaxpr"], forms[first:], exits, ctx)
    cond_in = forms[: params["cond_nconsts"]] + forms[carry0:]
    cond = _trace_region(params["cond_jaxpr"], cond_in, [None], ctx)
    new_params = dict(params, body_jaxpr=region.jaxpr, cond_jaxpr=cond.jaxpr)
    got = zip(carry, region.got, strict=True)
    marks = [PIN if g == (orig[i], PIN) else NONE for i, g in got]
    return bind(eqn, _entry(invals, inmarks, dtypes, orig, forms, ctx), new_params), marks


def eval_scan(eqn: Any, ins: Ins, ctx: Context) -> Outs:
    invals, inmarks, dtypes = ins
    params = eqn.params
    orig, forms = _forms(eqn, inmarks, dtypes)
    body = params["jaxpr"]  # body inputs: consts, carry, xs
    carry0, ncarry = jax_compat.scan_counts(params)
    carry = range(carry0, carry0 + ncarry)
    for i in carry:  # a carry changes each iteration: no longer a constant
        forms[i] = None if forms[i] is not None and forms[i][1] == CONST else forms[i]
    nys = len(body.out_avals) - ncarry
    # Each carry changes form at most twice (promoted, then demoted for good),
    # so this ends after at most 2 * ncarry + 1 traces of the body.
    demoted: set[int] = set()
    while True:
        exits = [forms[i] for i in carry] + [_FREE] * nys
        region = _trace_region(body, forms, exits, ctx, count=True)
        changed = False
        for j, i in enumerate(carry):
            if forms[i] is not None and region.got[j] != forms[i]:
                forms[i], changed = None, True
                demoted.add(i)
            elif (
                forms[i] is None
                and i not in demoted
                and region.got[j] == (ctx.config.dtype, ACT)
                and region.cast_only[i]
                and orig[i] is not None
                and orig[i].itemsize > ctx.config.dtype.itemsize
            ):
                forms[i], changed = region.got[j], True
        if not changed:
            break
    marks = [
        f[1] if f is not None else PIN if g == (orig[i], PIN) else NONE
        for i, f, g in zip(carry, (forms[i] for i in carry), region.got, strict=False)
    ] + [m for _, m in region.got[ncarry:]]
    entry = _entry(invals, inmarks, dtypes, orig, forms, ctx)
    products = region.products
    probes = None if products is None else _fp8_health.probes_for(len(products.names))
    if not probes:  # no fp8_health, no FP8 product in the body, or counting them
        outs, forward = bind(eqn, entry, dict(params, jaxpr=region.jaxpr)), []
    else:
        body = _region_body(params["jaxpr"], forms, exits, ctx, [])
        outs, forward = _measured_scan(params, entry, body, probes)
    if products is not None:
        _fp8_health.adopt(products, (params["length"],), forward)
    return outs, marks


def _measured_scan(
    params: dict[str, Any], entry: list[Any], body: Callable[..., list[Any]], probes: list[Any]
) -> tuple[list[Any], list[Any]]:
    """The scan of `params` on `entry` with `body` (its autocast body) under an
    ``fp8_health`` trace measuring its FP8 products: ``(outputs, forward
    statistics of each product, stacked per iteration)``.

    Each iteration's products take that iteration's slice of `probes`, scanned in
    beside ``xs``, and return their forward statistics beside ``ys``: the backward
    statistics leave as the probes' cotangents, one per iteration. Re-issued
    through the public ``lax.scan``, which takes the extra inputs and outputs
    whatever the scan primitive's parameters are in this JAX."""
    carry0, ncarry = jax_compat.scan_counts(params)
    consts, init, xs = entry[:carry0], entry[carry0 : carry0 + ncarry], entry[carry0 + ncarry :]

    def step(carry: list[Any], x: tuple[list[Any], list[Any]]) -> tuple[list[Any], Any]:
        with _fp8_health.apart(x[1]) as sub:
            outs = body(*consts, *carry, *x[0])
        return outs[:ncarry], (outs[ncarry:], sub.forward)

    carry, (ys, forward) = lax.scan(
        step, init, (xs, probes), params["length"], params["reverse"], params["unroll"]
    )
    return [*carry, *ys], forward
