"""``low_precision_state`` under every jaxamp path that skips a step: a skipped step keeps
the stored state and the params bit for bit; a finite step equals the float32-moment run
within what the storage can differ by.

Each path runs one gradient sequence with an overflowing call and a NaN call
(``GRADS``); its snapshots after each call are checked against plain optax with float32
moments, fed the calls that path takes. The tolerance is derived from the storage:
a stored moment's error obeys ``E_t = b * E_{t-1} + r_t``, ``r_t`` one step of the
code at the value (``_codes.bound``; one bfloat16 ulp) doubled for the binade the stored
block's scale may sit in off the float32 run's; the update a step makes is computed
from the float32 moments ``b * m' + (1 - b) g`` (so its error is ``b * E_{t-1}``),
and its worst case over that interval of ``mu`` and ``nu`` is added to the params'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.low_precision_state import _codes
from jaxamp.types import LowPrecisionState, Quantized8, Rounded16

LR, WD, B1, B2, EPS = 1e-2, 1e-2, 0.9, 0.999, 1e-8
BLOCK = 64
SHAPE = (32, 128)  # 4096 elements: stored at the default min_size; the bias (128) is not


def _grads() -> list[dict[str, np.ndarray]]:
    k = jax.random.split(jax.random.key(1), 8)
    out = []
    for i, kk in enumerate(k):
        # Rows of very different sizes, so that blocks use many binades and both codes.
        g = jax.random.normal(kk, SHAPE) * jnp.logspace(-4, 0, SHAPE[0])[:, None]
        g = np.array(g, np.float32)
        if i == 2:
            g[3, 5] = np.inf
        if i == 5:
            g[0, 0] = np.nan
        out.append({"b": np.full(SHAPE[1], 0.01 * (i + 1), np.float32), "w": g})
    return out


GRADS = _grads()
BAD = {2, 5}
PARAMS = {"b": jnp.zeros(SHAPE[1]), "w": jax.random.normal(jax.random.key(0), SHAPE) * 0.1}


def _adamw() -> optax.GradientTransformation:
    return optax.adamw(LR, B1, B2, EPS, weight_decay=WD)


def _lps(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    return jaxamp.low_precision_state(inner, dtype, block_size=BLOCK)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _stored(state) -> list:
    """The stored moments of a state, in tree order (adam's mu, then nu)."""
    is_s = lambda x: isinstance(x, (Quantized8, Rounded16))  # noqa: E731
    return [x for x in jax.tree.leaves(state, is_leaf=is_s) if is_s(x)]


def _lps_state(state) -> LowPrecisionState:
    is_l = lambda x: isinstance(x, LowPrecisionState)  # noqa: E731
    (found,) = [x for x in jax.tree.leaves(state, is_leaf=is_l) if is_l(x)]
    return found


# ---------------------------------------------------------------------------------------
# The paths. Each runs GRADS and returns (params, the LowPrecisionState) at the start and
# after each call.


def _functional(tx, how: str):
    params, state = PARAMS, jax.jit(tx.init)(PARAMS)  # one program, not one per operation

    @jax.jit
    def one(params, state, g):
        if how == "step":
            return jaxamp.step(tx, g, state, params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    out = [_host((params, _lps_state(state)))]
    for g in GRADS:
        params, state = one(params, state, g)
        out.append(_host((params, _lps_state(state))))
    return out


def _train_state(tx):
    create = jax.jit(lambda p: jaxamp.TrainState.create(apply_fn=None, params=p, tx=tx))
    ts = create(PARAMS)
    one = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))
    out = [_host((ts.params, _lps_state(ts.opt_state)))]
    for g in GRADS:
        ts = one(ts, g)
        out.append(_host((ts.params, _lps_state(ts.opt_state))))
    return out


class _Model(nnx.Module):
    def __init__(self):
        self.b = nnx.Param(PARAMS["b"])
        self.w = nnx.Param(PARAMS["w"])


def _nnx(tx):
    model = _Model()
    opt = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def one(opt, model, g):
        opt.update(model, g)

    def snapshot():
        params = {"b": model.b[...], "w": model.w[...]}
        return _host((params, _lps_state(nnx.as_pure(opt.opt_state))))

    out = [snapshot()]
    for g in GRADS:
        grads = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(grads, g)
        one(opt, model, grads)
        out.append(snapshot())
    return out


