"""``low_precision_state`` against plain optax in float32, and its rules.

The differential: the same gradient sequence through an optimizer and through the
optimizer wrapped, the params held fixed (so only the storage differs). The tolerance
is derived, step by step, from what the storage can do: each stored moment element
is within ``eps`` of the float32 value the wrapped optimizer computed (one bfloat16
ulp, ``2**-7`` of the magnitude; one code step, ``_codes.bound``, for the 8-bit
code); that error carried through the optimizer's own recurrence and into its update
is bounded, to first order, by the absolute Jacobian (taken of plain optax at the
float32 reference state) times the error, doubled for the curvature and for the
kinks of ``max``. Leaves not stored (small or named out) match plain optax exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import jaxamp
from jaxamp.low_precision_state import Quantized8, Rounded16, _codes, _transformation
from jaxamp.low_precision_state._stored import is_stored

BLOCK, MIN_SIZE, STEPS, LR = 32, 256, 3, 1e-2

OPTIMIZERS = {
    "adam": lambda: optax.adam(LR),
    "adamw": lambda: optax.adamw(LR, weight_decay=0.1),
    "lion": lambda: optax.lion(LR, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(LR, momentum=0.9),
    "rmsprop": lambda: optax.rmsprop(LR),
    "adafactor": lambda: optax.adafactor(LR),
    "lamb": lambda: optax.lamb(LR),
    "amsgrad": lambda: optax.amsgrad(LR),
    "inject_adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=LR, weight_decay=0.1
    ),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR)),
}


def _params() -> dict[str, jax.Array]:
    """A 2-D leaf (its last axis 40: a block and a short one), a 3-D leaf whose last
    axis (24) is smaller than a block, and a leaf under min_size."""
    rng = np.random.default_rng(0)
    shapes = {"w": (16, 40), "k": (2, 8, 24), "b": (40,)}
    return {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}


def _grads(steps: int, seed: int = 1) -> list[dict[str, jax.Array]]:
    """Random signs, magnitudes within a factor 4 of each leaf's scale (1e-3 to 10)."""
    rng = np.random.default_rng(seed)
    scale = {"w": 1e-3, "k": 10.0, "b": 1.0}
    out = []
    for _ in range(steps):
        g = {}
        for n, p in _params().items():
            mag = rng.uniform(0.5, 2.0, p.shape) * rng.choice([-1.0, 1.0], p.shape)
            g[n] = jnp.asarray(mag * scale[n], jnp.float32)
        out.append(g)
    return out


@jax.jit
def _decoded(inner_state):
    return jax.tree.map(lambda s: s.value() if is_stored(s) else s, inner_state, is_leaf=is_stored)


def _first_step(tx, g, params, **extra_args):
    """``tx.update``'s updates and state from ``tx.init(params)``, as one compiled
    program (run op by op, each operation would compile on its own for every shape)."""
    return jax.jit(lambda g, p, kw: tx.update(g, tx.init(p), p, **kw))(g, params, extra_args)


def test_inject_hyperparams_stay_float32_scalars() -> None:
    tx = OPTIMIZERS["inject_adamw"]()
    lps = jaxamp.low_precision_state(tx, "8bit", min_size=1)
    state = _first_step(lps, _grads(1)[0], _params())[1]
    for name, h in state.inner_state.hyperparams.items():
        assert isinstance(h, jax.Array) and h.dtype == np.float32 and h.ndim == 0, name
    assert float(state.inner_state.hyperparams["learning_rate"]) == np.float32(LR)


def _side_by_side(lps, tx, params, steps: int):
    """``lps`` and the optimizer it wraps, each stepped on the same gradients (jitted)."""
    state, ref = jax.jit(lps.init)(params), tx.init(params)
    step, ref_step = jax.jit(lps.update), jax.jit(tx.update)
    for g in _grads(steps):
        _, state = step(g, state, params)
        _, ref = ref_step(g, ref, params)
    return state, ref


