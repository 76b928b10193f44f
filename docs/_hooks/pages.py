"""MkDocs hook: pages for the files outside docs/ that the documentation links to.

Each ``examples/*.py`` becomes ``examples/<name>.md`` (its docstring, how to run it,
its source, as it is in the repository), with an index page ``examples/index.md``;
``benchmarks/RESULTS.md`` becomes ``benchmarks.md``. Generated at build time, so a
page can never show an older copy of the file.
"""

from __future__ import annotations

import ast
import pathlib
import re

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A Markdown link whose target is relative and not a page of this site: in
# RESULTS.md, raw result files under benchmarks/.
RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?![a-z]+:|#)([^)#]+)\)")


def _fence(source: str) -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", source)), default=0)
    return "`" * max(3, longest + 1)


def _example_page(path: pathlib.Path) -> str:
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source)) or ""
    fence = _fence(source)
    return (
        # no table of contents: the width goes to the source, written to 100 columns
        "---\nhide:\n  - toc\n---\n\n"
        f"# `examples/{path.name}`\n\n{doc}\n\n"
        f"Run it from the repository root, after `make test` or `make demo` has created "
        f"the environment: `.venv/bin/python examples/{path.name}` "
        f"(`tests/repo/test_examples.py` runs every example).\n\n"
        f'{fence}python title="examples/{path.name}"\n{source.rstrip()}\n{fence}\n'
    )


def _examples_index(paths: list[pathlib.Path]) -> str:
    rows = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ")
        rows.append(f"| [`{path.name}`]({path.stem}.md) | {summary} |")
    return (
        "# Examples\n\n"
        "Each runs as `.venv/bin/python examples/NAME.py` from the repository root, after "
        "`make test` or `make demo` has created the environment; `tests/repo/test_examples.py` "
        "runs them all. The PyTorch AMP recipes they port are listed in "
        "[the tour](../guide.md#every-pytorch-amp-recipe-as-a-runnable-example).\n\n"
        "| example | what it shows |\n|---|---|\n" + "\n".join(rows) + "\n"
    )


def _results_page() -> str:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")

    def outside(m: re.Match) -> str:
        return f"{m.group(1)} (`benchmarks/{m.group(2)}` in the repository)"

    return RELATIVE_LINK.sub(outside, text)


def on_files(files: Files, config) -> Files:
    examples = sorted((ROOT / "examples").glob("*.py"))
    for path in examples:
        files.append(
            File.generated(config, f"examples/{path.stem}.md", content=_example_page(path))
        )
    files.append(File.generated(config, "examples/index.md", content=_examples_index(examples)))
    files.append(File.generated(config, "benchmarks.md", content=_results_page()))
    return files
