"""The conformance models: other people's model code, installed from PyPI, tiny configs.

Each builder returns a :class:`Built`: float32 params, model state (BatchNorm
statistics) if any, a padded batch, the float32 forward ``apply(params, state,
batch) -> (logits, new_state)`` and, where the package has a compute-``dtype``
knob, ``hand(dtype)``: the same model built with ``dtype=`` (params stay
float32), same signature. The only code here is glue: configs, random inputs,
and (for flax, nnx and equinox, which ship layers, not models) a few lines that
stack the package's own layers.

A builder imports its package itself; ``harness.build`` turns an ImportError
into ``pytest.skip`` with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BATCH, SEQ, VOCAB, WIDTH, HEADS, LAYERS = 4, 16, 96, 32, 4, 2
# Valid tokens per row: full, padded, padded, and one row that is all padding,
# so that every query of that row has every key masked (where masks are
# query x key) and every query row of a key-padding mask sees no key.
LENGTHS = (16, 11, 5, 0)


@dataclasses.dataclass
class Built:
    params: Any
    state: Any
    batch: dict[str, Any]
    apply: Callable[..., tuple[jax.Array, Any]]
    hand: Callable[[Any], Callable[..., tuple[jax.Array, Any]]] | None
    lr: float = 3e-3
    notes: str = ""
    # Further batches the forward / gradient probe averages over, where one batch's
    # figures are noise (small-batch BatchNorm); training uses ``batch``.
    more_batches: tuple[dict[str, Any], ...] = ()
    # loss(output, batch) -> float32 scalar; None: the harness's weighted
    # cross-entropy of logits against ``batch["labels"]``.
    loss: Callable[[jax.Array, dict[str, Any]], jax.Array] | None = None
    # Compute dtypes whose range the model's own inputs leave (raw features):
    # there autocast must overflow visibly (non-finite outputs, skipped steps)
    # or match float32, never give finite outputs from clipped values.
    beyond_range: tuple[str, ...] = ()


def _valid(lengths: tuple[int, ...] = LENGTHS, seq: int = SEQ) -> np.ndarray:
    return (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def _tokens(seed: int, shape: tuple[int, ...], vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, vocab, shape).astype(np.int32)


def _lm_batch(seed: int = 0) -> dict[str, Any]:
    """Token ids (0 at padding), the mask, random targets and loss weights (valid tokens)."""
    valid = _valid()
    ids = _tokens(seed, (BATCH, SEQ)) * valid
    return {
        "ids": jnp.asarray(ids),
        "mask": jnp.asarray(valid),
        "labels": jnp.asarray(_tokens(seed + 1, (BATCH, SEQ))),
        "weights": jnp.asarray(valid, jnp.float32),
    }


# ---------------------------------------------------------------- flax linen


def flax_linen_transformer() -> Built:
    """Causal LM of flax's Embed, MultiHeadDotProductAttention, LayerNorm, Dense.

    Masks from ``nn.make_attention_mask`` & ``nn.make_causal_mask``; flax turns
    them into a ``jnp.finfo(float32).min`` bias (the all-padding row's queries see
    no key at all).
    """
    import flax.linen as nn

    class Block(nn.Module):
        dtype: Any = None

        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            h = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=self.dtype)(
                nn.LayerNorm(dtype=self.dtype)(x), mask=mask
            )
            x = x + h
            h = nn.Dense(4 * WIDTH, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
            return x + nn.Dense(WIDTH, dtype=self.dtype)(nn.gelu(h))

    class LM(nn.Module):
        dtype: Any = None

        @nn.compact
        def __call__(self, ids: jax.Array, valid: jax.Array) -> jax.Array:
            mask = nn.combine_masks(nn.make_attention_mask(valid, valid), nn.make_causal_mask(ids))
            x = nn.Embed(VOCAB, WIDTH, dtype=self.dtype)(ids)
            for _ in range(LAYERS):
                x = Block(self.dtype)(x, mask)
            return nn.Dense(VOCAB, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))

    batch = _lm_batch()
    params = jax.jit(LM().init)(jax.random.key(0), batch["ids"], batch["mask"])

    def make(dtype: Any) -> Callable[..., Any]:
        model = LM(dtype)
        return lambda p, s, b: (model.apply(p, b["ids"], b["mask"]), s)

    return Built(params, None, batch, make(None), make)


def flax_linen_lstm() -> Built:
    """flax's ``nn.RNN(nn.OptimizedLSTMCell)`` (a scan) with ``seq_lengths`` padding."""
    import flax.linen as nn

    class Tagger(nn.Module):
        dtype: Any = None

        @nn.compact
        def __call__(self, ids: jax.Array, lengths: jax.Array) -> jax.Array:
            x = nn.Embed(VOCAB, WIDTH, dtype=self.dtype)(ids)
            for _ in range(LAYERS):
                x = nn.RNN(nn.OptimizedLSTMCell(WIDTH, dtype=self.dtype))(x, seq_lengths=lengths)
            return nn.Dense(VOCAB, dtype=self.dtype)(x)

    batch = _lm_batch()
    batch["lengths"] = jnp.asarray(LENGTHS, jnp.int32)
    params = jax.jit(Tagger().init)(jax.random.key(0), batch["ids"], batch["lengths"])

    def make(dtype: Any) -> Callable[..., Any]:
        model = Tagger(dtype)
        return lambda p, s, b: (model.apply(p, b["ids"], b["lengths"]), s)

    return Built(params, None, batch, make(None), make, lr=1e-2)


