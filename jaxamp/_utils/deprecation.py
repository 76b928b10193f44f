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
