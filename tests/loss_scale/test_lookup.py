"""Looking the loss-scale state up: none found is one error type, whoever looked."""

import pickle

import jax.numpy as jnp
import optax
import pytest

import jaxamp

PARAMS = {"w": jnp.ones(2)}
PLAIN = optax.sgd(0.1).init(PARAMS)  # an optimizer state with no loss scale in it


def loss(p):
    return jnp.sum(p["w"])


LOOKUPS = {
    "jaxamp.get_loss_scale": jaxamp.get_loss_scale,
    "jaxamp.check_health": jaxamp.check_health,
    "jaxamp.check_in_sync": jaxamp.check_in_sync,
    "jaxamp.metrics": jaxamp.metrics,
    "jaxamp.stepped": jaxamp.stepped,
    "jaxamp.where_stepped": lambda s: jaxamp.where_stepped(s, PARAMS, PARAMS),
    "jaxamp.value_and_grad": lambda s: jaxamp.value_and_grad(loss)(s, PARAMS),
}


@pytest.mark.parametrize("fn", sorted(LOOKUPS))
def test_no_loss_scale_is_loss_scale_not_found_naming_the_function_and_the_object(fn):
    with pytest.raises(jaxamp.LossScaleNotFound) as info:
        LOOKUPS[fn](PLAIN)
    e = info.value
    assert isinstance(e, ValueError) and e.got is PLAIN and e.fn == fn
    assert str(e) == f"{fn}: {e.detail}" and "no LossScaleState" in e.detail
    again = pickle.loads(pickle.dumps(e))
    assert (type(again), str(again), again.got) == (type(e), str(e), PLAIN)


def test_nnx_value_and_grad_raises_it_for_a_model_passed_first():
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(jaxamp.LossScaleNotFound, match=r"^jaxamp\.nnx\.value_and_grad: ") as info:
        jaxamp.nnx.value_and_grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model, model)
    assert info.value.got is model and "the nnx.Module Linear first" in info.value.detail


def test_several_loss_scales_are_a_value_error_of_another_kind():
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    both = (tx.init(PARAMS), tx.init(PARAMS))
    with pytest.raises(ValueError, match=r"^jaxamp\.metrics: found 2 LossScaleStates") as info:
        jaxamp.metrics(both)
    assert not isinstance(info.value, jaxamp.LossScaleNotFound)
