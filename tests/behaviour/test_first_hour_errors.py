"""What a PyTorch AMP user types first gets an error that says what to write (issue 35,
items 6 and 7; each fails on 0.3)."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import jaxamp


def test_autocast_as_a_context_manager_says_to_wrap_the_function() -> None:
    with pytest.raises(TypeError, match=r"not a context manager.*jaxamp\.autocast\(f, dtype="):
        with jaxamp.autocast(dtype=jnp.float16):
            pass
    # The decorator form still works.
    f = jaxamp.autocast(dtype=jnp.float16)(lambda x: x @ x)
    assert f(jnp.ones((2, 2))).dtype == jnp.float32


def test_autocast_with_a_device_type_says_there_is_none() -> None:
    with pytest.raises(TypeError, match=r"no device type.*jaxamp\.autocast\(f, dtype="):
        jaxamp.autocast("cuda", dtype=jnp.float16)


def test_autocast_with_torchs_device_type_keyword_says_there_is_none() -> None:
    with pytest.raises(TypeError, match=r"no device type.*jaxamp\.autocast\(f, dtype="):
        jaxamp.autocast(device_type="cuda", dtype=jnp.float16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, "bfloat16"])
def test_autocast_given_the_dtype_first_says_to_wrap_the_function(dtype) -> None:
    """torch.autocast(torch.float16)'s spelling, and as a decorator: refused at once
    (not a JAX-internal error when the decorated function is passed)."""
    name = jnp.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"got the dtype {name}.*autocast\(f, dtype=jnp\.{name}\)"):

        @jaxamp.autocast(dtype)
        def f(x):
            return x @ x


def test_autocast_dtype_shorthand_says_what_to_write() -> None:
    with pytest.raises(
        TypeError, match=r"dtype='fp16' is not a dtype; write jnp\.float16 or 'float16'"
    ):
        jaxamp.autocast(lambda x: x, dtype="fp16")


@pytest.mark.parametrize("first", ["params", "plain optax state"])
def test_value_and_grad_without_the_state_in_front_says_what_comes_first(first: str) -> None:
    params = {"w": jnp.ones(2)}
    state = params if first == "params" else optax.adam(1e-3).init(params)
    loss = lambda p, x: jnp.sum(p["w"] * x)
    with pytest.raises(ValueError, match=r"first argument must be the optimizer state"):
        jaxamp.value_and_grad(loss)(state, jnp.ones(2))


@pytest.mark.parametrize("slip", ["optimizer forgotten", "model first"])
def test_nnx_value_and_grad_without_the_optimizer_first_says_so(slip: str) -> None:
    from flax import nnx

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    x = jnp.ones((3, 4))
    args = (model, x) if slip == "optimizer forgotten" else (model, optimizer, x)
    with pytest.raises(ValueError) as e:
        jaxamp.nnx.value_and_grad(loss)(*args)
    msg = str(e.value)
    assert "first argument must be the optimizer" in msg
    assert "jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x, y)" in msg
    assert "nnx.Module Linear" in msg
    assert ("argument 2: put it first" in msg) == (slip == "model first")


def test_check_health_on_a_run_without_loss_scaling_names_no_scale() -> None:
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.check_only(max_consecutive_nonfinite=5))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for _ in range(6):
        params, state = jaxamp.step(tx, {"w": jnp.array([jnp.inf, 0.0])}, state, params)
    with pytest.raises(FloatingPointError, match=r"6 steps in a row") as e:
        jaxamp.check_health(state)
    assert "the run has no loss scale" in str(e.value) and "scale is now" not in str(e.value)
