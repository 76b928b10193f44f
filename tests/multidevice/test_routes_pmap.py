"""docs/routes.md's `jaxamp.TrainState` under `pmap` block, on 8 simulated devices
(issue 35, item 12): `axis_name=` makes an inf on one device skip the step on all of
them; metrics carry a leading device axis; the replicas stay identical."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "routes.md"


def test_routes_pmap_block_runs_on_8_devices(capsys) -> None:
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    assert code.startswith("# under pmap")
    ns: dict = {}
    exec(compile(code, "docs/routes.md[pmap block]", "exec"), ns)
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
