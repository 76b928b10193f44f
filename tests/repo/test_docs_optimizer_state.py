"""docs/optimizer_state.md runs as written: its Python blocks, in order, in one
namespace (each builds on the first's params and grads), and the measured table is the
one `make bench` writes, included, not copied."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np

import jaxamp

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "optimizer_state.md"


def test_the_pages_python_blocks_run():
    codes = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(codes) == 4
    ns: dict = {}
    for i, code in enumerate(codes):
        exec(compile(code, f"docs/optimizer_state.md[python block {i}]", "exec"), ns)
    # the checkpoint's float32 state went into 8 bits and back, counts carried over
    plain = ns["plain"].init(ns["params"])
    assert jax.tree.structure(ns["back"]) == jax.tree.structure(plain)
    assert isinstance(ns["opt_state"].inner_state, jaxamp.types.LowPrecisionState)
    jax.tree.map(np.testing.assert_array_equal, ns["back"], plain)  # zeros stay zeros


def test_the_measured_table_is_included_from_what_make_bench_writes():
    assert '--8<-- "docs/_generated/optimizer_state_table.md"' in PAGE.read_text()
