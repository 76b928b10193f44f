"""The Python blocks of docs/fp8.md run as written, in order, in one namespace, and
train the page's MLP with FP8 products where the page says."""

import pathlib
import re

import jax

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "fp8.md"


def test_fp8_page_runs_and_its_mlp_has_fp8_products():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/fp8.md[python block {i}]", "exec"), namespace)
    jaxamp, ns = namespace["jaxamp"], namespace
    report = jaxamp.audit(jax.grad(ns["loss_fn"]))(ns["params"], ns["x"], ns["y"])
    fp8 = {(r.module, r.pass_) for r in report.matmuls if r.requested.startswith("f8")}
    # "Dense_1 and Dense_2 in FP8; the first and the last layer stay bfloat16"
    assert {m for m, _ in fp8} == {"MLP/Dense_1", "MLP/Dense_2"}
    assert {p for _, p in fp8} == {"forward", "backward"}
