"""``low_precision_state`` on a 2 x 4 mesh under jit: the stored moments are sharded as their
params (a weight on both axes, its last axis included, and a vector on its only axis), each
device quantizes its own blocks (the compiled step gathers nothing more than the same step
with plain optax), and the result equals the unsharded run bit for bit.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp.types import Quantized8, Rounded16

BLOCK = 128  # a row of w is 512 over 4 devices: each holds whole blocks
SPECS = {"b": P("b"), "v": P(("a", "b"), None), "w": P("a", "b")}
GATHERS = ("all-gather", "all-to-all", "collective-permute")


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "b": jnp.linspace(-1.0, 1.0, 512),
        "v": jax.random.normal(k2, (64, 16)),
        "w": jax.random.normal(k1, (16, 512)),
    }


def _grads(i: int):
    g = {
        k: jax.random.normal(jax.random.key(10 + i), x.shape) * jnp.logspace(-3, 0, x.shape[-1])
        for k, x in _params().items()
    }
    if i == 2:
        g["w"] = g["w"].at[5, 300].set(jnp.inf)
    return g


def _tx(inner, dtype):
    if dtype is not None:
        inner = jaxamp.low_precision_state(inner, dtype, block_size=BLOCK, min_size=0)
    return jaxamp.skip_nonfinite(inner)


def _mesh():
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _stored(state):
    is_s = lambda x: isinstance(x, (Quantized8, Rounded16))  # noqa: E731
    return [x for x in jax.tree.leaves(state, is_leaf=is_s) if is_s(x)]


def _collectives(tx, mesh) -> dict[str, int]:
    put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, SPECS)  # noqa: E731
    params = put(_params())
    state = jax.jit(tx.init)(params)
    text = (
        jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))
        .lower(params, state, put(_grads(0)))
        .compile()
        .as_text()
    )
    ops = ("all-reduce", *GATHERS)
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text)) for op in ops}


@functools.cache  # the baseline of both parametrizations, compiled once
def _plain_collectives() -> dict[str, int]:
    return _collectives(_tx(optax.adamw(1e-2), None), _mesh())


@pytest.mark.parametrize("dtype", ["8bit", jnp.bfloat16], ids=["8bit", "bf16"])
def test_sharded_state_quantizes_its_own_blocks(dtype) -> None:
    plain = _plain_collectives()
    ours = _collectives(_tx(optax.adamw(1e-2), dtype), _mesh())
    print(f"{dtype}: collectives plain adamw {plain}, low_precision_state {ours}")
    for op in GATHERS:
        assert ours[op] <= plain[op], (op, ours, plain)


@pytest.mark.parametrize("dtype", ["8bit", jnp.bfloat16], ids=["8bit", "bf16"])
def test_sharded_equals_unsharded_bit_for_bit(dtype) -> None:
    mesh = _mesh()
    # SGD with momentum (a moment to store), not AdamW: XLA:CPU compiles AdamW's float32
    # division and square root differently for a shard's shape than for the whole array
    # (tests/multidevice/test_low_precision_params.py).
    tx = _tx(optax.sgd(0.5, momentum=0.9), dtype)
    step = jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))

    def run(shard: bool):
        put = lambda t: (  # noqa: E731
            jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, SPECS)
            if shard
            else t
        )
        params = put(_params())
        state = jax.jit(tx.init)(params)
        for i in range(4):
            params, state = step(params, state, put(_grads(i)))
        return params, state

    sharded, unsharded = run(True), run(False)
    assert int(jaxamp.metrics(sharded[1])["skipped_steps"]) == 1
    stored = dict(zip(("b", "v", "w"), _stored(sharded[1]), strict=True))  # the trace's
    for name, x in stored.items():
        for arr in jax.tree.leaves(x):  # codes and scales, or the bfloat16 values
            want = NamedSharding(mesh, SPECS[name])
            assert arr.sharding.is_equivalent_to(want, arr.ndim), (name, arr.sharding)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_convert_state_of_leaves_on_different_devices():
    """A restored state can hold a scalar committed to one device (orbax restores
    it where the target's sharding, taken from a live state, put it) beside moments
    on the mesh: convert_state converts each as it is, as on one device."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    params = {k: jax.device_put(x, NamedSharding(mesh, SPECS[k])) for k, x in _params().items()}
    plain = optax.adam(1e-3)
    state = plain.init(params)
    adam = state[0]._replace(count=jax.device_put(jnp.int32(5), jax.devices()[0]))
    state = (adam, *state[1:])
    tx = jaxamp.low_precision_state(optax.adam(1e-3), "8bit", block_size=BLOCK, min_size=0)
    got = jaxamp.convert_state(state, tx, params)
    want = jaxamp.convert_state(jax.device_get(state), tx, _params())
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert got.inner_state[0].count.sharding == adam.count.sharding
    assert got.inner_state[0].mu["w"].codes.sharding.spec == SPECS["w"]
