"""autocast of a plain Python object reads its attributes at each call (issue 43, item 5)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

F16 = jnp.float16
X = jnp.ones((2, 4), jnp.float32)
TRACES = [0]  # how many times a _Model's __call__ ran: once per trace, not per call


class _Model:
    """A model as a plain class: weights as attributes."""

    def __init__(self, w: jnp.ndarray, scale: float = 1.0) -> None:
        self.w, self.scale = w, scale

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        TRACES[0] += 1
        return (x @ self.w) * self.scale

    def forward(self, x: jnp.ndarray) -> jnp.ndarray:
        return self(x)


class _Mlp:
    def __init__(self, layers: list[_Model]) -> None:
        self.layers = layers

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_weight_assigned_after_autocast_is_the_one_the_next_call_uses():
    # x @ w of small integers: exact in float16, so the results compare exactly.
    model = _Model(jnp.full((4, 3), 2.0))
    for fwd in (jaxamp.autocast(model, dtype=F16), jaxamp.autocast(model.forward, dtype=F16)):
        model.w = jnp.full((4, 3), 2.0)
        np.testing.assert_array_equal(np.asarray(fwd(X)), 8.0)
        model.w = jnp.full((4, 3), 4.0)
        np.testing.assert_array_equal(np.asarray(fwd(X)), 16.0)
        model.scale = 0.5  # a Python attribute is part of the cache's key
        np.testing.assert_array_equal(np.asarray(fwd(X)), 8.0)
        model.scale = 1.0


def test_a_weight_of_a_layer_the_model_holds_is_read_at_each_call():
    mlp = _Mlp([_Model(jnp.eye(4) * 2.0), _Model(jnp.eye(4))])
    fwd = jaxamp.autocast(mlp, dtype=F16)
    np.testing.assert_array_equal(np.asarray(fwd(X)), 2.0)
    mlp.layers[1].w = jnp.eye(4) * 3.0
    np.testing.assert_array_equal(np.asarray(fwd(X)), 6.0)


def test_a_new_weight_of_the_same_shape_reuses_the_compiled_program():
    model = _Model(jnp.full((4, 3), 2.0))
    fwd = jaxamp.autocast(model, dtype=F16)
    TRACES[0] = 0
    fwd(X)
    fwd(X)
    model.w = jnp.full((4, 3), 4.0)
    np.testing.assert_array_equal(np.asarray(fwd(X)), 16.0)
    assert TRACES[0] == 1  # one trace: the cache is hit, not bypassed
    model.w = jnp.full((4, 5), 1.0)  # a new shape: a new trace
    np.testing.assert_array_equal(np.asarray(fwd(X)), 4.0)
    assert TRACES[0] == 2


@dataclasses.dataclass
class _Dataclass:  # eq=True: __hash__ is None, mutable
    w: jax.Array

    def __call__(self, x):
        return x @ self.w


@dataclasses.dataclass(slots=True)
class _SlotsDataclass:
    w: jax.Array

    def __call__(self, x):
        return x @ self.w


class _Slots:
    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return x @ self.w


class _ComparedByIdentity:
    def __init__(self, w):
        self.w = w

    def __eq__(self, other):  # __hash__ becomes None
        return self is other

    def __call__(self, x):
        return x @ self.w


@pytest.mark.parametrize("cls", [_Dataclass, _SlotsDataclass, _Slots, _ComparedByIdentity])
def test_unhashable_and_slotted_objects_are_read_at_each_call_too(cls) -> None:
    model = cls(jnp.ones((2, 2)))
    fwd = jaxamp.autocast(model, dtype=jnp.float16)
    x = jnp.ones((1, 2))
    before = np.asarray(fwd(x), np.float32)
    model.w = model.w * 3
    np.testing.assert_array_equal(np.asarray(fwd(x), np.float32), 3 * before)
