"""Where an equation came from: its Flax module path and the user's source line.

Read from what JAX records on each equation (its name stack and traceback), for
[`jaxamp.find_overflow`][jaxamp.find_overflow]'s report.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from typing import Any

from jaxamp._utils import jax_compat
from jaxamp.casting._find_overflow import _overflow_eval
from jaxamp.casting._rules._scopes import MARKERS

# Packages whose frames are not "the model's source": the report names the
# innermost frame outside them (and outside the standard library).
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "chex", "jaxamp")


def stack_str(stack: _overflow_eval.Stack) -> str:
    out = ""
    for kind, name in reversed(stack):
        out = f"{name}({out})" if kind == "transform" else (f"{name}/{out}" if out else name)
    return out.rstrip("/")


def module_path(stack: _overflow_eval.Stack) -> tuple[str | None, str | None]:
    """(module path, class) from the scopes: linen names each module call by its
    name (nested: the path); autocast's nnx scopes are ``rel[Class]``, the path
    relative to the module before; ``[Class]`` alone (linen with ``modules=``)
    names a class."""
    path: list[str] = []
    cls = None
    for kind, name in stack:
        if kind != "scope" or name.startswith(MARKERS):
            continue
        if name.endswith("]") and "[" in name:
            prefix, _, klass = name[:-1].rpartition("[")
            cls = klass
            if prefix:
                path += prefix.split("/")
            continue
        path.append(name)
        cls = None
    return ("/".join(path) or None), cls


@functools.cache
def library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.realpath(location) + os.sep)
    return tuple(dirs)


def is_library(file: str) -> bool:
    """Whether `file` is in JAX, Flax, optax, chex, jaxamp or the standard library."""
    if file.startswith("<"):  # <frozen runpy>, <string>
        return True
    real = os.path.realpath(file)
    if real.startswith(library_dirs()):
        return True
    stdlib = sysconfig.get_path("stdlib")
    parts = real.split(os.sep)
    installed = "site-packages" in parts or "dist-packages" in parts
    return bool(stdlib) and real.startswith(os.path.realpath(stdlib) + os.sep) and not installed


def source(eqn: Any) -> tuple[str, int, str] | None:
    """The innermost frame of `eqn`'s traceback outside JAX, Flax, optax, chex, jaxamp."""
    for file, line, function in jax_compat.traceback_frames(eqn):
        if not is_library(file):
            return file, line, function
    return None
