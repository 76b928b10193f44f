"""Orbax checkpointing of jaxamp training states: orbax's restore, checked on both sides."""

from jaxamp.checkpoint._metadata import check_restorable
from jaxamp.checkpoint._restore import restore

__all__ = ["check_restorable", "restore"]
