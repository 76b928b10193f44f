"""skip_nonfinite(every_k=k): PyTorch's gradient accumulation with one scale per window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

LR = 0.125


def run(tx, grads_seq, params, *, fused):
    """Runs a sequence of gradient trees through tx under one jit; returns the per-call history."""
    state = tx.init(params)

    def body(carry, g):
        params, state = carry
        if fused:
            params, state = jaxamp.step(tx, g, state, params)
        else:
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
        return (params, state), (params, jaxamp.metrics(state))

    with jax.transfer_guard("disallow"):
        (params, state), hist = jax.jit(lambda c, s: jax.lax.scan(body, c, s))(
            (params, state), grads_seq
        )
    return params, state, hist


def torch_accumulation(bad, k, scale, growth_interval, w0):
    """Plain-Python model of PyTorch's recipe: scale, backward k times, scaler.step, update.

    SGD on one parameter whose true gradient is 1 on every micro-batch; ``bad[i]`` marks
    micro-batch i as overflowing (its scaled gradient is inf). Returns per-call (w, scale).
    """
    w, acc, good_streak, out = w0, 0.0, 0, []
    for i, b in enumerate(bad):
        acc += np.inf if b else 1.0 * scale  # the scaled gradient of this micro-batch
        if (i + 1) % k == 0:
            g = acc / k / scale
            if np.isfinite(g):
                w = w - LR * g
                good_streak += 1
                if good_streak == growth_interval:
                    scale, good_streak = scale * 2, 0
            else:
                scale, good_streak = scale / 2, 0
            acc = 0.0  # replaced, not multiplied
        out.append((w, scale))
    return out


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(1, 4),
    windows=st.integers(1, 6),
    data=st.data(),
    growth_interval=st.integers(1, 3),
)
def test_accumulation_matches_pytorchs_loop(k, windows, data, growth_interval):
    n = k * windows
    bad = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    scale0 = 2.0**10
    tx = jaxamp.skip_nonfinite(
        optax.sgd(LR),
        jaxamp.dynamic_scale(init_scale=scale0, growth_interval=growth_interval),
        every_k=k,
    )
    # The caller scales its loss with the scale the state holds at each call.
    params = {"w": jnp.float32(1.0)}
    state = tx.init(params)
    got = []
    step = jax.jit(lambda g, s, p: jaxamp.step(tx, g, s, p))
    for b in bad:
        s = jaxamp.get_loss_scale(state).scale
        g = {"w": jnp.where(b, jnp.inf, 1.0 * s)}
        params, state = step(g, state, params)
        got.append((float(params["w"]), float(jaxamp.get_loss_scale(state).scale)))
    want = torch_accumulation(bad, k, scale0, growth_interval, 1.0)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6)


def test_an_inf_micro_batch_costs_exactly_its_window():
    k = 4
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    ls = jaxamp.static_scale(8.0)
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), ls, every_k=k)
    rng = np.random.default_rng(0)
    grads = [
        {"w": jnp.asarray(rng.normal(size=3), jnp.float32) * 8, "b": jnp.float32(8.0)}
        for _ in range(3 * k)
    ]
    grads[k + 1] = {"w": jnp.array([1.0, jnp.inf, 2.0]), "b": jnp.float32(jnp.nan)}  # window 2
    seq = jax.tree.map(lambda *x: jnp.stack(x), *grads)
    p, state, hist = run(tx, seq, params, fused=True)
    # Reference: plain adam on the window means of windows 1 and 3, window 2 left out.
    ref_tx = optax.adam(0.1)
    rp, rs = params, ref_tx.init(params)
    for w in (0, 2):
        mean = jax.tree.map(lambda *x: sum(x) / k / 8.0, *grads[w * k : (w + 1) * k])
        u, rs = ref_tx.update(mean, rs, rp)
        rp = optax.apply_updates(rp, u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p, rp)
    skipped = np.asarray(hist[1]["skipped_steps"])
    np.testing.assert_array_equal(skipped, [0] * (2 * k - 1) + [1] * (k + 1))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.acc))
    assert int(state.mini_step) == 0


def test_micro_steps_change_nothing_but_the_accumulator():
    params = {"w": jnp.ones(2)}
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), jaxamp.dynamic_scale(growth_interval=1), every_k=3)
    state = tx.init(params)
    g = {"w": jnp.array([2.0, 4.0])}
    updates, s1 = tx.update(g, state, params)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    p, s2 = jaxamp.step(tx, g, state, params)
    np.testing.assert_array_equal(p["w"], params["w"])
    for s in (s1, s2):
        assert jax.tree.all(jax.tree.map(jnp.array_equal, s.inner_state, state.inner_state))
        assert float(s.loss_scale.scale) == float(state.loss_scale.scale)  # one scale per window
        assert int(s.loss_scale.growth_tracker) == 0
        np.testing.assert_array_equal(s.acc["w"], g["w"])
        assert int(s.mini_step) == 1


def test_step_equals_update_then_apply_bit_for_bit():
    rng = np.random.default_rng(1)
    seq = {"w": jnp.asarray(rng.normal(size=(12, 5)) * 2**10, jnp.float32)}
    seq["w"] = seq["w"].at[5, 2].set(jnp.inf)
    params = {"w": jnp.asarray(rng.normal(size=5), jnp.float32)}
    tx = jaxamp.skip_nonfinite(
        optax.adamw(1e-2), jaxamp.dynamic_scale(2.0**10, growth_interval=2), every_k=3
    )
    a = run(tx, seq, params, fused=True)
    b = run(tx, seq, params, fused=False)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_one_accumulator_and_nothing_else():
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    plain = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    acc = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), every_k=4)
    size = lambda s: sum(x.size for x in jax.tree.leaves(s))
    assert size(acc.init(params)) == size(plain.init(params)) + 20 + 1  # acc + mini_step


def test_works_with_train_state_metrics_and_get_loss_scale():
    params = {"w": jnp.ones(2)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.5), jaxamp.static_scale(4.0), every_k=2)
    ts = jaxamp.TrainState.create(apply_fn=None, params=params, tx=tx)
    for _ in range(2):
        ts = ts.apply_gradients(grads={"w": jnp.array([4.0, 8.0])})
    np.testing.assert_array_equal(ts.params["w"], [0.5, 0.0])
    assert float(ts.loss_scale.scale) == 4.0 and not bool(jaxamp.metrics(ts.opt_state)["skipped"])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_every_k_is_validated(bad):
    with pytest.raises((ValueError, TypeError), match="every_k"):
        jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), every_k=bad)


def test_finite_with_every_k_is_an_error():
    params = {"w": jnp.ones(2)}
    tx = jaxamp.skip_nonfinite(optax.sgd(0.5), jaxamp.static_scale(4.0), every_k=2)
    with pytest.raises(ValueError, match="every_k"):
        jaxamp.step(tx, params, tx.init(params), params, finite=jnp.array(True))


# ---------------------------------------------------------------- restoring a window elsewhere


def _window_after(k: int, calls: int, params):
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.static_scale(4.0), every_k=k)
    state = tx.init(params)
    for i in range(calls):
        params, state = jaxamp.step(tx, {"w": jnp.full(2, 4.0 * (i + 1))}, state, params)
    return params, state


@pytest.mark.parametrize("saved_k,restored_k", [(4, 2), (4, 3), (2, 4)])
def test_a_window_restored_under_another_every_k_applies_its_mean(
    tmp_path, saved_k, restored_k
) -> None:
    import orbax.checkpoint as ocp

    params = {"w": jnp.zeros(2)}
    calls = saved_k - 1  # mid-window: saved_k - 1 micro-batches accumulated
    params, state = _window_after(saved_k, calls, params)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "c", {"params": params, "opt_state": state})
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.static_scale(4.0), every_k=restored_k)
    target = {"params": params, "opt_state": tx.init(params)}
    with ocp.StandardCheckpointer() as ckpt:
        restored = jaxamp.checkpoint.restore(ckpt, target, directory=tmp_path / "c")
    params, state = restored["params"], restored["opt_state"]
    # Feed micro-batches until the window ends; unscaled gradients are 1, 2, 3, ...
    n = calls
    while True:
        n += 1
        params, state = jaxamp.step(tx, {"w": jnp.full(2, 4.0 * n)}, state, params)
        if int(state.mini_step) == 0:
            break
    # One update, by the mean of every micro-batch the window held: never k_saved / k times it.
    expected = -np.mean(np.arange(1.0, n + 1))
    np.testing.assert_allclose(params["w"], [expected, expected], rtol=1e-6)
    assert n == max(saved_k, restored_k)


def test_where_stepped_inside_a_window_follows_the_window_so_far() -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), jaxamp.dynamic_scale(2.0), every_k=3)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    good, bad = {"w": jnp.ones(2)}, {"w": jnp.array([jnp.inf, 1.0])}
    verdicts = []
    for g in (good, good, good, good, bad, good, good, good, good):
        params, state = jaxamp.step(tx, g, state, params)
        verdicts.append(bool(jaxamp.stepped(state)))
    # window 1 taken; window 2 poisoned at its 2nd call and skipped; window 3 taken
    assert verdicts == [True, True, True, True, False, False, True, True, True]


def test_stepped_reads_a_state_stacked_over_replicas_per_replica() -> None:
    # A pmap-stacked state read on the host, mid-window: one verdict per replica.
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), every_k=2)
    params = {"w": jnp.ones(3)}
    stacked = jax.tree.map(lambda a: jnp.stack([a] * 4), tx.init(params))
    grads = {"w": jnp.ones((4, 3)).at[2, 1].set(jnp.nan)}
    _, stacked = jax.vmap(lambda g, s: jaxamp.step(tx, g, s, params))(grads, stacked)
    got = np.asarray(jaxamp.stepped(stacked))
    np.testing.assert_array_equal(got, [True, True, False, True])
    np.testing.assert_array_equal(got, np.asarray(jax.vmap(jaxamp.stepped)(stacked)))
