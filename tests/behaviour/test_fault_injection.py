"""Fault injection: a real mixed-precision training loop under the faults AMP meets in practice.

Injected at random steps: an inf or a NaN into a random element of a random
gradient leaf, an overflowing loss, a stretch of overflows longer than the
hysteresis, one longer than ``max_consecutive_nonfinite``, and a checkpoint taken
in the middle of a hysteresis window. The loop runs under
``jax.transfer_guard("disallow")``; only ``check_health`` reads from the device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp

N_STEPS = 120
HYSTERESIS = 2
LIMIT = 3  # max_consecutive_nonfinite
CLEAN, INF, NAN, OVERFLOW = 0, 1, 2, 3
STRETCH_OK = range(40, 43)  # 3 overflows in a row: > hysteresis, <= LIMIT
STRETCH_BAD = range(80, 84)  # 4 in a row: the 4th exceeds LIMIT
CKPT_AFTER = 80  # right after the first fault of STRETCH_BAD: mid-hysteresis


def _schedule(seed: int = 1234) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    kind = np.zeros(N_STEPS, np.int32)
    kind[list(STRETCH_OK)] = OVERFLOW
    kind[list(STRETCH_BAD)] = rng.choice([INF, NAN, OVERFLOW], len(STRETCH_BAD))
    taken = set(STRETCH_OK) | set(STRETCH_BAD)
    free = [s for s in range(1, N_STEPS - 1) if not {s - 1, s, s + 1} & taken]
    isolated = rng.choice(free, 14, replace=False)
    kind[isolated] = rng.choice([INF, NAN, INF, NAN, OVERFLOW], len(isolated))
    kind[isolated[:3]] = [INF, NAN, OVERFLOW]  # each kind at least once
    return {
        "kind": kind,
        "leaf": rng.integers(0, 4, N_STEPS).astype(np.int32),
        "idx": rng.integers(0, 1 << 30, N_STEPS).astype(np.int32),
    }


def _init_params(rng: np.random.Generator) -> dict[str, jax.Array]:
    def dense(n_in: int, n_out: int) -> np.ndarray:
        return rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)

    return {
        "w1": jnp.asarray(dense(8, 32), jnp.float32),
        "b1": jnp.zeros(32, jnp.float32),
        "w2": jnp.asarray(dense(32, 1), jnp.float32),
        "b2": jnp.zeros(1, jnp.float32),
    }


def _forward(params: Any, x: jax.Array) -> jax.Array:
    # float16 compute, float32 params and loss: what mixed precision does.
    p = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    h = jax.nn.gelu(x.astype(jnp.float16) @ p["w1"] + p["b1"])
    return (h @ p["w2"] + p["b2"]).astype(jnp.float32)


def _loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((_forward(params, x) - y) ** 2)


_eval_loss = jax.jit(_loss)


def _inject(grads: Any, fault: dict[str, jax.Array]) -> Any:
    """Puts an inf or NaN at one element of one gradient leaf, as the fault says."""
    leaves, treedef = jax.tree.flatten(grads)
    bad = jnp.where(fault["kind"] == INF, jnp.inf, jnp.nan)
    hit = (fault["kind"] == INF) | (fault["kind"] == NAN)
    out = []
    for i, leaf in enumerate(leaves):
        where = jnp.arange(leaf.size).reshape(leaf.shape) == fault["idx"] % leaf.size
        out.append(jnp.where(hit & (fault["leaf"] == i) & where, bad.astype(leaf.dtype), leaf))
    return jax.tree.unflatten(treedef, out)


def _make_tx() -> optax.GradientTransformation:
    return jaxamp.skip_nonfinite(
        optax.chain(optax.clip_by_global_norm(5.0), optax.adam(3e-3)),
        jaxamp.dynamic_scale(
            init_scale=2.0**10,
            growth_interval=10,
            hysteresis=HYSTERESIS,
            max_scale=2.0**14,
            max_consecutive_nonfinite=LIMIT,
        ),
    )


def _make_step(tx: optax.GradientTransformation, fused: bool):
    @jax.jit
    def train_step(params, opt_state, x, y, fault):
        ls = jaxamp.get_loss_scale(opt_state)

        def scaled_loss(p):
            loss = _loss(p, x, y)
            loss = jnp.where(fault["kind"] == OVERFLOW, loss * jnp.float32(3e38), loss)
            return jaxamp.scale(ls, loss)

        grads = _inject(jax.grad(scaled_loss)(params), fault)
        if fused:
            new_params, new_state = jaxamp.step(tx, grads, opt_state, params)
        else:
            updates, new_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
        old = (params, opt_state.inner_state)
        new = (new_params, new_state.inner_state)
        same = jax.tree.map(lambda a, b: jnp.all(a == b), old, new)
        unchanged = jnp.all(jnp.stack(jax.tree.leaves(same)))
        info = dict(
            jaxamp.metrics(new_state),
            unchanged=unchanged,
            healthy=jaxamp.all_finite((new_params, new_state)),
        )
        return new_params, new_state, info

    return train_step


def _data(n_steps: int):
    rng = np.random.default_rng(0)
    params = _init_params(rng)
    w_true = rng.normal(size=(8, 1))
    x = rng.normal(size=(n_steps + 1, 64, 8)).astype(np.float32)
    y = (np.tanh(x @ w_true) + 0.1 * x[..., :1] ** 2).astype(np.float32)
    xs, ys = [jnp.asarray(a) for a in x], [jnp.asarray(a) for a in y]
    return params, xs[:-1], ys[:-1], (xs[-1], ys[-1])  # last batch held out


def _expected_scale(kinds: np.ndarray) -> list[tuple[float, int, int, int]]:
    """The documented dynamic-scaling rule, step by step, in plain Python."""
    scale, growth, hyst, streak, out = 2.0**10, 0, HYSTERESIS, 0, []
    for k in kinds:
        if k == CLEAN:
            growth, hyst, streak = growth + 1, HYSTERESIS, 0
            if growth >= 10:
                scale, growth = min(scale * 2, 2.0**14), 0
        else:
            growth, hyst, streak = 0, hyst - 1, streak + 1
            if hyst <= 0:
                scale, hyst = max(scale * 0.5, 1.0), HYSTERESIS
        out.append((scale, growth, hyst, streak))
    return out


def _run(step, params, opt_state, xs, ys, faults, start, stop, raised, infos):
    with jax.transfer_guard("disallow"):
        for i in range(start, stop):
            params, opt_state, info = step(params, opt_state, xs[i], ys[i], faults[i])
            infos[i] = info
            try:
                jaxamp.check_health(opt_state)  # host side, where one would log
            except FloatingPointError as e:
                raised[i] = str(e)
    return params, opt_state


@pytest.mark.parametrize("fused", [True, False], ids=["jaxamp.step", "tx.update"])
def test_fault_injection_run(tmp_path, fused: bool) -> None:
    sched = _schedule()
    kinds = sched["kind"]
    faulty = kinds != CLEAN
    params0, xs, ys, (x_eval, y_eval) = _data(N_STEPS)
    tx = _make_tx()
    step = _make_step(tx, fused)
    faults = [jax.device_put({k: v[i] for k, v in sched.items()}) for i in range(N_STEPS)]
    clean = jax.device_put({k: np.int32(0) for k in sched})
    # Committed to the device, like the arrays orbax restores: one compilation serves both.
    params0, opt0 = jax.device_put((params0, tx.init(params0)), jax.devices()[0])

    # 1. The faulty run, uninterrupted.
    infos: dict[int, Any] = {}
    raised: dict[int, str] = {}
    params, opt_state = _run(step, params0, opt0, xs, ys, faults, 0, N_STEPS, raised, infos)
    info = jax.device_get([infos[i] for i in range(N_STEPS)])

    skipped = np.array([r["skipped_steps"] for r in info])
    np.testing.assert_array_equal(np.diff(skipped, prepend=0), faulty.astype(np.int32))
    # Every injected step is skipped as a whole, and nothing else is.
    np.testing.assert_array_equal([bool(r["unchanged"]) for r in info], faulty)
    # No parameter or optimizer-state leaf ever holds an inf or NaN.
    assert all(bool(r["healthy"]) for r in info)
    # The loss scale follows the documented rule through every fault.
    got = [
        (float(r["loss_scale"]), int(r["growth_tracker"]), int(r["nonfinite_streak"])) for r in info
    ]
    want = [(s, g, st) for s, g, _, st in _expected_scale(kinds)]
    assert got == want
    # check_health raises exactly when more than LIMIT steps in a row were skipped.
    streak = np.array([w[3] for w in _expected_scale(kinds)])
    assert sorted(raised) == [int(i) for i in np.flatnonzero(streak > LIMIT)] == [83]
    assert f"{LIMIT + 1} steps in a row were skipped" in raised[83]

    # 2. A run without faults that skips the same steps.
    ref_params, ref_state = params0, opt0
    with jax.transfer_guard("disallow"):
        for i in range(N_STEPS):
            if not faulty[i]:
                ref_params, ref_state, _ = step(ref_params, ref_state, xs[i], ys[i], clean)
    loss = float(_eval_loss(params, x_eval, y_eval))
    ref_loss = float(_eval_loss(ref_params, x_eval, y_eval))
    assert loss < 0.5 * float(_eval_loss(params0, x_eval, y_eval))  # it did train
    assert abs(loss - ref_loss) <= 0.01 * ref_loss

    # 3. A checkpoint in the middle of a hysteresis window resumes bit for bit.
    part_infos: dict[int, Any] = {}
    mid = _run(step, params0, opt0, xs, ys, faults, 0, CKPT_AFTER + 1, {}, part_infos)
    ls = jaxamp.get_loss_scale(mid[1])
    assert int(ls.nonfinite_streak) == 1 and 0 < int(ls.hysteresis_tracker) < HYSTERESIS
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(CKPT_AFTER + 1, args=ocp.args.StandardSave({"params": mid[0], "opt": mid[1]}))
        mngr.wait_until_finished()
        target = jax.eval_shape(lambda: {"params": params0, "opt": tx.init(params0)})
        restored = jaxamp.checkpoint.restore(mngr, target)
    resumed_raised: dict[int, str] = {}
    resumed = _run(
        step,
        restored["params"],
        restored["opt"],
        xs,
        ys,
        faults,
        CKPT_AFTER + 1,
        N_STEPS,
        resumed_raised,
        {},
    )
    assert sorted(resumed_raised) == [83]
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves((params, opt_state)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
