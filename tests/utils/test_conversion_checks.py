"""Conversions that run but train wrong warn once, at trace time, with what to write
(issue 35, item 8); every documented path stays silent.

* float16 gradients taken without the loss scale (``jax.grad`` of the plain loss)
  handed to a ``skip_nonfinite`` optimizer with a dynamic scale: the step divides them
  by the scale, so the run has no loss scaling and a learning rate off by 2**15;
* Flax's own ``TrainState.apply_gradients(grads=..., batch_stats=...)`` with a jaxamp
  ``tx``: Flax writes ``batch_stats`` after ``tx.update`` returns, skipped or not.

Flax's own ``nnx.Optimizer`` on a model with forward-written state is refused (an
error, not a warning): tests/skip/test_nnx_state.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import jaxamp
from jaxamp._utils import conversion_checks

CATEGORY = getattr(jaxamp, "ConversionWarning", UserWarning)


@pytest.fixture(autouse=True)
def fresh_process_state():
    """Each test as a fresh process: nothing read, nothing warned yet."""
    conversion_checks.reset()
    yield
    conversion_checks.reset()


def _caught(run) -> list[str]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in got if issubclass(w.category, CATEGORY)]


def _data():
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    return x, y


MODEL = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)])


def _loss(params, x, y):
    return jnp.mean((MODEL.apply(params, x) - y) ** 2)


LOSS16 = jaxamp.autocast(_loss, dtype=jnp.float16)


def _setup(loss_scale: Any = "dynamic"):
    x, y = _data()
    params = MODEL.init(jax.random.key(1), x)
    ls = jaxamp.dynamic_scale() if loss_scale == "dynamic" else loss_scale
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), ls)
    return tx, params, tx.init(params), x, y


# ---------------------------------------------------------------------------------------
# (b) gradients never scaled


def _forgot_scaling_jit_step():
    tx, params, opt_state, x, y = _setup()

    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(LOSS16)(params, x, y)  # the mistake: no scale
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, loss

    for _ in range(3):
        params, opt_state, _ = train_step(params, opt_state)


def _forgot_scaling_tx_update_eager():
    tx, params, opt_state, x, y = _setup()
    for _ in range(2):
        grads = jax.grad(LOSS16)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)


def _forgot_scaling_train_state():
    tx, params, _, x, y = _setup()
    state = jaxamp.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state):
        grads = jax.grad(LOSS16)(state.params, x, y)
        return state.apply_gradients(grads=grads)

    train_step(train_step(state))


def _forgot_scaling_nnx():
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _data()
    loss = jaxamp.autocast(lambda m, x, y: jnp.mean((m(x) - y) ** 2), dtype=jnp.float16)

    @nnx.jit
    def train_step(model, optimizer):
        grads = nnx.grad(loss)(model, x, y)
        optimizer.update(model, grads)

    train_step(model, optimizer)
    train_step(model, optimizer)


@pytest.mark.parametrize(
    "run",
    [
        _forgot_scaling_jit_step,
        _forgot_scaling_tx_update_eager,
        _forgot_scaling_train_state,
        _forgot_scaling_nnx,
    ],
    ids=["jit-step", "eager-tx.update", "TrainState", "nnx"],
)
def test_gradients_taken_without_the_scale_warn_once(run) -> None:
    got = _caught(run)
    assert len(got) == 1, got  # once, though several steps ran
    assert "no loss has been multiplied by it" in got[0]
    assert "jaxamp.value_and_grad(loss_fn)(opt_state, params, ...)" in got[0]


def _forgot_scaling_static_scale():
    tx, params, opt_state, x, y = _setup(jaxamp.static_scale(2.0**15))

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(LOSS16)(params, x, y)  # the step divides these by 2**15 too
        return jaxamp.step(tx, grads, opt_state, params)

    train_step(*train_step(params, opt_state))


def _forgot_scaling_after_logging_the_scale():
    tx, params, opt_state, x, y = _setup()
    print("initial scale", float(jaxamp.get_loss_scale(opt_state).scale))  # a log read
    print(jaxamp.metrics(opt_state)["loss_scale"])
    jaxamp.check_health(opt_state)

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(LOSS16)(params, x, y)
        return jaxamp.step(tx, grads, opt_state, params)

    train_step(params, opt_state)


def _forgot_scaling_train_state_after_logging_the_scale():
    tx, params, _, x, y = _setup()
    state = jaxamp.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)
    print("scale at start:", float(state.loss_scale.scale))  # scaler.get_scale()
    jax.jit(lambda s: s.apply_gradients(grads=jax.grad(LOSS16)(s.params, x, y)))(state)


def _forgot_scaling_nnx_after_logging_the_scale():
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    print("scale", float(optimizer.loss_scale.scale))
    x, y = _data()
    loss = jaxamp.autocast(lambda m, x, y: jnp.mean((m(x) - y) ** 2), dtype=jnp.float16)
    optimizer.update(model, nnx.grad(loss)(model, x, y))  # eager, no nnx.jit


@pytest.mark.parametrize(
    "run",
    [
        _forgot_scaling_static_scale,
        _forgot_scaling_after_logging_the_scale,
        _forgot_scaling_train_state_after_logging_the_scale,
        _forgot_scaling_nnx_after_logging_the_scale,
    ],
    ids=["static_scale", "log-read-first", "TrainState-log-read-first", "nnx-log-read-first"],
)
def test_static_scale_and_a_logged_scale_still_warn(run) -> None:
    """A static scale divides the updates too; reading the scale to log it (eagerly,
    before the first step) is no loss multiplied by it."""
    got = _caught(run)
    assert len(got) == 1, got
    assert "no loss has been multiplied by it" in got[0]


def test_the_warning_is_a_filterable_category_and_comes_once_per_process() -> None:
    assert issubclass(CATEGORY, UserWarning) and CATEGORY is not UserWarning
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=CATEGORY)
        _forgot_scaling_jit_step()
    assert not [w for w in got if issubclass(w.category, CATEGORY)]


def test_the_mistake_is_real_sgd_steps_are_divided_by_the_scale() -> None:
    """What the warning is about: unscaled gradients given to a dynamic scale make
    an SGD step 2**15 times too small (against plain optax in float32)."""
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.array([1.0, 2.0, 3.0])}
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.dynamic_scale())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CATEGORY)
        updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -grads["w"] / 2.0**15, rtol=1e-7)


# The documented paths: none warns.


def _value_and_grad_jit():
    tx, params, opt_state, x, y = _setup()

    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jaxamp.value_and_grad(LOSS16)(opt_state, params, x, y)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, jaxamp.metrics(opt_state)

    with jax.transfer_guard("disallow"):
        for _ in range(2):
            params, opt_state, _ = train_step(params, opt_state)


def _scale_by_hand_plain_optax():
    tx, params, opt_state, x, y = _setup()

    @jax.jit
    def train_step(params, opt_state):
        ls = jaxamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jaxamp.scale(ls, LOSS16(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    train_step(*train_step(params, opt_state))


def _grads_and_step_in_separate_jits():
    tx, params, opt_state, x, y = _setup()
    grads_fn = jax.jit(lambda p, s: jaxamp.value_and_grad(LOSS16)(s, p, x, y)[1])
    apply_fn = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))
    for _ in range(2):
        params, opt_state = apply_fn(grads_fn(params, opt_state), opt_state, params)


def _train_state_value_and_grad():
    tx, params, _, x, y = _setup()
    state = jaxamp.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state):
        _, grads = jaxamp.value_and_grad(LOSS16)(state, state.params, x, y)
        return state.apply_gradients(grads=grads)

    train_step(train_step(state))


def _train_state_loss_scale_by_hand():
    tx, params, _, x, y = _setup()
    state = jaxamp.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state):
        grads = jax.grad(lambda p: LOSS16(p, x, y) * state.loss_scale.scale)(state.params)
        return state.apply_gradients(grads=grads)

    train_step(state)


def _nnx_paths():
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _data()
    loss = jaxamp.autocast(lambda m, x, y: jnp.mean((m(x) - y) ** 2), dtype=jnp.float16)

    @nnx.jit
    def ours(model, optimizer):
        _, grads = jaxamp.nnx.value_and_grad(loss)(optimizer, model, x, y)
        optimizer.update(model, grads)

    ours(model, optimizer)


def _nnx_flax_grad_of_scaled_loss():
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _data()
    loss = jaxamp.autocast(lambda m, x, y: jnp.mean((m(x) - y) ** 2), dtype=jnp.float16)

    @nnx.jit
    def flax_grad(model, optimizer):
        scaled = lambda m: loss(m, x, y) * optimizer.loss_scale.scale
        optimizer.update(model, nnx.grad(scaled)(model))

    flax_grad(model, optimizer)


def _readme_plain_optax_eager():
    """README's plain optax form, run with no jit, after logging the scale."""
    tx, params, opt_state, x, y = _setup()
    print(float(jaxamp.get_loss_scale(opt_state).scale))
    for _ in range(2):
        scaled = lambda p, s: jaxamp.scale(jaxamp.get_loss_scale(s), LOSS16(p, x, y))
        grads = jax.grad(scaled)(params, opt_state)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)


