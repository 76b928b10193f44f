"""The README's Python snippets, then docs/guide.md's, run as written, in order, in one
namespace (the guide is the README's long form and builds on its quick start)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_and_guide_python_blocks_run():
    namespace: dict = {}
    for doc, at_least in (("README.md", 1), ("docs/guide.md", 5)):
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
        assert len(blocks) >= at_least, doc
        for i, code in enumerate(blocks):
            exec(compile(code, f"{doc}[python block {i}]", "exec"), namespace)
        if doc == "README.md":  # the quick start trained three finite steps, none skipped
            assert int(namespace["m"]["skipped_steps"]) == 0
