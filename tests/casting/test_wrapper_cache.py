"""autocast's eager cache is keyed on everything that changes the answer; every output
dtype passes through (issue 31, items 4 and 5; each test fails on 0.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp


class _Net(nnx.Module):
    def __init__(self) -> None:
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.lin(x))


X = jnp.linspace(0.5, 1.5, 8).reshape(2, 4)
# float16 matmul of 4 terms against float32: a relative bound of a few float16 eps.
RTOL = 4 * 2.0**-10


def test_model_eval_after_an_eager_call_in_train_mode_turns_dropout_off() -> None:
    model = _Net()
    amp = jaxamp.autocast(model, dtype=jnp.float16)
    assert bool(jnp.any(amp(X) == 0))  # train mode: dropout zeroes some outputs
    model.eval()
    np.testing.assert_allclose(amp(X), model(X), rtol=RTOL, atol=1e-3)
    model.train()
    assert bool(jnp.any(amp(X) == 0))


@pytest.mark.parametrize("with_module", [False, True])
def test_static_arguments_are_part_of_the_key(with_module: bool) -> None:
    model = _Net()
    model.eval()

    def f(model, x, double=False):
        y = model(x) if with_module else x @ jnp.ones((4, 8))
        return y * (2.0 if double else 1.0)

    g = jaxamp.autocast(f, dtype=jnp.float16)
    once, twice = g(model, X, double=False), g(model, X, double=True)
    np.testing.assert_allclose(twice, 2.0 * once, rtol=0, atol=0)
    np.testing.assert_allclose(once, f(model, X), rtol=RTOL, atol=1e-3)


def test_every_output_dtype_passes_through() -> None:
    def f(x):
        key = jax.random.key(0)
        return (
            x * 2,
            jnp.array(False),
            x > 1,
            x.astype(jnp.int32),
            x.astype(jnp.complex64),
            key,
            True,
        )

    for call in (jaxamp.autocast(f, dtype=jnp.float16), jax.jit(jaxamp.autocast(f))):
        out = call(jnp.ones(2))
        ref = f(jnp.ones(2))
        assert [jnp.asarray(o).dtype for o in out] == [jnp.asarray(r).dtype for r in ref]
        assert not bool(out[1]) and bool(out[6])
        np.testing.assert_array_equal(jax.random.key_data(out[5]), jax.random.key_data(ref[5]))
