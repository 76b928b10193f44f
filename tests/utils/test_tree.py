"""Tree helpers: all_finite, select_tree, the tracer checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp


def test_all_finite_ignores_non_float_leaves_and_is_true_for_empty_trees():
    assert bool(jaxamp.all_finite({})) and bool(jaxamp.all_finite([None, ()]))
    tree = {"i": jnp.array([1, 2]), "b": jnp.array(True), "f": jnp.ones(2, jnp.bfloat16)}
    assert bool(jaxamp.all_finite(tree))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        assert not bool(jaxamp.all_finite(dict(tree, f=jnp.array([1.0, bad], jnp.bfloat16))))
    out = jax.jit(jaxamp.all_finite)(tree)
    assert out.shape == () and out.dtype == jnp.bool_


def test_all_finite_agrees_across_a_named_axis():
    xs = jnp.ones((4, 3)).at[2, 1].set(jnp.nan)
    local = jax.vmap(lambda x: jaxamp.all_finite(x))(xs)
    agreed = jax.vmap(lambda x: jaxamp.all_finite(x, axis_name="d"), axis_name="d")(xs)
    np.testing.assert_array_equal(local, [True, True, False, True])
    np.testing.assert_array_equal(agreed, [False] * 4)


def test_select_tree_selects_leafwise_and_checks_its_inputs():
    a = {"w": jnp.ones(2), "n": jnp.array([1, 2])}
    b = {"w": jnp.zeros(2), "n": jnp.array([3, 4])}
    out = jax.jit(jaxamp.select_tree)(jnp.array(True), a, b)
    np.testing.assert_array_equal(out["w"], a["w"])
    np.testing.assert_array_equal(out["n"], a["n"])
    out = jaxamp.select_tree(False, a, b)
    np.testing.assert_array_equal(out["n"], b["n"])
    with pytest.raises(ValueError, match="shape and dtype"):
        jaxamp.select_tree(jnp.array(True), {"w": jnp.ones(2)}, {"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="shape and dtype"):
        jaxamp.select_tree(jnp.array(True), {"w": jnp.ones(2)}, {"w": jnp.ones(2, jnp.float16)})


def test_all_finite_has_no_false_alarm_on_large_finite_values():
    # Their plain sum overflows to inf; each value is finite.
    big = {"f32": jnp.full((4,), 3e38), "f16": jnp.full((8,), 60000.0, jnp.float16)}
    assert bool(jaxamp.all_finite(big))
    assert bool(jax.jit(jaxamp.all_finite)(big))


def test_is_tracer_and_holds_tracer_see_every_transformation_and_nothing_concrete():
    from jaxamp._utils.tree import holds_tracer, is_tracer

    concrete = {"w": jnp.ones(2), "n": np.ones(2), "x": 1.0, "s": "name", "none": None}
    assert not any(is_tracer(x) for x in jax.tree.leaves(concrete)) and not holds_tracer(concrete)
    seen = []

    def probe(x):
        seen.append((is_tracer(x), holds_tracer({"a": 1.0, "b": [x]})))
        return x

    jax.jit(probe)(1.0)
    jax.grad(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.lax.scan(lambda c, x: (probe(c), x), 0.0, jnp.ones(2))
    assert seen == [(True, True)] * 4
