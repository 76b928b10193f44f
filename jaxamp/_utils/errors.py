"""Errors that name the public function the user called."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def named(fn: str) -> Iterator[None]:
    """Re-raises a ``ValueError`` raised inside with ``jaxamp.{fn}: `` in front of it."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"jaxamp.{fn}: {e}") from None