def _nnx_flax_grad_of_scaled_loss_eager():
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    print(float(optimizer.loss_scale.scale))  # a log read first: does not count, nor harm
    x, y = _data()
    loss = jaxamp.autocast(lambda m, x, y: jnp.mean((m(x) - y) ** 2), dtype=jnp.float16)
    scaled = lambda m: loss(m, x, y) * optimizer.loss_scale.scale
    optimizer.update(model, nnx.grad(scaled)(model))


def _static_scale_of_one_eager():
    tx, params, opt_state, x, y = _setup(jaxamp.static_scale(1.0))
    grads = jax.grad(LOSS16)(params, x, y)  # a scale of 1: nothing to multiply by
    jaxamp.step(tx, grads, opt_state, params)


def _bfloat16_no_scale():
    x, y = _data()
    params = MODEL.init(jax.random.key(1), x)
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3))  # no loss scale: the bfloat16 form
    opt_state = tx.init(params)
    loss = jaxamp.autocast(_loss, dtype=jnp.bfloat16)

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(loss)(params, x, y)
        return jaxamp.step(tx, grads, opt_state, params)

    train_step(params, opt_state)


def _pmap_value_and_grad():
    tx, params, _, x, y = _setup()
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale(), axis_name="d")
    n = jax.local_device_count()
    rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)
    params, opt_state = rep(params), rep(tx.init(params))

    def train_step(params, opt_state, x, y):
        _, grads = jaxamp.value_and_grad(LOSS16)(opt_state, params, x, y)
        grads = jax.lax.pmean(grads, "d")
        return jaxamp.step(tx, grads, opt_state, params)

    jax.pmap(train_step, axis_name="d")(params, opt_state, rep(x), rep(y))


