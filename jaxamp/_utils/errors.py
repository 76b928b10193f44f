"""Errors that name the public function the user called."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Self


class NamedError(Exception):
    """An error of a public function: ``str()`` is ``{fn}: {detail}``.

    The name and the detail are kept apart so that a public function that calls
    another (``check_health`` calls ``get_loss_scale``) names itself in front of the
    same detail (``named``): the user called the outer one.
    A subclass takes ``(detail, fn)`` first, as ``args``, and what else it carries as
    keyword attributes, so that a copy (and a pickle) rebuilds it whole.
    """

    def __init__(self, detail: str, fn: str | None = None) -> None:
        super().__init__(detail, fn)
        self.detail, self.fn = detail, fn

    def __str__(self) -> str:
        return self.detail if self.fn is None else f"{self.fn}: {self.detail}"

    def renamed(self, fn: str) -> Self:
        """A copy of this error raised for the public function ``fn``."""
        new = copy.copy(self)  # the constructor's arguments, then every attribute
        new.fn, new.args = fn, (self.detail, fn)
        return new


class NamedValueError(NamedError, ValueError):
    """A ``ValueError`` of a public function."""


class NamedTypeError(NamedError, TypeError):
    """A ``TypeError`` of a public function."""


_NAMED_KIND: dict[type[Exception], type[NamedError]] = {
    ValueError: NamedValueError,
    TypeError: NamedTypeError,
}


@contextlib.contextmanager
def named(fn: str, kinds: tuple[type[Exception], ...] = (ValueError,)) -> Iterator[None]:
    """Re-raises an error of ``kinds`` raised inside as the public function
    ``jaxamp.{fn}``'s: a ``NamedError`` of its type
    renamed (``stepped`` calls ``get_loss_scale``: the user called ``stepped``), any
    other with ``jaxamp.{fn}: `` in front of its message."""
    try:
        yield
    except NamedError as e:
        if not isinstance(e, kinds):
            raise
        raise e.renamed(f"jaxamp.{fn}") from None
    except kinds as e:
        kind = next(k for k in _NAMED_KIND if isinstance(e, k))
        raise _NAMED_KIND[kind](str(e), f"jaxamp.{fn}") from None


def unnamed(e: Exception) -> str:
    """The message of ``e`` without the name of the public function that raised it."""
    return e.detail if isinstance(e, NamedError) else str(e)


def with_article(noun: str) -> str:
    """``noun`` with its indefinite article: "a tuple", "an Optimizer"."""
    return f"{'an' if noun[:1] in 'aeiouAEIO' else 'a'} {noun}"
