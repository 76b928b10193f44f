"""Flax NNX end to end: a small transformer LM trained with jaxamp.nnx.Optimizer.

float16 compute with ``jaxamp.autocast``, dynamic loss scaling, one injected inf
(skipped as a whole: params, optimizer state, dropout RNG state and
``optimizer.step`` stay as they were), an orbax checkpoint mid-run, and a resume
into fresh objects that continues bit for bit.

    python examples/nnx_example.py
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import jaxamp

VOCAB, WIDTH, HEADS, SEQ, BATCH = 32, 64, 4, 32, 16
STEPS, SAVE_AT, POISON_AT = 60, 30, 20


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(ids)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


def batches(seed: int) -> np.ndarray:
    """Sequences counting up from a random start, modulo VOCAB: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, (STEPS, BATCH, 1))
    return ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def loss_fn(model: LM, ids: jax.Array, poison: jax.Array) -> jax.Array:
    logits = jaxamp.autocast(model, dtype=jnp.float16)(ids[:, :-1])  # float16 matmuls
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
    return jnp.mean(nll) * jnp.where(poison, jnp.inf, 1.0)  # the injected overflow


@nnx.jit
def train_step(model: LM, optimizer: jaxamp.nnx.Optimizer, ids, poison):
    loss, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, ids, poison)
    optimizer.update(model, grads)
    return loss, jaxamp.metrics(optimizer)


def build() -> tuple[LM, jaxamp.nnx.Optimizer]:
    model = LM(nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adamw(3e-3), jaxamp.dynamic_scale(2.0**15, growth_interval=20))
    return model, jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)


def run(model, optimizer, data, start: int, stop: int, log: bool) -> None:
    for i in range(start, stop):
        loss, m = train_step(model, optimizer, jnp.asarray(data[i]), jnp.array(i == POISON_AT))
        if log and (i % 10 == 0 or bool(m["skipped"])):
            scale = np.log2(float(m["loss_scale"]))
            print(
                f"step {i:2d}  loss {float(loss):.4f}  scale 2^{scale:.0f}"
                f"  skipped {bool(m['skipped'])}  optimizer.step {int(optimizer.step)}"
            )


def main() -> None:
    data = batches(0)
    model, optimizer = build()
    with tempfile.TemporaryDirectory() as root, ocp.CheckpointManager(root) as mngr:
        run(model, optimizer, data, 0, SAVE_AT, log=True)
        mngr.save(SAVE_AT, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
        mngr.wait_until_finished()
        run(model, optimizer, data, SAVE_AT, STEPS, log=True)
        # Resume from the checkpoint into fresh objects and redo the second half.
        fresh_model, fresh_opt = build()
        target = nnx.state((fresh_model, fresh_opt))
        nnx.update((fresh_model, fresh_opt), jaxamp.checkpoint.restore(mngr, target, step=SAVE_AT))
        run(fresh_model, fresh_opt, data, SAVE_AT, STEPS, log=False)

    def arrays(*nodes):  # every array, PRNG keys as their bits
        def bits(x):
            return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

        return [bits(x) for x in jax.tree.leaves(nnx.state(nodes))]

    pairs = zip(arrays(model, optimizer), arrays(fresh_model, fresh_opt), strict=True)
    same = all(np.array_equal(a, b) for a, b in pairs)
    m = jaxamp.metrics(optimizer)
    print(f"skipped steps: {int(m['skipped_steps'])} (the injected inf at step {POISON_AT}); "
          f"optimizer.step {int(optimizer.step)} of {STEPS} calls")  # fmt: skip
    print(f"resumed from step {SAVE_AT}, bit for bit: {same}")


if __name__ == "__main__":
    main()
