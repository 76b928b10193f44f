"""What a user's first reflexes get: each misuse -> the error or warning text it must give.

Rows are data: a name, a thunk that does what the user wrote, the exception (or
``ConversionWarning``) class and a regex of the message, which must name what to write
instead. Each row ran silently (or with an unrelated error) on 0.4 (issue 43).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp._utils import conversion_checks

P = {"w": jnp.ones(4)}
G = {"w": jnp.full(4, 0.25)}


def _guard(inner=None, ls="dynamic"):
    scale = jaxamp.dynamic_scale(2.0**10) if ls == "dynamic" else ls
    return jaxamp.skip_nonfinite(inner or optax.sgd(0.1), scale)


def _double_unscale():
    tx = _guard()
    st = tx.init(P)
    g, _ = jaxamp.unscale_and_check(jaxamp.get_loss_scale(st), G)
    jaxamp.unscale_and_check(jaxamp.get_loss_scale(st), g)


def _double_unscale_after_clip():
    tx = _guard()
    st = tx.init(P)
    g, _ = jaxamp.unscale_and_check(jaxamp.get_loss_scale(st), G)
    g = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]
    jax.jit(lambda g: jaxamp.unscale_and_check(jaxamp.get_loss_scale(st), g))(g)


def _check_health_in_jit():
    st = _guard().init(P)
    jax.jit(jaxamp.check_health)(st)


def _float16_autocast_without_scale():
    tx = _guard(ls=None)
    p = {"m": jnp.ones((2, 2))}
    fwd = jaxamp.autocast(lambda p, x: jnp.sum(x @ p["m"]), dtype=jnp.float16)
    jaxamp.step(tx, jax.grad(fwd)(p, jnp.ones((2, 2))), tx.init(p), p)


def _update_of_owned_state():
    st = _guard().init(P)
    jaxamp.update(jaxamp.get_loss_scale(st), True)


def _state_stepped_twice():
    tx = _guard()
    st = tx.init(P)
    grads = jaxamp.scale(jaxamp.get_loss_scale(st), G)
    jaxamp.step(tx, grads, st, P)
    jaxamp.step(tx, grads, st, P)  # the new opt_state was dropped


ERRORS: dict[str, tuple[Callable[[], object], type, str]] = {
    # item 3: PyTorch's GradScaler refuses float16 params ("Attempting to unscale FP16 gradients")
    "float16 params": (
        lambda: _guard(optax.adamw(1e-3)).init({"w": jnp.ones(3, jnp.float16)}),
        TypeError,
        r"params hold leaves of float16's range or narrower \(`w` \(float16\)\)"
        r".*float32 master params",
    ),
    "float16 params through jaxamp.step": (
        lambda: jaxamp.step(
            _guard(), G, _guard().init(P), {"w": jnp.ones(4, jnp.float16)}
        ),  # a state built for float32 params, stepped with float16 ones
        TypeError,
        r"params hold leaves of float16's range",
    ),
    "float16 optimizer state": (
        lambda: _guard(optax.adam(1e-3, mu_dtype=jnp.float16)).init(P),
        TypeError,
        r"inner_state hold leaves of float16's range or narrower \(`0.mu.w`.*mu_dtype=jnp.bfloat16",
    ),
    # issue 45: a moment stored in 8 bits still comes back to the wrapped optimizer in
    # its own dtype (adam casts mu to mu_dtype), which overflows from finite gradients
    "float16 optimizer state stored by low_precision_state": (
        lambda: _guard(
            jaxamp.low_precision_state(optax.adam(1e-3, mu_dtype=jnp.float16), "8bit", min_size=0)
        ).init(P),
        TypeError,
        r"inner_state hold leaves of float16's range or narrower \(`inner_state.0.mu.w` "
        r"\(float16\)\).*mu_dtype=jnp.bfloat16",
    ),
    "float16 params in multi_transform": (
        lambda: jaxamp.multi_transform({"a": optax.sgd(1.0)}, {"w": "a"}).init(
            {"w": jnp.ones(2, jnp.float16)}
        ),
        TypeError,
        r"jaxamp.multi_transform: the params hold leaves of float16's range",
    ),
    # item 7: PyTorch raises on a second unscale_()
    "unscale twice": (_double_unscale, TypeError, r"already unscaled.*finite=finite"),
    "unscale twice, a clip between, under jit": (
        _double_unscale_after_clip,
        TypeError,
        r"already unscaled",
    ),
    "every_k with unscaled gradients": (
        lambda: jaxamp.step(
            t := jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), every_k=2),
            jaxamp.unscale_and_check(jaxamp.dynamic_scale(), G)[0],
            t.init(P),
            P,
        ),
        ValueError,
        r"cannot be combined with every_k > 1.*Pass the scaled gradients",
    ),
    "a guard inside a guard": (
        lambda: _guard(_guard(optax.sgd(0.1))).init(P),
        ValueError,
        r"holds a jaxamp guard of its own.*unscaled twice",
    ),
    "a guard as a group of multi_transform": (
        lambda: jaxamp.multi_transform({"a": _guard()}, {"w": "a"}).init(P),
        ValueError,
        r"holds a jaxamp guard of its own",
    ),
    "unscale a tree holding unscaled gradients": (
        lambda: jaxamp.unscale_and_check(
            jaxamp.static_scale(4.0),
            (jaxamp.unscale_and_check(jaxamp.static_scale(4.0), G)[0], G),
        ),
        TypeError,
        r"already unscaled",
    ),
    "finite= with no guard in tx": (
        lambda: jaxamp.step(optax.sgd(0.1), G, optax.sgd(0.1).init(P), P, finite=True),
        TypeError,
        r"finite= needs a transformation from jaxamp.skip_nonfinite",
    ),
    # item 10: messages that name what to write
    "check_health inside jit": (_check_health_in_jit, TypeError, r"outside the jitted step"),
    "float() of a LossScaleState": (
        lambda: float(jaxamp.get_loss_scale(_guard().init(P))),
        TypeError,
        r"float\(jaxamp.get_loss_scale\(opt_state\).scale\)",
    ),
    "scale(loss) as in PyTorch": (
        lambda: jaxamp.scale(jnp.ones(())),
        TypeError,
        r"jaxamp.scale\(jaxamp.get_loss_scale\(opt_state\), loss\)",
    ),
    "value_and_grad(f, opt_state)": (
        lambda: jaxamp.value_and_grad(lambda p: p["w"].sum(), _guard().init(P)),
        TypeError,
        r"jaxamp.value_and_grad\(loss_fn\)\(opt_state, params, x, y\)",
    ),
    "torch_grad_scaler('cuda')": (
        lambda: jaxamp.compat.torch_grad_scaler("cuda"),
        TypeError,
        r"first argument is the device.*torch_grad_scaler\(init_scale=",
    ),
    # item 12: every_k is static; under inject_hyperparams it must be listed as static
    "every_k traced": (
        lambda: jax.jit(lambda k: jaxamp.skip_nonfinite(optax.sgd(0.1), every_k=k))(4),
        TypeError,
        r"every_k must be known when the transformation is built.*static_args",
    ),
}

WARNINGS: dict[str, tuple[Callable[[], object], str]] = {
    # item 8
    "float16 autocast, no loss scale": (
        _float16_autocast_without_scale,
        r"holds no loss scale.*jaxamp.skip_nonfinite\(inner, jaxamp.dynamic_scale\(\)\)",
    ),
    "jaxamp.update of the optimizer's own loss scale": (
        _update_of_owned_state,
        r"never seen by the optimizer. Drop the call",
    ),
    "the new opt_state dropped": (
        _state_stepped_twice,
        r"already given to a step.*params, opt_state = jaxamp.step",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_reflex_raises_naming_the_fix(name: str) -> None:
    fn, exc, pattern = ERRORS[name]
    with pytest.raises(exc, match=pattern):
        fn()


@pytest.mark.parametrize("name", list(WARNINGS))
def test_reflex_warns_naming_the_fix(name: str) -> None:
    fn, pattern = WARNINGS[name]
    conversion_checks.reset()
    with pytest.warns(jaxamp.ConversionWarning, match=pattern):
        fn()


def test_the_right_calls_stay_silent() -> None:
    """The warnings' counterparts: the same calls written right warn about nothing."""
    conversion_checks.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxamp.ConversionWarning)
        tx = _guard()
        st = tx.init(P)
        loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
        for _ in range(3):
            _, grads = jaxamp.value_and_grad(loss)(st, P)
            _, st = jaxamp.step(tx, grads, st, P)
        jaxamp.update(jaxamp.dynamic_scale(), True)  # a loss scale of one's own
        p = {"m": jnp.ones((2, 2))}
        bf16 = jaxamp.autocast(lambda p, x: jnp.sum(x @ p["m"]), dtype=jnp.bfloat16)
        jaxamp.step(
            _guard(ls=None), jax.grad(bf16)(p, jnp.ones((2, 2))), _guard(ls=None).init(p), p
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_k": np.int64(4)},
        {"every_k": jnp.int32(4)},
        {"max_consecutive_nonfinite": np.int64(5)},
        {"max_consecutive_nonfinite": jnp.int32(5)},
    ],
)
def test_numpy_and_jax_integers_are_integers(kwargs: dict) -> None:
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(), **kwargs)
    st = tx.init(P)
    if "every_k" in kwargs:
        assert isinstance(tx.update.every_k, int) and tx.update.every_k == 4
    else:
        assert int(st.loss_scale.max_consecutive_nonfinite) == 5
        mt = jaxamp.multi_transform({"a": optax.sgd(0.1)}, {"w": "a"}, **kwargs)
        assert int(mt.init(P).loss_scale.max_consecutive_nonfinite) == 5


