"""docs/routes.md's `pmap` blocks, on 8 simulated devices (issue 35, item 12): `axis_name=`
makes an inf on one device skip the step on all of them; metrics carry a leading device
axis; the replicas stay identical; with no loss scale too; a stacked state whose
replicas differ resumes bit for bit from a checkpoint of every replica, not of one."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "routes.md"


def _block(heading: str) -> dict:
    """Runs the python block of the docs/routes.md section under ``heading``."""
    section = DOC.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    ns: dict = {}
    exec(compile(code, f"docs/routes.md[{heading}]", "exec"), ns)
    return ns


def test_routes_pmap_block_runs_on_8_devices(capsys) -> None:
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    assert code.startswith("# under pmap")
    ns = _block("`jaxamp.TrainState` under `pmap`")
    assert ns["n"] == jax.local_device_count() == 8
    metrics = jax.device_get(ns["metrics"])
    for key, value in metrics.items():
        assert np.shape(value) == (8,), key
        assert (value == value[0]).all(), (key, value)  # every device agrees
    assert metrics["skipped"].all()
    assert metrics["skipped_steps"][0] == ns["skipped_before"] + 1
    state = jax.device_get(ns["state"])
    for leaf in jax.tree.leaves(state.params):  # one replica's params on every device
        assert (leaf == leaf[0]).all()
    assert "step(s) skipped" in capsys.readouterr().out


def test_without_axis_name_the_devices_disagree() -> None:
    """Why the block passes axis_name: a check that is not agreed skips only on the
    device whose gradients are non-finite, and the replicas drift apart."""
    from functools import partial

    import jax.numpy as jnp
    import optax

    import jaxamp

    n = jax.local_device_count()
    params = {"w": jnp.ones((n, 3))}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    opt_state = jax.tree.map(lambda a: jnp.stack([a] * n), tx.init({"w": jnp.ones(3)}))

    @partial(jax.pmap, axis_name="batch")
    def step(params, opt_state, g):  # per-device gradients, not averaged
        return jaxamp.step(tx, g, opt_state, params)

    grads = {"w": jnp.ones((n, 3)).at[0, 0].set(jnp.inf)}
    _, opt_state = step(params, opt_state, grads)
    skipped = np.asarray(jaxamp.metrics(opt_state)["skipped"])
    assert skipped[0] and not skipped[1:].any()


def test_routes_pmap_no_loss_scale_block_on_8_devices() -> None:
    ns = _block("bfloat16 (or FP8) under `pmap`: no loss scale")
    metrics = jax.device_get(ns["metrics"])
    assert metrics["skipped"].all() and (metrics["loss_scale"] == 1).all()
    for leaf in jax.tree.leaves(jax.device_get(ns["params"])):
        assert (leaf == leaf[0]).all()  # one NaN on device 0 kept every replica equal


def test_routes_pmap_checkpoint_of_every_replica_resumes_and_one_replica_does_not() -> None:
    import jax.numpy as jnp

    ns = _block("A checkpoint of a `pmap`-stacked state whose replicas differ")
    restored, x, y = ns["restored"], ns["x"], ns["y"]
    assert len({tuple(k) for k in np.asarray(restored.rng)}) == 8  # the replicas differ
    # What the page warns against: device 0's replica on every device draws other masks.
    one = jax.tree.map(lambda a: jnp.stack([a[0]] * 8), restored)
    step = ns["train_step"]
    from_one = jax.device_get(step(step(one, x, y), x, y).params)
    straight = jax.device_get(ns["straight"].params)
    differs = jax.tree.map(lambda a, b: not np.array_equal(a, b), straight, from_one)
    assert any(jax.tree.leaves(differs))
