"""jaxamp.multi_transform: several optimizers, one scale, each label skipped on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

PARAMS = {"body": {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}, "head": jnp.full((2,), 0.5)}
LABELS = {"body": "body", "head": "head"}  # a prefix of the params tree


def transforms():
    return {"body": optax.adam(0.1), "head": optax.sgd(0.5, momentum=0.9)}


def grads(scale, *, bad_head=False, bad_body=False):
    g = {"body": {"w": jnp.full((3, 2), 0.25), "b": jnp.full(2, -0.5)}, "head": jnp.ones(2)}
    g = jax.tree.map(lambda x: x * scale, g)
    if bad_head:
        g["head"] = g["head"].at[1].set(jnp.inf)
    if bad_body:
        g["body"]["b"] = g["body"]["b"].at[0].set(jnp.nan)
    return g


def test_a_non_finite_partition_is_skipped_while_the_other_steps():
    tx = jaxamp.multi_transform(transforms(), LABELS, jaxamp.dynamic_scale(init_scale=4.0))
    state = tx.init(PARAMS)
    params, new = jaxamp.step(tx, grads(4.0, bad_head=True), state, PARAMS)
    # The head: params and inner state bit for bit as they were.
    np.testing.assert_array_equal(params["head"], PARAMS["head"])
    for a, b in zip(
        jax.tree.leaves(new.inner_states["head"]),
        jax.tree.leaves(state.inner_states["head"]),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # The body stepped as optax.multi_transform would (eager op-by-op here, one fused
    # computation there: the last bit may differ).
    ref = optax.multi_transform(transforms(), LABELS)
    u, _ = ref.update(grads(1.0), ref.init(PARAMS), PARAMS)
    ref_params = optax.apply_updates(PARAMS, u)
    assert not np.array_equal(params["body"]["w"], PARAMS["body"]["w"])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params["body"], ref_params["body"]
    )
    # One shared scale, updated once with "every partition finite".
    m = jaxamp.metrics(new)
    assert float(m["loss_scale"]) == 2.0 and int(m["skipped_steps"]) == 1 and bool(m["skipped"])


def test_all_finite_equals_optax_multi_transform_bit_for_bit():
    tx = jaxamp.multi_transform(transforms(), LABELS, jaxamp.static_scale(1.0))
    ref = optax.multi_transform(transforms(), LABELS)
    p, s = PARAMS, tx.init(PARAMS)
    rp, rs = PARAMS, ref.init(PARAMS)
    for _ in range(3):
        p, s = jaxamp.step(tx, grads(1.0), s, p)
        u, rs = ref.update(grads(1.0), rs, rp)
        rp = optax.apply_updates(rp, u)
    jax.tree.map(np.testing.assert_array_equal, p, rp)
    for label in ("body", "head"):  # optax wraps each inner state in a MaskedState
        mine, theirs = (
            jax.tree.leaves(s.inner_states[label]),
            jax.tree.leaves(rs.inner_states[label]),
        )
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_step_equals_update_then_apply_bit_for_bit_under_jit():
    tx = jaxamp.multi_transform(
        transforms(), lambda p: {"body": "body", "head": "head"}, jaxamp.dynamic_scale(2.0**8)
    )
    seq = [grads(2.0**8), grads(2.0**8, bad_body=True), grads(2.0**7, bad_head=True)]

    @jax.jit
    def both(p1, s1, p2, s2, g):
        p1, s1 = jaxamp.step(tx, g, s1, p1)
        u, s2 = tx.update(g, s2, p2)
        return p1, s1, optax.apply_updates(p2, u), s2

    p1 = p2 = PARAMS
    s1 = s2 = tx.init(PARAMS)
    with jax.transfer_guard("disallow"):
        for g in seq:
            p1, s1, p2, s2 = both(p1, s1, p2, s2, g)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_train_state_get_loss_scale_and_check_health():
    tx = jaxamp.multi_transform(
        transforms(), LABELS, jaxamp.dynamic_scale(init_scale=4.0, max_consecutive_nonfinite=1)
    )
    ts = jaxamp.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    assert float(ts.loss_scale.scale) == 4.0
    ts = ts.apply_gradients(grads=grads(4.0, bad_body=True))
    jaxamp.check_health(ts.opt_state)  # one in a row: tolerated
    ts = ts.apply_gradients(grads=grads(2.0, bad_head=True))
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        jaxamp.check_health(ts.opt_state)
    assert float(jaxamp.get_loss_scale(ts.opt_state).scale) == 1.0


def test_bad_labels_are_clear_errors():
    with pytest.raises(ValueError, match=r"label\(s\) \['tail'\]"):
        jaxamp.multi_transform(transforms(), {"body": "body", "head": "tail"}).init(PARAMS)
    with pytest.raises(ValueError, match="param_labels must have the params' tree structure"):
        jaxamp.multi_transform(transforms(), {"body": "body"}).init(PARAMS)
    with pytest.raises(TypeError, match="transforms"):
        jaxamp.multi_transform([optax.sgd(0.1)], LABELS)
    with pytest.raises(TypeError, match=r"transforms\['head'\]"):
        jaxamp.multi_transform({"body": optax.sgd(0.1), "head": "sgd"}, LABELS)
    with pytest.raises(TypeError, match="axis_name"):
        jaxamp.multi_transform(transforms(), LABELS, axis_name=5)


def test_agrees_across_a_mapped_axis():
    tx = jaxamp.multi_transform(
        transforms(), LABELS, jaxamp.dynamic_scale(init_scale=4.0), axis_name="d"
    )
    state = tx.init(PARAMS)
    g = jax.tree.map(lambda x: jnp.stack([x, x]), grads(4.0))
    g["head"] = g["head"].at[1, 0].set(jnp.inf)  # only device 1 sees it
    params, new = jax.vmap(lambda g: jaxamp.step(tx, g, state, PARAMS), axis_name="d")(g)
    for d in range(2):
        np.testing.assert_array_equal(params["head"][d], PARAMS["head"])
        assert not np.array_equal(params["body"]["w"][d], PARAMS["body"]["w"])
    np.testing.assert_array_equal(new.loss_scale.scale, [2.0, 2.0])


def test_labels_are_compared_as_keys_not_as_text() -> None:
    tx = jaxamp.multi_transform({"1": optax.sgd(1.0)}, {"a": 1})
    with pytest.raises(ValueError, match="param_labels"):
        tx.init({"a": jnp.ones(2)})


def test_update_can_be_jitted_as_a_function() -> None:
    # `jax.jit(tx.update)` hashes the function: 0.3's update held an unhashable dict.
    tx = jaxamp.multi_transform(
        {"a": optax.sgd(0.1), "b": optax.sgd(1.0)}, {"w": "a", "b": "b"}, jaxamp.static_scale(2.0)
    )
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda p: 2.0 * p, params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], np.full(2, -0.1, np.float32))
    np.testing.assert_array_equal(updates["b"], np.full(3, -1.0, np.float32))
