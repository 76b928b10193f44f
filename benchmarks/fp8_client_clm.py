"""FP8 on Hugging Face's ``run_clm_flax`` setting: transformers' ``FlaxGPT2LMHeadModel``
trained as ``examples/flax/language-modeling/run_clm_flax.py`` trains it, with and
without ``jaxamp.fp8_select``; a client row of issue 46 beside ``fp8_clients``' lm1b.

The model is the installed transformers' (nothing of the script is copied here: it
is read for its recipe), random init, at a config reduced as the lm1b client's is:
byte vocab 256, ``n_embd`` 128, 2 layers, 4 heads, 64 positions, batch 16, every
dropout 0 (the README's GPT-2 config sets ``resid_pdrop = embd_pdrop = attn_pdrop =
0``; runs then differ only in their arithmetic), float32 params (the script's default
``--dtype``), logits from the tied token embedding (GPT-2's default). The rest as the
script:

* loss: next-token cross entropy, the logits of positions ``0 .. n-2`` against the
  inputs at ``1 .. n`` (the script's labels are its inputs), averaged over every
  token; the logits are cast to float32 first, so that every row's loss is float32;
* optimizer: ``optax.adamw`` with the script's decay mask (no weight decay on biases
  and LayerNorm scales) and its schedule, a linear warmup from 0 to the peak then a
  linear decay to 0 at the last step; ``b1 = 0.9, b2 = 0.98``, weight decay 0.01: the
  README's GPT-2 recipe (the script's ``TrainingArguments`` defaults, ``b2 = 0.999``
  and no weight decay, are AdamW's generic ones, and the README is how the script is
  meant to train GPT-2), ``eps = 1e-8`` (the default: the README leaves it); warmup
  5 % of the steps (the README's 1,000 warmup steps are for a run of many thousands;
  5 % is the lm1b client's share). Peak learning rate 1e-3 (``LR``, ``--lr``): the
  README's 5e-3 is for 124M params at batch 64 x 512 tokens; on this model 600 steps
  at 5e-3 end higher than at 2e-3 or 3e-3, and there bfloat16's own noise band is
  wider than the 1 % goal (``LR``'s comment has the pilot runs and the band);
* behind ``jaxamp.skip_nonfinite`` with no loss scale (the bfloat16 recipe), through
  ``jaxamp.value_and_grad`` + ``jaxamp.step`` (``fp8_clients.train``).

``ClmTask`` is an ``fp8_clients.ClientTask``: its batch, loss and optimizer are the
script's (``client_batch``, ``client_loss``, ``optimizer``), the rest is that module's.

Data, rows and judging are ``fp8_clients``': ``bench_low_precision.Task``'s byte LM
on the Python standard library's source, a fresh batch each step, the same batches as
the lm1b client's (its ``data_seed``), the held-out loss of the final params judged in
float32; rows float32, bfloat16 autocast, FP8 tensorwise and rowwise (every product
FP8 takes), FP8 with ``fp8_select`` at its default budget calibrated half way (step
300's batch at bfloat16 autocast's params), and the same with ``other_batches``
(``fp8_clients.OTHERS``: the next two training batches, as every client's rows);
bfloat16's noise band (``fp8.perturbed``) under the table.

Run: ``python benchmarks/fp8_client_clm.py [--steps N] [--noise-seeds K] [--out r.json]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

# Runnable as a script: fp8_clients sits beside it (and puts the repository on the path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_clients  # noqa: E402

#: ``GPT2Config`` fields (``n_positions`` is the task's sequence length).
CONFIG = {
    "vocab_size": 256,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
#: The README's GPT-2 AdamW (module docstring).
ADAMW = {"b1": 0.9, "b2": 0.98, "eps": 1e-8, "weight_decay": 0.01}
#: Pilot runs of 600 steps on this schedule, held-out loss from 5.396 at init, float32
#: (bfloat16 autocast): 1e-3 2.1240 (2.1241), 2e-3 1.9903 (1.9797), 3e-3 1.9550
#: (1.9164), 4e-3 2.1480, 5e-3 (the README's) 2.2704, 1e-2 2.4000. Above 1e-3 the
#: run's end turns on rounding: at 2e-3 bfloat16 autocast's own noise band (inits
#: moved by 2**-9) spans -0.35 to +1.10 %, 1.45 points, wider than the 1 % goal, so
#: a row there cannot be judged against the goal; at 1e-3 the band is -0.01 to
#: +0.01 % (benchmarks/RESULTS.md has both tables).
LR = 1e-3
WARMUP = 0.05


def clm_batch(window: jax.Array) -> dict[str, jax.Array]:
    """The script's batch from a batch of ``seq + 1``-byte windows: ``seq`` bytes of
    input ids, which are also the labels (the loss shifts them)."""
    inputs = window[:, :-1]
    return {"input_ids": inputs, "labels": inputs}


def clm_loss(logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """The script's loss: position ``t``'s logits against label ``t + 1``, averaged
    over every such token (one-hot targets, as it writes them), in float32."""
    shifted = logits[:, :-1].astype(jnp.float32)
    targets = jax.nn.one_hot(batch["labels"][:, 1:], shifted.shape[-1])
    return optax.softmax_cross_entropy(shifted, targets).mean()


def decay_mask(params: Any) -> Any:
    """True where the script decays a weight: not a bias, not a LayerNorm's scale
    (GPT-2's LayerNorms are ``ln_1``, ``ln_2`` and ``ln_f``)."""

    def decayed(path: tuple[Any, ...], _: Any) -> bool:
        names = [str(getattr(k, "key", k)) for k in path]
        layer_norm_scale = names[-1] == "scale" and names[-2] in ("ln_1", "ln_2", "ln_f")
        return names[-1] != "bias" and not layer_norm_scale

    return jax.tree_util.tree_map_with_path(decayed, params)


def linear_schedule(peak: float, steps: int, warmup: float = WARMUP) -> optax.Schedule:
    """The script's schedule: 0 to `peak` linearly over the warmup, then linearly to 0
    at step `steps`."""
    ramp = max(int(steps * warmup), 1)
    up = optax.linear_schedule(0.0, peak, ramp)
    down = optax.linear_schedule(peak, 0.0, max(steps - ramp, 1))
    return optax.join_schedules([up, down], [ramp])


class ClmTask(fp8_clients.ClientTask):
    """``FlaxGPT2LMHeadModel`` at `config`, trained with the script's loss and optimizer
    at peak learning rate `lr`, on ``fp8_clients.ClientTask``'s batches."""

    name = "transformers FlaxGPT2LMHeadModel, run_clm_flax's recipe"
    client_batch = staticmethod(clm_batch)
    client_loss = staticmethod(clm_loss)

    def __init__(self, config: dict[str, Any] = CONFIG, lr: float = LR) -> None:
        from transformers import FlaxGPT2LMHeadModel, GPT2Config

        super().__init__()
        self.peak_lr = lr
        self.optimizer_info = {
            "adamw": ADAMW,
            "peak_lr": lr,
            "schedule": f"{100 * WARMUP:g} % linear warmup, linear decay to 0",
            "decay_mask": "no decay on biases and ln_1 / ln_2 / ln_f scales",
        }
        self.config = {**config, "n_positions": self.seq}
        model = FlaxGPT2LMHeadModel(GPT2Config(**self.config), seed=0, _do_init=False)
        # what _do_init=True runs, jitted (eagerly it dispatches op by op: seconds)
        params = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(0), (1, self.seq))

        def apply(params: Any, state: Any, batch: dict[str, Any]) -> tuple[jax.Array, Any]:
            # train=False: no dropout rng (every rate is 0, so the script's train=True
            # computes the same); no attention_mask: the script's are all ones.
            return model(batch["input_ids"], params=params, train=False).logits, state

        self._set_apply(params, apply)

    def optimizer(self, steps: int) -> optax.GradientTransformation:
        """The script's AdamW (decay mask, warmup + linear decay) over `steps`."""
        return optax.adamw(linear_schedule(self.peak_lr, steps), mask=decay_mask, **ADAMW)  # type: ignore[arg-type]


