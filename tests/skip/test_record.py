"""The per-leaf record of non-finite gradients and ``jaxamp.explain``.

After a skipped step the optimizer state says which gradient leaves held inf or
NaN, and how often each has; ``explain`` names them by key path. Exercised
through every path that steps: ``tx.update``, ``jaxamp.step`` (fused), ``finite=``,
``every_k``, ``multi_transform``, ``TrainState``, the nnx optimizer, a real
linen model, and under ``jit`` with host transfers disallowed.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp


def _params():
    # A large leaf and small ones: every leaf's flag comes from the finite check (one
    # reduction per leaf); none is read again for the record.
    return {"enc": {"kernel": jnp.ones((200, 100)), "bias": jnp.ones(100)}, "head": jnp.ones(4)}


def _grads(bad: set[str], value=jnp.inf):
    g = jax.tree.map(jnp.ones_like, _params())
    if "enc.kernel" in bad:
        g["enc"]["kernel"] = g["enc"]["kernel"].at[1, 0].set(value)
    if "enc.bias" in bad:
        g["enc"]["bias"] = g["enc"]["bias"].at[0].set(value)
    if "head" in bad:
        g["head"] = g["head"].at[3].set(value)
    return g


PATHS = ["enc.bias", "enc.kernel", "head"]  # jax.tree.leaves order (sorted dict keys)


@pytest.mark.parametrize("fused", [True, False])
def test_names_exactly_the_planted_leaves_under_jit(fused) -> None:
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**4))
    params = _params()
    state = tx.init(params)

    @jax.jit
    def train(g, s, p):
        if fused:
            return jaxamp.step(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    plan = [{"head"}, set(), {"enc.kernel", "head"}, {"enc.bias"}, set()]
    grads = [
        jax.device_put(_grads(bad, jnp.nan if i % 2 else jnp.inf)) for i, bad in enumerate(plan)
    ]
    with jax.transfer_guard("disallow"):
        history = []
        for g in grads:
            params, state = train(g, state, params)
            history.append(state.nonfinite_leaves)
    last = [np.asarray(h.last) for h in history]
    assert [PATHS[i] for i in np.flatnonzero(last[0])] == ["head"]
    np.testing.assert_array_equal(last[1], last[0])  # a finite step keeps the last skip's
    assert [PATHS[i] for i in np.flatnonzero(last[2])] == ["enc.kernel", "head"]
    assert [PATHS[i] for i in np.flatnonzero(last[3])] == ["enc.bias"]
    np.testing.assert_array_equal(np.asarray(history[-1].count), [1, 1, 2])
    why = jaxamp.explain(state, params)
    assert why.skipped_steps == 3
    assert why.last == ("enc.bias",)
    assert why.counts == {"head": 2, "enc.bias": 1, "enc.kernel": 1}
    text = str(why)
    assert "3 step(s) skipped" in text and "1 of 3 gradient leaves" in text
    assert "head (2x), enc.bias (1x), enc.kernel (1x)" in text


def test_a_finite_run_says_nothing_was_skipped() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    params = _params()
    params, state = jaxamp.step(tx, _grads(set()), tx.init(params), params)
    why = jaxamp.explain(state, params)
    assert (why.skipped_steps, why.last, why.counts) == (0, (), {})
    assert str(why).startswith("No step has been skipped")


def test_finite_verdict_skip_with_finite_grads_records_no_leaf() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    params = _params()
    g = _grads(set())
    params, state = jaxamp.step(tx, g, tx.init(params), params, finite=jnp.array(False))
    why = jaxamp.explain(state, params)
    assert why.skipped_steps == 1 and why.last == ()
    assert "finite= verdict" in str(why)


def test_every_k_records_the_window_not_each_micro_batch() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), every_k=3)
    params = _params()
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))
    for bad in [{"enc.bias"}, set(), set()]:  # window 1: the first micro-batch overflows
        params, state = step(_grads(bad), state, params)
        if bad:  # inside the window: nothing recorded yet
            assert not np.asarray(state.nonfinite_leaves.last).any()
    assert jaxamp.explain(state, params).last == ("enc.bias",)
    for _ in range(3):  # window 2: finite
        params, state = step(_grads(set()), state, params)
    why = jaxamp.explain(state, params)
    assert why.skipped_steps == 1 and why.last == ("enc.bias",) and why.counts == {"enc.bias": 1}


def test_every_k_records_through_tx_update_without_params() -> None:
    # optax's usual call for sgd / adam: update(grads, state), no params. The window's
    # last call checks the window's mean, whose leaves are the params' leaves.
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), jaxamp.dynamic_scale(), every_k=2)
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for bad in [set(), {"enc.kernel", "head"}]:
        _, state = update(_grads(bad), state)
    assert jaxamp.explain(state, params).last == ("enc.kernel", "head")
    np.testing.assert_array_equal(np.asarray(state.nonfinite_leaves.count), [0, 1, 1])


def test_multi_transform_merges_the_partitions_leaves_in_param_order() -> None:
    labels = {"enc": {"kernel": "a", "bias": "b"}, "head": "a"}
    tx = jaxamp.multi_transform({"a": optax.sgd(0.1), "b": optax.adam(0.1)}, labels)
    params = _params()
    state = tx.init(params)
    for bad, want in [({"head"}, ["head"]), ({"enc.bias", "head"}, ["enc.bias", "head"])]:
        params, state = jaxamp.step(tx, _grads(bad), state, params)
        assert list(jaxamp.explain(state, params).last) == want
    assert jaxamp.explain(state, params).counts == {"head": 2, "enc.bias": 1}


def test_train_state_and_linen_model_paths() -> None:
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, name="up")(x)
            return nn.Dense(1, name="down")(nn.relu(x))

    model = Net()
    x = jnp.ones((4, 3))
    params = model.init(jax.random.key(0), x)["params"]
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale())
    state = jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def train(state, x, blow):
        def loss_fn(p):
            # An overflow planted in the first layer's kernel gradient only.
            planted = jnp.sum(p["up"]["kernel"]) * blow
            return jnp.mean(model.apply({"params": p}, x) ** 2) + planted

        _, grads = jaxamp.value_and_grad(loss_fn)(state, state.params)
        return state.apply_gradients(grads=grads)

    state = train(state, x, jnp.float32(0.0))
    state = train(state, x, jnp.float32(jnp.inf))
    why = jaxamp.explain(state)  # a TrainState carries its params
    assert why.last == ("up.kernel",)
    assert why.n_leaves == 4


def test_nnx_optimizer_paths() -> None:
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(3, 8, rngs=rngs)
            self.down = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    model = Net(nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale())
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train(model, optimizer, x, blow):
        def loss_fn(m, x):  # an overflow planted in the head's bias gradient only
            return jnp.mean(m(x) ** 2) + jnp.sum(m.down.bias[...]) * blow

        _, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x)
        optimizer.update(model, grads)

    train(model, optimizer, jnp.ones((4, 3)), jnp.float32(0.0))
    train(model, optimizer, jnp.ones((4, 3)), jnp.float32(jnp.inf))
    why = jaxamp.explain(optimizer, model)
    assert why.skipped_steps == 1
    assert why.last == ("down.bias",)
    assert why.n_leaves == 4


def test_explain_errors_name_what_to_pass() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    params = _params()
    state = tx.init(params)
    with pytest.raises(TypeError, match="pass the params"):
        jaxamp.explain(state)
    with pytest.raises(ValueError, match="`params` has 1 leaves but the optimizer state tracks 3"):
        jaxamp.explain(state, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="found no jaxamp.skip_nonfinite"):
        jaxamp.explain(optax.sgd(0.1).init(params), params)
    hand = jaxamp.types.SkipNonfiniteState(state.inner_state, state.loss_scale)
    with pytest.raises(ValueError, match="keeps no per-leaf record"):
        jaxamp.explain(hand, params)
    with pytest.raises(TypeError, match="call it outside jax.jit"):
        jax.jit(lambda s, p: jaxamp.explain(s, p).n_leaves)(state, params)


def test_a_hand_built_state_still_steps_without_a_record() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    params = _params()
    hand = jaxamp.types.SkipNonfiniteState(tx.init(params).inner_state, jaxamp.dynamic_scale())
    _, state = jaxamp.step(tx, _grads({"head"}), hand, params)
    assert state.nonfinite_leaves is None and int(state.loss_scale.skipped_steps) == 1


# One transformation per way of splitting the leaves into independently skipped parts:
# with several parts, each part's skip branch writes the record, in any order.
_TXS = {
    "skip_nonfinite": jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale()),
    "two parts": jaxamp.multi_transform(
        {"a": optax.sgd(0.1), "b": optax.adam(0.1)},
        {"enc": {"kernel": "a", "bias": "b"}, "head": "a"},
        jaxamp.dynamic_scale(),
    ),
    "three parts": jaxamp.multi_transform(
        {"x": optax.sgd(0.1), "y": optax.sgd(0.2), "z": optax.adam(0.1)},
        {"enc": {"kernel": "z", "bias": "x"}, "head": "y"},
        jaxamp.dynamic_scale(),
    ),
}
_STEPS = {k: jax.jit(lambda g, s, p, tx=tx: jaxamp.step(tx, g, s, p)) for k, tx in _TXS.items()}


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(sorted(_TXS)),
    st.lists(st.sets(st.sampled_from(PATHS)), min_size=1, max_size=6),
)
def test_record_matches_a_plain_python_model(which, plan) -> None:
    tx = _TXS[which]
    params = _params()
    state = tx.init(params)
    counts = dict.fromkeys(PATHS, 0)
    last: tuple[str, ...] = ()
    for bad in plan:
        params, state = _STEPS[which](_grads(bad), state, params)
        for p in bad:
            counts[p] += 1
        if bad:
            last = tuple(p for p in PATHS if p in bad)
    why = jaxamp.explain(state, params)
    assert why.last == last
    assert why.counts == {p: n for p, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n}
    assert why.skipped_steps == sum(1 for bad in plan if bad)
