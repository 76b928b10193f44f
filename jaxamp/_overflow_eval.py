"""The evaluator behind ``find_overflow``: a jaxpr run eagerly, one equation at a time.

Each equation is bound on concrete arrays and its floating outputs are checked;
the first equation whose lower-precision (float16 / bfloat16) output holds an
inf or NaN while all its floating inputs were finite is the finding, and the
evaluation stops there. A float32 (or wider) equation that makes a non-finite
value from finite inputs is remembered (the first one) and the evaluation goes
on, in case a lower-precision one comes later.

Higher-order primitives are entered, so that the op inside is found, not the
call around it: the rules live in ``HANDLERS`` (primitive name -> handler), as
``jax.experimental.jet`` keeps its rules in a dict. Every other primitive is
bound as a whole. Every access to JAX internals goes through ``_jax_compat``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxamp import _jax_compat

__all__ = ["HANDLERS", "Finding", "Frame", "find", "is_float", "nonfinite_kind"]

Stack = tuple[tuple[str, str], ...]  # (kind, name) pairs, outermost first


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where an equation runs: the name stack around it and the loop iterations."""

    stack: Stack = ()
    iterations: tuple[int, ...] = ()

    def enter(self, eqn: Any) -> Frame:
        return Frame(self.stack + _jax_compat.name_stack_items(eqn), self.iterations)

    def iteration(self, i: int) -> Frame:
        return Frame(self.stack, (*self.iterations, i))


@dataclasses.dataclass(frozen=True)
class Finding:
    """The equation that made a non-finite value from finite inputs, and its values."""

    eqn: Any
    invals: tuple[Any, ...]
    frame: Frame
    dtype: np.dtype  # of the first non-finite output
    kind: str  # "inf" or "nan"

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


Handler = Callable[[Any, list[Any], Frame, _State], list[Any]]

#: Higher-order primitive name -> handler(eqn, invals, frame, state) -> outputs.
HANDLERS: dict[str, Handler] = {}


def find(closed: ClosedJaxpr, args: Sequence[Any]) -> Finding | None:
    """Evaluates `closed` on `args`; the first lower-precision finding, else the
    first float32 one, else None."""
    state = _State()
    try:
        _eval(closed.jaxpr, closed.consts, list(args), Frame(), state)
    except _Found as found:
        return found.finding
    return state.wide


def is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.result_type(x)
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # pragma: no cover - an extended dtype numpy cannot read
        return False


def nonfinite_kind(x: Any) -> str | None:
    """``"inf"``, ``"nan"`` (a NaN and no inf) or None for a finite floating array.

    Read on the host: a jitted check would compile once per shape and dtype,
    which costs more than the copy for a debugging run.
    """
    a = np.asarray(x)
    if np.isinf(a).any():
        return "inf"
    return "nan" if np.isnan(a).any() else None


def _open(sub: ClosedJaxpr | Jaxpr) -> tuple[Jaxpr, Sequence[Any]]:
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def _eval_sub(sub: ClosedJaxpr | Jaxpr, args: Sequence[Any], frame: Frame, state: _State) -> list:
    jaxpr, consts = _open(sub)
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
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = frame.enter(eqn)
        handler = HANDLERS.get(eqn.primitive.name)
        with _jax_compat.eqn_context(eqn):
            if handler is not None:
                outs = handler(eqn, invals, inner, state)
            else:
                out = _jax_compat.bind(eqn.primitive, invals, eqn.params)
                outs = _jax_compat.outputs_as_list(eqn.primitive, out)
                _check(eqn, invals, outs, inner, state)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


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
        finding = Finding(eqn, tuple(invals), frame, np.dtype(x.dtype), kind)
        if finding.low_precision:
            raise _Found(finding)
        if state.wide is None:
            state.wide = finding
        return


# --------------------------------------------------------------------------
# Handlers: enter the sub-jaxpr, so that the op inside is reported.
# --------------------------------------------------------------------------


def register(*names: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = fn
        return fn

    return deco


def _call(param: str) -> Handler:
    def handler(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
        return _eval_sub(eqn.params[param], invals, frame, state)

    return handler


# jit (``pjit`` before JAX 0.7), remat (``checkpoint`` / ``remat2`` by version).
register("pjit", "jit", "checkpoint", "remat", "remat2")(_call("jaxpr"))
register("closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")(_call("call_jaxpr"))
# JAX 0.5 writes a custom_vjp function as custom_vjp_call_jaxpr.
register("custom_vjp_call_jaxpr")(_call("fun_jaxpr"))


@register("scan")
def _scan(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    params = eqn.params
    nconsts, ncarry, length = params["num_consts"], params["num_carry"], params["length"]
    consts = invals[:nconsts]
    carry = invals[nconsts : nconsts + ncarry]
    xs = invals[nconsts + ncarry :]
    steps: dict[int, list[Any]] = {}
    order = range(length - 1, -1, -1) if params["reverse"] else range(length)
    for i in order:
        outs = _eval_sub(
            params["jaxpr"], [*consts, *carry, *(x[i] for x in xs)], frame.iteration(i), state
        )
        carry, steps[i] = outs[:ncarry], outs[ncarry:]
    if not length:
        ys = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[ncarry:]]
    else:
        ys = [jnp.stack(col) for col in zip(*(steps[i] for i in range(length)), strict=True)]
    return [*carry, *ys]


@register("while")
def _while(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    params = eqn.params
    ncond, nbody = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = invals[:ncond], invals[ncond : ncond + nbody]
    carry = invals[ncond + nbody :]
    i = 0
    while True:
        (pred,) = _eval_sub(params["cond_jaxpr"], [*cond_consts, *carry], frame.iteration(i), state)
        if not bool(pred):
            return carry
        carry = _eval_sub(params["body_jaxpr"], [*body_consts, *carry], frame.iteration(i), state)
        i += 1


@register("cond")
def _cond(eqn: Any, invals: list[Any], frame: Frame, state: _State) -> list[Any]:
    branches = eqn.params["branches"]
    index = min(max(int(invals[0]), 0), len(branches) - 1)
    return _eval_sub(branches[index], invals[1:], frame, state)
