"""``jaxamp.convert_state``: float32 optax states into 8-bit and bfloat16 ones and back,
against the float32 values they came from, within each format's error bound; the
structure checked; an orbax checkpoint of a plain optax state converted and trained on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp
from jaxamp.low_precision_state import _codes
from jaxamp.types import LowPrecisionState, Quantized8, Rounded16

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
BLOCK = 256
# "w" and "b" are stored (their last axis: a whole block and a partial one); "s" is
# below min_size and stays float32.
SHAPES = {"w": (8, 300), "b": (300,), "s": (4,)}


def _params() -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    return {n: jax.random.normal(k, s) for (n, s), k in zip(SHAPES.items(), keys, strict=True)}


def _grads(i: int) -> dict[str, jax.Array]:
    """Gradients whose rows span six decades (the moments' blocks need their scales)."""
    keys = jax.random.split(jax.random.fold_in(jax.random.key(1), i), len(SHAPES))
    out = {}
    for (n, s), k in zip(SHAPES.items(), keys, strict=True):
        decades = jnp.linspace(-5, 0, s[0]).reshape(-1, *([1] * (len(s) - 1)))
        out[n] = jax.random.normal(k, s) * 10.0 ** (decades if len(s) > 1 else -2)
    return out


def _adam() -> optax.GradientTransformation:
    return optax.adam(LR, B1, B2, EPS)


def _txs(wrap=lambda tx: tx):
    """The plain optimizer, and it with its moments in 8 bits and in bfloat16."""
    low = lambda dtype: jaxamp.low_precision_state(_adam(), dtype, block_size=BLOCK, min_size=64)
    return wrap(_adam()), wrap(low("8bit")), wrap(low(jnp.bfloat16))


def _trained(tx, steps: int = 3):
    params, state = _params(), jax.jit(tx.init)(_params())
    update = jax.jit(tx.update)
    for i in range(steps):
        _, state = update(_grads(i), state, params)
    return state


def _adam_state(state):
    """The ScaleByAdamState inside a plain or a wrapped adam's state."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    (found,) = [x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x)]
    return found


# One program per moment's form and shape (run op by op, each operation compiles alone).
_value = jax.jit(lambda moment: moment.value())


def _values(moment) -> np.ndarray:
    if isinstance(moment, Quantized8 | Rounded16):
        return np.asarray(_value(moment))
    return np.asarray(moment)


def _structure(tx):
    """The tree structure of ``tx.init(_params())`` (static fields included)."""
    return jax.tree.structure(jax.eval_shape(tx.init, _params()))


def _bf16_step(x: np.ndarray) -> np.ndarray:
    """The gap between the two bfloat16 neighbours of ``x`` (normal values): a
    stochastically rounded value is within it."""
    x = np.abs(np.asarray(x, np.float64))
    return np.where(x > 0, 2.0 ** (np.floor(np.log2(np.where(x > 0, x, 1.0))) - 7), 0.0)


def _assert_moments_within(got, want, bound) -> None:
    for field in ("mu", "nu"):
        for name in ("w", "b"):
            g, w = _values(getattr(got, field)[name]), _values(getattr(want, field)[name])
            err = np.abs(g.astype(np.float64) - w)
            excess = err - bound(w)
            assert (excess <= 0).all(), (field, name, float(excess.max()))
            assert (err > 0).any()  # the conversion stored them: they moved
        # below min_size: carried over as they were
        np.testing.assert_array_equal(_values(getattr(got, field)["s"]), getattr(want, field)["s"])
    np.testing.assert_array_equal(got.count, want.count)


def test_float32_to_8bit_and_back_within_the_code_bound():
    plain, eight, _ = _txs()
    state = _trained(plain)
    small = jaxamp.convert_state(state, eight, _params())
    assert jax.tree.structure(small) == _structure(eight)
    assert int(small.count) == 0  # a LowPrecisionState the source had none of
    stored = _adam_state(small)
    assert isinstance(stored.mu["w"], Quantized8) and stored.mu["w"].block_size == BLOCK
    assert stored.mu["s"].dtype == jnp.float32
    bound = lambda x: _codes.bound(x, BLOCK)
    _assert_moments_within(stored, _adam_state(state), bound)
    back = jaxamp.convert_state(small, plain, _params())
    assert jax.tree.structure(back) == jax.tree.structure(state)
    dtypes = [[x.dtype for x in jax.tree.leaves(s)] for s in (back, state)]
    assert dtypes[0] == dtypes[1]
    _assert_moments_within(_adam_state(back), _adam_state(state), bound)


def test_float32_to_bfloat16_and_back_within_bfloat16s_step():
    plain, _, sixteen = _txs()
    state = _trained(plain)
    small = jaxamp.convert_state(state, sixteen, _params())
    stored = _adam_state(small)
    assert isinstance(stored.nu["w"], Rounded16) and stored.nu["w"].values.dtype == jnp.bfloat16
    _assert_moments_within(stored, _adam_state(state), _bf16_step)
    back = jaxamp.convert_state(small, plain, _params())
    _assert_moments_within(_adam_state(back), _adam_state(state), _bf16_step)


def test_8bit_and_bfloat16_convert_inside_wrappers_and_keep_their_step_count():
    """Inside skip_nonfinite and a chain: 8-bit values into bfloat16 exactly (at most 5
    significant bits) and back to the same values; bfloat16 ones into 8 bits within the
    code's bound; the loss-scale state and the LowPrecisionState's count carried over."""
    wrap = lambda tx: jaxamp.skip_nonfinite(optax.chain(optax.clip(1.0), tx), jaxamp.check_only())
    plain, eight, sixteen = _txs(wrap)
    inner = lambda s: s.inner_state[1]
    eight_state = _trained(eight)
    as16 = jaxamp.convert_state(eight_state, sixteen, _params())
    assert jax.tree.structure(as16) == _structure(sixteen)
    assert isinstance(inner(as16), LowPrecisionState) and int(inner(as16).count) == 3
    jax.tree.map(np.testing.assert_array_equal, as16.loss_scale, eight_state.loss_scale)
    as8 = jaxamp.convert_state(as16, eight, _params())
    assert int(inner(as8).count) == 3
    for field in ("mu", "nu"):
        want = getattr(_adam_state(eight_state), field)
        got16, got8 = (getattr(_adam_state(s), field) for s in (as16, as8))
        assert isinstance(got16["w"], Rounded16) and isinstance(got8["w"], Quantized8)
        for name in ("w", "b"):
            np.testing.assert_array_equal(_values(got16[name]), _values(want[name]))
            np.testing.assert_array_equal(_values(got8[name]), _values(want[name]))

    sixteen_state = _trained(sixteen)
    to8 = jaxamp.convert_state(sixteen_state, eight, _params())
    assert int(inner(to8).count) == 3
    bound = lambda x: _codes.bound(x, BLOCK)
    _assert_moments_within(_adam_state(to8), _adam_state(sixteen_state), bound)
    # into plain optax's state: the wrapper and its count dropped, the moments decoded
    as32 = jaxamp.convert_state(sixteen_state, plain, _params())
    assert jax.tree.structure(as32) == _structure(plain)
    for field in ("mu", "nu"):
        got, want = getattr(_adam_state(as32), field), getattr(_adam_state(sixteen_state), field)
        np.testing.assert_array_equal(got["w"], _values(want["w"]))  # bfloat16 in float32: exact


def test_a_state_in_its_own_form_is_kept_bit_for_bit_and_a_conversion_is_deterministic():
    plain, eight, _ = _txs()
    state = _trained(eight)
    same = jaxamp.convert_state(state, eight, _params())
    jax.tree.map(np.testing.assert_array_equal, same, state)
    again = [jaxamp.convert_state(_trained(plain), eight, _params()) for _ in range(2)]
    jax.tree.map(np.testing.assert_array_equal, *again)


def test_another_optimizer_or_shape_is_refused_naming_where_they_differ():
    plain, eight, _ = _txs()
    state = _trained(eight)
    other_optimizer = (
        r"at 0, `opt_state` has a ScaleByAdamState .*ScaleByRmsState.*low_precision_state"
    )
    with pytest.raises(ValueError, match=other_optimizer):
        jaxamp.convert_state(state, optax.chain(optax.scale_by_rms(), optax.scale(-LR)), _params())
    other = {**_params(), "w": jnp.zeros((8, 299))}
    shapes = (
        r"at 0\.mu\.w, `opt_state` has a leaf of shape \(8, 300\) "
        r"and tx.init\(params\) a leaf of shape \(8, 299\)"
    )
    with pytest.raises(ValueError, match=shapes):
        jaxamp.convert_state(state, plain, other)
    guarded = jaxamp.skip_nonfinite(_adam())
    with pytest.raises(
        ValueError, match=r"at <root>, `opt_state` has a tuple .* SkipNonfiniteState"
    ):
        jaxamp.convert_state(state, guarded, _params())
    with pytest.raises(TypeError, match="`tx` must be the optax optimizer"):
        jaxamp.convert_state(state, "8bit", _params())


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"] + params["s"].sum()
    return jnp.mean((pred - y) ** 2)


def _update_bound(mu, nu, g, count, b_mu, b_nu) -> np.ndarray:
    """The largest ``|adam update from stored moments - from the float32 ones|`` per
    element, for moments decoded anywhere within ``b_mu`` / ``b_nu`` of the float32
    ``mu`` / ``nu``: the update is monotone in each, so it is largest at a corner."""
    mu, nu, g = (np.asarray(a, np.float64) for a in (mu, nu, g))
    t = int(count) + 1

    def update(m, v):
        m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
        return -LR * (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)

    exact = update(mu, nu)
    corners = [
        update(m, v) for m in (mu - b_mu, mu + b_mu) for v in (np.maximum(nu - b_nu, 0), nu + b_nu)
    ]
    return np.max([np.abs(c - exact) for c in corners], axis=0)


def test_an_orbax_checkpoint_of_plain_optax_converts_and_trains_on_like_float32(tmp_path):
    """A float32 plain-optax state saved with orbax, restored into plain optax's
    structure, converted to 8 bits: its first update is within what the code's bound
    allows of float32's, and 20 more steps end within 1 % of float32's loss."""
    plain, eight = (jaxamp.skip_nonfinite(tx) for tx in _txs()[:2])
    params = _params()
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (64, 8))
    y = x @ jax.random.normal(kw, (8, 300)) + 0.1 * jax.random.normal(kw, (64, 300))
    grad = jax.jit(jax.grad(_loss))
    # One compiled step per optimizer, whichever run it takes.
    steps = {
        tx: jax.jit(lambda p, s, tx=tx: jaxamp.step(tx, grad(p, x, y), s, p))
        for tx in (plain, eight)
    }

    def train(tx, params, state, n):
        for _ in range(n):
            params, state = steps[tx](params, state)
        return params, state

    params, state = train(plain, params, jax.jit(plain.init)(params), 5)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
        ckptr.wait_until_finished()
        target = jax.eval_shape(lambda: {"params": params, "opt_state": plain.init(params)})
        restored = jaxamp.checkpoint.restore(ckptr, target, directory=tmp_path / "ckpt")
    jax.tree.map(np.testing.assert_array_equal, restored["opt_state"], state)
    small = jaxamp.convert_state(restored["opt_state"], eight, restored["params"])

    g = grad(params, x, y)
    ref, _ = jax.jit(plain.update)(g, state, params)
    got, _ = jax.jit(eight.update)(g, small, params)
    stored, f32 = _adam_state(small), _adam_state(state)
    for name in ("w", "b"):
        mu, nu = np.asarray(f32.mu[name]), np.asarray(f32.nu[name])
        allowed = _update_bound(
            mu, nu, g[name], f32.count, _codes.bound(mu, BLOCK), _codes.bound(nu, BLOCK)
        )
        # float32 arithmetic in both updates: a few of its ulps on top
        allowed += 16 * np.finfo(np.float32).eps * np.abs(np.asarray(ref[name]))
        err = np.abs(np.asarray(got[name], np.float64) - np.asarray(ref[name]))
        assert (err <= allowed).all(), (name, float((err - allowed).max()))
        assert (_values(stored.mu[name]) != mu).any()

    p32, _ = train(plain, params, state, 20)
    p8, s8 = train(eight, restored["params"], small, 20)
    assert int(jaxamp.metrics(s8)["skipped_steps"]) == 0
    loss32, loss8 = float(_loss(p32, x, y)), float(_loss(p8, x, y))
    assert loss32 < float(_loss(params, x, y))  # training went on
    assert abs(loss8 - loss32) <= 0.01 * loss32, (loss8, loss32)
