"""The documentation site: every public name listed, and the built site read the way
a browser reads it.

The API pages (docs/api/*.md) must name each export of ``jaxamp``, ``jaxamp.nnx``,
``jaxamp.compat`` and ``jaxamp.checkpoint`` exactly once, and nothing else, and every
page must be in the navigation.

The site is built once (``mkdocs build --strict`` into a temporary directory), then
every page is parsed with the standard library's HTML parser: every internal link
(``href``/``src``) must name a file of the built site (a link to a directory lands on
a directory listing when the site is opened from disk) and every ``#anchor`` an id in
that file; every API example must be a code block (``>>>`` only inside
``<pre>``/``<code>``, never in a paragraph or a blockquote, where Markdown puts the
``>>>`` lines of a docstring section it does not read as examples); no Sphinx role
(``:func:``, ``:class:``...) may be left in any page's text; the search index must be
there in the form that works from ``file://`` (the offline plugin's
``search_index.js``); every example script and the benchmark results have a page.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import pathlib
import posixpath
import re
import subprocess
import sys
import threading
import urllib.parse
import urllib.request

import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[2]
MKDOCS = pathlib.Path(sys.executable).with_name("mkdocs")
ROLE = re.compile(r":(func|class|meth|mod|attr|data|obj|exc|ref|py:\w+):`?")
# Material's own links to outside the site, and the scheme-less forms a browser
# also leaves alone.
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|//)", re.I)

DOCS = ROOT / "docs"
NAMESPACES = {
    "jaxamp": [n for n in jaxamp.__all__ if n not in ("checkpoint", "compat", "nnx", "types")],
    "jaxamp.types": jaxamp.types.__all__,
    "jaxamp.nnx": jaxamp.nnx.__all__,
    "jaxamp.compat": jaxamp.compat.__all__,
    "jaxamp.checkpoint": jaxamp.checkpoint.__all__,
}
needs_mkdocs = pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed")


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
    nav = (ROOT / "mkdocs.yml").read_text()
    # docs/_generated/: what `make demo` writes, included into pages (snippets), no page
    assert "exclude_docs: |\n  _hooks/\n  _generated/*.md\n" in nav
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = {p for p in pages if p not in nav and not p.startswith("_generated/")}
    assert not missing, f"pages outside the site's navigation: {sorted(missing)}"


class Page(html.parser.HTMLParser):
    """The ids, the links and the text (with where it sits) of one HTML file."""

    TRACKED = ("pre", "code", "p", "blockquote", "script", "style", "td", "th")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag, url)
        self.open = dict.fromkeys(self.TRACKED, 0)
        self.text: list[tuple[str, frozenset[str]]] = []  # (data, tracked tags it is in)
        self.code_blocks: list[str] = []
        self._pre: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if a.get(key):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) is not None and tag in ("a", "link", "img", "script", "source"):
                self.links.append((tag, a[key]))
        if tag in self.open:
            self.open[tag] += 1
        if tag == "pre":
            self._pre = []

    def handle_endtag(self, tag):
        if tag in self.open and self.open[tag]:
            self.open[tag] -= 1
        if tag == "pre" and self._pre is not None:
            self.code_blocks.append("".join(self._pre))
            self._pre = None

    def handle_data(self, data):
        if self._pre is not None:
            self._pre.append(data)
        self.text.append((data, frozenset(t for t, n in self.open.items() if n)))

    def visible_text(self) -> str:
        return "".join(d for d, where in self.text if not where & {"script", "style"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [str(MKDOCS), "build", "--strict", "--clean", "-d", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    pages = {}
    for path in out.rglob("*.html"):
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.relative_to(out).as_posix()] = page
    return {"out": out, "build": done, "pages": pages}


@needs_mkdocs
def test_builds_with_no_warning(site):
    done = site["build"]
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr, done.stderr[-4000:]


@needs_mkdocs
def test_every_internal_link_and_anchor_resolves(site):
    out, pages = site["out"], site["pages"]
    assert "index.html" in pages and len(pages) >= 10, sorted(pages)
    broken = []
    for name, page in sorted(pages.items()):
        if name == "404.html":  # shown by a server only; its links are absolute
            continue
        for tag, url in page.links:
            if EXTERNAL.match(url) or url == "":
                continue
            parts = urllib.parse.urlsplit(url)
            if parts.query and not parts.path:
                continue
            target = posixpath.normpath(
                posixpath.join(posixpath.dirname(name), urllib.parse.unquote(parts.path))
            )
            if not parts.path:
                target = name
            path = out / target
            if target.startswith("..") or not path.is_file():
                why = "a directory (a listing from disk)" if path.is_dir() else "missing"
                broken.append(f"{name}: <{tag}> {url} -> {target}: {why}")
                continue
            if parts.fragment:
                ids = pages[target].ids if target in pages else set()
                if urllib.parse.unquote(parts.fragment) not in ids:
                    broken.append(f"{name}: <{tag}> {url}: no id {parts.fragment!r} in {target}")
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken[:60])


@needs_mkdocs
def test_api_examples_are_code_blocks(site):
    api = {n: p for n, p in site["pages"].items() if n.startswith("api/")}
    assert len(api) >= 4, sorted(site["pages"])
    for name, page in sorted(api.items()):
        prose = [
            d.strip()
            for d, where in page.text
            if ">>>" in d and not where & {"pre", "code", "script", "style"}
        ]
        assert not prose, f"{name}: >>> outside a code block: {prose[:3]}"
        examples = [b for b in page.code_blocks if ">>>" in b]
        assert examples, f"{name}: no example rendered as a code block"
    # every public object with an example in its docstring shows it as code
    top = site["pages"].get("api/jaxamp.html")
    assert top is not None, "no api/jaxamp.html (directory URLs do not work from disk)"
    assert sum(">>>" in b for b in top.code_blocks) >= 40


@needs_mkdocs
def test_api_attribute_tables_have_one_name_per_row(site):
    for name, page in sorted(site["pages"].items()):
        if not name.startswith("api/"):
            continue
        cells = [d for d, where in page.text if where >= {"td", "code"}]
        joined = [c for c in cells if re.fullmatch(r"\w+,", c.strip())]
        assert not joined, f"{name}: a table row names several attributes: {joined}"


@needs_mkdocs
def test_no_raw_sphinx_roles(site):
    for name, page in sorted(site["pages"].items()):
        found = ROLE.findall(page.visible_text())
        assert not found, f"{name}: raw Sphinx roles in the text: {found[:5]}"


@needs_mkdocs
def test_search_works_from_disk(site):
    out = site["out"]
    # the offline plugin's index is a script, which a page opened from file:// can load
    index = out / "search" / "search_index.js"
    assert index.is_file(), sorted(p.name for p in (out / "search").iterdir())
    assert "jaxamp.dynamic_scale" in index.read_text(encoding="utf-8")
    # nor a script from the network (the offline plugin's default iframe-worker shim,
    # which search needs under file://, is on unpkg.com)
    for name, page in site["pages"].items():
        remote = [url for tag, url in page.links if tag == "script" and EXTERNAL.match(url)]
        assert not remote, f"{name} loads scripts from the network: {remote}"


@needs_mkdocs
def test_every_example_and_the_results_have_a_page(site):
    pages = site["pages"]
    for example in sorted((ROOT / "examples").glob("*.py")):
        page = pages.get(f"examples/{example.stem}.html")
        assert page is not None, f"no page for examples/{example.name}"
        source = example.read_text(encoding="utf-8")
        shown = max(page.code_blocks, key=len, default="")
        assert shown.strip() == source.strip(), f"examples/{example.name}: source not shown"
    assert "benchmarks.html" in pages


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@needs_mkdocs
def test_served_as_make_docs_serve_serves_it(site):
    # `make docs-serve` is http.server over the built directory: the pages, their
    # assets and the search index come back, each linked page included.
    handler = functools.partial(QuietHandler, directory=str(site["out"]))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        try:
            for path in ("", "start/pytorch.html", "api/jaxamp.html", "search/search_index.json"):
                with urllib.request.urlopen(base + path, timeout=10) as response:
                    assert response.status == 200, path
                    assert response.read(), path
        finally:
            server.shutdown()