def test_unscaled_gradients_step_once_unscaled() -> None:
    """Item 7's reflex: unscale_and_check, then jaxamp.step without finite= (or tx.update),
    with or without a clip between: the update is that of the true gradients, eager and
    under jit, equal to plain optax on them."""
    ls = jaxamp.static_scale(2.0**15)
    tx = jaxamp.skip_nonfinite(optax.sgd(1.0), ls)
    st = tx.init(P)
    scaled = jaxamp.scale(ls, G)
    ref = optax.apply_updates(P, optax.sgd(1.0).update(G, optax.sgd(1.0).init(P))[0])
    g, finite = jaxamp.unscale_and_check(ls, scaled)
    for got in (
        jaxamp.step(tx, g, st, P)[0],
        jax.jit(lambda g, st: jaxamp.step(tx, g, st, P))(g, st)[0],
        jaxamp.step(tx, g, st, P, finite=finite)[0],
        optax.apply_updates(P, tx.update(g, st, P)[0]),
    ):
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(ref["w"]))
    clip = optax.clip_by_global_norm(0.1)
    clipped = clip.update(g, clip.init(P))[0]
    assert isinstance(clipped, jaxamp.types.Unscaled)
    ref_clipped = {"w": P["w"] - 1.0 * clip.update(G, clip.init(P))[0]["w"]}
    np.testing.assert_allclose(
        np.asarray(jaxamp.step(tx, clipped, st, P)[0]["w"]),
        np.asarray(ref_clipped["w"]),
        rtol=2 * np.finfo(np.float32).eps,
    )
    # An edit that made a leaf non-finite is caught: the step is skipped.
    bad = jax.tree.map(lambda x: x.at[0].set(jnp.inf), g)
    new, st2 = jaxamp.step(tx, bad, st, P)
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(P["w"]))
    assert int(jaxamp.metrics(st2)["skipped_steps"]) == 1


