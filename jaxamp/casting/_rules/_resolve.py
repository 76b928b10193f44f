"""The user's ``rules=`` and ``modules=``, checked and resolved when ``autocast`` is built."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from typing import Any

from jax import lax

from jaxamp.casting._rules._primitives import NAMES
from jaxamp.casting._rules._rules import DEFAULT_RULES, FLOAT32, OP_CLASSES


@functools.cache
def known_primitives() -> frozenset[str]:
    """Every primitive name a rule may name: the table's, the higher-order ones
    jaxamp enters, and every primitive of ``jax.lax`` and ``jax.extend``."""
    names = set(DEFAULT_RULES) | {n for kind_names in NAMES.values() for n in kind_names}
    try:
        from jax.extend.core import primitives

        for value in vars(primitives).values():
            name = getattr(value, "name", None)
            if isinstance(name, str) and hasattr(value, "bind"):
                names.add(name)
    except ImportError:  # pragma: no cover - older jax.extend
        pass
    for value in vars(lax).values():
        name = getattr(value, "name", None)
        if isinstance(name, str) and hasattr(value, "bind"):
            names.add(name)
    return frozenset(names)


def _check_class(where: str, value: Any) -> None:
    if value not in OP_CLASSES:
        raise ValueError(f"autocast: {where}={value!r}; expected one of {OP_CLASSES}")


def resolve_rules(rules: Mapping[Any, str] | None, where: str = "rules") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (rules or {}).items():
        if isinstance(key, str):
            name = key
            if name not in known_primitives():
                known = sorted(known_primitives())
                close = sorted((k for k in known if k.startswith(name)), key=len)[:3]
                close += [k for k in difflib.get_close_matches(name, known, n=3) if k not in close]
                hint = f" Closest known names: {', '.join(close)}." if close else ""
                raise ValueError(
                    f"autocast: {where} names an unknown primitive {name!r}.{hint} Keys are "
                    "primitive names as in jax.make_jaxpr output (see jaxamp.DEFAULT_RULES), "
                    "or the primitive objects themselves."
                )
        else:
            name = getattr(key, "name", None)
            if not isinstance(name, str):
                raise TypeError(f"autocast: {where} keys must be primitive names, got {key!r}")
        _check_class(f"{where}[{name!r}]", value)
        out[name] = value
    return out


def resolve_modules(modules: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    resolved = []
    for pattern, value in (modules or {}).items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"autocast: modules keys must be module name patterns, got {pattern!r}")
        if isinstance(value, str):
            if value != FLOAT32:
                raise ValueError(
                    f"autocast: modules[{pattern!r}]={value!r}; expected 'float32' (run the "
                    "module in full precision) or a mapping of primitive rules"
                )
            resolved.append((pattern, FLOAT32))
        elif isinstance(value, Mapping):
            resolved.append((pattern, resolve_rules(value, f"modules[{pattern!r}]")))
        else:
            raise TypeError(
                f"autocast: modules[{pattern!r}] must be 'float32' or a mapping of primitive "
                f"rules, got {type(value).__name__}"
            )
    return tuple(resolved)
