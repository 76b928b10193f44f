"""An nnx Variable stands for the value it holds, live or as a checkpoint saves it."""

import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxamp._utils.variables import held_value, is_variable


def test_a_variable_and_its_saved_form_stand_for_their_one_leaf():
    x = jnp.arange(3.0)
    for wrapped in (nnx.OptArray(x), nnx.Param(x), {"value": x}, {"value": {"raw": x}}):
        assert held_value(wrapped) is x, wrapped
    assert held_value({"value": nnx.OptArray(x)}) is x


def test_asking_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Flax's deprecated VariableState alias warns
        assert is_variable(nnx.Param(jnp.ones(2))) and not is_variable(jnp.ones(2))


def test_anything_else_is_itself():
    x = np.float32(2.0)
    two = {"a": jnp.ones(2), "b": jnp.zeros(2)}  # a state of two fields, not a Variable
    for plain in (x, 3, jnp.ones(2), two, (jnp.ones(1),), None):
        assert held_value(plain) is plain
    assert not is_variable(two) and not is_variable(jnp.ones(2))
    assert is_variable(nnx.BatchStat(jnp.ones(2)))
