"""On an Auto mesh a guarded step keeps each output's sharding as plain optax does.

0.4's first finite check joined small leaves into one array; XLA's sharding
propagation then sharded a replicated bias's outputs after it (P() -> P('data')),
found by tests/matrix's Auto-mesh cells. Checked for the fused and the optax forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp


@pytest.mark.parametrize("fused", [False, True], ids=["tx.update", "jaxamp.step"])
def test_replicated_small_leaves_stay_replicated(fused: bool) -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rep, sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = {"b": jax.device_put(jnp.ones(16), rep), "k": jax.device_put(jnp.ones((8, 16)), sh)}
    x = jax.device_put(jnp.ones((8, 8)), sh)
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["k"] + p["b"]) ** 2)

    def run(tx, scale):
        @jax.jit
        def step(p, s, x):
            g = jax.tree.map(lambda a: a * scale, jax.grad(loss)(p, x))
            if fused:
                return jaxamp.step(tx, g, s, p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step(params, tx.init(params), x)

    ours = run(jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale(16.0)), 16.0)
    plain = run(optax.adam(1e-3), 1.0)
    assert ours[0]["b"].sharding.is_equivalent_to(plain[0]["b"].sharding, 1)
    assert ours[0]["b"].sharding.spec == P()
    mu = ours[1].inner_state[0].mu["b"]
    assert mu.sharding.is_equivalent_to(plain[1][0].mu["b"].sharding, 1)
