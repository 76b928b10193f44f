"""Orbax checkpointing of jaxamp training states: orbax's restore, checked on both sides."""

from jaxamp.checkpoint._restore import check_restorable, restore

__all__ = ["check_restorable", "restore"]
