"""Names the docstring examples (run as doctests) may use without importing them."""

import flax
import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(
        jax=jax,
        jnp=jnp,
        np=np,
        optax=optax,
        flax=flax,
        jaxamp=jaxamp,
        policy=jaxamp.Policy.from_string("half"),
        params={"w": jnp.ones((2, 2))},
        x=jnp.ones((2, 2)),
        logits=jnp.ones((2, 3), jnp.float16),
        rngs=nnx.Rngs(0),
    )
