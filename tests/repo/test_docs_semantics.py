"""docs/semantics.md is the contract the tests cite: every citation names one of its
sections, and nothing cites the contract's old home outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "semantics.md"
CITED_IN = ("tests", "jaxamp", "docs", "examples", "CHANGELOG.md", "README.md")


def _files() -> list[Path]:
    out = []
    for name in CITED_IN:
        path = ROOT / name
        found = [path] if path.is_file() else path.rglob("*")
        out += [p for p in found if p.suffix in (".py", ".md") and p.is_file()]
    return out


def test_every_citation_names_a_section_of_the_page() -> None:
    anchors = set(re.findall(r"^#+ .*\{#([a-z0-9-]+)\}$", PAGE.read_text(), flags=re.M))
    assert {"update-rule", "guard", "skipped-as-a-whole", "autocast-program"} <= anchors
    cited = {}
    for path in _files():
        for anchor in re.findall(r"semantics\.md#([a-z0-9-]+)", path.read_text()):
            cited.setdefault(anchor, []).append(str(path.relative_to(ROOT)))
    assert len(cited) >= 5, cited  # the tests that check the contract say which part
    unknown = {a: where for a, where in cited.items() if a not in anchors}
    assert not unknown, f"citations of sections docs/semantics.md does not have: {unknown}"


def test_nothing_cites_a_contract_outside_the_repository() -> None:
    here = Path(__file__).resolve()
    stale = [str(p.relative_to(ROOT)) for p in _files() if p != here and "API.md" in p.read_text()]
    assert not stale, f"cite docs/semantics.md's sections instead of API.md in: {stale}"
