"""The nnx client of ``fp8_clients``: the ``Transformer`` of flax's ``examples/gemma``
(the successor of ``lm1b_nnx``), imported at run time from a flax checkout (``--gemma
DIR``, the directory holding ``transformer.py``; nothing of it is copied here).

The example's modules import each other by flat names (``import modules``, ``import
layers``, ``import params``): they are imported with `DIR` first on ``sys.path``, and
``sys.path`` and ``sys.modules`` are put back after, so that no other module named
``modules`` or ``params`` is shadowed or left shadowed. The example's own requirements
(``requirements.txt``) include ``jaxtyping``, which its modules import for annotations;
a package it imports that is not installed is named in the error.

Config (``CONFIG``), reduced as ``fp8_clients.CONFIG`` is from the example's (``configs/
tiny.py``: 4 layers, width 256, MLP 512, 4 query heads of 128 and one key/value head,
no post-norms, global attention, no soft cap; vocab 35,008, 128 tokens, batch 32 per
device) to the lm1b client's sizes: vocab 256 (bytes), ``embed_dim`` 128,
``hidden_dim`` 512, 2 layers, 4 query heads of 32 (the lm1b client's ``qkv_dim`` 128)
and, as tiny.py, one key/value head; dropout 0, float32 compute and params (autocast
sets the dtypes; the example's ``use_bfloat16`` would build the model in bfloat16).
The model ties its embedding: the logits are ``embedder.attend``.

The batch is the example's (``input_pipeline_grain``, ``train.py``): targets are the
inputs shifted left (the model does not shift), weight 0 where the input is padding
(byte 0: every weight is 1), positions and causal mask built from the inputs' mask as
its ``eval_step`` builds them. The loss is its ``compute_weighted_cross_entropy`` with
no label smoothing: the weighted cross entropy summed over the weights' sum, which is
``harness.loss_of`` (``train.py`` imports the example's data and checkpoint stack,
clu, grain, orbax, so it is not imported). Its optimizer is the lm1b example's AdamW
(``fp8_clients.ADAMW`` and ``LR``: the same b1, b2, eps, weight decay and peak rate),
on the same warm-up + cosine schedule (its rsqrt schedule after 1,000 warm-up steps
decays too little in 600).

The defaults (600 steps, 3 noise draws), measured at ``nice -n 19`` on 2 cores that other
jobs shared: 673 CPU-s (11 CPU-minutes), 11:15 wall.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fp8_clients
import jax
import jax.numpy as jnp
from flax import nnx

#: ``TransformerConfig`` fields for the client (the module docstring says what the
#: example's tiny config is); ``attention_types`` by name (``AttentionType``'s members).
CONFIG: dict[str, Any] = {
    "num_layers": 2,
    "num_embed": 256,
    "embed_dim": 128,
    "hidden_dim": 512,
    "num_heads": 4,
    "head_dim": 32,
    "num_kv_heads": 1,
    "final_logit_softcap": None,
    "use_post_attn_norm": False,
    "use_post_ffw_norm": False,
    "attention_types": ("GLOBAL", "GLOBAL"),
    "dropout_rate": 0.0,
}
#: What the client uses of the example: the model and its mask/position helpers
#: (transformer.py) and its config (transformer_cfg.py).
FILES = ("transformer.py", "transformer_cfg.py")


def load_gemma(directory: str | Path) -> SimpleNamespace:
    """flax's ``examples/gemma`` from `directory`: ``transformer`` and ``transformer_cfg``
    (and, through them, the example's other modules), imported under the example's own
    module names with ``sys.path`` and ``sys.modules`` put back after."""
    path = Path(directory).expanduser()
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--gemma {directory}: no {', '.join(missing)} there; give the directory of "
            "flax's examples/gemma in a flax checkout, e.g. --gemma ~/flax/examples/gemma"
        )
    names = {f.stem for f in path.glob("*.py")}
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(path))
    try:
        loaded = {n: importlib.import_module(n) for n in ("transformer", "transformer_cfg")}
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] in names:
            raise
        raise ModuleNotFoundError(
            f"--gemma {directory}: the example imports {e.name}, which is not installed "
            f"here; install it (pip install {e.name.partition('.')[0]}, as the example's "
            "requirements.txt does)",
            name=e.name,
        ) from e
    finally:
        sys.path.remove(str(path))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
    return SimpleNamespace(**loaded)


def gemma_batch(window: jax.Array) -> dict[str, jax.Array]:
    """The example's batch from a batch of ``seq + 1``-byte windows: the first ``seq``
    bytes are the inputs, the last ``seq`` the targets; weight 0 at padding inputs."""
    inputs = window[:, :-1]
    return {
        "inputs": inputs,
        "labels": window[:, 1:],
        "weights": (inputs > 0).astype(jnp.float32),
    }


class GemmaTask(fp8_clients.ClientTask):
    """flax's nnx gemma ``Transformer`` at `config`, split into its params and the
    rest of its state and merged inside ``apply`` (``nnx.split`` / ``nnx.merge``, as
    the example's ``jax_train_step`` does): ``fp8_clients``' train step and
    ``fp8_select`` see a function of the params."""

    name = "Flax gemma Transformer, nnx (examples/gemma/transformer.py)"
    client_batch = staticmethod(gemma_batch)

    def __init__(self, example: SimpleNamespace, config: dict[str, Any] = CONFIG) -> None:
        super().__init__()
        self.config = dict(config)
        types = tuple(example.transformer_cfg.AttentionType[t] for t in config["attention_types"])
        cfg = example.transformer_cfg.TransformerConfig(**{**config, "attention_types": types})
        model = example.transformer.Transformer(cfg, rngs=nnx.Rngs(params=0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        build = example.transformer

        def apply(params: Any, state: Any, batch: dict[str, Any]) -> tuple[jax.Array, Any]:
            inputs = batch["inputs"]
            mask = inputs > 0
            logits, _ = nnx.merge(graphdef, params, rest)(
                inputs,
                build.build_positions_from_mask(mask),
                None,
                build.make_causal_attn_mask(mask),
            )
            return logits, state

        self._set_apply(params, apply)
