"""Keeping an old spelling working, with a ``DeprecationWarning``, for one release.

Each decorator also says so in the docstring it decorates (one sentence, appended),
so that no docstring carries the deprecation by hand."""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from jaxamp._utils.conversion_checks import _stacklevel

F = TypeVar("F", bound=Callable[..., Any])


def add_note(obj: Any, text: str) -> None:
    """Appends the paragraph ``text`` to ``obj``'s docstring (once), indented as the
    docstring is, so that ``inspect.getdoc`` and ``help`` show it as written."""
    doc = obj.__doc__ or ""
    if " ".join(text.split()) in " ".join(doc.split()):
        return
    lines = doc.expandtabs().splitlines()[1:]
    indents = [len(s) - len(s.lstrip()) for s in lines if s.strip()]
    pad = " " * min(indents, default=0)
    obj.__doc__ = f"{doc.rstrip()}\n\n{pad}{text}\n"


def positional_deprecated(*formerly_positional: str, removed_in: str) -> Callable[[F], F]:
    """Lets the keyword-only parameters ``formerly_positional`` of the decorated
    function still be passed by position, in that order after its positional ones,
    with a ``DeprecationWarning`` naming them, until jaxamp ``removed_in``. Its
    signature (``inspect.signature``, the docs) is the new one."""

    def wrap(f: F) -> F:
        params = inspect.signature(f).parameters
        n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params.values())
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

        listed = ", ".join(f"``{k}``" for k in keyword_only)
        add_note(
            wrapper,
            f"Until jaxamp {removed_in} the keyword-only {listed} can also be passed by "
            "position, after the positional arguments, with a ``DeprecationWarning``.",
        )
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


def _publish(
    sig: inspect.Signature, old: str, default: _Marker, at: int | None
) -> inspect.Signature:
    """``sig`` with ``old`` appended, keyword-only, whose default says what to write
    instead; the required positional parameters from index ``at`` on get the default
    ``<required>``, so that a binding given ``old`` in their place (jax.jit's argnames,
    ``Signature.bind``, ``functools.partial``, equinox.filter_jit) binds as in 0.3."""
    names = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    later = set() if at is None else set(names[at:])
    published = [
        p.replace(default=REQUIRED) if p.name in later and p.default is p.empty else p
        for p in sig.parameters.values()
    ]
    extra = inspect.Parameter(old, inspect.Parameter.KEYWORD_ONLY, default=default)
    if published and published[-1].kind is inspect.Parameter.VAR_KEYWORD:
        published.insert(len(published) - 1, extra)
    else:
        published.append(extra)
    return sig.replace(parameters=published)


