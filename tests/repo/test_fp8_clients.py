"""benchmarks/fp8_clients.py on a stand-in for flax's lm1b models.py (CI has no flax
checkout): a module loaded by path under a name of its own, its FP8 products counted,
trained by the harness's loop."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_clients  # noqa: E402

import jaxamp  # noqa: E402
from tests.conformance import fp8  # noqa: E402

# The interface fp8_clients uses of examples/lm1b/models.py: a config taking the
# fields it sets, and a linen TransformerLM(config) of token ids giving logits.
STAND_IN = """
import dataclasses

import flax.linen as nn


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    output_vocab_size: int
    emb_dim: int = 32
    mlp_dim: int = 32
    max_len: int = 64


class TransformerLM(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        c = self.config
        y = nn.Embed(c.vocab_size, c.emb_dim)(inputs)
        y = nn.relu(nn.Dense(c.mlp_dim)(y))
        y = nn.relu(nn.Dense(c.emb_dim)(y))
        return nn.Dense(c.output_vocab_size)(y)
"""
CONFIG = {"vocab_size": 256, "output_vocab_size": 256}


def test_lm1b_without_models_py_names_the_flag_and_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--lm1b .*examples/lm1b"):
        fp8_clients.load_lm1b(tmp_path)


def test_too_few_steps_are_named_by_the_flag(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        fp8_clients.main(["--lm1b", str(tmp_path), "--steps", "0"])
    assert "--steps 0: train at least 2 steps" in capsys.readouterr().err


def test_a_client_loaded_by_path_trains_in_fp8_with_its_products_counted(tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text(STAND_IN)
    module = fp8_clients.load_lm1b(tmp_path)
    # benchmarks/models.py and tests/conformance/models.py exist: no clash with either.
    assert module.__name__ == "flax_examples_lm1b_models"
    assert sys.modules.get("models") is not module
    task = fp8_clients.Lm1bTask(module, CONFIG)
    init = task.final_loss(task.built.params, jnp.float32)
    apply = jaxamp.autocast(task.built.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8("tensorwise"))
    # The middle Dense (first and last layer stay bfloat16).
    assert fp8._products(apply, task.built)["fp8"] == 1
    run = fp8_clients.train(task, apply, 2)
    assert run["skipped"] == 0 and math.isfinite(run["final"])
    assert run["final"] < init  # the warmup's one step at the peak learning rate trained it


def test_every_row_runs_and_is_judged_against_bfloat16_autocast(tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text(STAND_IN)
    module = fp8_clients.load_lm1b(tmp_path)
    task = fp8_clients.Lm1bTask(module, CONFIG)
    result = fp8_clients.run(task, steps=2, noise_seeds=1, log=lambda _: None)
    names = [r["row"] for r in result["rows"]]
    selected = [f"fp8 {s}, fp8_select (budget 0.05)" for s in fp8.SCALINGS] + [
        f"fp8 {s}, fp8_select (budget 0.05, 2 other batches)" for s in fp8.SCALINGS
    ]
    assert names == ["float32", "bfloat16 autocast", "fp8 tensorwise", "fp8 rowwise", *selected]
    bf16, f32 = result["rows"][1]["final"], result["rows"][0]["final"]
    for r in result["rows"]:
        assert r["ratio_bf16"] == r["final"] / bf16 and r["ratio_f32"] == r["final"] / f32
        assert r["meets_goal"] == (abs(r["ratio_bf16"] - 1) <= fp8.GOAL) and r["skipped"] == 0
    # One candidate layer (the middle Dense): the selection keeps it or says why not.
    assert all(len(r["selection"]["modules"]) == 1 for r in result["rows"][4:])
    assert len(result["noise"]["ratios"]) == 1
    table = fp8_clients.format_table(result).splitlines()
    assert [line.split(" | ")[0] for line in table[2:10]] == [f"| {n}" for n in names]
    # The other batches' sampling noise is measured (nonzero: they differ from the first).
    assert all(r["selection"]["noise"] > 0 for r in result["rows"][6:])
    json.dumps(result, default=float)  # what --out writes
