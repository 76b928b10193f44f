"""The README's Python snippets run as written, in order, in one namespace."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md[python block {i}]", "exec"), namespace)
    # The quick start trained three finite steps with nothing skipped.
    assert int(namespace["m"]["skipped_steps"]) == 0