SAFE_AROUND = {
    "chain of one": lambda g: optax.chain(g),
    "flatten": lambda g: optax.flatten(g),
    "inject_hyperparams": lambda g: optax.inject_hyperparams(lambda learning_rate: g)(
        learning_rate=1.0
    ),
}


@pytest.mark.parametrize("name", list(SAFE_AROUND))
def test_unscaled_gradients_through_a_structure_safe_around_the_guard(name: str) -> None:
    """jaxamp.step and TrainState strip no mark on the way to a guard inside a chain of
    one, optax.flatten (which ravels the gradients) or inject_hyperparams: the update is
    that of the true gradients, with the Unscaled mark or with finite=."""
    ls = jaxamp.static_scale(4.0)
    tx = SAFE_AROUND[name](jaxamp.skip_nonfinite(optax.sgd(1.0), ls))
    st = tx.init(P)
    g, finite = jaxamp.unscale_and_check(ls, jaxamp.scale(ls, G))
    want = np.asarray(P["w"] - G["w"])
    for new in (
        jaxamp.step(tx, g, st, P)[0],
        jax.jit(lambda g, st: jaxamp.step(tx, g, st, P))(g, st)[0],
        jaxamp.step(tx, g.tree, st, P, finite=finite)[0],
        jaxamp.TrainState.create(apply_fn=None, params=P, tx=tx).apply_gradients(grads=g).params,
    ):
        np.testing.assert_array_equal(np.asarray(new["w"]), want)


