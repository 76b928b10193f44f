"""The evaluator behind ``find_overflow``: a jaxpr run eagerly, one equation at a time.

Each equation is bound on concrete arrays and its floating outputs are checked;
the first equation whose lower-precision (float16 / bfloat16) output holds an
inf or NaN while all its floating inputs were finite is the finding, and the
evaluation stops there. A float32 (or wider) equation that makes a non-finite
value from finite inputs is remembered (the first one) and the evaluation goes
on, in case a lower-precision one comes later.

Higher-order primitives are entered, so that the op inside is found, not the
call around it: the rules live in ``HANDLERS`` (kind of primitive -> handler;
the kinds and their names by JAX version are ``_primitives``', as autocast's).
Every other primitive is bound as a whole; one that holds a jaxpr (a
higher-order primitive with no handler) is marked ``opaque`` when it is the
finding, so that the report does not blame a float32 op for what a float16 op
inside it did.

A ``shard_map`` body runs on per-device blocks, with collectives between them,
so it cannot be evaluated on the global arrays. Inside one, every value is kept
as its per-device blocks stacked along a new leading axis that is sharded over
the mesh axes the value varies over (``_overflow_shard``), and each equation
runs in its own ``jax.shard_map`` over the same mesh: the collectives see the
same devices and blocks as in the program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float
from jaxamp.casting._find_overflow._overflow_shard import Shard
from jaxamp.casting._rules._primitives import BODY, Kind, body, has_subjaxprs, kind_of, open_jaxpr

__all__ = ["HANDLERS", "Finding", "Frame", "find", "nonfinite_kind"]

Stack = tuple[tuple[str, str], ...]  # (kind, name) pairs, outermost first


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where an equation runs: the name stack around it, the loop iterations and,
    inside a ``shard_map`` body, how its values are laid out."""

    stack: Stack = ()
    iterations: tuple[int, ...] = ()
    shard: Shard | None = None

    def enter(self, eqn: Any) -> Frame:
        return dataclasses.replace(self, stack=self.stack + jax_compat.name_stack_items(eqn))

    def iteration(self, i: int) -> Frame:
        return dataclasses.replace(self, iterations=(*self.iterations, i))

    def bind(self, eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list:
        """`eqn` bound on `invals` (with other `params` if given), as it runs here."""
        key = ("bind", eqn) if params is None else None
        params = eqn.params if params is None else params

        def fn(*xs: Any) -> list[Any]:
            # Inside jax.shard_map's trace, where the equation's manual mesh is current.
            with jax_compat.eqn_context(eqn):
                out = jax_compat.bind(eqn.primitive, list(xs), params)
            return jax_compat.outputs_as_list(eqn.primitive, out)

        in_avals = [v.aval for v in eqn.invars]
        return self.local(fn, invals, in_avals, [v.aval for v in eqn.outvars], key)

    def local(
        self, fn: Callable, vals: Sequence, in_avals: Sequence, out_avals: Sequence, key: Any = None
    ) -> list[Any]:
        """``fn(*vals)``, where `fn` works on the values as the program sees them
        (per-device blocks in a ``shard_map`` body); the avals give their layout.
        `key`, where given, names `fn` for the compilation cache (``Shard._map``)."""
        if self.shard is None:
            return list(fn(*vals))
        return self.shard.call(fn, vals, in_avals, out_avals, key)

    def stacked(self, aval: Any) -> bool:
        """Whether a value of type `aval` is held as stacked per-device blocks."""
        return self.shard is not None and bool(self.shard.axes_of(aval))

    def uniform(self, x: Any) -> Any:
        """The one value `x` holds on every device, or None if devices differ."""
        a = np.asarray(x)
        if self.shard is None or a.ndim == 0:
            return a
        return a.flat[0] if (a == a.flat[0]).all() else None


@dataclasses.dataclass(frozen=True)
class Finding:
    """The equation that made a non-finite value from finite inputs, and its values."""

    eqn: Any
    invals: tuple[Any, ...]
    frame: Frame
    dtype: np.dtype  # of the first non-finite output
    kind: str  # "inf" or "nan"
    # Primitives that read the non-finite output (followed out of call bodies):
    # for a cast, the op it feeds, whose dtype rule decides the cast.
    consumers: tuple[str, ...] = ()
    # Positions of the non-finite output among the current jaxpr's outputs, while
    # the finding propagates out of call bodies.
    escapes: tuple[int, ...] = ()
    # A higher-order primitive bound as a whole: the overflow is somewhere inside.
    opaque: bool = False

    @property
    def low_precision(self) -> bool:
        return self.dtype.itemsize < 4


class _Found(Exception):
    def __init__(self, finding: Finding) -> None:
        super().__init__(finding)
        self.finding = finding


@dataclasses.dataclass
class _State:
    wide: Finding | None = None  # the first float32 (or wider) finding
    cache: dict = dataclasses.field(default_factory=dict)  # see Shard._map


Handler = Callable[[Any, list[Any], Frame, _State], list[Any]]

# Kinds whose body's outputs are the equation's outputs, one to one: a finding's
# consumers are followed out of them.
_CALLS = frozenset(BODY)


def find(closed: ClosedJaxpr, args: Sequence[Any], cache: dict | None = None) -> Finding | None:
    """Evaluates `closed` on `args`; the first lower-precision finding, else the
    first float32 one, else None. `cache` (an empty dict, then the same one)
    keeps what was compiled to run ``shard_map`` bodies for another run of
    `closed`."""
    state = _State(cache={} if cache is None else cache)
    try:
        _eval(closed.jaxpr, closed.consts, list(args), Frame(), state)
    except _Found as found:
        return found.finding
    return state.wide


def nonfinite_kind(x: Any) -> str | None:
    """``"inf"``, ``"nan"`` (a NaN and no inf) or None for a finite floating array.

    Read on the host: a jitted check would compile once per shape and dtype,
    which costs more than the copy for a debugging run.
    """
    a = np.asarray(x)
    if np.isinf(a).any():
        return "inf"
    return "nan" if np.isnan(a).any() else None


def _eval_sub(sub: ClosedJaxpr | Jaxpr, args: Sequence[Any], frame: Frame, state: _State) -> list:
    jaxpr, consts = open_jaxpr(sub)
    return _eval(jaxpr, consts, list(args), frame, state)


def _eval(
    jaxpr: Jaxpr, consts: Sequence[Any], args: list[Any], frame: Frame, state: _State
) -> list[Any]:
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x

    def read(v: Any) -> Any:
        if isinstance(v, Literal):
            return frame.shard.literal(v) if frame.shard is not None else v.val
        return env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = frame.enter(eqn)
        handler = HANDLERS.get(kind_of(eqn.primitive.name))
        try:
            if handler is None:
                outs = bind_checked(eqn, invals, inner, state)
            elif frame.shard is None:
                with jax_compat.eqn_context(eqn):
                    outs = handler(eqn, invals, inner, state)
            else:  # each equation inside restores its own context in the body's trace
                outs = handler(eqn, invals, inner, state)
        except _Found as found:
            raise _Found(_consumed(found.finding, jaxpr, eqn, handler is not None)) from None
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _consumed(finding: Finding, jaxpr: Jaxpr, eqn: Any, entered: bool) -> Finding:
    """`finding` with the readers of its output in `jaxpr` (`eqn` made that output,
    or is the call whose body made it) and where that output leaves `jaxpr`."""
    if not entered:
        outs = list(eqn.outvars)
    elif kind_of(eqn.primitive.name) in _CALLS:
        outs = [eqn.outvars[i] for i in finding.escapes]
    else:
        return dataclasses.replace(finding, escapes=())
    ids = {id(v) for v in outs}
    readers = tuple(e.primitive.name for e in jaxpr.eqns if any(id(v) in ids for v in e.invars))
    escapes = tuple(i for i, v in enumerate(jaxpr.outvars) if id(v) in ids)
    return dataclasses.replace(finding, consumers=finding.consumers + readers, escapes=escapes)


def bind_checked(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    """`eqn` bound as a whole, its outputs checked."""
    outs = frame.bind(eqn, invals)
    _check(eqn, invals, outs, frame, state)
    return outs


def _check(eqn: Any, invals: list[Any], outs: list[Any], frame: Frame, state: _State) -> None:
    """Records `eqn` if it made a non-finite floating output from finite inputs."""
    for x in outs:
        if not is_float(x):
            continue
        kind = nonfinite_kind(x)
        if kind is None:
            continue
        if any(is_float(v) and nonfinite_kind(v) is not None for v in invals):
            return  # it only passed on what it was given
        opaque = has_subjaxprs(eqn.params)
        finding = Finding(eqn, tuple(invals), frame, np.dtype(x.dtype), kind, opaque=opaque)
        if finding.low_precision:
            raise _Found(finding)
        if state.wide is None:
            state.wide = finding
        return


# --------------------------------------------------------------------------
# Handlers: enter the sub-jaxpr, so that the op inside is reported.
# --------------------------------------------------------------------------


def _call(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    return _eval_sub(body(eqn), invals, frame, state)


def _scan(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    params = eqn.params
    (nconsts, ncarry), length = jax_compat.scan_counts(params), params["length"]
    body, _ = open_jaxpr(params["jaxpr"])
    consts = invals[:nconsts]
    carry = invals[nconsts : nconsts + ncarry]
    xs = invals[nconsts + ncarry :]
    x_avals = [v.aval for v in eqn.invars[nconsts + ncarry :]]
    y_avals = [v.aval for v in eqn.outvars[ncarry:]]
    steps: dict[int, list[Any]] = {}
    order = range(length - 1, -1, -1) if params["reverse"] else range(length)
    # Stacked per-device blocks (in a shard_map body) hold the scanned axis second.
    x_axes = [1 if frame.stacked(a) else 0 for a in x_avals]
    for i in order:
        x_i = [
            lax.index_in_dim(x, i, axis, keepdims=False) for x, axis in zip(xs, x_axes, strict=True)
        ]
        outs = _eval_sub(params["jaxpr"], [*consts, *carry, *x_i], frame.iteration(i), state)
        carry, steps[i] = outs[:ncarry], outs[ncarry:]
    if not length:
        ys = frame.local(lambda: [jnp.zeros(a.shape, a.dtype) for a in y_avals], [], [], y_avals)
    else:
        cols = zip(*(steps[i] for i in range(length)), strict=True)
        ys = [
            jnp.stack(col, axis=1 if frame.stacked(y) else 0)
            for col, y in zip(cols, y_avals, strict=True)
        ]
    return [*carry, *ys]


def _while(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    params = eqn.params
    ncond, nbody = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = invals[:ncond], invals[ncond : ncond + nbody]
    carry = invals[ncond + nbody :]
    i = 0
    while True:
        (pred,) = _eval_sub(params["cond_jaxpr"], [*cond_consts, *carry], frame.iteration(i), state)
        go = frame.uniform(pred)
        if go is None:
            # Devices leave the loop at different iterations: the rest runs as a whole.
            return bind_checked(eqn, [*cond_consts, *body_consts, *carry], frame, state)
        if not bool(go):
            return carry
        carry = _eval_sub(params["body_jaxpr"], [*body_consts, *carry], frame.iteration(i), state)
        i += 1


def _cond(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    branches = eqn.params["branches"]
    index = frame.uniform(invals[0])
    if index is None:  # devices take different branches
        return bind_checked(eqn, invals, frame, state)
    index = min(max(int(index), 0), len(branches) - 1)
    return _eval_sub(branches[index], invals[1:], frame, state)


def _shard_map(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    shard = Shard.of(eqn.params, state.cache) if frame.shard is None else None
    if shard is None:  # a nested shard_map, or a JAX whose shard_map is not public
        return bind_checked(eqn, invals, frame, state)
    body = eqn.params["jaxpr"]
    jaxpr, _ = open_jaxpr(body)
    blocks = shard.enter(invals, eqn.params["in_specs"], [v.aval for v in jaxpr.invars])
    outs = _eval_sub(body, blocks, dataclasses.replace(frame, shard=shard), state)
    return shard.leave(outs, [v.aval for v in jaxpr.outvars], eqn.params["out_specs"])


#: Kind of higher-order primitive -> handler(eqn, invals, frame, state) -> outputs.
HANDLERS: dict[Kind, Handler] = {
    **dict.fromkeys(BODY, _call),
    Kind.SCAN: _scan,
    Kind.WHILE: _while,
    Kind.COND: _cond,
    Kind.SHARD_MAP: _shard_map,
}
