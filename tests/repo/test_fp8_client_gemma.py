"""benchmarks/fp8_client_gemma.py on a stand-in for flax's examples/gemma (CI has no flax
checkout): modules that import each other by flat names, loaded without leaving them on
``sys.path`` or in ``sys.modules``, an nnx model merged inside the function, its FP8
products counted, trained by fp8_clients' loop."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_client_gemma  # noqa: E402
import fp8_clients  # noqa: E402

import jaxamp  # noqa: E402
from tests.conformance import fp8  # noqa: E402

# The interface fp8_client_gemma uses of examples/gemma: transformer_cfg's config and
# AttentionType, transformer's nnx Transformer(config, rngs=...) called as
# (tokens, positions, cache, attention_mask) -> (logits, cache), and its mask and
# position helpers; the modules import each other by flat names, as the example's do.
STAND_IN_CFG = """
import dataclasses
import enum


class AttentionType(enum.Enum):
    GLOBAL = 1


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    num_embed: int
    embed_dim: int
    hidden_dim: int
    attention_types: tuple
"""
STAND_IN_MODULES = """
from flax import nnx


class FeedForward(nnx.Module):
    def __init__(self, features, hidden, *, rngs):
        self.up = nnx.Linear(features, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, features, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))
"""
STAND_IN_TRANSFORMER = """
import jax.numpy as jnp
from flax import nnx

import modules
from transformer_cfg import TransformerConfig


class Transformer(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs):
        self.embedder = nnx.Embed(config.num_embed, config.embed_dim, rngs=rngs)
        self.position = nnx.Embed(64, config.embed_dim, rngs=rngs)
        self.mlp = modules.FeedForward(config.embed_dim, config.hidden_dim, rngs=rngs)

    def __call__(self, last_tokens, positions, cache, attention_mask):
        x = self.embedder(last_tokens) + self.position(positions)
        x = x + self.mlp(x)
        # the causal mean of the earlier tokens: a batched product (bf16 by default)
        mask = attention_mask.astype(x.dtype)
        x = x + jnp.einsum("BTS,BSD->BTD", mask, x) / mask.sum(-1, keepdims=True)
        return self.embedder.attend(x), cache


def make_causal_attn_mask(input_mask):
    causal = jnp.tril(jnp.ones((input_mask.shape[-1],) * 2, dtype=jnp.bool_))
    return input_mask[..., None, :] * causal[None]


def build_positions_from_mask(input_mask):
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)
"""
CONFIG = {"num_embed": 256, "embed_dim": 32, "hidden_dim": 64, "attention_types": ("GLOBAL",)}


def _stand_in(directory: Path, transformer: str = STAND_IN_TRANSFORMER) -> Path:
    (directory / "transformer_cfg.py").write_text(STAND_IN_CFG)
    (directory / "modules.py").write_text(STAND_IN_MODULES)
    (directory / "transformer.py").write_text(transformer)
    return directory


def test_gemma_without_the_example_names_the_flag_and_what_to_give(tmp_path: Path) -> None:
    (tmp_path / "transformer.py").write_text("")
    with pytest.raises(FileNotFoundError, match=r"--gemma .*transformer_cfg.py.*examples/gemma"):
        fp8_client_gemma.load_gemma(tmp_path)


def test_a_package_the_example_imports_that_is_missing_is_named(tmp_path: Path) -> None:
    # The real example imports jaxtyping, which jaxamp's own dependencies do not bring.
    _stand_in(tmp_path, "import jaxamp_test_absent_package\n")
    with pytest.raises(
        ModuleNotFoundError, match=r"--gemma .*imports jaxamp_test_absent_package, .*pip install"
    ):
        fp8_client_gemma.load_gemma(tmp_path)
    assert str(tmp_path) not in sys.path and "modules" not in sys.modules


def test_the_examples_flat_modules_are_imported_and_not_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module of ours named as one of the example's: shadowed while the example is
    # imported, put back after; the example's own are not left in sys.modules.
    ours = types.ModuleType("modules")
    monkeypatch.setitem(sys.modules, "modules", ours)
    path_before = list(sys.path)
    example = fp8_client_gemma.load_gemma(_stand_in(tmp_path))
    assert sys.modules["modules"] is ours and sys.path == path_before
    assert "transformer" not in sys.modules and "transformer_cfg" not in sys.modules
    assert Path(example.transformer.__file__).parent == tmp_path
    assert example.transformer.modules is not ours
    assert example.transformer.TransformerConfig is example.transformer_cfg.TransformerConfig


def test_the_nnx_client_trains_in_fp8_with_its_products_counted(tmp_path: Path) -> None:
    task = fp8_client_gemma.GemmaTask(fp8_client_gemma.load_gemma(_stand_in(tmp_path)), CONFIG)
    window = task.batch(0)
    batch = task.built.batch
    assert (batch["inputs"] == window[:, :-1]).all() and (batch["labels"] == window[:, 1:]).all()
    init = task.final_loss(task.built.params, jnp.float32)
    apply = jaxamp.autocast(task.built.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8("tensorwise"))
    # mlp.down: the first layer (mlp.up), the tied attend (the last) and the batched
    # product stay bfloat16.
    products = fp8._products(apply, task.built)
    assert (products["fp8"], products["total"]) == (1, 4)
    run = fp8_clients.train(task, apply, 2)
    assert run["skipped"] == 0 and math.isfinite(run["final"])
    assert run["final"] < init  # the warmup's one step at the peak learning rate trained it


def test_every_row_of_the_nnx_client_runs_with_its_layers_named(tmp_path: Path) -> None:
    task = fp8_client_gemma.GemmaTask(fp8_client_gemma.load_gemma(_stand_in(tmp_path)), CONFIG)
    result = fp8_clients.run(task, steps=2, noise_seeds=0, log=lambda _: None)
    assert [r["row"] for r in result["rows"]][:4] == [
        "float32", "bfloat16 autocast", "fp8 tensorwise", "fp8 rowwise"
    ]  # fmt: skip
    # The model is merged from its params inside the function: its one candidate layer
    # is named by the weight it reads.
    assert all(list(r["selection"]["modules"]) == ["mlp/down/kernel"] for r in result["rows"][4:])
    assert result["config"] == {**CONFIG, "batch": task.bsz, "seq": task.seq}
    json.dumps(result, default=float)  # what --out writes
