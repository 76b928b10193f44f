"""Flax (and equinox) only where the program itself uses them.

jaxamp's core (loss scaling, the optax guard, ``jaxamp.step``, ``autocast`` of a
plain function) needs neither: an equinox or plain-optax program need not have Flax
installed, nor pay for importing it. A Flax object can exist only once the program
has imported its module, so a check for one asks ``loaded`` and never imports; the
Flax adapters (``jaxamp.TrainState``, ``jaxamp.nnx``) import Flax when first used,
through ``lazy_attributes``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: Flax's fp8 metadata collection (``nn.Fp8DotGeneralOp``, fp8 einsum): its
#: "gradients" are the new values of the fp8 scales and amax histories.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def loaded(name: str) -> ModuleType | None:
    """The module ``name`` (``"flax.nnx"``) if the program has imported it, else None.

    Imports nothing: where it is None, no object of that module can be in the
    program, so there is nothing to check.
    """
    return sys.modules.get(name)


def lazy_attributes(
    module: str, attributes: dict[str, str], fallback: Callable[[str], Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each name in ``attributes`` (name ->
    the module holding it, or the submodule of that name) on first use, and asks
    ``fallback`` for any other name."""

    def __getattr__(name: str) -> Any:
        if name not in attributes:
            return fallback(name)
        source = importlib.import_module(attributes[name])
        value = source if source.__name__ == f"{module}.{name}" else getattr(source, name)
        setattr(sys.modules[module], name, value)  # later reads find it without this hook
        return value

    __getattr__.aliases = getattr(fallback, "aliases", {})  # type: ignore[attr-defined]
    return __getattr__
