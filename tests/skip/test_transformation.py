"""What ``skip_nonfinite``, ``multi_transform`` and ``jaxamp.step`` take as gradients and
params (``_transformation.check_grads``): equinox's own training loop, driven as
equinox's examples drive ``optax.adamw``, against that plain ``optax.adamw``.

Equinox's idiom: ``opt_state = optim.init(eqx.filter(model, eqx.is_array))``, gradients
from ``eqx.filter_grad`` (``None`` for every field it does not differentiate), and
``optim.update(grads, opt_state, params)`` with ``params`` the filtered model or the
whole model (activation functions, flags and names included), which optax accepts.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from tests.helpers import assert_trees_equal, batches

STEPS, BAD_STEP = 5, 2


class _Net(eqx.Module):
    """Non-array fields of every kind: a function, a bool, an int, a str (and Dropout's
    own ``inference`` bool and ``p`` float)."""

    lin1: eqx.nn.Linear
    drop: eqx.nn.Dropout
    lin2: eqx.nn.Linear
    act: Callable
    double: bool
    n_out: int
    name: str

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(4, 8, key=k1)
        self.drop = eqx.nn.Dropout(0.25)
        self.lin2 = eqx.nn.Linear(8, 3, key=k2)
        self.act = jax.nn.gelu
        self.double = True
        self.n_out = 2
        self.name = "net"

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        h = self.drop(self.act(self.lin1(x)), key=key)
        out = self.lin2(h)[: self.n_out]
        return 2.0 * out if self.double else out


def _mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))


MODELS = {
    # (model, the poisoned leaf on the bad step, its name in jaxamp.explain)
    "mlp": (_mlp, lambda m: m.layers[1].weight, "layers.1.weight"),
    "net": (lambda: _Net(jax.random.PRNGKey(1)), lambda m: m.lin2.weight, "lin2.weight"),
}


def _loss(model, x, y, key):
    if isinstance(model, _Net):
        pred = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
        return jnp.mean((pred - y[:, : model.n_out]) ** 2)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _params(model, whole: bool):
    return model if whole else eqx.filter(model, eqx.is_array)


def _reference(model, whole: bool, skip=(BAD_STEP,)):
    """Plain optax.adamw the equinox way, unscaled, leaving out the skipped step."""
    optim = optax.adamw(1e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def one(model, opt_state, x, y, key):
        grads = eqx.filter_grad(_loss)(model, x, y, key)
        updates, opt_state = optim.update(grads, opt_state, _params(model, whole))
        return eqx.apply_updates(model, updates), opt_state

    xs, ys = batches(STEPS)
    for i in range(STEPS):
        if i not in skip:
            model, opt_state = one(model, opt_state, xs[i], ys[i], jax.random.PRNGKey(i))
    return model, opt_state


def _jaxamp(model, whole: bool, use_step: bool, poison):
    """The same loop through skip_nonfinite: gradients of the scaled loss, one of step
    BAD_STEP's leaves set to inf."""
    tx = jaxamp.skip_nonfinite(optax.adamw(1e-3), jaxamp.dynamic_scale())
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def one(model, opt_state, x, y, key, bad):
        ls = jaxamp.get_loss_scale(opt_state)
        grads = eqx.filter_grad(lambda m: jaxamp.scale(ls, _loss(m, x, y, key)))(model)
        grads = eqx.tree_at(
            poison, grads, replace_fn=lambda w: w.at[0, 0].set(jnp.where(bad, jnp.inf, w[0, 0]))
        )
        params = _params(model, whole)
        if use_step:
            new, opt_state = jaxamp.step(tx, grads, opt_state, params)
            return (new if whole else eqx.combine(new, model)), opt_state
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state

    xs, ys = batches(STEPS)
    for i in range(STEPS):
        bad = jnp.array(i == BAD_STEP)
        model, opt_state = one(model, opt_state, xs[i], ys[i], jax.random.PRNGKey(i), bad)
    return model, opt_state