# ---------------------------------------------------------------- flax nnx


def _nnx_attention_lm(dtype: Any, rngs: Any, parallel: str | None = None) -> Any:
    """Embed, nnx.MultiHeadAttention (padding & causal mask), LayerNorm, Linear head.

    ``parallel="tensor"``: kernels annotated with ``nnx.with_partitioning`` for
    tensor parallelism over 'data' (heads and the MLP hidden dim split across
    devices); ``"data"``: the embedding lookup's output sharded along 'data'
    like its (batch-sharded) token ids, as an Explicit mesh requires.
    """
    sharded = parallel == "tensor"
    from flax import nnx

    def init(base: Any, spec: tuple[Any, ...]) -> Any:
        return nnx.with_partitioning(base, spec) if sharded else base

    dense = nnx.initializers.lecun_normal()

    class LM(nnx.Module):
        def __init__(self) -> None:
            self.embed = nnx.Embed(VOCAB, WIDTH, dtype=dtype, rngs=rngs)
            self.ln1 = nnx.LayerNorm(WIDTH, dtype=dtype, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=HEADS if not sharded else 8,
                in_features=WIDTH,
                qkv_features=WIDTH if not sharded else 64,
                decode=False,
                dtype=dtype,
                kernel_init=init(dense, (None, "data", None)),
                out_kernel_init=init(dense, ("data", None, None)),
                rngs=rngs,
            )
            self.ln2 = nnx.LayerNorm(WIDTH, dtype=dtype, rngs=rngs)
            self.up = nnx.Linear(WIDTH, 64, dtype=dtype, kernel_init=init(dense, (None, "data")),
                                 rngs=rngs)  # fmt: skip
            self.down = nnx.Linear(64, WIDTH, dtype=dtype,
                                   kernel_init=init(dense, ("data", None)), rngs=rngs)  # fmt: skip
            self.head = nnx.Linear(WIDTH, VOCAB, dtype=dtype, rngs=rngs)

        def __call__(self, ids: jax.Array, valid: jax.Array) -> jax.Array:
            mask = nnx.combine_masks(
                nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(ids)
            )
            # Contracting over a sharded dim (heads, MLP hidden): the output is
            # replicated (an all-reduce), which an Explicit mesh wants spelled out.
            P = jax.sharding.PartitionSpec
            out = P() if sharded else None
            x = self.embed(ids, out_sharding=P("data") if parallel == "data" else None)
            x = x + self.attn(self.ln1(x), mask=mask, deterministic=True, out_sharding=out)
            x = x + self.down(nnx.gelu(self.up(self.ln2(x))), out_sharding=out)
            return self.head(x)

    return LM()


def nnx_attention_lm(parallel: str | None = None) -> Built:
    from flax import nnx

    batch = _lm_batch()
    graphdef, params = nnx.split(_nnx_attention_lm(None, nnx.Rngs(0), parallel), nnx.Param)

    def make(dtype: Any) -> Callable[..., Any]:
        g = nnx.split(_nnx_attention_lm(dtype, nnx.Rngs(0), parallel), nnx.Param)[0]

        def apply(p: Any, s: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
            return nnx.merge(g, p)(b["ids"], b["mask"]), s

        return apply

    return Built(params, None, batch, make(None), make)


# ---------------------------------------------------------------- transformers


def _hf(model_cls: Any, config: Any, call: Callable[..., Any]) -> tuple[Any, Callable[..., Any]]:
    """Random-init params (no download) and ``make(dtype)`` for a transformers Flax model."""
    model = model_cls(config, seed=0, _do_init=False)
    # what _do_init=True runs, jitted (eagerly it dispatches op by op: seconds)
    params = jax.jit(model.init_weights, static_argnums=1)(model.key, model.input_shape)

    def make(dtype: Any) -> Callable[..., Any]:
        m = model if dtype is None else model_cls(config, seed=0, dtype=dtype, _do_init=False)
        return lambda p, s, b: (call(m, p, b).logits, s)

    return params, make


def hf_gpt2() -> Built:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS,
                     n_head=HEADS)  # fmt: skip
    params, make = _hf(FlaxGPT2LMHeadModel, cfg,
                       lambda m, p, b: m(b["ids"], attention_mask=b["mask"], params=p))  # fmt: skip
    return Built(params, None, _lm_batch(), make(None), make)


