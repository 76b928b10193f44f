"""The Python blocks of docs/nnx.md run as written, in order, in one namespace."""

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "nnx.md"


def test_nnx_doc_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/nnx.md[python block {i}]", "exec"), namespace)
    assert int(namespace["optimizer"].step) == 1
    assert int(namespace["fresh_opt"].loss_scale.skipped_steps) == 1
