"""skip_nonfinite, step, get_loss_scale and TrainState in real optax / flax training loops."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from tests.helpers import assert_trees_equal, batches, mlp_init, mlp_loss

STEPS, BAD_STEP = 8, 3


def _poison(grads, leaf=("l0", "w"), value=jnp.inf):
    g = grads[leaf[0]][leaf[1]]
    g = g.reshape(-1).at[0].set(value).reshape(g.shape)
    return {**grads, leaf[0]: {**grads[leaf[0]], leaf[1]: g}}


def _train_scaled(tx, params, losses, steps=STEPS, bad_step=BAD_STEP, use_step=False):
    """Trains with loss scaling; gradients of step `bad_step` get an inf in one leaf."""
    state = tx.init(params)
    xs, ys = batches(steps)

    @jax.jit
    def one(params, state, x, y, bad):
        s = jaxamp.get_loss_scale(state)
        grads = None
        for loss in losses:  # several losses under one scale: gradients add up
            g = jax.grad(lambda p, loss=loss: jaxamp.scale(s, loss(p, x, y)))(params)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        grads = jax.lax.cond(bad, _poison, lambda g: g, grads)
        if use_step:
            return jaxamp.step(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        params, state = one(params, state, xs[i], ys[i], jnp.array(i == bad_step))
    return params, state


def _train_reference(tx, params, losses, steps=STEPS, skip=(BAD_STEP,)):
    """Plain optax without scaling that simply leaves out the skipped steps."""
    state = tx.init(params)
    xs, ys = batches(steps)

    @jax.jit
    def one(params, state, x, y):
        grads = jax.grad(lambda p: sum(loss(p, x, y) for loss in losses))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        if i not in skip:
            params, state = one(params, state, xs[i], ys[i])
    return params, state


def _loss_b(params, x, y):
    return 0.1 * jnp.mean(jnp.abs(params["l1"]["w"])) + mlp_loss(params, x, -y)


def _ls():
    return jaxamp.dynamic_scale(init_scale=2.0**10, growth_interval=2)


def _allclose(a, b):
    chex.assert_trees_all_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: optax.adam(1e-2),
        lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
    ],
    ids=["adam", "clip+adamw"],
)
@pytest.mark.parametrize("use_step", [False, True], ids=["update", "step"])
def test_skipping_equals_training_without_the_bad_step(make_inner, use_step):
    """PyTorch's own GradScaler test: scaled run with an inf at step k == unscaled run minus k."""
    p0 = mlp_init(jax.random.PRNGKey(0))
    tx = jaxamp.skip_nonfinite(make_inner(), _ls())
    params, state = _train_scaled(tx, p0, [mlp_loss], use_step=use_step)
    ref_params, ref_state = _train_reference(make_inner(), p0, [mlp_loss])
    _allclose(params, ref_params)
    _allclose(state.inner_state, ref_state)
    ls = jaxamp.get_loss_scale(state)
    assert int(ls.skipped_steps) == 1
    # Backed off once at step 3, grew after steps 1, 5 and 7: 2**10 -> 2**11 -> 2**10 -> 2**12.
    assert float(ls.scale) == 2.0**12


def test_two_losses_under_one_scale():
    p0 = mlp_init(jax.random.PRNGKey(1))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), _ls())
    params, state = _train_scaled(tx, p0, [mlp_loss, _loss_b])
    ref_params, ref_state = _train_reference(optax.adam(1e-2), p0, [mlp_loss, _loss_b])
    _allclose(params, ref_params)
    _allclose(state.inner_state, ref_state)


def test_multi_transform_two_optimizers_one_scale():
    p0 = mlp_init(jax.random.PRNGKey(2))
    labels = {"l0": {"w": "adam", "b": "sgd"}, "l1": {"w": "adam", "b": "sgd"}}

    def inner():
        return optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}, labels)

    tx = jaxamp.skip_nonfinite(inner(), _ls())
    params, state = _train_scaled(tx, p0, [mlp_loss])
    ref_params, ref_state = _train_reference(inner(), p0, [mlp_loss])
    _allclose(params, ref_params)
    _allclose(state.inner_state, ref_state)


def test_multisteps_inside_skip_nonfinite():
    """Each micro-batch is checked; the bad one is left out of the accumulation."""
    p0 = mlp_init(jax.random.PRNGKey(3))
    tx = jaxamp.skip_nonfinite(optax.MultiSteps(optax.adam(1e-2), 2), _ls())
    params, state = _train_scaled(tx, p0, [mlp_loss], steps=9)
    ref_params, ref_state = _train_reference(
        optax.MultiSteps(optax.adam(1e-2), 2), p0, [mlp_loss], steps=9
    )
    _allclose(params, ref_params)
    _allclose(state.inner_state, ref_state)


