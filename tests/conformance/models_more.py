"""More conformance models (``models.MODELS`` lists them): a diffusion UNet, a GNN
on raw features, an equinox CNN with BatchNorm state.

* diffusers' Flax ``FlaxUNet2DConditionModel`` (0.39 is the last diffusers with
  Flax classes), a tiny config, random init, no download; the loss is the
  denoising objective (mean squared error to the noise), not cross-entropy.
* a jraph ``GraphNetwork`` stack shaped like the ogbg-molpcba GraphConvNet
  (node / edge embedding, message passing with MLPs, a global readout, 128
  binary tasks with missing labels masked) on raw, unnormalised node features
  up to 3.5e5: past float16's range. There autocast must overflow visibly
  (inf, a skipped step, a ``find_overflow`` report) or match float32, never
  give finite logits computed from clipped inputs (``Built.beyond_range``).
* equinox ``Conv2d`` + ``BatchNorm`` (``mode="batch"``): the running statistics
  are an ``eqx.nn.State``, model state threaded through the step like linen's
  ``batch_stats``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .models import BATCH, Built, _image_batch

# ---------------------------------------------------------------- diffusers


def _noise_mse(pred: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """The denoising loss: mean squared error to the noise, in float32."""
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - batch["noise"]))


def diffusers_unet() -> Built:
    """Cross-attention down / up blocks, a mid block, GroupNorm(32): SD's UNet, 8x8 latents."""
    from diffusers import FlaxUNet2DConditionModel

    config = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        attention_head_dim=8,
        cross_attention_dim=32,
    )
    rng = np.random.default_rng(11)
    batch = {
        "sample": jnp.asarray(rng.normal(size=(BATCH, 4, 8, 8)), jnp.float32),
        "timesteps": jnp.asarray(rng.integers(0, 1000, (BATCH,)), jnp.int32),
        "context": jnp.asarray(rng.normal(size=(BATCH, 6, 32)), jnp.float32),
        "noise": jnp.asarray(rng.normal(size=(BATCH, 4, 8, 8)), jnp.float32),
    }
    params = jax.jit(FlaxUNet2DConditionModel(**config).init_weights)(jax.random.key(0))

    def make(dtype: Any) -> Callable[..., Any]:
        model = FlaxUNet2DConditionModel(**config, dtype=jnp.float32 if dtype is None else dtype)

        def apply(p: Any, s: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
            out = model.apply({"params": p}, b["sample"], b["timesteps"], b["context"])
            return out.sample, s

        return apply

    # At the suite's 3e-3, 30 steps fit the one batch's noise to a loss of 0.003; a
    # smaller rate keeps it O(1), where a 2% comparison means something.
    return Built(params, None, batch, make(None), make, lr=3e-4, loss=_noise_mse,
                 notes="denoising MSE loss; 8x8 latents")  # fmt: skip


# ---------------------------------------------------------------- jraph

GNN_TASKS, GNN_LATENT, GNN_STEPS = 128, 32, 2
# Raw node features: one count-like column up to this, the rest small integers.
GNN_FEATURE_MAX = 3.5e5


def _graphs(seed: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """BATCH - 1 random molecules-sized graphs padded with one graph (jraph's
    padding); labels in {0, 1} with a third missing, weights 0 there and on padding."""
    import jraph

    rng = np.random.default_rng(seed)
    graphs = []
    for _ in range(BATCH - 1):
        n, e = int(rng.integers(5, 12)), int(rng.integers(8, 20))
        nodes = rng.integers(0, 10, (n, 9)).astype(np.float32)
        nodes[:, 0] = rng.uniform(0, GNN_FEATURE_MAX, n)
        graphs.append(
            jraph.GraphsTuple(
                nodes=nodes,
                edges=rng.integers(0, 4, (e, 3)).astype(np.float32),
                senders=rng.integers(0, n, e).astype(np.int32),
                receivers=rng.integers(0, n, e).astype(np.int32),
                n_node=np.asarray([n], np.int32),
                n_edge=np.asarray([e], np.int32),
                globals=None,
            )
        )
    batched = jraph.batch_np(graphs)
    padded = jraph.pad_with_graphs(
        batched, int(batched.n_node.sum()) + 1, int(batched.n_edge.sum()), BATCH
    )
    labels = rng.integers(0, 2, (BATCH, GNN_TASKS)).astype(np.float32)
    weights = (rng.random((BATCH, GNN_TASKS)) > 1 / 3).astype(np.float32)
    weights[-1] = 0.0  # the padding graph
    return jax.tree.map(jnp.asarray, padded), labels, weights


def _masked_bce(logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """ogbg-molpcba's loss: sigmoid cross-entropy over the labelled tasks, in float32."""
    import optax

    losses = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), batch["labels"])
    w = batch["weights"]
    return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1.0)


