"""The optax paths under an Explicit mesh (issue 30, item 1).

``tx.update`` + ``optax.apply_updates`` is the path of Flax's own ``nnx.Optimizer``,
Flax's plain ``TrainState`` and every optax chain. On 0.3 its skip branch built
zero updates without the parameters' typed sharding, and ``lax.cond`` refused the
two branches. Each form runs a finite step (equal to plain optax) and a skipped one
(params unchanged), and every output keeps its sharding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxamp


def _forms():
    adamw = optax.adamw(1e-3)
    scale = jaxamp.dynamic_scale(2.0**4)
    return {
        "skip_nonfinite": (jaxamp.skip_nonfinite(adamw, scale), adamw, 1),
        "every_k": (jaxamp.skip_nonfinite(adamw, scale, every_k=2), optax.MultiSteps(adamw, 2), 2),
        "multi_transform": (
            jaxamp.multi_transform({"a": adamw, "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}, scale),
            optax.multi_transform({"a": adamw, "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}),
            1,
        ),
    }


@pytest.mark.parametrize("form", ["skip_nonfinite", "every_k", "multi_transform"])
@pytest.mark.parametrize("fused", [False, True], ids=["tx.update", "jaxamp.step"])
def test_optax_path_on_an_explicit_mesh(form: str, fused: bool) -> None:
    tx, ref, k = _forms()[form]
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        params = {
            "w": jax.device_put(jnp.arange(128.0).reshape(8, 16) / 100, P("fsdp", "tensor")),
            "b": jnp.linspace(-1.0, 1.0, 16),
        }
        specs = jax.tree.map(lambda x: x.sharding.spec, params)

        @jax.jit
        def step(grads, opt_state, params):
            if fused:
                return jaxamp.step(tx, grads, opt_state, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        @jax.jit
        def ref_step(grads, opt_state, params):
            updates, opt_state = ref.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        grads = jax.tree.map(lambda p: jnp.cos(p) * 16.0, params)  # scaled by 2**4
        p, s = params, tx.init(params)
        rp, rs = params, ref.init(params)
        for _ in range(k):
            p, s = step(grads, s, p)
            rp, rs = ref_step(jax.tree.map(lambda g: g / 16.0, grads), rs, rp)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert not np.array_equal(np.asarray(p["w"]), np.asarray(params["w"]))
        plant = jnp.arange(128).reshape(8, 16) == 3 * 16 + 5  # one inf in one shard
        bad = {"w": jnp.where(plant, jnp.inf, grads["w"]), "b": grads["b"]}
        before = jax.device_get(p)
        for _ in range(k):
            p, s = step(bad, s, p)
        # multi_transform skips each label on its own: only w's partition is skipped.
        kept = ["w"] if form == "multi_transform" else ["w", "b"]
        for name in kept:
            np.testing.assert_array_equal(np.asarray(p[name]), before[name])
        assert int(jaxamp.metrics(s)["skipped_steps"]) == 1
        assert jax.tree.map(lambda x: x.sharding.spec, p) == specs