def selections(result: dict[str, Any]) -> str:
    """A line per ``fp8_select`` row: the layers kept, their gradient error, and with
    ``other_batches`` the sampling noise and the error common to the batches."""
    lines = []
    for r in result["rows"]:
        s = r.get("selection")
        if s:
            kept = sum(s["modules"].values())
            lines.append(f"{r['row']}: {kept} of {len(s['modules'])} kept, gradient error "
                         f"{s['error']:.3g}, noise {s['noise']:.3g}, "
                         f"common {s['common']:.3g}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=fp8_clients.STEPS)
    p.add_argument("--noise-seeds", type=int, default=fp8_clients.NOISE_SEEDS)
    p.add_argument("--lr", type=float, default=LR, help="peak learning rate (default: LR)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: the rows train that many steps; give --steps 1 or more")
    if args.noise_seeds < 0:
        p.error(f"--noise-seeds {args.noise_seeds}: give 0 (no noise band) or more")
    if not args.lr > 0:
        p.error(
            f"--lr {args.lr:g}: the peak learning rate; give a positive number, e.g. --lr {LR:g}"
        )
    start = time.perf_counter()
    import transformers

    result = fp8_clients.run(ClmTask(lr=args.lr), args.steps, args.noise_seeds)
    result["transformers"] = transformers.__version__
    return fp8_clients.finish(result, start, args.out, selections(result))


if __name__ == "__main__":
    main()
