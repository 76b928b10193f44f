"""Flax nnx Variables: a Variable stands for the value it holds.

nnx wraps each array of a model or of an optimizer state in a Variable
(``nnx.Param``, ``nnx.OptArray``): a pytree node of one leaf, whose key path adds
the Variable's own attribute, and whose saved form (``nnx.state`` restored,
orbax's metadata) is a mapping of one entry. Code that reads one value (a loss
scale, a ring's shape) or names a leaf reads through the Variable. Flax is never
imported here: where the program has not imported ``flax.nnx``, it holds no Variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from jaxamp._utils.optional import loaded


def is_variable(x: Any) -> bool:
    """An nnx Variable (``VariableState`` too, on the Flax versions that have one)."""
    nnx = loaded("flax.nnx")
    if nnx is None:
        return False
    # Read from the module's own names: where Flax keeps ``VariableState`` only as a
    # deprecated alias of ``Variable``, getattr would warn on every call.
    state = vars(nnx).get("VariableState", nnx.Variable)
    return isinstance(x, nnx.Variable | state)


def held_value(x: Any) -> Any:
    """The one value ``x`` stands for: the leaf of an nnx Variable, or of its saved
    form (a mapping of one entry), however deep they nest; anything else as it is."""
    while True:
        if isinstance(x, Mapping) and len(x) == 1:
            x = next(iter(x.values()))
        elif is_variable(x) and len(leaves := jax.tree.leaves(x)) == 1:
            x = leaves[0]
        else:
            return x
