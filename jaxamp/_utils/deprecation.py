"""Keeping an old spelling working, with a ``DeprecationWarning``, for one release."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

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


def renamed_parameter(old: str, new: str, *, removed_in: str) -> Callable[[F], F]:
    """Lets the parameter ``new`` of the decorated function still be passed by its old
    keyword ``old``, with a ``DeprecationWarning``, until jaxamp ``removed_in``. Its
    signature (``inspect.signature``, the docs) is the new one; by position nothing
    changes."""

    def wrap(f: F) -> F:
        assert new in inspect.signature(f).parameters
        name = f"jaxamp.{f.__name__}"

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{name}() got both {old}= and {new}=; pass {new}= only.")
                warnings.warn(
                    f"{name}: the argument {old}= is now called {new}=; {old}= is deprecated "
                    f"and will be an error in jaxamp {removed_in}.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return f(*args, **kwargs)

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