def test_float16_gradients_of_float32_params_reach_the_optimizer_in_float32() -> None:
    """Gradients compressed to float16 (an all-reduce in float16) over float32 master
    params: the inner optimizer gets them in float32, as PyTorch's master gradients, so
    Adam's squared gradient does not overflow from a finite value (it wrote inf into nu
    on a step counted as taken)."""
    ls = jaxamp.static_scale(128.0)
    tx = jaxamp.skip_nonfinite(optax.adam(0.1), ls)
    params = {"w": jnp.zeros(2)}
    true = np.array([300.0, 1.0], np.float32)  # 300**2 overflows float16
    grads = {"w": jnp.asarray(true * 128.0, jnp.float16)}
    ref = optax.adam(0.1)
    ref_updates, ref_state = ref.update({"w": jnp.asarray(true)}, ref.init(params), params)
    for new, state in (
        jaxamp.step(tx, grads, tx.init(params), params),
        (lambda u, s: (optax.apply_updates(params, u), s))(
            *tx.update(grads, tx.init(params), params)
        ),
    ):
        nu = np.asarray(state.inner_state[0].nu["w"])
        np.testing.assert_allclose(nu, np.asarray(ref_state[0].nu["w"]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(ref_updates["w"]), rtol=1e-6)
        assert int(jaxamp.metrics(state)["skipped_steps"]) == 0


def test_unscaled_gradients_read_as_their_tree() -> None:
    """What code written for a dict of gradients asks of them (Flax's apply_gradients
    asks ``"key" in grads``), and jaxamp.nnx.Optimizer.update, keep working."""
    ls = jaxamp.static_scale(4.0)
    g, _ = jaxamp.unscale_and_check(ls, {"w": jnp.ones(2), "b": jnp.ones(1)})
    assert "w" in g and sorted(g) == ["b", "w"] and len(g) == 2
    assert sorted(g.keys()) == ["b", "w"] and g["w"].shape == (2,)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = jaxamp.nnx.Optimizer(
        model, jaxamp.skip_nonfinite(optax.sgd(1.0), ls), wrt=nnx.Param
    )
    before = np.asarray(model.kernel[...])
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))) * 4.0)(model)
    unscaled, _ = jaxamp.unscale_and_check(ls, grads)
    optimizer.update(model, unscaled)  # the true gradient is 1 per kernel entry
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), before - 1.0)