@pytest.mark.parametrize(
    "run",
    [
        _value_and_grad_jit,
        _scale_by_hand_plain_optax,
        _grads_and_step_in_separate_jits,
        _train_state_value_and_grad,
        _train_state_loss_scale_by_hand,
        _nnx_paths,
        _nnx_flax_grad_of_scaled_loss,
        _readme_plain_optax_eager,
        _nnx_flax_grad_of_scaled_loss_eager,
        _static_scale_of_one_eager,
        _bfloat16_no_scale,
        _pmap_value_and_grad,
    ],
    ids=[
        "value_and_grad-jit",
        "scale-by-hand",
        "separate-jits",
        "TrainState",
        "TrainState.loss_scale-by-hand",
        "nnx.value_and_grad",
        "nnx.grad-of-scaled-loss",
        "readme-plain-optax-eager",
        "nnx.grad-of-scaled-loss-eager",
        "static_scale-1-eager",
        "bfloat16",
        "pmap",
    ],
)
def test_documented_paths_do_not_warn(run) -> None:
    assert _caught(run) == []


def _float16_run_then_bfloat16_run():
    tx, params, opt_state, x, y = _setup()  # the float16 run, with a loss scale
    _, grads = jax.jit(jaxamp.value_and_grad(LOSS16))(opt_state, params, x, y)
    jaxamp.step(tx, grads, opt_state, params)
    _bfloat16_no_scale()  # make demo's next run, in the same process