def _multi(dtype):
    tx = jaxamp.multi_transform(
        {"lps": _lps(_adamw(), dtype), "sgd": optax.sgd(LR)}, {"b": "sgd", "w": "lps"}
    )
    return _functional(tx, "update")


def _guard(dtype, **kw):
    return jaxamp.skip_nonfinite(_lps(_adamw(), dtype), **kw)


# Which calls make each reference step (their mean), and on which of the other calls the
# whole LowPrecisionState, count included, stays as it was (the wrapper is not called);
# on the rest of them the params and the stored moments do, and the count moves
# (MultiSteps inside the wrapper between windows, apply_if_finite skipping inside it).
ONE = [(c,) for c in range(len(GRADS)) if c not in BAD]
WINDOWS = [(0, 1), (6, 7)]  # every_k=2 over the calls: (2, 3) and (4, 5) are skipped whole
FINITE_WINDOWS = [(0, 1), (3, 4), (6, 7)]  # MultiSteps sees the finite calls only
PATHS = {  # name: (dtype, run, steps, whole)
    "update-8bit": ("8bit", lambda d: _functional(_guard(d), "update"), ONE, BAD),
    "update-bf16": (jnp.bfloat16, lambda d: _functional(_guard(d), "update"), ONE, BAD),
    "step-mixed": (
        {"mu": "8bit", "nu": jnp.bfloat16},
        lambda d: _functional(_guard(d), "step"),
        ONE,
        BAD,
    ),
    "train_state-bf16": (jnp.bfloat16, lambda d: _train_state(_guard(d)), ONE, BAD),
    "nnx-8bit": ("8bit", lambda d: _nnx(_guard(d)), ONE, BAD),
    "multi_transform-8bit": ("8bit", _multi, ONE, BAD),
    "every_k-8bit": (
        "8bit",
        lambda d: _functional(_guard(d, every_k=2), "step"),
        WINDOWS,
        {0, 2, 3, 4, 5, 6},
    ),
    "multisteps-bf16": (
        jnp.bfloat16,
        lambda d: _functional(
            jaxamp.skip_nonfinite(_lps(optax.MultiSteps(_adamw(), 2), d)), "update"
        ),
        FINITE_WINDOWS,
        BAD,
    ),
    "apply_if_finite-8bit": (
        "8bit",
        lambda d: _functional(_lps(optax.apply_if_finite(_adamw(), 3), d), "update"),
        ONE,
        set(),
    ),
}


# ---------------------------------------------------------------------------------------
# The float32 reference and the bounds.


@jax.jit
def _reference_step(params, state, g):
    updates, state = _adamw().update(g, state, params)
    return optax.apply_updates(params, updates), state


_value = jax.jit(lambda moment: moment.value())


def _reference(groups) -> list[tuple[dict, np.ndarray, np.ndarray]]:
    """(params, mu["w"], nu["w"]) after each step of plain adamw with float32 moments,
    one step per group of calls, on their mean."""
    tx = _adamw()
    params, state = PARAMS, tx.init(PARAMS)
    steps = []
    for calls in groups:
        g = jax.tree.map(lambda *x: sum(x) / len(x), *(GRADS[c] for c in calls))
        params, state = _reference_step(params, state, g)
        adam = state[0]
        steps.append(_host((params, adam.mu["w"], adam.nu["w"])))
    return steps


def _step_error(x: np.ndarray, dtype) -> np.ndarray:
    """Twice what storing ``x`` can move it by (one step of the code at the value)."""
    if isinstance(dtype, str):
        return 2 * _codes.bound(x, BLOCK)
    e = np.floor(np.log2(np.maximum(np.abs(x), np.finfo(np.float32).tiny)))
    return 2 * 2.0 ** (e - 7)  # bfloat16's ulp at x


