"""jaxamp/checkpoint/_nnx_record.py: a 0.3 nnx optimizer checkpoint under LoRA restores.

``data/v0_3_nnx_lora`` was written by jaxamp 0.3 (``data/make_v0_3_nnx_lora.py``): its
optimizer's record holds copies of the frozen base, which 0.4 no longer keeps.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxamp

DATA = Path(__file__).parent / "data"
_spec = importlib.util.spec_from_file_location("make_lora", DATA / "make_v0_3_nnx_lora.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


@pytest.fixture
def saved(tmp_path) -> Path:
    return Path(shutil.copytree(DATA / "v0_3_nnx_lora", tmp_path / "ckpt"))


def _restore(ckptr, saved: Path, seed: int = 1):
    model, optimizer = make.build(seed)  # another seed: every restored value must come from disk
    nnx.update(model, ckptr.restore(saved / "model", nnx.state(model)))
    state = jaxamp.checkpoint.restore(ckptr, nnx.state(optimizer), directory=saved / "optimizer")
    nnx.update(optimizer, state)
    return model, optimizer


def test_a_0_3_lora_checkpoint_resumes_as_0_3_ran_it(saved) -> None:
    model, optimizer = _restore(ocp.StandardCheckpointer(), saved)
    assert int(optimizer.step[...]) == 3
    assert float(optimizer.loss_scale.scale) == 2.0**10
    make.train(model, optimizer, [3])
    want = np.load(saved / "next.npz")
    got = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    }
    assert sorted(got) == sorted(want.files)
    for k in want.files:  # the same float32 program: equal up to summation order
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # The record holds what a forward writes (the BatchStats), not the frozen base.
    kept = jax.tree_util.tree_flatten_with_path(nnx.state(optimizer)["kept"])[0]
    assert {jax.tree_util.keystr(p) for p, _ in kept} == {
        "['bn']['mean'].value",
        "['bn']['var'].value",
    }


def test_a_0_3_lora_checkpoint_restores_through_a_manager(saved, tmp_path) -> None:
    root = tmp_path / "runs"
    (root / "7").mkdir(parents=True)
    shutil.copytree(saved / "optimizer", root / "7" / "default")
    model, optimizer = make.build(1)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(optimizer))
    with ocp.CheckpointManager(root) as mngr:
        state = jaxamp.checkpoint.restore(mngr, abstract)
    nnx.update(optimizer, state)
    assert int(optimizer.step[...]) == 3


def test_only_the_old_record_is_dropped(saved) -> None:
    # Leaves beyond the target outside a `kept` record are not dropped: orbax's error
    # stands (here the model's checkpoint, with its BatchNorm, into a model without one).
    class NoNorm(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.LoRA(4, 2, 4, base_module=nnx.Linear(4, 4, rngs=rngs), rngs=rngs)

    target = nnx.state(NoNorm(nnx.Rngs(0)))
    with pytest.raises(ValueError, match="partial_restore"):
        jaxamp.checkpoint.restore(ocp.StandardCheckpointer(), target, directory=saved / "model")