def test_a_bfloat16_run_after_a_float16_one_does_not_warn() -> None:
    assert _caught(_float16_run_then_bfloat16_run) == []


def test_float16_without_a_scale_warns_after_a_scaled_float16_run() -> None:
    def run():
        _float16_run_then_bfloat16_run()
        tx, params, opt_state, x, y = _setup(None)  # float16 again, no loss scale
        jaxamp.step(tx, jax.jit(jax.grad(LOSS16))(params, x, y), opt_state, params)

    (msg,) = _caught(run)
    assert "a float16 autocast was traced, but this optimizer holds no loss scale" in msg


# ---------------------------------------------------------------------------------------
# (a) Flax's own TrainState writing model state on a skipped step


class _BN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        return nn.Dense(1)(nn.relu(x))


class FlaxBNState(train_state.TrainState):
    batch_stats: Any


class OurBNState(jaxamp.TrainState):
    batch_stats: Any


def _bn_steps(cls, bad_step: int | None = None):
    """Two jitted steps; the second one's batch holds an inf when ``bad_step`` is 1."""
    model = _BN()
    x, y = _data()
    variables = model.init(jax.random.key(1), x)
    tx = jaxamp.skip_nonfinite(optax.adam(1e-3), jaxamp.dynamic_scale())
    state = cls.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=tx,
    )

    @jax.jit
    def train_step(state, x):
        def loss_fn(params):
            out, new = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
            )
            return jnp.mean((out - y) ** 2), new["batch_stats"]

        (_, stats), grads = jaxamp.value_and_grad(loss_fn, has_aux=True)(state, state.params)
        return state.apply_gradients(grads=grads, batch_stats=stats)

    for i in range(2):
        state = train_step(state, x.at[0, 0].set(jnp.inf) if i == bad_step else x)
    return state


def test_flax_train_state_writing_batch_stats_warns_naming_the_fix() -> None:
    got = _caught(lambda: _bn_steps(FlaxBNState))
    assert len(got) == 1, got
    assert "FlaxBNState" in got[0] and "batch_stats=" in got[0]
    assert "jaxamp.TrainState" in got[0]


def test_the_flax_train_state_mistake_is_real_and_jaxamps_keeps_the_stats() -> None:
    """Why it warns: Flax's TrainState keeps the bad batch's NaN statistics on the
    skipped step; jaxamp.TrainState keeps the old ones (and does not warn)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CATEGORY)
        flax_state = _bn_steps(FlaxBNState, bad_step=1)
    ours = []
    assert _caught(lambda: ours.append(_bn_steps(OurBNState, bad_step=1))) == []
    for state in (flax_state, ours[0]):
        assert int(jaxamp.metrics(state.opt_state)["skipped_steps"]) == 1
    assert not all(np.isfinite(v).all() for v in jax.tree.leaves(flax_state.batch_stats))
    assert all(np.isfinite(v).all() for v in jax.tree.leaves(ours[0].batch_stats))


def test_flax_train_state_without_model_state_does_not_warn() -> None:
    tx, params, _, x, y = _setup()
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state):
        _, grads = jaxamp.value_and_grad(LOSS16)(state.opt_state, state.params, x, y)
        return state.apply_gradients(grads=grads)

    assert _caught(lambda: train_step(state)) == []
