"""One vocabulary for the states a user passes (behaviour across ``loss_scale/`` and ``skip/``).

Every public function whose subject is a state takes it first, by position
(docs/api/decisions.md): either kind where either works (an optimizer state, what holds
one: a ``TrainState``, an nnx optimizer, or a ``LossScaleState``), an optimizer state
where only that will do, a ``LossScaleState`` where only that will. Each accepts what it
documents, and given the other kind, says which argument is wrong and what to pass
instead.
"""

from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxamp

PARAMS = {"w": jnp.ones(2)}


@functools.cache
def forms():
    """An optimizer state, what holds one, and a bare loss-scale state, after one step."""
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(init_scale=8.0))
    grads = {"w": jnp.array([jnp.inf, 1.0])}
    _, opt_state = jaxamp.step(tx, grads, tx.init(PARAMS), PARAMS)
    train_state = jaxamp.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    train_state = train_state.apply_gradients(grads=grads)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(jnp.full((1, 2), jnp.inf))))(model))
    ls = jaxamp.update(jaxamp.dynamic_scale(init_scale=8.0), False)
    return {
        "opt_state": opt_state,
        "TrainState": train_state,
        "nnx.Optimizer": optimizer,
        "LossScaleState": ls,
    }


TAKES_EITHER = {
    "get_loss_scale": lambda s: float(jaxamp.get_loss_scale(s).scale),
    "metrics": lambda s: float(jaxamp.metrics(s)["loss_scale"]),
    "check_health": lambda s: jaxamp.check_health(s),
    "check_in_sync": lambda s: jaxamp.check_in_sync(s),
    "stepped": lambda s: bool(jaxamp.stepped(s)),
    "where_stepped": lambda s: float(jaxamp.where_stepped(s, jnp.float32(1), jnp.float32(0))),
}


@pytest.mark.filterwarnings("ignore::jaxamp.ConversionWarning")  # made-up gradients
def test_what_takes_either_takes_every_form_and_reads_the_same_state():
    for name in TAKES_EITHER:
        first = next(iter(inspect.signature(getattr(jaxamp, name)).parameters.values()))
        assert (first.name, first.kind) == ("state", first.POSITIONAL_ONLY), name
    for name, call in TAKES_EITHER.items():
        got = {form: call(state) for form, state in forms().items()}
        assert len(set(got.values())) == 1, (name, got)  # the same skipped step, the same state
    assert TAKES_EITHER["get_loss_scale"](forms()["opt_state"]) == 4.0
    assert TAKES_EITHER["stepped"](forms()["opt_state"]) is False


@pytest.mark.filterwarnings("ignore::jaxamp.ConversionWarning")
def test_value_and_grad_and_find_overflow_take_every_form():
    loss_fn = lambda w: jnp.sum(w**2)  # noqa: E731
    for form, state in forms().items():
        _, grads = jaxamp.value_and_grad(loss_fn)(state, jnp.ones(2))
        assert grads.tolist() == [8.0, 8.0], form  # d(4 * w**2) at the scale of 4
        report = jaxamp.find_overflow(loss_fn, scale=state)(jnp.ones(2))
        assert report.loss_scale == 4.0, form


def test_what_needs_a_loss_scale_state_names_it_and_says_where_to_find_it():
    opt_state = forms()["opt_state"]
    calls = {
        "scale": lambda s: jaxamp.scale(s, jnp.float32(1)),
        "unscale_and_check": lambda s: jaxamp.unscale_and_check(s, jnp.ones(2)),
        "update": lambda s: jaxamp.update(s, True),
    }
    for name, call in calls.items():
        first = next(iter(inspect.signature(getattr(jaxamp, name)).parameters.values()))
        assert (first.name, first.kind) == ("loss_scale", first.POSITIONAL_ONLY), name
        with pytest.raises(TypeError) as e:
            call(opt_state)
        assert str(e.value) == (
            f"jaxamp.{name}: `loss_scale` must be a LossScaleState, got a "
            "SkipNonfiniteState, which holds one; pass the loss-scale state inside it: "
            "jaxamp.get_loss_scale(opt_state)."
        )
        with pytest.raises(TypeError, match=r"got an Optimizer, which holds one; pass the"):
            call(forms()["nnx.Optimizer"])
        with pytest.raises(TypeError, match=r"got a float; make one with jaxamp.dynamic_scale"):
            call(2.0)