def test_skipped_step_leaves_params_and_inner_state_bit_identical():
    params = mlp_init(jax.random.PRNGKey(5))
    tx = jaxamp.skip_nonfinite(optax.adamw(1e-2), jaxamp.dynamic_scale())
    state = tx.init(params)
    xs, ys = batches(2)
    grads = jax.grad(
        lambda p: jaxamp.scale(jaxamp.get_loss_scale(state), mlp_loss(p, xs[0], ys[0]))
    )(params)
    updates, state = jax.jit(tx.update)(grads, state, params)  # one real step first
    params = optax.apply_updates(params, updates)
    for value in (jnp.inf, -jnp.inf, jnp.nan):
        bad = (
            _poison(grads, ("l1", "b"), value) if value is jnp.nan else _poison(grads, value=value)
        )
        updates, new_state = jax.jit(tx.update)(bad, state, params)
        assert_trees_equal(new_state.inner_state, state.inner_state)  # Adam's count included
        assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
        new_params, new_state2 = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))(
            bad, state, params
        )
        assert_trees_equal(new_params, params)
        assert_trees_equal(new_state2.inner_state, state.inner_state)
        assert int(new_state.inner_state[0].count) == 1


def test_updates_use_the_scale_the_gradients_were_scaled_with():
    """MPX unscales with the *updated* scale, halving gradients on growth steps."""
    params = {"w": jnp.array([1.0, 2.0])}
    tx = jaxamp.skip_nonfinite(
        optax.sgd(1.0), jaxamp.dynamic_scale(init_scale=8.0, growth_interval=1)
    )
    state = tx.init(params)
    true_grad = jnp.array([0.25, -0.5])
    for expected_scale in (16.0, 32.0):
        scaled = jaxamp.scale(jaxamp.get_loss_scale(state), {"w": true_grad})
        updates, state = tx.update(scaled, state, params)
        np.testing.assert_array_equal(updates["w"], -true_grad)
        assert float(jaxamp.get_loss_scale(state).scale) == expected_scale


