"""Checks of the non-public JAX behaviour isolated in jaxamp/_utils/jax_compat.py.

If one of these fails after a JAX upgrade, autocast needs updating: fix
_utils/jax_compat.py rather than silencing the test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import PartitionSpec as P

from jaxamp._utils import jax_compat


def test_named_scope_reaches_equations():
    def f(x):
        with jax.named_scope("outer_marker"):
            return jnp.sin(x)

    eqn = jax.make_jaxpr(f)(1.0).jaxpr.eqns[0]
    assert "outer_marker" in jax_compat.name_stack(eqn)
    # Transformations keep the scope name visible in the equations they emit.
    grad_jaxpr = jax.make_jaxpr(jax.grad(f))(1.0)
    assert all(
        "outer_marker" in jax_compat.name_stack(e)
        for e in grad_jaxpr.jaxpr.eqns
        if e.primitive.name in ("sin", "cos")
    )


def test_bind_reproduces_every_equation():
    def f(x):
        y = jax.jit(lambda a: a * 2)(x)
        y = jax.lax.scan(lambda c, a: (c + a, a), 0.0, y)[0]
        return jax.checkpoint(jnp.sin)(y) + jax.nn.relu(y)

    closed = jax.make_jaxpr(f)(jnp.arange(3.0))

    def replay(x):
        env = {closed.jaxpr.invars[0]: x}
        for eqn in closed.jaxpr.eqns:
            args = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            outs = jax_compat.outputs_as_list(
                eqn.primitive, jax_compat.bind(eqn.primitive, args, eqn.params)
            )
            env.update(zip(eqn.outvars, outs, strict=True))
        return env[closed.jaxpr.outvars[0]]

    x = jnp.arange(3.0)
    assert jnp.allclose(replay(x), f(x))
    assert jnp.allclose(jax.grad(replay)(x[0] + x), jax.grad(f)(x[0] + x))


def test_higher_order_params_hold_jaxprs():
    # autocast recognises inner programs as ClosedJaxpr / Jaxpr param values.
    def f(x):
        return jax.lax.cond(x > 0, jnp.sin, jnp.cos, jax.checkpoint(jnp.exp)(x))

    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    for eqn in eqns:
        if eqn.primitive.name == "cond":
            assert all(isinstance(b, ClosedJaxpr) for b in eqn.params["branches"])
        if eqn.primitive.name.startswith("remat") or eqn.primitive.name == "checkpoint":
            assert isinstance(eqn.params["jaxpr"], Jaxpr)


def test_scan_counts_on_this_jax():
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c * k + x, c), c, xs)

    k = jnp.float32(2.0)  # a closed-over constant of the body
    eqn = next(
        e for e in jax.make_jaxpr(f)(1.0, jnp.ones(3)).jaxpr.eqns if e.primitive.name == "scan"
    )
    consts, carry = jax_compat.scan_counts(eqn.params)
    assert (consts, carry) == (1, 1)
    assert len(eqn.invars) == consts + carry + 1


def test_scan_counts_reads_jax_0_11_flat_tree():
    # JAX 0.11 (not installable here: CI's index stops at 0.10.2) replaced
    # `num_consts` / `num_carry` by `ft_in`, a flat tree of (consts, carry, xs)
    # whose `unpack()` gives the three parts; this stands in for it.
    class FlatTree:
        def unpack(self):
            return (["k1", "k2"], ["c"], ["x1", "x2", "x3"])

    assert jax_compat.scan_counts({"ft_in": FlatTree(), "length": 3}) == (2, 1)


def test_shard_map_availability_matches_version():
    # jaxamp enters shard_map through the public jax.shard_map (JAX >= 0.7).
    major, minor = (int(p) for p in jax.__version__.split(".")[:2])
    if (major, minor) >= (0, 7):
        assert jax_compat.HAS_SHARD_MAP


@pytest.mark.skipif(not jax_compat.HAS_SHARD_MAP, reason="jax.shard_map is JAX >= 0.7")
def test_shard_map_call():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("i",))
    g = jax.shard_map(lambda a: jax.lax.psum(a * 2, "i"), mesh=mesh, in_specs=P(), out_specs=P())
    closed = jax.make_jaxpr(g)(jnp.ones(4))
    eqn = closed.jaxpr.eqns[0]
    assert eqn.primitive.name == "shard_map"
    body = eqn.params["jaxpr"]
    out = jax_compat.shard_map_call(
        lambda *xs: jax.core.eval_jaxpr(body, (), *xs), [jnp.ones(4)], eqn.params
    )
    assert jnp.allclose(out[0], 2.0)


@pytest.mark.skipif(not hasattr(jax.sharding, "AxisType"), reason="Explicit meshes: JAX >= 0.6")
def test_eqn_context_restores_the_mesh_an_equation_was_traced_under():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jnp.ones((4, 2))
        closed = jax.make_jaxpr(
            lambda x: jax.sharding.auto_axes(lambda y: y * 2.0, out_sharding=P())(x)
        )(x)
        (mul,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "mul"]
        inner = mul.invars[0].aval.sharding.mesh
        assert inner != jax.sharding.get_abstract_mesh()  # Auto inside, Explicit outside
        with jax_compat.eqn_context(mul):
            assert jax.sharding.get_abstract_mesh() == inner


def test_custom_rule_params():
    @jax.custom_jvp
    def g(x):
        return jnp.sin(x)

    g.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    eqn = jax.make_jaxpr(g)(1.0).jaxpr.eqns[0]
    rule, consts, out_zeros = jax_compat.custom_jvp_rule(eqn.params, 1)
    assert len(rule.invars) == 2 and out_zeros == [False]

    @jax.custom_vjp
    def h(x):
        return jnp.sin(x)

    h.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda r, ct: (r * ct,))
    eqn = jax.make_jaxpr(h)(1.0).jaxpr.eqns[0]
    # CUSTOM_VJP_ENTERED says which form this JAX writes.
    expected = "custom_vjp_call" if jax_compat.CUSTOM_VJP_ENTERED else "custom_vjp_call_jaxpr"
    assert eqn.primitive.name == expected
    if not jax_compat.CUSTOM_VJP_ENTERED:
        return  # JAX 0.5: autocast runs it as written and reads none of its params
    fwd, consts, out_trees = jax_compat.custom_vjp_fwd(eqn.params, [True])
    out_tree, res_tree, forwards = out_trees()
    assert out_tree.num_leaves == 1 and len(forwards) == res_tree.num_leaves == 1
    bwd = jax_compat.custom_vjp_bwd(eqn.params)
    assert float(bwd(jnp.float32(2.0), jnp.float32(3.0))[0]) == 6.0