def test_what_needs_an_optimizer_state_says_a_loss_scale_state_is_not_enough():
    ls = forms()["LossScaleState"]
    assert list(inspect.signature(jaxamp.explain).parameters)[0] == "state"
    with pytest.raises(TypeError) as e:
        jaxamp.explain(ls, PARAMS)
    msg = str(e.value)
    assert msg.startswith("jaxamp.explain: the state is a LossScaleState"), msg
    assert "Pass the state of the jaxamp.skip_nonfinite / jaxamp.multi_transform" in msg
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    assert list(inspect.signature(jaxamp.step).parameters)[2] == "opt_state"
    with pytest.raises(TypeError, match=r"got LossScaleState\. Pass the opt_state that tx.init"):
        jaxamp.step(tx, PARAMS, ls, PARAMS)


def test_a_state_with_no_loss_scale_is_named_by_the_function_called():
    plain = optax.sgd(0.1).init(PARAMS)  # an optimizer not wrapped in skip_nonfinite
    for name, call in TAKES_EITHER.items():
        with pytest.raises(ValueError) as e:
            call(plain)
        msg = str(e.value)
        assert msg.startswith(
            f"jaxamp.{name}: no LossScaleState found in the state passed (got a tuple)"
        ), msg
        assert "jaxamp.skip_nonfinite(inner, " in msg, msg
        assert "`new` and `old`" not in msg, msg  # where_stepped blamed its other arguments


@pytest.mark.filterwarnings("ignore::jaxamp.ConversionWarning")
def test_several_loss_scale_states_are_named_by_where_they_are_and_by_the_function_called():
    two = {"gen": forms()["opt_state"], "disc": forms()["opt_state"]}
    where = "found 2 LossScaleStates in the optimizer state, at disc.loss_scale and gen.loss_scale;"
    for name, call in TAKES_EITHER.items():
        with pytest.raises(ValueError) as e:
            call(two)
        assert str(e.value).startswith(f"jaxamp.{name}: {where} "), str(e.value)
        assert "pass the sub-state you mean" in str(e.value)
    loss_fn = lambda w: jnp.sum(w**2)  # noqa: E731
    with pytest.raises(ValueError) as e:
        jaxamp.value_and_grad(loss_fn)(two, jnp.ones(2))
    assert str(e.value).startswith(f"jaxamp.value_and_grad: {where} "), str(e.value)
    with pytest.raises(ValueError, match=rf"^find_overflow: scale: {where} "):
        jaxamp.find_overflow(loss_fn, scale=two)(jnp.ones(2))


def test_skip_nonfinite_given_a_number_or_an_optimizer_state_says_what_to_write():
    """``find_overflow``'s ``scale`` takes a number or the optimizer state; the
    ``loss_scale`` a transformation is built with is a LossScaleState only."""
    sgd = optax.sgd(0.1)
    partitioned = lambda t, ls: jaxamp.multi_transform({"a": t}, {"w": "a"}, ls)  # noqa: E731
    for fn, build in (("skip_nonfinite", jaxamp.skip_nonfinite), ("multi_transform", partitioned)):
        for number, shown in ((1024.0, "1024.0"), (1024, "1024"), (jnp.float32(8), "8.0")):
            with pytest.raises(TypeError) as e:
                build(sgd, number)
            msg = str(e.value)
            assert msg.startswith(f"jaxamp.{fn}: `loss_scale` must be a LossScaleState"), msg
            assert msg.endswith(
                f"pass jaxamp.static_scale({shown}); for one that adapts, jaxamp.dynamic_scale()."
            ), msg
        for holder in ("opt_state", "TrainState", "nnx.Optimizer"):
            with pytest.raises(TypeError) as e:
                build(sgd, forms()[holder])
            assert str(e.value).endswith(
                "It holds one: to go on with its scale and counters, pass "
                "jaxamp.get_loss_scale(opt_state)."
            ), str(e.value)
        with pytest.raises(TypeError, match=r"or None, got str\.$"):
            build(sgd, "dynamic")
