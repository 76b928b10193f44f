"""The public API as text: one line per public name of ``jaxamp``, ``jaxamp.types``,
``jaxamp.nnx``, ``jaxamp.compat`` and ``jaxamp.checkpoint`` (kind, name, parameters with
their kinds and defaults; a class's fields and public methods; the deprecated spellings
still served), compared with ``public_api.golden.txt`` by ``test_public_api.py``.

After a deliberate change of the public API, regenerate the golden file and review its diff::

    python -m tests.behaviour.public_api --update
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import pathlib
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

GOLDEN = pathlib.Path(__file__).with_name("public_api.golden.txt")
UPDATE = "python -m tests.behaviour.public_api --update"
NAMESPACES = ("jaxamp", "jaxamp.types", "jaxamp.nnx", "jaxamp.compat", "jaxamp.checkpoint")


def signature(obj: Any) -> str:
    """``obj``'s published signature without annotations: the parameters' names, kinds
    (``/`` and ``*`` as Python writes them) and defaults."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(?)"
    bare = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=sig.empty))


def describe(qualname: str, obj: Any) -> Iterator[str]:
    if isinstance(obj, types.ModuleType):
        yield f"module {qualname}"
    elif inspect.isclass(obj):
        yield from _describe_class(qualname, obj)
    elif callable(obj):
        yield f"function {qualname}{signature(obj)}"
    elif isinstance(obj, Mapping):
        yield f"mapping {qualname} ({len(obj)} entries)"
    else:
        yield f"value {qualname} = {obj!r}"


def _describe_class(qualname: str, cls: type) -> Iterator[str]:
    if issubclass(cls, enum.Enum):
        members = ", ".join(f"{m.name}={m.value!r}" for m in cls)
        yield f"enum {qualname}: {members}"
        return
    if issubclass(cls, Warning):
        yield f"warning {qualname}({', '.join(c.__name__ for c in cls.__bases__)})"
        return
    if dataclasses.is_dataclass(cls):
        kind = "dataclass"
        fields = [
            f"{f.name}{' (kw_only)' if f.kw_only is True else ''}" for f in dataclasses.fields(cls)
        ]
    elif hasattr(cls, "_fields"):
        kind, fields = "namedtuple", list(cls._fields)
    else:
        kind, fields = "class", None
    line = f"{kind} {qualname}{signature(cls)}"
    yield line if fields is None else f"{line} fields: {', '.join(fields)}"
    if fields is None and "__init__" in vars(cls):
        yield f"method {qualname}.__init__{signature(cls.__init__)}"
    # A field's default (a dtype class) is callable too: fields are listed above.
    field_names = {f.split(" ")[0] for f in fields or ()}
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") or name in field_names:
            continue
        if isinstance(member, property):
            yield f"property {qualname}.{name}"
        elif isinstance(member, staticmethod | classmethod) or callable(member):
            yield f"method {qualname}.{name}{signature(getattr(cls, name))}"


def lines() -> list[str]:
    import importlib

    out = []
    for ns in NAMESPACES:
        module = importlib.import_module(ns)
        for name in sorted(module.__all__):
            out.extend(describe(f"{ns}.{name}", getattr(module, name)))
        aliases = getattr(vars(module).get("__getattr__"), "aliases", {})
        for old, (new, _) in sorted(aliases.items()):
            out.append(f"deprecated {ns}.{old} -> {new}")
    return out


def text() -> str:
    return "\n".join(lines()) + "\n"


def main(argv: list[str]) -> int:
    if argv != ["--update"]:
        print(__doc__)
        return 2
    GOLDEN.write_text(text())
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