def _backend_contracts_multiply_adds() -> bool:
    """Whether this XLA:CPU build fuses ``a * b + c`` into one FMA (LLVM does above -O0)."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.normal(size=4096).astype(np.float32) for _ in range(3))
    fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
    return bool((fused != a * b + c).any())


# make test runs this one at XLA's default LLVM level (the rest of its suite at -O0,
# where nothing is contracted and the test below could not fail).
@pytest.mark.xla_default
def test_step_is_bit_identical_to_update_then_apply():
    """step == tx.update + apply_updates, bit for bit, on applied and on skipped steps.

    Fused into the update, `p + u` could become an FMA with u's last multiply and
    differ in the last bit from adding the rounded updates tx.update hands out;
    step keeps the two equal. Against the plain, unwrapped optimizer (which may
    contract) it agrees to a rounding per step.
    """
    if not _backend_contracts_multiply_adds():
        pytest.skip(
            "this XLA:CPU contracts no multiply-add (LLVM at -O0, or a CPU without FMA): "
            "nothing to guard; run without --xla_backend_optimization_level=0"
        )
    params = mlp_init(jax.random.PRNGKey(6), sizes=(16, 64, 8))

    def make_inner():
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))

    tx = jaxamp.skip_nonfinite(
        make_inner(), jaxamp.dynamic_scale(init_scale=2.0**8, growth_interval=2)
    )
    plain = make_inner()
    k1, k2 = jax.random.split(jax.random.PRNGKey(9))
    xs, ys = jax.random.normal(k1, (6, 16, 16)), jax.random.normal(k2, (6, 16, 8))
    true_grads = jax.jit(jax.grad(mlp_loss))

    @jax.jit
    def via_update(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def via_step(p, s, g):
        return jaxamp.step(tx, g, s, p)

    @jax.jit
    def via_plain(p, s, g):
        u, s = plain.update(g, s, p)
        return optax.apply_updates(p, u), s

    a = b = (params, tx.init(params))
    c = (params, plain.init(params))
    for i in range(6):
        g = true_grads(b[0], xs[i], ys[i])
        if i == 2:
            g = _poison(g)
        # Scaling by a power of two is exact, so unscaling gives back g bit for bit.
        scaled = jaxamp.scale(jaxamp.get_loss_scale(b[1]), g)
        a, b = via_update(*a, scaled), via_step(*b, scaled)
        assert_trees_equal(a, b)
        if i != 2:
            c = via_plain(*c, g)
            chex.assert_trees_all_close(b[0], c[0], rtol=1e-5, atol=1e-8)
            chex.assert_trees_all_close(b[1].inner_state, c[1], rtol=1e-5, atol=1e-8)
    assert int(jaxamp.get_loss_scale(b[1]).skipped_steps) == 1


def test_jitted_loop_with_donation_under_transfer_guard_and_in_scan():
    params = mlp_init(jax.random.PRNGKey(7))
    tx = jaxamp.skip_nonfinite(
        optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**12, growth_interval=5)
    )
    xs, ys = batches(20)
    bad = jnp.zeros(20, bool).at[jnp.array([4, 11, 12])].set(True)

    def train_step(params, state, x, y, is_bad):
        s = jaxamp.get_loss_scale(state)
        loss, grads = jax.value_and_grad(lambda p: jaxamp.scale(s, mlp_loss(p, x, y)))(params)
        grads = jax.lax.cond(is_bad, lambda g: _poison(g, value=jnp.nan), lambda g: g, grads)
        params, state = jaxamp.step(tx, grads, state, params)
        return params, state, jaxamp.metrics(state)

    step_fn = jax.jit(train_step, donate_argnums=(0, 1))
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    data = [(xs[i], ys[i], bad[i]) for i in range(20)]  # on device before the guard
    with jax.transfer_guard("disallow"):
        for x, y, is_bad in data:
            p, s, m = step_fn(p, s, x, y, is_bad)
    assert int(m["skipped_steps"]) == 3
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((p, s)))

    def body(carry, batch):
        p, s, m = train_step(*carry, *batch)
        return (p, s), m["loss_scale"]

    (p2, s2), scales = jax.jit(lambda c, b: jax.lax.scan(body, c, b))(
        (params, tx.init(params)), (xs, ys, bad)
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), (p, s), (p2, s2))
    assert scales.shape == (20,) and float(scales[-1]) == float(jaxamp.get_loss_scale(s).scale)


def test_init_returns_fresh_buffers():
    params = {"w": jnp.ones(3)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    a, b = tx.init(params), tx.init(params)
    for x, y in zip(jax.tree.leaves(a.loss_scale), jax.tree.leaves(b.loss_scale), strict=False):
        assert x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer()
    donate = jax.jit(lambda s: jaxamp.update(s, True), donate_argnums=0)
    donate(a.loss_scale)
    assert float(b.loss_scale.scale) == 2.0**15  # b is still alive
    assert float(tx.init(params).loss_scale.scale) == 2.0**15  # so is tx's own copy


def test_max_consecutive_nonfinite_never_applies_a_bad_update():
    """optax.apply_if_finite applies the NaN update after N failures; we keep skipping."""
    params = {"w": jnp.ones(2)}
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), jaxamp.dynamic_scale(max_consecutive_nonfinite=3))
    state = tx.init(params)
    bad = {"w": jnp.array([jnp.nan, 1.0])}
    step = jax.jit(lambda p, s: jaxamp.step(tx, bad, s, p))
    for i in range(6):
        params, state = step(params, state)
        np.testing.assert_array_equal(params["w"], [1.0, 1.0])
        if i < 3:
            jaxamp.check_health(state)
        else:
            with pytest.raises(FloatingPointError, match=f"{i + 1} steps in a row"):
                jaxamp.check_health(state)


def test_loss_scale_none_only_skips():
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0))
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([0.5, 0.25], jnp.bfloat16)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-0.5, -0.25])
    updates, state = tx.update({"w": jnp.array([jnp.inf, 0.25], jnp.bfloat16)}, state, params)
    assert not bool(jnp.any(updates["w"] != 0))
    assert int(jaxamp.metrics(state)["skipped_steps"]) == 1


def test_extra_args_are_forwarded():
    params = {"w": jnp.ones(2)}
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
    tx = jaxamp.skip_nonfinite(inner, jaxamp.static_scale(1.0))
    state = tx.init(params)
    g = {"w": jnp.ones(2)}
    for loss in (1.0, 2.0, 3.0):
        updates, state = tx.update(g, state, params, value=jnp.array(loss))
    assert float(state.inner_state[1].scale) < 1.0  # the plateau rule saw the values
    params2, _ = jaxamp.step(tx, g, state, params, value=jnp.array(4.0))
    assert params2["w"].shape == (2,)


def test_get_loss_scale_through_nesting():
    params = {"w": jnp.ones(2)}
    ls = jaxamp.dynamic_scale(init_scale=64.0)
    # The structures safe around the guard (tests/loss_scale/test_placement.py refuses
    # the others: MultiSteps, a chain with other members, partition, ...).
    nested = [
        optax.chain(jaxamp.skip_nonfinite(optax.sgd(0.1), ls)),
        optax.named_chain(("guard", jaxamp.skip_nonfinite(optax.sgd(0.1), ls))),
        optax.flatten(jaxamp.skip_nonfinite(optax.sgd(0.1), ls)),
        optax.inject_hyperparams(
            lambda learning_rate: jaxamp.skip_nonfinite(optax.sgd(learning_rate), ls)
        )(learning_rate=0.1),
        jaxamp.skip_nonfinite(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), ls),
    ]
    for tx in nested:
        state = tx.init(params)
        assert float(jaxamp.get_loss_scale(state).scale) == 64.0
        updates, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state, params)
        assert float(jaxamp.get_loss_scale(state).scale) == 32.0
    ts = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=nested[0])
    assert float(jaxamp.get_loss_scale(ts.opt_state).scale) == 64.0
    with pytest.raises(ValueError, match="no LossScaleState"):
        jaxamp.get_loss_scale(optax.adam(0.1).init(params))
    two = optax.chain(
        jaxamp.skip_nonfinite(optax.sgd(0.1), ls), jaxamp.skip_nonfinite(optax.sgd(0.1), ls)
    )
    with pytest.raises(ValueError, match="found 2"):
        jaxamp.get_loss_scale(two.init(params))


def test_train_state():
    params = mlp_init(jax.random.PRNGKey(8))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**10))
    state = jaxamp.TrainState.create(apply_fn=mlp_loss, params=params, tx=tx)
    assert isinstance(state, flax_train_state.TrainState)
    xs, ys = batches(3)

    @jax.jit
    def train(state, x, y, bad):
        grads = jax.grad(lambda p: jaxamp.scale(state.loss_scale, state.apply_fn(p, x, y)))(
            state.params
        )
        grads = jax.lax.cond(bad, _poison, lambda g: g, grads)
        return state.apply_gradients(grads=grads)

    s1 = train(state, xs[0], ys[0], jnp.array(False))
    s2 = train(s1, xs[1], ys[1], jnp.array(True))
    assert_trees_equal(s2.params, s1.params)
    assert_trees_equal(s2.opt_state.inner_state, s1.opt_state.inner_state)
    assert int(s2.step) == 2 and float(s2.loss_scale.scale) == 2.0**9
    assert not bool(jnp.all(s1.params["l0"]["w"] == params["l0"]["w"]))


def test_bad_arguments():
    with pytest.raises(TypeError, match="inner"):
        jaxamp.skip_nonfinite("adam")
    with pytest.raises(TypeError, match="loss_scale"):
        jaxamp.skip_nonfinite(optax.sgd(0.1), 2.0**15)
    with pytest.raises(ValueError, match="max_consecutive_nonfinite"):
        jaxamp.check_only(max_consecutive_nonfinite=-1)
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1))
    with pytest.raises(TypeError, match="SkipNonfiniteState"):
        jaxamp.step(
            tx, {"w": jnp.ones(1)}, optax.sgd(0.1).init({"w": jnp.ones(1)}), {"w": jnp.ones(1)}
        )
    with pytest.raises(ValueError, match="scalar bool"):
        jaxamp.select_tree(jnp.ones(2, bool), {"a": jnp.ones(2)}, {"a": jnp.ones(2)})
    with pytest.raises(ValueError, match="structure"):
        jaxamp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)})


def test_step_is_bit_identical_to_update_then_apply_without_a_check():
    """No check (no_scale, unchecked static scale): neither form has a cond to round through."""
    params = mlp_init(jax.random.PRNGKey(10), sizes=(16, 64, 8))
    g = jax.tree.map(lambda p: jnp.sin(p * 3.0), params)
    for ls in (jaxamp.no_scale(), jaxamp.static_scale(4.0, check_finite=False)):
        tx = jaxamp.skip_nonfinite(optax.adamw(1e-2, weight_decay=0.1), ls)

        @jax.jit
        def via_update(p, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        @jax.jit
        def via_step(p, s, tx=tx):
            return jaxamp.step(tx, g, s, p)

        a = b = (params, tx.init(params))
        for _ in range(3):
            a, b = via_update(*a), via_step(*b)
            assert_trees_equal(a, b)


# ---------------------------------------------------------------- value_and_grad argnums


def _vg_case(n_args: int, argnums, has_aux: bool, kw: bool):
    def fun(*args, **kwargs):
        loss = sum((i + 1.0) * jnp.sum(a**2) for i, a in enumerate(args))
        loss = loss + sum(jnp.sum(v) for v in kwargs.values())
        return (loss, {"n": len(args)}) if has_aux else loss

    args = [jnp.arange(1.0, 2.0 + i) for i in range(n_args)]
    kwargs = {"state": jnp.ones(2), "w": jnp.full(2, 3.0)} if kw else {}
    return fun, args, kwargs


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_value_and_grad_reads_argnums_exactly_as_jax(data) -> None:
    n = data.draw(st.integers(1, 4), label="n_args")
    index = st.integers(-n - 1, n)  # one out of range on each side
    argnums = data.draw(
        st.one_of(index, st.tuples(index, index), st.lists(index, min_size=1, max_size=3)),
        label="argnums",
    )
    has_aux, kw = data.draw(st.booleans(), label="has_aux"), data.draw(st.booleans(), label="kw")
    fun, args, kwargs = _vg_case(n, argnums, has_aux, kw)
    scale = 8.0  # a power of two: the scaled gradients are exactly 8x jax's
    try:
        want = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
    except Exception as e:  # jax refuses: jaxamp refuses the same way
        with pytest.raises(type(e)):
            jaxamp.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(
                jaxamp.static_scale(scale), *args, **kwargs
            )
        return
    got = jaxamp.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(
        jaxamp.static_scale(scale), *args, **kwargs
    )
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got[0], want[0])
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(g, w * scale), got[1], want[1])


def test_value_and_grad_takes_a_loss_keyword_named_state() -> None:
    fun = lambda w, *, state: jnp.sum(w * state)
    value, grads = jaxamp.value_and_grad(fun)(jaxamp.static_scale(2.0), jnp.ones(2), state=3.0)
    assert float(value) == 6.0
    np.testing.assert_array_equal(grads, [6.0, 6.0])


# ---------------------------------------------------------------- the inner update, traced once


@pytest.mark.parametrize("every_k", [1, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_the_inner_update_is_traced_once_per_step(every_k: int, fused: bool) -> None:
    traces = []
    sgd = optax.sgd(0.1)

    def update(updates, state, params=None):
        traces.append(1)
        return sgd.update(updates, state, params)

    inner = optax.GradientTransformation(sgd.init, update)
    tx = jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale(), every_k=every_k)
    params = {"w": jnp.ones(3)}

    @jax.jit
    def one(params, state, g):
        if fused:
            return jaxamp.step(tx, g, state, params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    one(params, tx.init(params), {"w": jnp.ones(3)})
    assert len(traces) == 1


def test_multi_transform_traces_each_inner_update_once() -> None:
    traces = {"a": 0, "b": 0}

    def counted(label):
        sgd = optax.sgd(0.1)

        def update(updates, state, params=None):
            traces[label] += 1
            return sgd.update(updates, state, params)

        return optax.GradientTransformation(sgd.init, update)

    tx = jaxamp.multi_transform({"a": counted("a"), "b": counted("b")}, {"x": "a", "y": "b"})
    params = {"x": jnp.ones(2), "y": jnp.ones(2)}
    jax.jit(lambda p, s, g: jaxamp.step(tx, g, s, p))(params, tx.init(params), params)
    assert traces == {"a": 1, "b": 1}


def test_max_consecutive_nonfinite_takes_the_loss_scale_states_spellings() -> None:
    import math

    tx = jaxamp.skip_nonfinite(
        optax.sgd(1.0), jaxamp.dynamic_scale(max_consecutive_nonfinite=math.inf)
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    bad = {"w": jnp.full(2, jnp.nan)}
    step = jax.jit(lambda p, s: jaxamp.step(tx, bad, s, p))
    for _ in range(300):  # never raises with math.inf, however long the streak
        params, state = step(params, state)
    jaxamp.check_health(state)
    with pytest.raises(ValueError, match=r"math\.inf \(never raise\)"):
        jaxamp.check_only(max_consecutive_nonfinite=2.5)
