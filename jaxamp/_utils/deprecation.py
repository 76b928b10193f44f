"""Keeping an old spelling working, with a ``DeprecationWarning``, for one release."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from jaxamp._utils.conversion_checks import _stacklevel

F = TypeVar("F", bound=Callable[..., Any])


def positional_deprecated(*formerly_positional: str, removed_in: str) -> Callable[[F], F]:
    """Lets the keyword-only parameters ``formerly_positional`` of the decorated
    function still be passed by position, in that order after its positional ones,
    with a ``DeprecationWarning`` naming them, until jaxamp ``removed_in``. Its
    signature (``inspect.signature``, the docs) is the new one."""

    def wrap(f: F) -> F:
        params = inspect.signature(f).parameters
        n = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in formerly_positional)
        keyword_only = list(formerly_positional)
        name = f"jaxamp.{f.__name__}"

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > n:
                extra = args[n:]
                if len(extra) > len(keyword_only):
                    raise TypeError(
                        f"{name}() takes {n} positional argument(s) ({n + len(keyword_only)} "
                        f"until jaxamp {removed_in}) but {len(args)} were given."
                    )
                names = keyword_only[: len(extra)]
                twice = [k for k in names if k in kwargs]
                if twice:
                    raise TypeError(f"{name}() got multiple values for argument {twice[0]!r}")
                shown = ", ".join(f"{k}=..." for k in names)
                warnings.warn(
                    f"{name}: passing {', '.join(names)} by position is deprecated and "
                    f"will be an error in jaxamp {removed_in}; pass {shown} by keyword.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs.update(zip(names, extra, strict=True))
                args = args[:n]
            return f(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap


class _Marker:
    """A default in a published signature that stands for an argument not given."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


# The published default of a required parameter that an old keyword can stand in for.
REQUIRED = _Marker("<required>")


def renamed_parameter(old: str, new: str, *, removed_in: str) -> Callable[[F], F]:
    """Lets the parameter ``new`` of the decorated function still be passed by its old
    keyword ``old``, with a ``DeprecationWarning``, until jaxamp ``removed_in``. By
    position nothing changes.

    The published signature (``inspect.signature``, what ``jax.jit``'s
    ``donate_argnames`` / ``static_argnames``, ``Signature.bind``, ``functools.partial``
    and ``equinox.filter_jit`` read) lists ``old`` as a keyword-only parameter whose
    default reads ``<deprecated: use new=>``, and shows ``new`` and the required
    parameters after it with the default ``<required>``: given ``old`` instead, they
    bind as they did when ``old`` was the name. The docs read the source, which has the
    new name only; a call missing a required argument is still Python's error.
    """

    def wrap(f: F) -> F:
        sig = inspect.signature(f)
        names = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert new in names and old not in sig.parameters
        assert all(
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in sig.parameters.values()
        )
        name = f"jaxamp.{f.__name__}"
        at = names.index(new)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, _Marker) for a in (*args, *kwargs.values())):
                # A wrapper filled in the published defaults (``BoundArguments.apply_defaults``):
                # the markers are the arguments not given.
                kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
                kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, _Marker)}
                args = args[len(names) :]
            if old in kwargs:
                if new in kwargs or len(args) > at:
                    how = "" if new in kwargs else f" (by position: {new} is argument {at + 1})"
                    raise TypeError(f"{name}() got both {old}= and {new}={how}; pass {new}= only.")
                warnings.warn(
                    f"{name}: the argument {old}= is now called {new}=; {old}= is deprecated "
                    f"and will be an error in jaxamp {removed_in}.",
                    DeprecationWarning,
                    stacklevel=_stacklevel(),
                )
                kwargs[new] = kwargs.pop(old)
            return f(*args, **kwargs)

        published = [
            p.replace(default=REQUIRED) if p.name in names[at:] and p.default is p.empty else p
            for p in sig.parameters.values()
        ]
        deprecated = _Marker(f"<deprecated: use {new}=>")
        published.append(inspect.Parameter(old, inspect.Parameter.KEYWORD_ONLY, default=deprecated))
        wrapper.__signature__ = sig.replace(parameters=published)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return wrap


def deprecated_aliases(
    module: str, aliases: dict[str, tuple[str, Any]], removed_in: str
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name in ``aliases`` (old -> (new
    spelling, the object)) with a ``DeprecationWarning`` naming the new spelling;
    the old names are not in the module's ``__all__``."""

    def __getattr__(name: str) -> Any:
        if name in aliases:
            new, obj = aliases[name]
            warnings.warn(
                f"{module}.{name} is deprecated and will be removed in jaxamp {removed_in}; "
                f"use {new}.",
                DeprecationWarning,
                stacklevel=2,
            )
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
