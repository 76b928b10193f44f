"""The arrays a plain Python object that ``autocast`` wraps holds, read at each call.

``autocast(model)`` or ``autocast(model.forward)``, with ``model`` an instance of a
plain Python class holding its weights (arrays) as attributes: ``model.w = new`` must change
the next call's answer. The arrays among the object's attributes (directly, in
lists, tuples, dicts, or in plain objects it holds: its layers) cross the trace as
inputs, like `f`'s own array arguments, and the other attributes are part of the
eager cache's key, as static arguments are (``_wrapper._static_key``); `f` runs on
a shallow copy of the object holding the traced arrays. So a weight update is one
more call of the same compiled program, not a new trace.

Arrays in a closure or in a global are constants of the trace, as they are for
``jax.jit``. An nnx module has its own route (``_wrapper._call_nnx``); a
pytree (an equinox module) or an object hashed by value (a linen module) is
immutable by contract and stays a constant of `f`.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxamp._utils.optional import loaded


def _slots(kind: type) -> list[str]:
    """The slot attributes a class and its bases declare."""
    names = []
    for k in kind.__mro__:
        declared = k.__dict__.get("__slots__", ())
        names += [declared] if isinstance(declared, str) else list(declared)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _attrs(obj: Any) -> dict[str, Any]:
    """An object's attributes: its ``__dict__`` and its slots (those that are set)."""
    found = dict(getattr(obj, "__dict__", {}))
    for name in _slots(type(obj)):
        if hasattr(obj, name):
            found[name] = getattr(obj, name)
    return found


def _plain(x: Any) -> bool:
    """Whether `x` is an instance of a plain Python class: attributes in a
    ``__dict__`` or slots, mutable (hashed by identity, or not hashable: a dataclass
    with ``eq``), no pytree and no nnx module. An object hashed by value (a linen
    module, a frozen dataclass) is immutable by contract."""
    kind = type(x)
    if isinstance(x, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return False
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return False
    if not (hasattr(x, "__dict__") or _slots(kind)):
        return False
    if kind.__hash__ not in (object.__hash__, None):
        return False
    nnx = loaded("flax.nnx")
    if nnx is not None and nnx.graph.is_graph_node(x):
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


@jax.tree_util.register_pytree_with_keys_class
class _Held:
    """A plain object as a pytree node: its attributes are the children (keyed by
    name: FP8 names a layer by its weight's path), with the plain objects among
    them (its layers) held the same way."""

    def __init__(self, obj: Any, attrs: dict[str, Any]) -> None:
        self.obj, self.attrs = obj, attrs

    def tree_flatten_with_keys(self) -> tuple[list[Any], tuple[Any, tuple[str, ...]]]:
        keys = tuple(self.attrs)
        children = [(jax.tree_util.GetAttrKey(k), self.attrs[k]) for k in keys]
        return children, (self.obj, keys)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, tuple[str, ...]], children: list[Any]) -> _Held:
        obj, keys = aux
        return cls(obj, dict(zip(keys, children, strict=True)))

    def rebuilt(self) -> Any:
        """A shallow copy of the object with these attributes (the original is
        not written from inside a trace)."""
        held = copy.copy(self.obj)
        is_held = lambda x: isinstance(x, _Held)  # noqa: E731
        for k, v in self.attrs.items():
            # object.__setattr__: past a class's own __setattr__ (and for slots).
            object.__setattr__(
                held,
                k,
                jax.tree_util.tree_map(
                    lambda x: x.rebuilt() if is_held(x) else x, v, is_leaf=is_held
                ),
            )
        return held


def _hold(obj: Any, seen: set[int]) -> _Held:
    seen = seen | {id(obj)}

    def inner(x: Any) -> Any:
        return _hold(x, seen) if _plain(x) and id(x) not in seen else x

    attrs = {k: jax.tree_util.tree_map(inner, v, is_leaf=_plain) for k, v in _attrs(obj).items()}
    return _Held(obj, attrs)


def holder(
    f: Callable[..., Any], is_array: Callable[[Any], bool]
) -> tuple[Any, Callable[..., Any]] | None:
    """``(held, call)`` when `f` is a plain object's ``__call__`` or one of its
    methods and the object holds arrays (``is_array``): `held` is the object as a
    pytree (its attributes, and those of the plain objects it holds), and
    ``call(held, *args, **kwargs)`` is ``f`` run on a copy of the object rebuilt
    from `held` (its arrays then traced values). Else None: `f` is traced as it
    is (a ``jax.custom_vjp`` or a ``functools.partial`` is a callable object too,
    holding functions, not arrays)."""
    if isinstance(f, types.MethodType):
        obj, func = f.__self__, f.__func__
    elif _plain(f) and callable(f):
        obj, func = f, type(f).__call__
    else:
        return None
    if not _plain(obj):
        return None

    held = _hold(obj, set())
    if not any(is_array(x) for x in jax.tree_util.tree_leaves(held)):
        return None

    def call(held: _Held, *args: Any, **kwargs: Any) -> Any:
        return func(held.rebuilt(), *args, **kwargs)

    return held, call