def renamed_parameter(
    old: str, new: str, *, removed_in: str, module: str = "jaxamp"
) -> Callable[[F], F]:
    """Lets the parameter ``new`` of the decorated function still be passed by its old
    keyword ``old`` (a name jaxamp 0.3 shipped), with a ``DeprecationWarning``, until
    jaxamp ``removed_in``. By position nothing changes. ``new`` may be positional-only
    (the subject of a function: the state, given by position so that its name can never
    need this again), positional-or-keyword or keyword-only.

    The published signature (``inspect.signature``, what ``jax.jit``'s
    ``donate_argnames`` / ``static_argnames``, ``Signature.bind``, ``functools.partial``
    and ``equinox.filter_jit`` read) lists ``old`` as a keyword-only parameter whose
    default says what to write instead, and shows ``new`` and the required positional
    parameters after it with the default ``<required>``: given ``old`` instead, they
    bind as they did when ``old`` was the name. The docs read the source, which has the
    new name only; a call missing a required argument is still Python's error.
    """

    def wrap(f: F) -> F:
        sig = inspect.signature(f)
        params = sig.parameters
        names = [
            p.name
            for p in params.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        only = [p.name for p in params.values() if p.kind is p.POSITIONAL_ONLY]
        assert new in params and old not in params
        assert params[new].kind is not inspect.Parameter.VAR_POSITIONAL
        name = f"{module}.{f.__name__}"
        at = names.index(new) if new in names else None
        by_position = new in only
        instead = f"pass {new} by position" if by_position else f"use {new}="

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # Positional-only parameters are moved from keywords to positions only where
            # jaxamp put them there (a published default filled in, or the old keyword):
            # a user's `state=` gets Python's own error, as for any `/` parameter.
            to_position = False
            if any(isinstance(a, _Marker) for a in (*args, *kwargs.values())):
                # A wrapper filled in the published defaults (``BoundArguments.apply_defaults``):
                # the markers are the arguments not given.
                given = {**dict(zip(names, args, strict=False)), **kwargs}
                given = {k: v for k, v in given.items() if not isinstance(v, _Marker)}
                args, kwargs = args[len(names) :], given
                to_position = True
            if old in kwargs:
                if new in kwargs or (at is not None and len(args) > at):
                    how = "" if new in kwargs else f" (by position: {new} is argument {at + 1})"
                    raise TypeError(
                        f"{name}() got both {old}= and {new}{how}; {instead} only."
                        if by_position
                        else f"{name}() got both {old}= and {new}={how}; pass {new}= only."
                    )
                what = (
                    f"the keyword {old}= is deprecated and will be an error in jaxamp "
                    f"{removed_in}; pass it by position ({new})"
                    if by_position
                    else f"the argument {old}= is now called {new}=; {old}= is deprecated "
                    f"and will be an error in jaxamp {removed_in}"
                )
                warnings.warn(f"{name}: {what}.", DeprecationWarning, stacklevel=_stacklevel())
                kwargs[new] = kwargs.pop(old)
                to_position = True
            if to_position and any(k in kwargs for k in only):
                # Positional-only parameters go by position, in order.
                args = list(args)
                for k in only[len(args) :]:
                    if k not in kwargs:
                        break
                    args.append(kwargs.pop(k))
            return f(*args, **kwargs)

        default = _Marker(f"<deprecated: {instead}>")
        wrapper.__signature__ = _publish(sig, old, default, at)  # type: ignore[attr-defined]
        add_note(
            wrapper,
            f"Until jaxamp {removed_in} the keyword ``{old}=`` also works"
            + (f" (for ``{new}``, now given by position)" if by_position else f" (now ``{new}=``)")
            + ", with a ``DeprecationWarning``.",
        )
        return wrapper  # type: ignore[return-value]

    return wrap


def deprecated_parameter(old: str, instead: str, *, removed_in: str) -> Callable[[F], F]:
    """The keyword-only parameter ``old`` of the decorated function (a name jaxamp 0.3
    shipped, whose setting now lives elsewhere) still works, with a
    ``DeprecationWarning`` saying ``instead`` (what to write), until jaxamp
    ``removed_in``. The function still receives it; its published signature shows it
    with a default that says it is deprecated, and its docstring says so."""

    def wrap(f: F) -> F:
        sig = inspect.signature(f)
        assert sig.parameters[old].kind is inspect.Parameter.KEYWORD_ONLY
        assert sig.parameters[old].default is None
        name = f"jaxamp.{f.__name__}"

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if isinstance(kwargs.get(old), _Marker):
                kwargs.pop(old)
            if kwargs.get(old) is not None:
                warnings.warn(
                    f"{name}: {old}= is deprecated and will be an error in jaxamp "
                    f"{removed_in}; {instead}.",
                    DeprecationWarning,
                    stacklevel=_stacklevel(),
                )
            return f(*args, **kwargs)

        published = [
            p.replace(default=_Marker(f"<deprecated: {instead}>")) if p.name == old else p
            for p in sig.parameters.values()
        ]
        wrapper.__signature__ = sig.replace(parameters=published)  # type: ignore[attr-defined]
        add_note(
            wrapper,
            f"Until jaxamp {removed_in} the keyword ``{old}=`` also works, with a "
            f"``DeprecationWarning``: {instead}.",
        )
        return wrapper  # type: ignore[return-value]

    return wrap


def deprecated_aliases(
    module: str, aliases: dict[str, tuple[str, Any]], removed_in: str, *, note: bool = True
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name in ``aliases`` (old -> (new
    spelling, the object)) with a ``DeprecationWarning`` naming the new spelling;
    the old names are not in the module's ``__all__``. With ``note``, each object's
    docstring says that the old spelling works until jaxamp ``removed_in``."""
    for old, (_, obj) in aliases.items() if note else ():
        add_note(
            obj,
            f"Until jaxamp {removed_in} it is also reachable as ``{module}.{old}``, with a "
            "``DeprecationWarning``.",
        )

    def __getattr__(name: str) -> Any:
        if name in aliases:
            new, obj = aliases[name]
            level = _stacklevel()
            # `from jaxamp import old` asks twice: importlib's hasattr, then the import's
            # own read; the second one warns, at the user's line.
            if sys._getframe(level - 1).f_globals.get("__name__") != "importlib._bootstrap":
                warnings.warn(
                    f"{module}.{name} is deprecated and will be removed in jaxamp "
                    f"{removed_in}; use {new}.",
                    DeprecationWarning,
                    stacklevel=level,
                )
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    __getattr__.aliases = aliases  # type: ignore[attr-defined]  # read by the API's golden file
    return __getattr__
