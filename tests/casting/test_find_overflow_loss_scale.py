"""``find_overflow(..., scale=...)`` takes the loss scale in every form the step holds it.

``loss_scale`` is "the loss scale the step uses" everywhere in jaxamp: the object given to
``skip_nonfinite`` and the optimizer state that holds it are accepted as they are, so the
one that trains is the one that is tested; a plain number is the scale itself. Anything
else is refused with the forms listed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp

W = jnp.full((4, 4), 0.3)
X = jnp.ones((2, 4))


def loss_fn(w, x):
    return jnp.mean(x @ w)


def scale_tested(loss_scale) -> float:
    return jaxamp.find_overflow(loss_fn, scale=loss_scale)(W, X).loss_scale


def test_every_form_the_step_holds_tests_that_scale():
    ls = jaxamp.dynamic_scale(init_scale=2.0**11)
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), ls)
    opt_state = tx.init({"w": W})
    nested = optax.chain(tx).init({"w": W})
    train_state = jaxamp.TrainState.create(apply_fn=None, params={"w": W}, tx=tx)
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    partitioned = jaxamp.multi_transform(
        {"a": optax.sgd(0.1)}, {"w": "a"}, jaxamp.static_scale(2.0**9)
    ).init({"w": W})
    forms = {
        "LossScaleState": (ls, 2.0**11),
        "opt_state": (opt_state, 2.0**11),
        "nested opt_state": (nested, 2.0**11),
        "TrainState": (train_state, 2.0**11),
        "nnx.Optimizer": (optimizer, 2.0**11),
        "multi_transform state": (partitioned, 2.0**9),
        "check-only state (bfloat16)": (jaxamp.skip_nonfinite(optax.sgd(0.1)).init(W), 1.0),
        "float": (512.0, 512.0),
        "int": (512, 512.0),
        "numpy scalar": (np.float32(512.0), 512.0),
        "jax scalar": (jnp.asarray(512.0), 512.0),
        "bfloat16 scalar": (jnp.asarray(512.0, jnp.bfloat16), 512.0),
    }
    for name, (form, want) in forms.items():
        assert scale_tested(form) == want, name


@pytest.mark.filterwarnings("ignore::jaxamp.ConversionWarning")  # grads made up, not scaled
def test_the_state_after_a_backoff_is_tested_at_its_current_scale():
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(init_scale=2.0**11))
    params = {"w": W}
    _, opt_state = jaxamp.step(tx, {"w": jnp.full((4, 4), jnp.inf)}, tx.init(params), params)
    assert scale_tested(opt_state) == 2.0**10


@pytest.mark.parametrize(
    "bad, shown",
    [
        (None, "None"),
        (True, "True"),
        ("dynamic", "'dynamic'"),
        (jnp.array(True), "an array of bool"),
        (optax.sgd(0.1).init({"w": W}), "a tuple with no LossScaleState in it"),
    ],
)
def test_anything_else_is_refused_with_the_forms_listed(bad, shown):
    with pytest.raises(TypeError) as e:
        scale_tested(bad)
    msg = str(e.value)
    assert msg.startswith("find_overflow: scale must be the loss scale the step uses"), msg
    for form in ("jaxamp.LossScaleState", "optimizer state", "positive number"):
        assert form in msg, msg
    assert msg.endswith(f"got {shown}"), msg


def test_two_loss_scale_states_are_named_not_guessed():
    two = (jaxamp.dynamic_scale(), jaxamp.static_scale(8.0))
    with pytest.raises(ValueError, match=r"find_overflow: scale: found 2 LossScaleStates"):
        scale_tested(two)


def test_none_found_is_told_by_the_error_type_not_its_wording(monkeypatch):
    # find_overflow tells "no state in it" (the forms listed) from "several" (named) by
    # the type get_loss_scale raises, so rewording its message changes neither.
    from jaxamp.casting._find_overflow import _find_overflow

    def reworded(x):
        raise jaxamp.LossScaleNotFound("nothing to read the scale from", got=x)

    monkeypatch.setattr(_find_overflow, "get_loss_scale", reworded)
    with pytest.raises(TypeError, match=r"got a tuple with no LossScaleState in it$"):
        scale_tested(optax.sgd(0.1).init({"w": W}))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_number_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        scale_tested(bad)


def test_a_replicated_state_is_one_scale():
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(init_scale=2.0**11))
    replicated = jax.tree.map(lambda x: jnp.stack([x, x]), tx.init(W))  # as pmap keeps it
    assert scale_tested(replicated) == 2.0**11


@pytest.mark.parametrize("bad", [1e39, 1e-45, 2**200, np.float64(1e39), 10**400])
def test_a_number_must_be_a_normal_float32_as_the_step_multiplies_by_it(bad):
    """1e39 is inf as the float32 the program multiplies by, and 1e-45 a subnormal
    (flushed to 0 on most accelerators): neither is a scale a step can use."""
    with pytest.raises(ValueError, match=r"^find_overflow: scale must be .* normal float32"):
        scale_tested(bad)


def test_the_normal_float32_bounds_are_accepted():
    assert scale_tested(2.0**-126) == 2.0**-126
    assert scale_tested(2.0**126) == 2.0**126


def test_a_traced_loss_scale_is_the_clear_error_naming_it():
    """Inside a jitted step the optimizer state is traced: find_overflow runs op by op
    on concrete values, so it says to call it outside, naming what is traced."""
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    opt_state = tx.init({"w": W})
    traced = {
        "opt_state": opt_state,
        "LossScaleState": jaxamp.get_loss_scale(opt_state),
        "number": jnp.float32(512.0),
    }
    for form, state in traced.items():
        with pytest.raises(TypeError) as e:
            jax.jit(lambda s: jaxamp.find_overflow(loss_fn, scale=s)(W, X))(state)
        assert str(e.value).startswith(
            "find_overflow: scale is a traced value; call it outside jax.jit"
        ), (form, str(e.value))
        # Both traced: the arguments are named first, as the usual case.
        with pytest.raises(TypeError, match=r"^find_overflow: the arguments must be concrete"):
            jax.jit(lambda w, s: jaxamp.find_overflow(loss_fn, scale=s)(w, X))(W, state)


def test_the_docstring_says_which_scale_to_pass_after_a_skip():
    doc = " ".join(jaxamp.find_overflow.__doc__.split())
    assert "After a skipped step, pass the scale from *before* that step" in doc
    assert "jnp.copy(jaxamp.get_loss_scale(opt_state).scale)" in doc
