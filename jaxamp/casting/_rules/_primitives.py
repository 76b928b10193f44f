"""The higher-order primitives jaxamp enters, by kind: one table of their names.

JAX has renamed several across the supported versions (``pjit`` became ``jit``;
remat is ``remat``, ``remat2`` or ``checkpoint``; JAX 0.5 writes a
``jax.custom_vjp`` function as ``custom_vjp_call_jaxpr``). Both jaxpr evaluators,
autocast's interpreter and ``find_overflow``'s, key their handlers by the
[`Kind`][jaxamp.casting._rules._primitives.Kind] this table gives a name, so they cannot
disagree on which names a kind has.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr


class Kind(enum.Enum):
    """What a higher-order primitive does with the jaxpr it holds."""

    JIT = "jit"  # a nested jax.jit: its body is `params["jaxpr"]`
    CALL = "call"  # closed_call / core_call / call: `params["call_jaxpr"]`
    REMAT = "remat"  # jax.checkpoint: `params["jaxpr"]`
    CUSTOM_JVP = "custom_jvp"  # jax.custom_jvp: the primal is `params["call_jaxpr"]`
    CUSTOM_VJP = "custom_vjp"  # jax.custom_vjp (JAX >= 0.6): `params["call_jaxpr"]`
    CUSTOM_VJP_JAXPR = "custom_vjp_jaxpr"  # jax.custom_vjp on JAX 0.5: `params["fun_jaxpr"]`
    SCAN = "scan"
    WHILE = "while"
    COND = "cond"
    SHARD_MAP = "shard_map"


#: Every name each kind has had in the supported JAX versions.
NAMES: Mapping[Kind, tuple[str, ...]] = {
    Kind.JIT: ("jit", "pjit"),
    Kind.CALL: ("closed_call", "core_call", "call"),
    Kind.REMAT: ("remat", "remat2", "checkpoint"),
    Kind.CUSTOM_JVP: ("custom_jvp_call",),
    Kind.CUSTOM_VJP: ("custom_vjp_call",),
    Kind.CUSTOM_VJP_JAXPR: ("custom_vjp_call_jaxpr",),
    Kind.SCAN: ("scan",),
    Kind.WHILE: ("while",),
    Kind.COND: ("cond",),
    Kind.SHARD_MAP: ("shard_map",),
}

_KIND_OF: Mapping[str, Kind] = {name: kind for kind, names in NAMES.items() for name in names}

#: The parameter that holds the body of a call-like kind (its outputs are the call's).
BODY: Mapping[Kind, str] = {
    Kind.JIT: "jaxpr",
    Kind.CALL: "call_jaxpr",
    Kind.REMAT: "jaxpr",
    Kind.CUSTOM_JVP: "call_jaxpr",
    Kind.CUSTOM_VJP: "call_jaxpr",
    Kind.CUSTOM_VJP_JAXPR: "fun_jaxpr",
    Kind.SHARD_MAP: "jaxpr",
}


def kind_of(name: str) -> Kind | None:
    """The kind of the primitive called ``name``, or None for one jaxamp does not enter."""
    return _KIND_OF.get(name)


def body(eqn: Any) -> Any:
    """The body jaxpr of a call-like equation (``BODY``)."""
    return eqn.params[BODY[kind_of(eqn.primitive.name)]]


#: kind -> what an evaluator does with an equation of that kind.
Handlers = Mapping[Kind, Callable[..., Any]]


def subjaxprs(params: Mapping[str, Any]) -> Iterator[tuple[str, ClosedJaxpr | Jaxpr]]:
    """Each inner jaxpr an equation's `params` hold, with its param's name; a tuple of
    them (``cond``'s branches) gives each in order."""
    for key, value in params.items():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if isinstance(sub, ClosedJaxpr | Jaxpr):
                yield key, sub


def has_subjaxprs(params: Mapping[str, Any]) -> bool:
    """Whether an equation's `params` hold an inner jaxpr (``subjaxprs``)."""
    return next(subjaxprs(params), None) is not None


def open_jaxpr(sub: ClosedJaxpr | Jaxpr) -> tuple[Jaxpr, Sequence[Any]]:
    """An inner jaxpr as ``(jaxpr, consts)``: a ``ClosedJaxpr``'s own, or none."""
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()