def test_a_dtype_mapping_stores_only_the_named_fields() -> None:
    tx = optax.adam(LR)
    lps = jaxamp.low_precision_state(tx, {"mu": "8bit"}, min_size=MIN_SIZE, block_size=BLOCK)
    params = _params()
    state, ref = _side_by_side(lps, tx, params, steps=2)
    adam = state.inner_state[0]
    assert isinstance(adam.mu["w"], Quantized8) and isinstance(adam.mu["k"], Quantized8)
    assert not is_stored(adam.mu["b"])  # under min_size
    # nu not named: float32, and (it depends on the gradients only) plain optax's exactly.
    for n in params:
        assert adam.nu[n].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(adam.nu[n]), np.asarray(ref[0].nu[n]))


def test_the_innermost_named_field_decides() -> None:
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=LR)
    dtype = {"inner_state": jnp.bfloat16, "mu": "8bit", "nu": None}
    # Which leaves are stored, and how, is decided when init is traced: its abstract
    # evaluation builds the same state tree.
    state = jax.eval_shape(jaxamp.low_precision_state(tx, dtype, min_size=1).init, _params())
    adam = state.inner_state.inner_state[0]
    assert all(isinstance(x, Quantized8) for x in adam.mu.values())
    assert not any(is_stored(x) for x in adam.nu.values())
    # A dict key is not a field name: a param called "mu" is not a moment named mu.
    params = {"mu": jnp.ones((64, 64)), "nu": jnp.ones((64, 64))}
    with pytest.raises(ValueError, match="no field called.*not keys of a dict"):
        jax.eval_shape(
            jaxamp.low_precision_state(optax.sgd(LR, momentum=0.9), {"mu": "8bit"}).init, params
        )
    sgd = jaxamp.low_precision_state(optax.sgd(LR, momentum=0.9), {"trace": "8bit"})
    state = jax.eval_shape(sgd.init, params)
    assert all(isinstance(state.inner_state[0].trace[n], Quantized8) for n in params)


def test_selection_rules() -> None:
    """Floating leaves of ndim >= 1 and at least min_size elements; not scalars,
    ints, or optax.MultiSteps' gradient sum. Decided when init is traced: its abstract
    evaluation builds the same state tree."""
    ms = optax.MultiSteps(optax.adam(LR), every_k_schedule=2).gradient_transformation()
    params = {
        "big": jnp.ones((64, 64)),
        "edge": jnp.ones((4096,)),  # exactly min_size
        "small": jnp.ones((4095,)),
        "scalar": jnp.ones(()),
        "ints": jnp.ones((64, 64), jnp.int32),
    }
    state = jax.eval_shape(jaxamp.low_precision_state(ms, "8bit").init, params)
    inner = state.inner_state
    adam = inner.inner_opt_state[0]
    assert isinstance(adam.mu["big"], Quantized8) and isinstance(adam.nu["edge"], Quantized8)
    for n in ("small", "scalar"):
        assert adam.mu[n].dtype == np.float32 and not is_stored(adam.mu[n])
    assert not any(is_stored(x) for x in jax.tree.leaves(inner.acc_grads, is_leaf=is_stored))
    assert inner.mini_step.dtype == np.int32  # counters untouched
    # ints in the params: optax's zeros_like keeps int moments, never stored.
    assert not is_stored(adam.mu["ints"])
    # min_size=0 takes the small ones too, but never a scalar.
    adam = jaxamp.low_precision_state(optax.adam(LR), jnp.bfloat16, min_size=0)
    mu = jax.eval_shape(adam.init, params).inner_state[0].mu
    assert isinstance(mu["small"], Rounded16) and not is_stored(mu["scalar"])


