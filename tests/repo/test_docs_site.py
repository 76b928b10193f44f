"""The documentation site lists every public name, and its prose blocks run.

The API pages (docs/api/*.md) must name each export of ``jaxamp``, ``jaxamp.nnx``,
``jaxamp.compat`` and ``jaxamp.checkpoint`` exactly once, and nothing else; `make
docs` (mkdocs --strict, in `make test`) then renders each one's signature and
docstring, and fails on any warning.
"""

import pathlib
import re

import jaxamp

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
NAMESPACES = {
    "jaxamp": [n for n in jaxamp.__all__ if n not in ("checkpoint", "compat", "nnx")],
    "jaxamp.nnx": jaxamp.nnx.__all__,
    "jaxamp.compat": jaxamp.compat.__all__,
    "jaxamp.checkpoint": jaxamp.checkpoint.__all__,
}


def test_the_api_pages_list_every_public_name_once():
    entries = re.findall(r"^::: (\S+)$", "".join(
        p.read_text() for p in sorted((DOCS / "api").glob("*.md"))), flags=re.M)  # fmt: skip
    assert len(entries) == len(set(entries)), sorted(entries)
    listed = {}
    for e in entries:
        module, _, name = e.rpartition(".")
        listed.setdefault(module, set()).add(name)
    assert listed == {m: set(names) for m, names in NAMESPACES.items()}
    for module, names in NAMESPACES.items():  # and each is a real, documented object
        obj = jaxamp if module == "jaxamp" else getattr(jaxamp, module.split(".")[1])
        for n in names:
            value = getattr(obj, n)
            if callable(value):  # DEFAULT_RULES is data, documented on its page
                assert value.__doc__, f"{module}.{n} has no docstring"


def test_every_page_is_in_the_navigation():
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = {p for p in pages if p not in nav}
    assert not missing, f"pages outside the site's navigation: {sorted(missing)}"