@pytest.mark.parametrize("use_step", [False, True], ids=["update", "step"])
@pytest.mark.parametrize("whole", [False, True], ids=["filtered", "whole_model"])
@pytest.mark.parametrize("name", list(MODELS))
def test_equinox_loop_equals_plain_adamw_and_skips_the_bad_step(name, whole, use_step) -> None:
    make, poison, leaf_name = MODELS[name]
    want_model, want_state = _reference(make(), whole)
    got_model, got_state = _jaxamp(make(), whole, use_step, poison)
    # The scale is a power of two: scaling and unscaling are exact, so bit for bit.
    assert_trees_equal(eqx.filter(got_model, eqx.is_array), eqx.filter(want_model, eqx.is_array))
    assert_trees_equal(got_state.inner_state, want_state)
    # The non-array fields come back as they went in (the same objects).
    got_static = eqx.filter(got_model, eqx.is_array, inverse=True)
    want_static = eqx.filter(make(), eqx.is_array, inverse=True)
    assert jax.tree.structure(got_static) == jax.tree.structure(want_static)
    for a, b in zip(jax.tree.leaves(got_static), jax.tree.leaves(want_static), strict=True):
        assert a is b or a == b, (a, b)
    # The skipped step moved nothing but the documented counters.
    m = jaxamp.metrics(got_state)
    assert int(m["skipped_steps"]) == 1 and float(m["loss_scale"]) == 2.0**14
    why = jaxamp.explain(got_state, eqx.filter(got_model, eqx.is_array))
    assert why.last == (leaf_name,) and why.counts == {leaf_name: 1}
    # The whole model names the same leaves: its non-array fields are not params.
    assert jaxamp.explain(got_state, got_model).last == (leaf_name,)


def test_multi_transform_takes_the_whole_model_as_params() -> None:
    """Two labels over an equinox model with non-array fields, the whole model as params,
    against optax.multi_transform given the filtered model."""
    model = _Net(jax.random.PRNGKey(2))
    arrays = eqx.filter(model, eqx.is_array)
    labels = jax.tree.map(lambda _: "body", arrays)
    labels = eqx.tree_at(lambda m: (m.lin2.weight, m.lin2.bias), labels, ("head", "head"))
    label_fn = lambda _: labels  # noqa: E731  (a Module is callable: not a labels tree to optax)
    transforms = {"body": optax.adamw(1e-3), "head": optax.sgd(1e-2)}
    ref = optax.multi_transform(transforms, label_fn)
    tx = jaxamp.multi_transform(transforms, label_fn, jaxamp.static_scale(4.0))
    x, y = (b[0] for b in batches(1))
    key = jax.random.PRNGKey(3)

    @eqx.filter_jit
    def reference(model):
        grads = eqx.filter_grad(_loss)(model, x, y, key)
        params = eqx.filter(model, eqx.is_array)  # optax.multi_transform refuses the whole model
        updates, _ = ref.update(grads, ref.init(params), params)
        return eqx.apply_updates(model, updates), updates

    @eqx.filter_jit
    def ours(model):
        state = tx.init(arrays)
        ls = jaxamp.get_loss_scale(state)
        grads = eqx.filter_grad(lambda m: jaxamp.scale(ls, _loss(m, x, y, key)))(model)
        updates, _ = tx.update(grads, state, model)
        return jaxamp.step(tx, grads, state, model)[0], updates

    want, want_updates = reference(model)
    got, got_updates = ours(model)
    assert_trees_equal(got_updates, want_updates)
    assert_trees_equal(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))
    assert got.act is model.act and got.name == "net" and got.drop.inference is False