def test_multisteps_accumulates_in_float32() -> None:
    """acc_grads stays float32 across steps: a sum rounded each step would be biased."""
    ms = optax.MultiSteps(optax.adam(LR), every_k_schedule=3).gradient_transformation()
    lps = jaxamp.low_precision_state(ms, "8bit", min_size=MIN_SIZE, block_size=BLOCK)
    params = _params()
    state, ref = _side_by_side(lps, ms, params, steps=2)
    for n in params:
        np.testing.assert_array_equal(
            np.asarray(state.inner_state.acc_grads[n]), np.asarray(ref.acc_grads[n])
        )


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: optax.contrib.prodigy(1.0), "params0"),
        (lambda: optax.contrib.dog(), "init_params"),
        (lambda: optax.contrib.cocob(), "init_particles"),
        (lambda: optax.contrib.schedule_free_adamw(1e-2), "z"),
    ],
    ids=["prodigy", "dog", "cocob", "schedule_free"],
)
def test_copies_of_the_params_stay_as_they_are(make, field) -> None:
    """An optimizer's copy of the params is not a moment: it is subtracted from the
    params, and stored in 8 bits their difference is mostly rounding error."""
    params = {"w": jnp.ones((64, 256))}
    state = jax.eval_shape(jaxamp.low_precision_state(make(), "8bit").init, params)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_stored)[0]
    found = [x for path, x in leaves if field in _transformation._names(path)]
    assert found and all(not is_stored(x) and x.dtype == np.float32 for x in found)
    # Named in a mapping, it is refused rather than ignored.
    with pytest.raises(ValueError, match=f"dtype names '{field}', which is never stored"):
        jaxamp.low_precision_state(make(), {field: "8bit"})


def test_prodigy_in_8_bits_trains_as_in_float32() -> None:
    """Prodigy estimates its step size from ``params0 - params``: with ``params0`` kept
    and its moments in 8 bits, least squares ends at float32's loss, within 5 %."""
    kx, ka, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (64, 256))
    y = x @ jax.random.normal(ka, (256, 128))
    w0 = 0.1 * jax.random.normal(kw, (256, 128))

    def final_loss(tx) -> float:
        def loss(w):
            return jnp.mean((x @ w - y) ** 2)

        def step(carry, _):
            w, s = carry
            u, s = tx.update(jax.grad(loss)(w), s, w)
            return (optax.apply_updates(w, u), s), None

        (w, _), _ = jax.lax.scan(step, (w0, tx.init(w0)), None, length=100)
        return float(loss(w))

    ref = final_loss(optax.contrib.prodigy(1.0))
    got = final_loss(jaxamp.low_precision_state(optax.contrib.prodigy(1.0), "8bit"))
    # Each 8-bit update is ~10 % off float32's, an error that averages out over the
    # steps: 5 % of the final loss is far above it, and far below the 18x of before.
    assert abs(got / ref - 1) <= 0.05, (got, ref)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"dtype": jnp.float16}, "dtype=float16"),
        ({"dtype": "float16"}, "dtype=float16"),
        ({"dtype": {"nu": jnp.float16}}, "dtype['nu']=float16"),
        ({"dtype": "bf16"}, "dtype must be"),
        ({"dtype": jnp.float32}, "dtype must be"),
        ({"dtype": {"mu": "4bit"}}, "dtype['mu'] must be"),
        ({"dtype": None}, "dtype must be"),
        ({"dtype": {}}, "dtype is an empty mapping"),
        ({"dtype": "8bit", "block_size": 0}, "`block_size`"),
        ({"dtype": "8bit", "block_size": 1.5}, "`block_size`"),
        ({"dtype": "8bit", "block_size": True}, "`block_size`"),
        ({"dtype": "8bit", "min_size": -1}, "`min_size`"),
        ({"dtype": "8bit", "min_size": "4096"}, "`min_size`"),
    ],
)
def test_bad_arguments_are_named(kwargs, argument) -> None:
    with pytest.raises(ValueError, match=argument.replace("[", r"\[").replace("]", r"\]")):
        jaxamp.low_precision_state(optax.adam(LR), **kwargs)


