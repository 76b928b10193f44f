"""``jaxamp.value_and_grad(..., inexact_only=True)``: equinox models holding non-float
fields, against ``eqx.filter_value_and_grad`` and ``jax.value_and_grad`` (issue 43, item 11).

The default (every leaf differentiated, as ``jax.value_and_grad``) is pinned against JAX in
``test_skip_nonfinite.py``; here, the filtered route and the error that points to it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers import assert_trees_equal, batches
from tests.skip.test_transformation import _loss, _Net

SCALE = 8.0  # a power of two: the scaled gradients are exactly SCALE times the plain ones


def _scaled(tree):
    return jax.tree.map(lambda g: g * SCALE, tree)


@pytest.mark.parametrize("has_aux", [False, True])
def test_an_equinox_model_gets_eqx_filter_value_and_grad_times_the_scale(has_aux) -> None:
    model = _Net(jax.random.PRNGKey(0))
    x, y = (b[0] for b in batches(1))
    key = jax.random.PRNGKey(1)
    loss = (lambda *a: (_loss(*a), {"n": 1})) if has_aux else _loss
    tx = jaxamp.skip_nonfinite(optax.adamw(1e-3), jaxamp.static_scale(SCALE))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    grad_fn = jaxamp.value_and_grad(loss, has_aux=has_aux, inexact_only=True)
    got_value, got = eqx.filter_jit(grad_fn)(opt_state, model, x, y, key)
    want_fn = eqx.filter_value_and_grad(loss, has_aux=has_aux)
    want_value, want = eqx.filter_jit(want_fn)(model, x, y, key)
    assert_trees_equal(got_value, want_value)
    assert jax.tree.structure(got) == jax.tree.structure(want)  # None for every field
    assert_trees_equal(got, _scaled(want))


def test_without_inexact_only_the_refused_leaf_is_named_and_the_keyword_suggested() -> None:
    model = _Net(jax.random.PRNGKey(0))
    x, y = (b[0] for b in batches(1))
    with pytest.raises(TypeError, match=r"argument 0's leaf `drop.inference` \(a bool\)") as e:
        jaxamp.value_and_grad(_loss)(jaxamp.static_scale(SCALE), model, x, y, jax.random.PRNGKey(1))
    assert "inexact_only=True" in str(e.value) and "eqx.filter_value_and_grad" in str(e.value)
    # A refusal with nothing non-floating to name is JAX's own, as it was.
    with pytest.raises(TypeError) as e:
        jaxamp.value_and_grad(lambda w: w)(jaxamp.static_scale(SCALE), jnp.ones(2))
    assert "inexact_only" not in str(e.value)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (-1, 0), [1]])
def test_argnums_are_read_as_jax_reads_them_and_only_float_arrays_differentiated(argnums) -> None:
    a = {"w": jnp.arange(1.0, 4.0), "idx": jnp.array([0, 2]), "act": jnp.tanh, "p": 0.5}
    b = (jnp.full(2, 0.5, jnp.float32), True)

    def fun(a, b, c):
        h = a["act"](a["w"][a["idx"]] * b[0]) * (2.0 if b[1] else 1.0)
        return jnp.sum(h) * a["p"] * c

    def floats_only(a, b):
        return (
            {"w": a["w"], "idx": None, "act": None, "p": None},
            (b[0], None),
        )

    def by_jax(fa, fb, fc):  # jax.value_and_grad over the float arrays, the rest closed over
        return fun({**a, "w": fa["w"]}, (fb[0], b[1]), 3.0)  # fc: None (3.0 is not an array)

    nums = argnums if isinstance(argnums, int) else tuple(argnums)
    want_value, want = jax.value_and_grad(by_jax, argnums=nums)(*floats_only(a, b), None)
    got_value, got = jaxamp.value_and_grad(fun, argnums=argnums, inexact_only=True)(
        jaxamp.static_scale(SCALE), a, b, 3.0
    )
    np.testing.assert_array_equal(got_value, want_value)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_trees_equal(got, _scaled(want))


@pytest.mark.parametrize("argnums", [0, (0, 2), -1])
def test_on_float_arrays_inexact_only_changes_nothing(argnums) -> None:
    fun = lambda p, x, q: jnp.sum(p["w"] * x) + jnp.sum(q**2)  # noqa: E731
    args = ({"w": jnp.ones(3), "b": [jnp.zeros(2)]}, jnp.arange(3.0), jnp.ones(2))
    ls = jaxamp.static_scale(SCALE)
    want = jaxamp.value_and_grad(fun, argnums=argnums)(ls, *args)
    got = jaxamp.value_and_grad(fun, argnums=argnums, inexact_only=True)(ls, *args)
    assert_trees_equal(got, want)
