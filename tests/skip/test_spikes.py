"""Spike skipping (``jaxamp.spike_rule``) in the guarded step's one ``lax.cond``.

The decisions match a plain-Python model of the rule on random loss and
gradient-norm sequences; a spike step keeps params and optimizer state bit for
bit, never moves the loss scale, is counted apart in ``metrics``, composes with
``every_k``, ``multi_transform``, ``TrainState`` (model state kept) and the nnx
optimizer, and its history is checkpointed and validated on restore.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import jaxamp

N = 4  # params per leaf: a gradient of all g has norm 2|g|


def _grads(g):
    return {"w": jnp.full((N,), g, jnp.float32)}


class Reference:
    """The rule in plain Python (float64), written from the docstring of jaxamp.skip._spikes."""

    def __init__(self, window, sigmas, warmup, loss=True, grad_norm=True):
        self.window, self.sigmas, self.warmup = window, sigmas, warmup
        self.use_loss, self.use_norm = loss, grad_norm
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.margin = math.inf  # how close the closest decision came to its threshold

    def _limit(self, values):
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return mean + self.sigmas * max(std, 1e-4 * abs(mean))

    def step(self, loss, norm, finite) -> bool:
        spike = False
        if finite and len(self.losses) >= self.warmup:
            for on, value, hist in (
                (self.use_loss, loss, self.losses),
                (self.use_norm, norm, self.norms),
            ):
                if on:
                    limit = self._limit(hist)
                    self.margin = min(self.margin, abs(value - limit) / max(1.0, abs(limit)))
                    spike = spike or value > limit
        if finite and math.isfinite(loss):
            self.losses = (self.losses + [loss])[-self.window :]
            self.norms = (self.norms + [norm])[-self.window :]
        return spike


_RULE = dict(window=6, sigmas=2.0, warmup=3)
_TX = jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(**_RULE))
_STEP = jax.jit(lambda g, s, p, v: jaxamp.step(_TX, g, s, p, value=v))

finite_float = st.floats(0.125, 10.0, allow_nan=False, width=32)
event = st.one_of(
    st.tuples(finite_float, finite_float),  # (loss, per-element gradient)
    st.tuples(finite_float, st.just(math.inf)),  # non-finite gradients
    st.tuples(st.just(math.nan), finite_float),  # finite gradients, NaN loss
)


@settings(max_examples=40, deadline=None)
@given(st.lists(event, min_size=1, max_size=20))
def test_decisions_match_the_plain_python_rule(events) -> None:
    ref = Reference(**_RULE)
    params = {"w": jnp.zeros(N)}
    state = _TX.init(params)
    want_skips = 0
    for loss, g in events:
        finite = math.isfinite(g)
        norm = 2.0 * float(np.float32(g)) if finite else math.inf
        spike = ref.step(float(np.float32(loss)), norm, finite)
        want_skips += spike
        old = params
        params, state = _STEP(_grads(g), state, params, jnp.float32(loss))
        assert bool(state.spikes.skipped) == spike
        if spike or not finite:
            np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(old["w"]))
    assume(ref.margin > 1e-4)  # float32 sums: no verdict decided by the last bit
    m = jaxamp.metrics(state)
    assert int(m["spike_skipped_steps"]) == want_skips
    assert int(m["skipped_steps"]) == sum(1 for _, g in events if not math.isfinite(g))
    filled = min(len(ref.losses), _RULE["window"])
    assert int(min(int(state.spikes.count), _RULE["window"])) == filled


def _warm(tx, params, state, n, loss=1.0, g=1.0, **kw):
    step = jax.jit(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v))
    for i in range(n):
        wobble = 0.01 * (i % 3)
        params, state = step(_grads(g + wobble), state, params, jnp.float32(loss + wobble))
    return params, state, step


def test_a_spike_keeps_params_and_inner_state_bit_for_bit_and_never_moves_the_scale() -> None:
    rule = jaxamp.spike_rule(window=8, warmup=4)
    ls = jaxamp.dynamic_scale(2.0**4, growth_interval=3)
    with_rule = jaxamp.skip_nonfinite(optax.adam(1e-2), ls, spikes=rule)
    without = jaxamp.skip_nonfinite(optax.adam(1e-2), ls)
    params = {"w": jnp.linspace(-1.0, 1.0, N)}
    p1, s1, step1 = _warm(with_rule, params, with_rule.init(params), 6)
    p2, s2, _ = _warm(without, params, without.init(params), 6)
    before = jax.tree.map(np.asarray, (p1, s1.inner_state))
    # A loss spike, then a gradient-norm spike; the scale would grow at either.
    for g, loss in [(1.0, 50.0), (40.0, 1.0)]:
        p1, s1 = step1(_grads(g), s1, p1, jnp.float32(loss))
        assert bool(s1.spikes.skipped) and bool(jaxamp.metrics(s1)["skipped"])
        assert not bool(jaxamp.stepped(s1))
        jax.tree.map(
            np.testing.assert_array_equal, before, jax.tree.map(np.asarray, (p1, s1.inner_state))
        )
        s2 = jax.jit(without.update)(_grads(g), s2, p2)[1]
    # The loss scale moves exactly as it does without the rule: by finiteness alone.
    jax.tree.map(np.testing.assert_array_equal, s1.loss_scale, s2.loss_scale)
    assert int(s1.loss_scale.skipped_steps) == 0 and int(s1.spikes.skips) == 2


def test_a_lasting_level_change_is_accepted_after_a_few_steps() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=8, warmup=4))
    params = {"w": jnp.zeros(N)}
    params, state, step = _warm(tx, params, tx.init(params), 8)
    spikes = []
    for _ in range(8):
        params, state = step(_grads(1.0), state, params, jnp.float32(3.0))
        spikes.append(bool(state.spikes.skipped))
    assert spikes[0] and not all(spikes) and not spikes[-1]


def test_warmup_and_judging_the_norm_only() -> None:
    tx = jaxamp.skip_nonfinite(
        optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=4, warmup=4, loss=False)
    )
    params = {"w": jnp.zeros(N)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))  # no value= needed
    for g in [1.0, 1.1, 1.0, 100.0]:  # the 4th arrives with 3 recorded: still warming up
        params, state = step(_grads(g), state, params)
        assert not bool(state.spikes.skipped)
    params, state = step(_grads(1000.0), state, params)
    assert bool(state.spikes.skipped)


def test_every_k_judges_the_windows_mean_loss() -> None:
    tx = jaxamp.skip_nonfinite(
        optax.sgd(0.1), None, every_k=2, spikes=jaxamp.spike_rule(window=4, warmup=2)
    )
    params = {"w": jnp.zeros(N)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v))
    for loss in [1.0, 3.0, 1.9, 2.1, 2.0, 2.0]:  # windows of mean 2.0, 2.0, 2.0
        params, state = step(_grads(1.0), state, params, jnp.float32(loss))
    np.testing.assert_allclose(np.asarray(state.spikes.losses[:3]), [2.0, 2.0, 2.0])
    before = np.asarray(params["w"])
    params, state = step(_grads(1.0), state, params, jnp.float32(1.0))
    assert float(state.spikes.pending) == 1.0 and not bool(state.spikes.skipped)
    params, state = step(_grads(1.0), state, params, jnp.float32(9.0))  # mean 5.0: a spike
    assert bool(state.spikes.skipped) and float(state.spikes.pending) == 0.0
    np.testing.assert_array_equal(np.asarray(params["w"]), before)


def test_multi_transform_spike_skips_every_partition() -> None:
    tx = jaxamp.multi_transform(
        {"a": optax.sgd(0.1), "b": optax.adam(0.1)},
        {"w": "a", "v": "b"},
        jaxamp.dynamic_scale(2.0),
        spikes=jaxamp.spike_rule(window=4, warmup=2),
    )
    params = {"w": jnp.zeros(N), "v": jnp.zeros(N)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v))
    g = {"w": jnp.ones(N), "v": jnp.ones(N)}
    for loss in [1.0, 1.1, 0.9]:
        params, state = step(g, state, params, jnp.float32(loss))
    before = jax.tree.map(np.asarray, (params, state.inner_states))
    params, state = step(g, state, params, jnp.float32(100.0))
    assert bool(jaxamp.metrics(state)["spike_skipped"])
    jax.tree.map(
        np.testing.assert_array_equal,
        before,
        jax.tree.map(np.asarray, (params, state.inner_states)),
    )


def test_train_state_keeps_model_state_on_a_spike() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=4, warmup=2))

    class State(jaxamp.TrainState):
        stats: dict

    state = State.create(
        apply_fn=None, params={"w": jnp.zeros(N)}, tx=tx, stats={"m": jnp.zeros(2)}
    )
    step = jax.jit(
        lambda s, v, m: s.apply_gradients(
            grads=_grads(1.0), extra_args={"value": v}, stats={"m": m}
        )
    )
    for i, loss in enumerate([1.0, 1.1, 0.9]):
        state = step(state, jnp.float32(loss), jnp.full(2, float(i)))
    state = step(state, jnp.float32(100.0), jnp.full(2, 99.0))
    np.testing.assert_array_equal(np.asarray(state.stats["m"]), [2.0, 2.0])


def test_nnx_optimizer_passes_value_to_the_rule() -> None:
    model = nnx.Linear(N, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=4, warmup=2))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train(model, optimizer, x, bump):
        loss_fn = lambda m, x: jnp.mean(m(x) ** 2) + bump
        loss, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x)
        optimizer.update(model, grads, value=loss)

    x = jnp.ones((2, N))
    for _ in range(3):
        train(model, optimizer, x, jnp.float32(0.0))
    kernel = np.asarray(model.kernel[...])
    train(model, optimizer, x, jnp.float32(1e3))
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)
    assert int(optimizer.step[...]) == 3
    assert "the last step was one" in str(jaxamp.explain(optimizer, model))


def test_spike_state_round_trips_through_orbax_and_is_validated(tmp_path) -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), None, spikes=jaxamp.spike_rule(window=4, warmup=2))
    params = {"w": jnp.zeros(N)}
    params, state, _ = _warm(tx, params, tx.init(params), 5)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ok", state)
    ckptr.wait_until_finished()
    back = jaxamp.checkpoint.restore(
        ckptr, jax.eval_shape(tx.init, params), directory=tmp_path / "ok"
    )
    jax.tree.map(np.testing.assert_array_equal, back.spikes, state.spikes)
    bad = state._replace(spikes=state.spikes._replace(count=jnp.int32(8)))
    ckptr.save(tmp_path / "bad", bad)
    ckptr.wait_until_finished()
    with pytest.raises(ValueError, match=r"invalid spike state: count must be in \[0, 8\), got 8"):
        jaxamp.checkpoint.restore(
            ckptr, jax.eval_shape(tx.init, params), directory=tmp_path / "bad"
        )
    nan = state._replace(
        spikes=state.spikes._replace(losses=state.spikes.losses.at[0].set(jnp.nan))
    )
    ckptr.save(tmp_path / "nan", nan)
    ckptr.wait_until_finished()
    with pytest.raises(ValueError, match="losses holds a non-finite recorded value"):
        jaxamp.checkpoint.restore(
            ckptr, jax.eval_shape(tx.init, params), directory=tmp_path / "nan"
        )


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="window must be >= 2"):
        jaxamp.spike_rule(window=1)
    with pytest.raises(ValueError, match="sigmas must be finite and > 0"):
        jaxamp.spike_rule(sigmas=0.0)
    with pytest.raises(ValueError, match=r"warmup must be in \[2, window=8\]"):
        jaxamp.spike_rule(window=8, warmup=9)
    with pytest.raises(ValueError, match="at least one of loss and grad_norm"):
        jaxamp.spike_rule(loss=False, grad_norm=False)
    with pytest.raises(TypeError, match="window must be an int"):
        jaxamp.spike_rule(window=8.0)
    with pytest.raises(TypeError, match="spikes must be None or a jaxamp.spike_rule"):
        jaxamp.skip_nonfinite(optax.sgd(0.1), spikes={"window": 8})
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), spikes=jaxamp.spike_rule())
    params = {"w": jnp.zeros(N)}
    state = tx.init(params)
    with pytest.raises(TypeError, match="pass it as value=loss"):
        jaxamp.step(tx, _grads(1.0), state, params)
    with pytest.raises(ValueError, match="value= must be the scalar floating loss"):
        jaxamp.step(tx, _grads(1.0), state, params, value=jnp.ones(3))
    plain = jaxamp.skip_nonfinite(optax.sgd(0.1)).init(params)
    with pytest.raises(TypeError, match="opt_state.spikes is NoneType"):
        jaxamp.step(tx, _grads(1.0), plain, params, value=1.0)


def test_a_flat_history_does_not_make_a_rounding_wobble_a_spike() -> None:
    # std 0 (every loss the same): the floor of 1e-4 of the mean keeps 1.0000001 from
    # being "6 sigmas" above 1.0, while a real jump is still skipped.
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), spikes=jaxamp.spike_rule(window=8, warmup=4))
    params = {"w": jnp.zeros(N)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, v: jaxamp.step(tx, g, s, p, value=v))
    for _ in range(6):
        params, state = step(_grads(1.0), state, params, jnp.float32(1.0))
    params, state = step(_grads(1.0), state, params, jnp.float32(1.0000001))
    assert not bool(state.spikes.skipped)
    params, state = step(_grads(1.0), state, params, jnp.float32(1.01))
    assert bool(state.spikes.skipped)


def test_train_state_names_where_the_loss_goes() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), spikes=jaxamp.spike_rule(window=4))
    ts = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.zeros(N)}, tx=tx)
    with pytest.raises(TypeError, match=r"extra_args=\{'value': loss\}"):
        ts.apply_gradients(grads=_grads(1.0), value=jnp.float32(1.0))
    ts = ts.apply_gradients(grads=_grads(1.0), extra_args={"value": jnp.float32(1.0)})
    assert int(ts.opt_state.spikes.count) == 1