def hf_bert() -> Built:
    from transformers import BertConfig, FlaxBertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, intermediate_size=4 * WIDTH,
                     max_position_embeddings=SEQ)  # fmt: skip
    params, make = _hf(FlaxBertForMaskedLM, cfg,
                       lambda m, p, b: m(b["ids"], attention_mask=b["mask"], params=p))  # fmt: skip
    return Built(params, None, _lm_batch(), make(None), make)


class _JnpWithClipAMax:
    """``jax.numpy`` for transformers' Flax T5, which calls ``jnp.clip(x, a_max=...)``.

    jax 0.10 removed clip's ``a_min`` / ``a_max`` (now ``min`` / ``max``); the
    last transformers with Flax models (4.57.6) still passes them. Installed as
    the ``jnp`` of ``modeling_flax_t5`` only: nothing else in the process sees it.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(jnp, name)

    @staticmethod
    def clip(x: Any, a_min: Any = None, a_max: Any = None, **kw: Any) -> Any:
        return jnp.clip(x, kw.pop("min", a_min), kw.pop("max", a_max), **kw)


def hf_t5() -> Built:
    from transformers import FlaxT5ForConditionalGeneration, T5Config
    from transformers.models.t5 import modeling_flax_t5

    modeling_flax_t5.jnp = _JnpWithClipAMax()  # see the class's docstring

    cfg = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=4 * WIDTH,
                   num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                   relative_attention_num_buckets=8, decoder_start_token_id=0)  # fmt: skip
    batch = _lm_batch()
    batch["dec_ids"] = jnp.asarray(_tokens(7, (BATCH, SEQ)) * _valid(LENGTHS[::-1]))
    batch["dec_mask"] = jnp.asarray(_valid(LENGTHS[::-1]))
    batch["weights"] = jnp.asarray(_valid(LENGTHS[::-1]), jnp.float32)

    def call(m: Any, p: Any, b: dict[str, Any]) -> Any:
        return m(b["ids"], attention_mask=b["mask"], decoder_input_ids=b["dec_ids"],
                 decoder_attention_mask=b["dec_mask"], params=p)  # fmt: skip

    params, make = _hf(FlaxT5ForConditionalGeneration, cfg, call)
    return Built(params, None, batch, make(None), make,
                 notes="jnp.clip(a_max=) shim for jax 0.10")  # fmt: skip


def hf_vit() -> Built:
    from transformers import FlaxViTForImageClassification, ViTConfig

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=WIDTH,
                    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    intermediate_size=4 * WIDTH, num_labels=10)  # fmt: skip
    params, make = _hf(FlaxViTForImageClassification, cfg,
                       lambda m, p, b: m(b["pixels"], params=p))  # fmt: skip
    return Built(params, None, _image_batch(channels_first=True), make(None), make,
                 notes="no padding (images)")  # fmt: skip


def _image_batch(
    channels_first: bool = False, size: int = 16, batch: int = BATCH, seed: int = 3
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(batch, size, size, 3)).astype(np.float32)
    if channels_first:
        x = x.transpose(0, 3, 1, 2)
    return {
        "pixels": jnp.asarray(x),
        "labels": jnp.asarray(rng.integers(0, 10, (batch,)).astype(np.int32)),
        "weights": jnp.ones((batch,), jnp.float32),
    }


# ---------------------------------------------------------------- flaxmodels


# ResNet18 halves the resolution five times: at 32x32 its last stage is 1x1, and a
# train-mode BatchNorm there normalises each channel over 4 numbers. Any rounding
# then moves the gradient at random (float16 and bfloat16, autocast and hand-cast
# alike: cosines from 0.61 to 0.81 over 4 seeds, hand-cast's final loss 1.09-1.11x
# float32's); 8 images of 64x64 give the last BatchNorm 32 values per channel.
RESNET_BATCH, RESNET_SIZE, RESNET_PROBES = 8, 64, 4


def flaxmodels_resnet18() -> Built:
    """flaxmodels' ResNet18 (BatchNorm in training mode: batch statistics are model state)."""
    import flaxmodels

    batches = [
        _image_batch(size=RESNET_SIZE, batch=RESNET_BATCH, seed=3 + i) for i in range(RESNET_PROBES)
    ]
    init = flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=10).init
    variables = jax.jit(init, static_argnames="train")(
        jax.random.key(0), batches[0]["pixels"], train=True
    )

    def make(dtype: Any) -> Callable[..., Any]:
        name = "float32" if dtype is None else jnp.dtype(dtype).name
        model = flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=10, dtype=name)

        def apply(p: Any, s: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
            y, new = model.apply({"params": p, **s}, b["pixels"], train=True,
                                 mutable=["batch_stats"])  # fmt: skip
            return y, new

        return apply

    state = {"batch_stats": variables["batch_stats"]}
    # A small rate keeps the final loss O(1), where a 2% comparison means something.
    return Built(variables["params"], state, batches[0], make(None), make, lr=5e-7,
                 notes=f"BatchNorm, no padding; {RESNET_BATCH} images of {RESNET_SIZE}x"
                 f"{RESNET_SIZE}; forward / gradient figures: mean over {RESNET_PROBES} "
                 "batches", more_batches=tuple(batches[1:]))  # fmt: skip


# ---------------------------------------------------------------- equinox


def equinox_transformer() -> Built:
    """equinox's Embedding, MultiheadAttention (boolean padding & causal mask), LayerNorm, MLP.

    Equinox has no compute-dtype knob (its ``dtype=`` is the parameter dtype),
    so there is no hand-cast variant.
    """
    import equinox as eqx

    keys = jax.random.split(jax.random.key(0), 8)

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        attn: list[eqx.nn.MultiheadAttention]
        ln: list[eqx.nn.LayerNorm]
        mlp: list[eqx.nn.MLP]
        head: eqx.nn.Linear

        def __call__(self, ids: jax.Array, valid: jax.Array) -> jax.Array:
            mask = (valid[:, None] & valid[None, :] & jnp.tri(SEQ, dtype=bool)).astype(bool)
            x = jax.vmap(self.embed)(ids)
            for i in range(LAYERS):
                h = jax.vmap(self.ln[2 * i])(x)
                x = x + self.attn[i](h, h, h, mask=mask)
                x = x + jax.vmap(self.mlp[i])(jax.vmap(self.ln[2 * i + 1])(x))
            return jax.vmap(self.head)(x)

    model = LM(
        eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0]),
        [eqx.nn.MultiheadAttention(HEADS, WIDTH, key=keys[1 + i]) for i in range(LAYERS)],
        [eqx.nn.LayerNorm(WIDTH) for _ in range(2 * LAYERS)],
        [
            eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, activation=jax.nn.gelu, key=keys[4 + i])
            for i in range(LAYERS)
        ],  # fmt: skip
        eqx.nn.Linear(WIDTH, VOCAB, key=keys[7]),
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def apply(p: Any, s: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
        m = eqx.combine(p, static)
        return jax.vmap(m)(b["ids"], b["mask"].astype(bool)), s

    return Built(params, None, _lm_batch(), apply, None,
                 notes="no compute-dtype knob: no hand-cast")  # fmt: skip


def _more(name: str) -> Callable[[], Built]:
    """A builder of ``models_more`` (kept there: this module would pass 400 lines)."""

    def builder() -> Built:
        from . import models_more

        return getattr(models_more, name)()

    builder.__name__ = name
    return builder


# name -> (pip distribution for the skip message, builder)
MODELS: dict[str, tuple[str, Callable[[], Built]]] = {
    "flax-linen-transformer": ("flax", flax_linen_transformer),
    "flax-linen-lstm": ("flax", flax_linen_lstm),
    "flax-nnx-attention": ("flax", nnx_attention_lm),
    "hf-gpt2": ("transformers", hf_gpt2),
    "hf-bert-mlm": ("transformers", hf_bert),
    "hf-t5": ("transformers", hf_t5),
    "hf-vit": ("transformers", hf_vit),
    "flaxmodels-resnet18": ("flaxmodels", flaxmodels_resnet18),
    "equinox-transformer": ("equinox", equinox_transformer),
    "diffusers-unet": ("diffusers", _more("diffusers_unet")),
    "jraph-gnn": ("jraph", _more("jraph_gnn")),
    "equinox-batchnorm-cnn": ("equinox", _more("equinox_batchnorm_cnn")),
}
