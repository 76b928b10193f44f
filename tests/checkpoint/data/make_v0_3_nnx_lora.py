"""Writes ``v0_3_nnx_lora/``: a checkpoint of a jaxamp 0.3 ``jaxamp.nnx.Optimizer``
with ``wrt=nnx.LoRAParam``, whose record (``kept``) holds copies of the frozen Params,
and ``v0_3_nnx_lora/next.npz``: what 0.3 computes on the step after it.

Run with jaxamp 0.3 (commit 0c27419) first on the path, from this folder::

    git worktree add /tmp/wt-03 0c27419
    PYTHONPATH=/tmp/wt-03 python make_v0_3_nnx_lora.py

``tests/checkpoint/test_nnx_record.py`` builds the same model and restores it.
"""

import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import jaxamp

OUT = Path(__file__).parent / "v0_3_nnx_lora"


class Lora(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        base = nnx.Linear(4, 4, rngs=rngs)
        self.lin = nnx.LoRA(4, 2, 4, base_module=base, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def build(seed: int):
    model = Lora(nnx.Rngs(seed))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**10))
    return model, jaxamp.nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)


def loss(model, x):
    return jnp.mean((model(x) - 0.5) ** 2)


def batch(i: int):
    return jnp.sin(jnp.arange(12.0).reshape(3, 4) + i)


def train(model, optimizer, steps):
    vg = jaxamp.nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
    for i in steps:
        _, grads = vg(optimizer, model, batch(i))
        optimizer.update(model, grads)


if __name__ == "__main__":
    assert jaxamp.__version__ == "0.3.0", jaxamp.__file__
    model, optimizer = build(0)
    train(model, optimizer, range(3))
    shutil.rmtree(OUT, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(OUT.absolute() / "model", nnx.state(model))
    ckptr.save(OUT.absolute() / "optimizer", nnx.state(optimizer))
    ckptr.wait_until_finished()
    for f in OUT.rglob("commit_success.txt"):
        f.unlink()  # it names this machine's path
    train(model, optimizer, [3])
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    np.savez(OUT / "next.npz", **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
    print("wrote", OUT, file=sys.stderr)