def test_float16_is_refused_with_what_to_write() -> None:
    with pytest.raises(ValueError, match="jnp.bfloat16") as info:
        jaxamp.low_precision_state(optax.adam(LR), jnp.float16)
    assert "'8bit'" in str(info.value)


def test_inner_must_be_an_optax_transformation() -> None:
    with pytest.raises(TypeError, match="`inner`.*GradientTransformation.*function"):
        jaxamp.low_precision_state(lambda g, s, p: (g, s), "8bit")


def test_inner_holding_a_loss_scale_is_refused() -> None:
    guarded = jaxamp.skip_nonfinite(optax.adam(LR), jaxamp.dynamic_scale())
    lps = jaxamp.low_precision_state(guarded, "8bit")
    with pytest.raises(ValueError, match=r"`inner` holds a loss scale.*skip_nonfinite\(jaxamp"):
        lps.init(_params())


def test_extra_args_pass_through() -> None:
    """optax.polyak_sgd needs value=: the wrapper passes it on, keyword and all."""
    tx = optax.polyak_sgd(max_learning_rate=1.0, f_min=0.0)
    lps = jaxamp.low_precision_state(optax.chain(tx, optax.trace(0.9)), "8bit", min_size=1)
    params, g = _params(), _grads(1)[0]
    u, state = _first_step(lps, g, params, value=jnp.float32(2.5))
    ref, _ = _first_step(optax.chain(tx, optax.trace(0.9)), g, params, value=jnp.float32(2.5))
    for n in params:  # computed before anything is stored: plain optax's update
        np.testing.assert_allclose(np.asarray(u[n]), np.asarray(ref[n]), rtol=1e-6)
    with pytest.raises(TypeError, match="value"):
        jax.jit(lps.update)(g, state, params)
    plateau = optax.chain(optax.adam(LR), optax.contrib.reduce_on_plateau())
    lps = jaxamp.low_precision_state(plateau, jnp.bfloat16, min_size=1)
    u, _ = _first_step(lps, g, params, value=jnp.float32(1.0))
    assert jax.tree.structure(u) == jax.tree.structure(params)


