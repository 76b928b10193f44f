"""docs/semantics.md: value_and_grad (#value-and-grad), step(finite=) (#guard), metrics["skipped"]
(#loss-scale-state), fp8 metadata (#skipped-as-a-whole)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxamp

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.float32(0.5)}
X = jnp.array([0.5, 1.0, -1.5])


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def loss_fn(params, x, *, shift=0.0):
    return jnp.sum((params["w"] * x + params["b"] - shift) ** 2)


# value_and_grad ---------------------------------------------------------------------------


def test_value_and_grad_returns_the_unscaled_loss_and_the_scaled_grads():
    ls = jaxamp.static_scale(2.0**10)
    value, grads = jaxamp.value_and_grad(loss_fn)(ls, PARAMS, X, shift=1.0)
    ref_value, ref_grads = jax.value_and_grad(loss_fn)(PARAMS, X, shift=1.0)
    assert value == ref_value  # the loss as fun computed it, not scaled-then-unscaled
    jax.tree.map(lambda g, r: np.testing.assert_array_equal(g, r * 2.0**10), grads, ref_grads)


def test_value_and_grad_takes_an_opt_state_or_a_train_state_has_aux_and_argnums():
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(4.0))
    ts = jaxamp.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    aux_fn = lambda p, x: (loss_fn(p, x), {"pred": p["w"] * x})
    for state in (ts.opt_state, ts):
        (value, aux), grads = jaxamp.value_and_grad(aux_fn, has_aux=True)(state, PARAMS, X)
        np.testing.assert_array_equal(aux["pred"], PARAMS["w"] * X)
        assert value == loss_fn(PARAMS, X)
    _, (gp, gx) = jaxamp.value_and_grad(loss_fn, argnums=(0, 1))(ts, PARAMS, X)
    np.testing.assert_array_equal(gx, 4.0 * jax.grad(loss_fn, argnums=1)(PARAMS, X))
    # Under jit, and straight into step: one train step without a scale lambda.
    step = jax.jit(
        lambda ts: ts.apply_gradients(grads=jaxamp.value_and_grad(loss_fn)(ts, ts.params, X)[1])
    )
    ts = jax.device_put(ts)  # TrainState.create leaves step a Python int
    with jax.transfer_guard("disallow"):
        ts2 = step(ts)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, PARAMS, jax.grad(loss_fn)(PARAMS, X))
    jax.tree.map(np.testing.assert_array_equal, ts2.params, want)


def test_value_and_grad_bad_outputs_are_clear_errors():
    ls = jaxamp.dynamic_scale()
    with pytest.raises(TypeError, match="pair"):
        jaxamp.value_and_grad(lambda p: loss_fn(p, X), has_aux=True)(ls, PARAMS)
    with pytest.raises(TypeError, match="scalar floating loss"):
        jaxamp.value_and_grad(lambda p: p["w"])(ls, PARAMS)
    with pytest.raises(ValueError, match="no LossScaleState"):
        jaxamp.value_and_grad(loss_fn)(optax.sgd(0.1).init(PARAMS), PARAMS, X)


# step(finite=) ----------------------------------------------------------------------------


def test_step_with_finite_neither_unscales_nor_checks_again():
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), jaxamp.dynamic_scale(init_scale=8.0))
    state = tx.init(PARAMS)
    scaled = jaxamp.value_and_grad(loss_fn)(state, PARAMS, X)[1]
    unscaled, finite = jaxamp.unscale_and_check(jaxamp.get_loss_scale(state), scaled)
    norm = global_norm(unscaled)  # the pre-clip norm, no second unscale needed
    np.testing.assert_allclose(norm, global_norm(jax.grad(loss_fn)(PARAMS, X)), rtol=1e-6)
    a = jaxamp.step(tx, scaled, state, PARAMS)
    b = jaxamp.step(tx, unscaled, state, PARAMS, finite=finite)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # An edit the user made (clipping) is what the optimizer sees.
    clipped = jax.tree.map(lambda g: g * jnp.minimum(1.0, 0.1 / norm), unscaled)
    p, s = jaxamp.step(tx, clipped, state, PARAMS, finite=finite)
    # Plain optax takes the plain tree (the Unscaled mark is jaxamp's).
    u, _ = optax.adam(0.1).update(clipped.tree, optax.adam(0.1).init(PARAMS), PARAMS)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), p, optax.apply_updates(PARAMS, u)
    )


def test_step_with_finite_false_skips_and_backs_off():
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), jaxamp.dynamic_scale(init_scale=8.0))
    state = tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)  # finite values, but the user says no
    p, s = jax.jit(lambda g, s, p, f: jaxamp.step(tx, g, s, p, finite=f))(
        grads, state, PARAMS, jnp.array(False)
    )
    jax.tree.map(np.testing.assert_array_equal, p, PARAMS)
    assert float(s.loss_scale.scale) == 4.0 and bool(jaxamp.metrics(s)["skipped"])
    ts = jaxamp.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    ts = ts.apply_gradients(grads=grads, finite=jnp.array(False))
    jax.tree.map(np.testing.assert_array_equal, ts.params, PARAMS)


@pytest.mark.parametrize("bad", [jnp.ones(2, bool), jnp.float32(1.0), 1])
def test_finite_must_be_a_scalar_bool(bad):
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    with pytest.raises(ValueError, match="`finite` must be a scalar bool"):
        jaxamp.step(tx, PARAMS, tx.init(PARAMS), PARAMS, finite=bad)


def test_finite_needs_a_jaxamp_transformation():
    tx = optax.sgd(0.1)
    with pytest.raises(TypeError, match="finite= needs"):
        jaxamp.step(tx, PARAMS, tx.init(PARAMS), PARAMS, finite=jnp.array(True))


# skipped, schedules -----------------------------------------------------------------------


def test_skipped_metric_and_schedules_do_not_advance_on_a_skipped_step():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    tx = jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale(init_scale=2.0))
    state = tx.init(PARAMS)
    good = jax.tree.map(jnp.ones_like, PARAMS)
    bad = {"w": jnp.array([1.0, jnp.nan, 1.0]), "b": jnp.float32(1.0)}
    step = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))
    p, s = step(good, state, PARAMS)
    assert not bool(jaxamp.metrics(s)["skipped"]) and int(s.inner_state.count) == 1
    p2, s2 = step(bad, s, p)
    assert bool(jaxamp.metrics(s2)["skipped"])
    assert int(s2.inner_state.count) == 1  # the schedule's step count did not advance
    assert float(s2.inner_state.hyperparams["learning_rate"]) == float(
        s.inner_state.hyperparams["learning_rate"]
    )
    _, s3 = step(good, s2, p2)
    assert not bool(jaxamp.metrics(s3)["skipped"]) and int(s3.inner_state.count) == 2


# Flax fp8 metadata ------------------------------------------------------------------------


class Fp8MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x))
        return nn.Dense(1, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x)


def test_fp8_metadata_is_overwritten_never_unscaled_checked_or_optimized():
    model = Fp8MLP()
    x = jax.random.normal(jax.random.key(0), (8, 3))
    y = jnp.sin(x[:, :1])
    variables = model.init(jax.random.key(1), x)
    loss = lambda v: jnp.mean((model.apply(v, x) - y) ** 2)

    def train(ts, scaled):
        def one(ts, _):
            if scaled:
                grads = jaxamp.value_and_grad(loss)(ts, ts.params)[1]
            else:
                grads = jax.grad(loss)(ts.params)
            new = ts.apply_gradients(grads=grads)
            return new, grads

        return jax.lax.scan(one, ts, None, length=4)

    ref = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))
    ref, _ = jax.jit(lambda t: train(t, False))(ref)
    # Scale 1: Flax's TrainState (to the last bit of XLA's fusion choices).
    tx1 = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.static_scale(1.0))
    ours1 = jaxamp.TrainState.create(apply_fn=model.apply, params=variables, tx=tx1)
    ours1, _ = jax.jit(lambda t: train(t, True))(ours1)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        ours1.params,
        ref.params,
    )
    # The optimizer only ever holds state for the "params" collection, as in Flax.
    assert jax.tree.structure(ours1.opt_state.inner_state) == jax.tree.structure(ref.opt_state)
    # A real loss scale: the fp8 leaves are the last "gradients" themselves, never unscaled.
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**10))
    ours = jaxamp.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    ours, grads = jax.jit(lambda t: train(t, True))(ours)
    owg = "_overwrite_with_gradient"
    jax.tree.map(
        np.testing.assert_array_equal, ours.params[owg], jax.tree.map(lambda g: g[-1], grads[owg])
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3),
        ours.params["params"],
        ref.params["params"],
    )
    assert int(jaxamp.metrics(ours)["skipped_steps"]) == 0
    # A non-finite value in the metadata is not checked: the step still applies.
    g = jax.tree.map(jnp.zeros_like, ours.params)
    g[owg]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_scale"] = jnp.full((1,), jnp.nan)
    after = ours.apply_gradients(grads=g)
    assert not bool(jaxamp.metrics(after)["skipped"])
