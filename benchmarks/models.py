"""The benchmark model: a GPT-style decoder-only transformer LM in Flax (linen).

Every variant of the benchmark trains this same model on the same batch, so the
only difference between variants is how the optimizer step is protected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Size of the LM and of its training batch."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


SIZES: dict[str, ModelConfig] = {
    # ~7.4M params: 4 layers, tied 16k embedding; a small batch, so that the
    # optimizer step is a visible share of the train step (as in large-model training).
    "default": ModelConfig(vocab=16384, d_model=256, n_layers=4, n_heads=4, seq_len=32, batch=2),
    # ~124M params, GPT-2 small shape; for a GPU.
    "large": ModelConfig(vocab=50304, d_model=768, n_layers=12, n_heads=12, seq_len=1024, batch=8),
    # ~0.9B params (d_model 2048, 16 layers of 16 heads of 128, every dimension a
    # multiple of 128): where FP8's GEMMs can pay (issue 46's ~1B row); for a GPU.
    "xl": ModelConfig(vocab=50304, d_model=2048, n_layers=16, n_heads=16, seq_len=1024, batch=8),
    # Many small leaves (132: biases, norm scales and 64-wide kernels, 8 layers): what a
    # per-leaf cost (a check's reduction, a copy) weighs when the leaves are many and small.
    "many_leaves": ModelConfig(vocab=512, d_model=64, n_layers=8, n_heads=4, seq_len=16, batch=2),
    # For the smoke test only.
    "tiny": ModelConfig(vocab=256, d_model=32, n_layers=1, n_heads=2, seq_len=8, batch=2),
}


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    cfg: ModelConfig
    dtype: Any = None  # Flax computation dtype; None: from the inputs and params (float32)

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        dt = self.dtype
        h = nn.LayerNorm(dtype=dt)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.cfg.n_heads, use_bias=True, dtype=dt)(
            h, h, mask=mask
        )
        x = x + h
        h = nn.LayerNorm(dtype=dt)(x)
        h = nn.Dense(self.cfg.d_ff, dtype=dt)(h)
        h = nn.gelu(h)
        h = nn.Dense(self.cfg.d_model, dtype=dt)(h)
        return x + h


class TransformerLM(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, tied output projection.

    ``dtype`` is Flax's computation dtype for every layer (params stay float32): the
    hand-cast mixed-precision model that ``benchmarks/gpu.py`` compares with autocast.
    The default (None) is the float32 model every ``run.py`` variant trains.
    """

    cfg: ModelConfig
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, dtype=self.dtype)
        pos = self.param(
            "pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model), jnp.float32
        )
        x = embed(tokens) + pos[: tokens.shape[-1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(cfg.n_layers):
            x = Block(cfg, self.dtype)(x, mask)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return embed.attend(x)


def build(
    size: str | ModelConfig, seed: int = 0
) -> tuple[TransformerLM, Any, tuple[jax.Array, jax.Array]]:
    """Returns ``(model, params, (inputs, targets))`` for a named size or a config.

    The batch is random tokens; targets are the inputs shifted by one.
    """
    cfg = SIZES[size] if isinstance(size, str) else size
    model = TransformerLM(cfg)
    k_init, k_data = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_data, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = model.init(k_init, inputs)["params"]
    return model, params, (inputs, targets)


def loss_fn(model: TransformerLM, params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy, in float32."""
    inputs, targets = batch
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


def param_count(params: Any) -> int:
    """Number of scalars in ``params``."""
    return sum(int(x.size) for x in jax.tree.leaves(params))
