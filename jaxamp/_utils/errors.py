"""Errors that name the public function the user called."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

# "jaxamp.get_loss_scale: ", "jaxamp.nnx.value_and_grad: ": a public function's name.
_NAMED = re.compile(r"jaxamp\.[\w.]+: ")


@contextlib.contextmanager
def named(fn: str) -> Iterator[None]:
    """Re-raises a ``ValueError`` raised inside with ``jaxamp.{fn}: `` in front of it, in
    place of the name of a public function ``fn`` called (``stepped`` calls
    ``get_loss_scale``): the user called ``fn``."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"jaxamp.{fn}: {unnamed(e)}") from None


def unnamed(e: Exception) -> str:
    """The message of ``e`` without the public function's name in front."""
    message = str(e)
    found = _NAMED.match(message)
    return message[found.end() :] if found else message


def with_article(noun: str) -> str:
    """``noun`` with its indefinite article: "a tuple", "an Optimizer"."""
    return f"{'an' if noun[:1] in 'aeiouAEIO' else 'a'} {noun}"
