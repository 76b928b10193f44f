"""Checks of ``jaxamp/casting/_rules/_primitives.py``: finding the jaxprs an equation holds."""

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxamp.casting._rules._primitives import has_subjaxprs, open_jaxpr, subjaxprs


def _eqn(f, *args):
    """The last equation of `f`'s jaxpr (the op under test; a cond's predicate cast before it)."""
    return jax.make_jaxpr(f)(*args).jaxpr.eqns[-1]


def _keys(eqn):
    return [key for key, _ in subjaxprs(eqn.params)]


def test_each_inner_jaxpr_is_found_under_its_param():
    x = jnp.ones(3)
    cond = _eqn(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), jnp.bool_(True), x)
    assert cond.primitive.name == "cond"
    assert _keys(cond) == ["branches", "branches"]
    loop = _eqn(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: c * 2, x), x)
    assert sorted(_keys(loop)) == ["body_jaxpr", "cond_jaxpr"]
    scan = _eqn(lambda x: jax.lax.scan(lambda c, y: (c + y, y), 0.0, x), x)
    assert _keys(scan) == ["jaxpr"]
    assert _keys(_eqn(jax.jit(jnp.sin), x)) == ["jaxpr"]
    for eqn in (cond, loop, scan):
        assert has_subjaxprs(eqn.params)
        assert all(isinstance(s, ClosedJaxpr | Jaxpr) for _, s in subjaxprs(eqn.params))


def test_a_plain_op_holds_none():
    eqn = _eqn(jnp.sin, jnp.ones(3))
    assert _keys(eqn) == [] and not has_subjaxprs(eqn.params)


def test_open_jaxpr_gives_a_closed_jaxprs_consts_and_none_for_an_open_one():
    closed = jax.make_jaxpr(lambda x: x * jnp.arange(3.0))(jnp.ones(3))
    jaxpr, consts = open_jaxpr(closed)
    assert jaxpr is closed.jaxpr and list(consts) == list(closed.consts)
    assert open_jaxpr(closed.jaxpr) == (closed.jaxpr, ())