def test_bfloat16_params_moments_computed_in_float32_and_stored() -> None:
    """optax.adam builds bfloat16 moments for bfloat16 params; wrapped, they are stored
    (the dtype recorded as bfloat16), decoded to float32 for the update: the update and
    the moments are float32 Adam's (the moments within one code step)."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
    tx = optax.adam(LR)
    lps = jaxamp.low_precision_state(tx, "8bit", min_size=MIN_SIZE, block_size=BLOCK)
    state = jax.jit(lps.init)(params)
    mu = state.inner_state[0].mu
    assert isinstance(mu["w"], Quantized8) and mu["w"].dtype == np.dtype(jnp.bfloat16)
    assert mu["b"].dtype == np.dtype(jnp.bfloat16)  # not stored: stays as optax built it
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    step, ref_step = jax.jit(lps.update), jax.jit(tx.update)
    for g in _grads(2):
        # float32 Adam from the decoded moments (at the first step, zeros: plain optax's).
        ref_state = jax.tree.map(
            lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            _decoded(state.inner_state),
        )
        u_ref, ref_state = ref_step(g, ref_state, params32)
        u, state = step(g, state, params)
        assert u["w"].dtype == np.float32  # computed in float32, not rounded to bfloat16
        np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(u_ref["w"]), rtol=1e-6)
        adam, ref = state.inner_state[0], ref_state[0]
        for name in ("mu", "nu"):
            stored, want = getattr(adam, name)["w"], np.asarray(getattr(ref, name)["w"])
            assert isinstance(stored, Quantized8) and stored.dtype == np.dtype(jnp.bfloat16)
            err = np.abs(np.asarray(_decoded(stored), np.float64) - want)
            assert (err <= _codes.bound(want, BLOCK)).all()


@pytest.mark.parametrize("dtype", ["8bit", jnp.bfloat16], ids=["8bit", "bf16"])
def test_seed_decides_the_draws(dtype) -> None:
    # One leaf: the draws are the seed's whatever the tree (each seed compiles a step).
    params, g = {"w": _params()["w"]}, {"w": _grads(1)[0]["w"]}

    def stored(seed):
        lps = jaxamp.low_precision_state(optax.adam(LR), dtype, min_size=1, seed=seed)
        return jax.tree.leaves(_first_step(lps, g, params)[1])

    a, b, c = stored(0), stored(0), stored(1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(not np.array_equal(np.asarray(x), np.asarray(z)) for x, z in zip(a, c, strict=True))


def test_each_step_draws_anew() -> None:
    """The count advances and is part of the key: the same moment value stored at two
    steps rounds with different draws."""
    params = {"w": jnp.zeros((64, 64))}
    rms = jaxamp.low_precision_state(optax.scale_by_rms(decay=0.0), jnp.bfloat16, min_size=1)
    g = {"w": jnp.full((64, 64), 1.0 + 2.0**-9)}  # its square lies between two bfloat16s
    state, step = rms.init(params), jax.jit(rms.update)
    stored = []
    for _ in range(2):
        _, state = step(g, state, params)
        stored.append(np.asarray(state.inner_state.nu["w"].values, np.float32))
    assert int(state.count) == 2
    assert not np.array_equal(stored[0], stored[1])


@pytest.mark.parametrize("dtype", ["8bit", jnp.bfloat16], ids=["8bit", "bf16"])
def test_jit_and_no_jit_agree(dtype) -> None:
    lps = jaxamp.low_precision_state(optax.adamw(LR), dtype, min_size=MIN_SIZE, block_size=BLOCK)
    params = _params()
    eager = jitted = lps.init(params)
    step = jax.jit(lps.update)
    for g in _grads(2):
        u_e, eager = lps.update(g, eager, params)
        u_j, jitted = step(g, jitted, params)
        # From the same decoded moments, the two programs differ only in float32
        # rounding: an optimising backend contracts multiply-adds (one rounding fewer
        # per op, 2**-24 relative, over AdamW's ~8 ops), and the update is a difference
        # (the Adam term minus the weight decay term), so the error is relative to the
        # terms: bounded by the update's largest magnitude, not each element's.
        e, j = np.asarray(ravel_pytree(u_e)[0]), np.asarray(ravel_pytree(u_j)[0])
        np.testing.assert_allclose(e, j, rtol=8 * 2**-24, atol=8 * 2**-24 * np.abs(j).max())
    for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        if x.dtype == np.float32 and x.size < MIN_SIZE:  # a leaf kept as it is: as above
            np.testing.assert_allclose(x, y, rtol=8 * 2**-24, atol=8 * 2**-24 * np.abs(y).max())
        else:  # stored (codes, scales, bfloat16 values) and counts: the same bits
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_jitted_step_makes_no_host_transfer() -> None:
    lps = jaxamp.low_precision_state(optax.adamw(LR), "8bit", min_size=MIN_SIZE, block_size=BLOCK)
    params = _params()

    @functools.partial(jax.jit, donate_argnums=(1,))
    def train_step(params, state, g):
        u, state = lps.update(g, state, params)
        return optax.apply_updates(params, u), state

    grads = jax.device_put(_grads(3))
    state = jax.jit(lps.init)(params)
    params, state = train_step(params, state, grads[0])  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for g in grads[1:]:
            params, state = train_step(params, state, g)
    assert int(state.count) == 3


def test_a_bfloat16_moment_read_back_is_the_stored_one() -> None:
    """The state as a checkpoint holds it: bfloat16 arrays, bit for bit what was drawn."""
    lps = jaxamp.low_precision_state(optax.adam(LR), jnp.bfloat16, min_size=MIN_SIZE)
    params = _params()
    _, state = lps.update(_grads(1)[0], lps.init(params), params)
    mu = state.inner_state[0].mu["w"]
    assert mu.values.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(mu.value()), np.asarray(mu.values).astype(np.float32))
