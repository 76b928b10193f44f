"""Flax glue: naming module calls for ``modules=`` rules, and nnx / linen calls.

Module rules match on the ``jax.named_scope`` stack of each equation. Linen
names every module call itself; ``linen_class_scopes`` adds the class through
flax's own ``nn.intercept_methods`` (a context, not a patch). nnx adds no
scopes: autocast calls *its own* merged copy of the user's modules, and gives
each copy a private subclass whose ``__call__`` opens the scope ``rel[Class]``,
``rel`` the module's path relative to the module whose call encloses it
(``blocks/0`` in ``decoder``), so that the name stack reads as the model's own
path (``decoder[Decoder]/blocks/0[Block]/mlp[MLP]``: ``decoder/blocks/0/mlp``),
as linen's does; a module called from outside its parent's call is named under
its caller (the whole path there). Each copy holds its path in an attribute,
which nnx keeps in the graph it splits, so the modules an nnx transform
rebuilds from a copy (``nnx.remat``, ``nnx.scan`` over a stack of layers) are
named by it too. The user's classes and objects are never modified, and the
copies are this call's own, so concurrent calls in other threads do not see
each other's names.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from jaxamp._utils.optional import loaded

# The attribute of a module copy that holds its path in the graph autocast was
# called with (a static attribute to nnx: split and merged with the module).
_PATH = "_jaxamp_nnx_path"
# The path of the named module whose __call__ is running (None: none, or one
# made inside the call, whose path is unknown).
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxamp_nnx_caller", default=None
)
_NAMED: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()
_NAMED_SET: weakref.WeakSet[type] = weakref.WeakSet()  # the subclasses themselves


def is_bound_linen(x: Any) -> bool:
    linen = loaded("flax.linen")
    return linen is not None and isinstance(x, linen.Module) and x.scope is not None


def linen_class_scopes() -> Any:
    """A context naming every linen module method call `[Class]` (for `modules=`).

    Linen puts each module call under a ``jax.named_scope`` of the module's
    name only, so an explicitly named module (``nn.LayerNorm(name="ln")``)
    would not show its class; this interceptor adds it inside that scope. A
    null context when flax.linen is not imported (then there are no linen
    modules).
    """
    linen = loaded("flax.linen")
    if linen is None or not hasattr(linen, "intercept_methods"):
        return contextlib.nullcontext()

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        with jax.named_scope(f"[{type(context.module).__name__}]"):
            return next_fun(*args, **kwargs)

    return linen.intercept_methods(interceptor)


def flat_variables(nnx: Any, state: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, Variable)`` pairs of an nnx state (flax >= 0.11 and 0.10 spellings)."""
    to_flat = getattr(nnx, "to_flat_state", None)
    if to_flat is not None:
        return list(to_flat(state))
    return list(state.flat_state().items())  # pragma: no cover - flax 0.10


def same_leaves(xs: list[Any], var: Any) -> bool:
    """Whether a Variable still holds the very leaf objects `xs` (nothing was written)."""
    ys = jax.tree_util.tree_leaves(var)
    return len(xs) == len(ys) and all(x is y for x, y in zip(xs, ys, strict=True))


def _relative(path: str | None, caller: str | None) -> str:
    """`path` relative to the path of the module whose call encloses it (see above)."""
    if path is None:
        return ""
    if caller and path.startswith(caller + "/"):
        return path[len(caller) + 1 :]
    return "" if path == caller else path


def _named_class(cls: type) -> type:
    """A subclass of `cls` whose calls open a ``rel[Class]`` named scope (see above)."""
    named = _NAMED.get(cls)
    if named is not None:
        return named
    original = cls.__call__

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A module made inside the call (not one of the copies, nor rebuilt
        # from one) has no path: named by its class only.
        path, caller = vars(self).get(_PATH), _CALLER.get()
        token = _CALLER.set(path)
        try:
            with jax.named_scope(f"{_relative(path, caller)}[{cls.__name__}]"):
                return original(self, *args, **kwargs)
        finally:
            _CALLER.reset(token)

    kwds = {"pytree": cls._pytree__is_pytree} if hasattr(cls, "_pytree__is_pytree") else {}
    named = types.new_class(
        cls.__name__,
        (cls,),
        kwds,
        lambda ns: ns.update(__call__=__call__, __module__=cls.__module__),
    )
    named.__qualname__ = cls.__qualname__
    _NAMED[cls] = named
    _NAMED_SET.add(named)
    return named


def name_nnx_calls(nnx: Any, copies: Sequence[Any]) -> None:
    """Names the calls of every module in `copies` (autocast's own merged copies); a copy
    split from a named one (an autocast inside another) keeps its path."""
    for root in copies:
        for path, node in nnx.iter_graph(root):
            if isinstance(node, nnx.Module) and _PATH not in vars(node):
                object.__setattr__(node, _PATH, "/".join(str(p) for p in path))
                cls = type(node)
                if cls not in _NAMED_SET and any("__call__" in vars(k) for k in cls.__mro__[:-1]):
                    object.__setattr__(node, "__class__", _named_class(cls))