def jraph_gnn() -> Built:
    """jraph.GraphMapFeatures embeddings, GraphNetwork message passing (edge, node and
    global MLPs of flax Dense + LayerNorm), a Dense readout of the globals."""
    import flax.linen as nn
    import jraph

    class Mlp(nn.Module):
        dtype: Any = None

        @nn.compact
        def __call__(self, *parts: jax.Array) -> jax.Array:
            x = jnp.concatenate(parts, axis=-1)
            x = nn.Dense(GNN_LATENT, dtype=self.dtype)(x)
            return nn.relu(nn.LayerNorm(dtype=self.dtype)(x))

    class GraphConvNet(nn.Module):
        dtype: Any = None

        @nn.compact
        def __call__(self, graph: Any) -> jax.Array:
            graph = graph._replace(globals=jnp.zeros((graph.n_node.shape[0], GNN_TASKS)))
            graph = jraph.GraphMapFeatures(
                embed_node_fn=nn.Dense(GNN_LATENT, dtype=self.dtype),
                embed_edge_fn=nn.Dense(GNN_LATENT, dtype=self.dtype),
            )(graph)
            for _ in range(GNN_STEPS):
                graph = jraph.GraphNetwork(
                    update_edge_fn=Mlp(self.dtype),
                    update_node_fn=Mlp(self.dtype),
                    update_global_fn=Mlp(self.dtype),
                )(graph)
            return jraph.GraphMapFeatures(embed_global_fn=nn.Dense(GNN_TASKS, dtype=self.dtype))(
                graph
            ).globals

    graph, labels, weights = _graphs(5)
    batch = {"graph": graph, "labels": jnp.asarray(labels), "weights": jnp.asarray(weights)}
    params = jax.jit(GraphConvNet().init)(jax.random.key(0), graph)

    def make(dtype: Any) -> Callable[..., Any]:
        model = GraphConvNet(dtype)
        return lambda p, s, b: (model.apply(p, b["graph"]), s)

    return Built(params, None, batch, make(None), make, loss=_masked_bce,
                 beyond_range=("float16",),
                 notes=f"raw node features up to {GNN_FEATURE_MAX:g}: float16 must overflow "
                 "visibly or match float32")  # fmt: skip


# ---------------------------------------------------------------- equinox


def equinox_batchnorm_cnn() -> Built:
    """equinox Conv2d, BatchNorm (batch statistics, running averages in an
    ``eqx.nn.State``), max pooling and a Linear head, vmapped over the batch."""
    import equinox as eqx

    keys = jax.random.split(jax.random.key(0), 3)

    class Cnn(eqx.Module):
        conv1: eqx.nn.Conv2d
        bn1: eqx.nn.BatchNorm
        conv2: eqx.nn.Conv2d
        bn2: eqx.nn.BatchNorm
        head: eqx.nn.Linear

        def __init__(self) -> None:
            self.conv1 = eqx.nn.Conv2d(3, 16, 3, padding=1, key=keys[0])
            self.bn1 = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
            self.conv2 = eqx.nn.Conv2d(16, 32, 3, padding=1, key=keys[1])
            self.bn2 = eqx.nn.BatchNorm(32, axis_name="batch", mode="batch")
            self.head = eqx.nn.Linear(32, 10, key=keys[2])

        def __call__(self, x: jax.Array, state: Any) -> tuple[jax.Array, Any]:
            x, state = self.bn1(self.conv1(x), state)
            x = eqx.nn.MaxPool2d(2, 2)(jax.nn.relu(x))
            x, state = self.bn2(self.conv2(x), state)
            return self.head(jnp.mean(jax.nn.relu(x), axis=(1, 2))), state

    model, state = eqx.nn.make_with_state(Cnn)()
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def apply(p: Any, s: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
        m = eqx.combine(p, static)
        return jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(b["pixels"], s)

    return Built(params, state, _image_batch(channels_first=True), apply, None,
                 notes="BatchNorm state (eqx.nn.State); no compute-dtype knob: "
                 "no hand-cast")  # fmt: skip
