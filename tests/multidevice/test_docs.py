"""The Python blocks of docs/distributed.md run as written, in order, on 8 devices."""

from __future__ import annotations

import pathlib
import re

import jax

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed.md"


def test_distributed_doc_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/distributed.md[python block {i}]", "exec"), namespace)
    assert jax.device_count() == 8
    # The FSDP restore really is sharded over the 8 devices.
    w = namespace["train"]["params"]["w"]
    assert len({s.device for s in w.addressable_shards}) == 8
    assert not w.sharding.is_fully_replicated
    assert int(namespace["dp_opt_state"].loss_scale.skipped_steps) == 0
    assert namespace["migrated"].loss_scale.scale.dtype == "float32"