def _bounds(ref, mu_dtype, nu_dtype):
    """Per reference step: the bounds of |mu - ref|, |nu - ref| and |w - ref|."""
    em = ev = ep = np.zeros(SHAPE)
    out = []
    for t, (_, mu, nu) in enumerate(ref, start=1):
        # The update is computed from the float32 moments: error b * E_{t-1}.
        cm, cv = 1 - B1**t, 1 - B2**t
        m_hat, v_hat = mu / cm, nu / cv
        dm, dv = B1 * em / cm, B2 * ev / cv
        u_ref = m_hat / (np.sqrt(v_hat) + EPS)
        worst = np.zeros(SHAPE)
        for m in (m_hat - dm, m_hat + dm):
            for v in (np.maximum(v_hat - dv, 0), v_hat + dv):
                worst = np.maximum(worst, np.abs(m / (np.sqrt(v) + EPS) - u_ref))
        ep = ep * (1 + LR * WD) + LR * worst
        em = B1 * em + _step_error(mu, mu_dtype)
        ev = B2 * ev + _step_error(nu, nu_dtype)
        out.append((em, ev, ep))
    return out


def _dtypes(dtype):
    if isinstance(dtype, dict):
        return dtype["mu"], dtype["nu"]
    return dtype, dtype


@pytest.mark.parametrize("name", list(PATHS))
def test_skipped_steps_keep_the_stored_state_and_finite_ones_match_float32(name) -> None:
    dtype, run, groups, whole = PATHS[name]
    snaps = run(dtype)
    ref = _reference(groups)
    bounds = _bounds(ref, *_dtypes(dtype))
    applied = {calls[-1]: j for j, calls in enumerate(groups)}
    f32 = lambda t, x: 8 * t * 2.0**-23 * np.abs(x).max()  # noqa: E731 (float32 reordering)
    prev = snaps[0]
    for i, (params, lps) in enumerate(snaps[1:]):
        moments = _stored(lps.inner_state)
        assert len(moments) == 2, moments
        if i not in applied:
            # Nothing moves: params, codes, scales, bfloat16 values (and the count, where
            # the wrapper was not called).
            # multi_transform skips each label on its own: the bias (sgd's) moves.
            own = (lambda p: p["w"]) if name.startswith("multi") else (lambda p: p)  # noqa: E731
            kept = (own(prev[0]), prev[1] if i in whole else _stored(prev[1].inner_state))
            now = (own(params), lps if i in whole else moments)
            assert jax.tree.structure(kept) == jax.tree.structure(now)
            for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(now), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{name}: call {i} changed")
        else:
            j = applied[i]
            (rp, rmu, rnu), (em, ev, ep) = ref[j], bounds[j]
            for what, got, want, bound in (
                ("mu", _value(moments[0]), rmu, em),
                ("nu", _value(moments[1]), rnu, ev),
                ("w", params["w"], rp["w"], ep),
            ):
                err = np.abs(np.asarray(got, np.float64) - want)
                tol = bound + f32(j + 1, want)
                assert (err <= tol).all(), (
                    f"{name}: call {i} {what}: worst {err.max():.3g}, over its bound at "
                    f"{np.argwhere(err > tol)[:3].tolist()}"
                )
            if not name.startswith("multi_transform"):  # there the bias is sgd's
                np.testing.assert_allclose(params["b"], rp["b"], rtol=0, atol=f32(j + 1, rp["b"]))
            # Nothing non-finite is stored (a NaN scale would mark a non-finite block).
            assert all(
                np.isfinite(x).all() for x in jax.tree.leaves(moments) if x.dtype.kind == "f"
            )
        prev = (params, lps)
    stored = Quantized8 if _dtypes(dtype)[0] == "8bit" else Rounded16
    assert isinstance(_stored(prev[1].inner_state)[0], stored)


def test_finite_gradients_never_store_a_nonfinite_moment_that_the_guard_lets_through() -> None:
    """A moment that overflows from finite gradients is what the guard refuses up front
    (float16 optimizer state, wrapped or not: tests/behaviour/test_reflexes.py); float32
    moments of finite gradients too large to square store a NaN scale (the block is
    non-finite, as the float32 moment is), which a finiteness check of the state sees."""
    tx = _lps(_adamw(), "8bit")
    state = tx.init(PARAMS)
    g = {"b": np.zeros(SHAPE[1], np.float32), "w": np.full(SHAPE, 1e20, np.float32)}
    _, state = jax.jit(tx.update)(g, state, PARAMS)
    mu, nu = _stored(state.inner_state)
    assert np.isfinite(np.asarray(mu.scales)).all()
    assert np.isnan(np.asarray(nu.scales)).all()  # 1e40: inf in float32
    assert not bool(jaxamp.all_finite(state))