def test_a_genuine_mismatch_is_refused_and_points_an_equinox_user_to_eqx_filter() -> None:
    model = _mlp()
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(4))))(model)
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(1.0))
    state = tx.init(eqx.filter(model, eqx.is_array))
    # The gradients of another model: a different tree, however None is read.
    other = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(4))))(
        eqx.nn.MLP(4, 3, 8, 1, key=jax.random.PRNGKey(0))
    )
    for call in (
        lambda: tx.update(other, state, model),
        lambda: jaxamp.step(tx, other, state, model),
    ):
        with pytest.raises(ValueError, match="does not match the params' tree") as e:
            call()
        assert "eqx.filter(model, eqx.is_inexact_array)" in str(e.value)
        assert "eqx.filter_value_and_grad" in str(e.value)
    # A gradient where the params hold a non-array field: refused, naming the leaf.
    bad = eqx.tree_at(lambda g: g.activation, grads, jnp.ones(()), is_leaf=lambda x: x is None)
    with pytest.raises(ValueError, match="activation"):
        tx.update(bad, state, model)
    # Plain dicts: the message stays about plain trees.
    with pytest.raises(ValueError, match="does not match the params' tree") as e:
        tx.update({"a": jnp.ones(2)}, tx.init({"b": jnp.ones(2)}), {"b": jnp.ones(2)})
    assert "eqx" not in str(e.value)


class _Indexed(eqx.Module):
    """An integer array field: no gradient (eqx.filter_grad gives None), so equinox users
    give tx.init eqx.filter(model, eqx.is_inexact_array)."""

    w: jax.Array
    b: jax.Array
    idx: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.sum(self.w[self.idx] * x) + self.b


def test_an_integer_array_field_is_kept_and_explain_names_the_float_leaves() -> None:
    model = _Indexed(jnp.arange(1.0, 4.0), jnp.zeros(()), jnp.array([0, 2]))
    x = jnp.array([0.5, -2.0])
    init_params = eqx.filter(model, eqx.is_inexact_array)
    optim = optax.adamw(1e-2)
    tx = jaxamp.skip_nonfinite(optax.adamw(1e-2), jaxamp.static_scale(8.0))

    @eqx.filter_jit
    def reference(model, state):
        grads = eqx.filter_grad(lambda m: m(x))(model)
        updates, state = optim.update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    @eqx.filter_jit
    def ours(model, state, bad):
        ls = jaxamp.get_loss_scale(state)
        grads = eqx.filter_grad(lambda m: jaxamp.scale(ls, m(x)))(model)
        grads = eqx.tree_at(lambda g: g.b, grads, replace_fn=lambda b: jnp.where(bad, jnp.nan, b))
        return jaxamp.step(tx, grads, state, model)

    want, want_state = reference(model, optim.init(init_params))
    got, state = ours(model, tx.init(init_params), jnp.array(False))
    assert_trees_equal(got, want)  # the int array too, untouched
    assert_trees_equal(state.inner_state, want_state)
    got, state = ours(got, state, jnp.array(True))
    assert_trees_equal(got, want)
    assert jaxamp.explain(state, got).last == ("b",)


def test_every_k_takes_the_whole_model() -> None:
    """Gradient accumulation: the window's add branch hands the params through too."""
    make = MODELS["net"][0]
    tx = jaxamp.skip_nonfinite(optax.adamw(1e-3), jaxamp.static_scale(4.0), every_k=2)
    xs, ys = batches(4)

    def run(whole: bool):
        model = make()
        state = tx.init(eqx.filter(model, eqx.is_array))

        @eqx.filter_jit
        def one(model, state, x, y, key):
            ls = jaxamp.get_loss_scale(state)
            grads = eqx.filter_grad(lambda m: jaxamp.scale(ls, _loss(m, x, y, key)))(model)
            new, state = jaxamp.step(tx, grads, state, _params(model, whole))
            return (new if whole else eqx.combine(new, model)), state

        for i in range(4):
            model, state = one(model, state, xs[i], ys[i], jax.random.PRNGKey(i))
        return model, state

    (got, got_state), (want, want_state) = run(True), run(False)
    assert_trees_equal(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))
    assert_trees_equal(got_state, want_state)
    assert got.act is jax.nn.gelu and got.name == "net" and got.n_out == 2
