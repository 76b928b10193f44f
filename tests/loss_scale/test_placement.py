"""Where the guard may sit among optax transformations (``jaxamp/loss_scale/_placement.py``).

Each structure around ``jaxamp.skip_nonfinite`` is either refused by name, by every
function that reads the state and by the guard's own ``update`` when an optax wrapper
calls it, or is safe: then it trains as the same structure around plain optax on finite
steps, and on a skipped step nothing but the documented counters moves (drawn
sequences of finite / inf / NaN batches). Each refused structure wrote NaN, froze
training or read scaled gradients on 0.4 (issue 43, items 1 and 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

P = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.ones(2)}
SCALE = 2.0**10


def _guard(inner: Any = None, ls: Any = "dynamic") -> Any:
    scale = jaxamp.dynamic_scale(SCALE, growth_interval=3) if ls == "dynamic" else ls
    return jaxamp.skip_nonfinite(inner or optax.adam(0.1), scale)


# name -> (the structure around a guard, the regex its refusal must match)
REFUSED: dict[str, tuple[Callable[[Any], Any], str]] = {
    "chain, guard last (item 1)": (
        lambda g: optax.chain(optax.scale_by_adam(), g),
        r"after other transformations.*Put them inside: jaxamp.skip_nonfinite\(optax.chain",
    ),
    "chain, clip before the guard (item 1)": (
        lambda g: optax.chain(optax.clip_by_global_norm(1.0), g),
        r"see the scaled, unchecked gradients",
    ),
    "chain, guard first": (
        lambda g: optax.chain(g, optax.add_decayed_weights(0.5)),
        r"before other transformations.*would still run on a skipped step",
    ),
    "named_chain, guard last": (
        lambda g: optax.named_chain(("clip", optax.clip(1.0)), ("guard", g)),
        r"after other transformations in an optax.named_chain",
    ),
    "MultiSteps (item 2)": (
        lambda g: optax.MultiSteps(g, 2),
        r"wrapped in optax.MultiSteps.*jaxamp.skip_nonfinite\(inner, loss_scale, every_k=k\)",
    ),
    "mechanize (item 2)": (
        lambda g: optax.contrib.mechanize(g),
        r"wrapped in optax.contrib.mechanize.*skip_nonfinite\(optax.contrib.mechanize\(inner\)",
    ),
    "apply_if_finite": (
        lambda g: optax.apply_if_finite(g, 3),
        r"wrapped in optax.apply_if_finite.*never backs off",
    ),
    "masked": (
        lambda g: optax.masked(g, {"w": True, "b": False}),
        r"wrapped in optax.masked.*optax.set_to_zero\(\)",
    ),
    "partition": (
        lambda g: optax.partition({"a": g, "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}),
        r"wrapped in optax.partition.*jaxamp.multi_transform",
    ),
    "MultiSteps around a chain of one": (
        lambda g: optax.MultiSteps(optax.chain(g), 2),
        r"wrapped in optax.MultiSteps",
    ),
}

# name -> the structure around a guard that jaxamp knows to be safe
SAFE: dict[str, Callable[[Any], Any]] = {
    "alone": lambda g: g,
    "chain of one": lambda g: optax.chain(g),
    "named_chain of one": lambda g: optax.named_chain(("guard", g)),
    "flatten": lambda g: optax.flatten(g),
}


def _readers(tx: Any) -> dict[str, Callable[[], Any]]:
    """Every function that reads an optimizer state, given this ``tx``'s."""
    state = tx.init(P)
    loss = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"])  # noqa: E731
    grads = jax.tree.map(jnp.ones_like, P)
    return {
        "get_loss_scale": lambda: jaxamp.get_loss_scale(state),
        "metrics": lambda: jaxamp.metrics(state),
        "check_health": lambda: jaxamp.check_health(state),
        "value_and_grad": lambda: jaxamp.value_and_grad(loss)(state, P),
        "stepped": lambda: jaxamp.stepped(state),
        "step": lambda: jaxamp.step(tx, grads, state, P),
        "TrainState": lambda: jaxamp.TrainState.create(
            apply_fn=None, params=P, tx=tx
        ).apply_gradients(grads=grads),
    }


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_unsafe_structure_is_refused_by_every_reader(name: str) -> None:
    around, pattern = REFUSED[name]
    tx = around(_guard())
    for reader, read in _readers(tx).items():
        with pytest.raises(ValueError, match=pattern):
            read()
        assert reader  # (named in the traceback's locals when one does not raise)


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_optax_wrapper_calling_the_guard_is_refused_without_a_reader(name: str) -> None:
    """With no loss scale (bfloat16) nothing may read the state: the guard's update sees
    the optax wrapper that calls it, eager and under jit."""
    around, pattern = REFUSED[name]
    tx = around(_guard(ls=None))
    state = tx.init(P)
    grads = jax.tree.map(jnp.ones_like, P)
    with pytest.raises(ValueError, match=pattern):
        tx.update(grads, state, P)
    with pytest.raises(ValueError, match=pattern):
        jax.jit(tx.update)(grads, state, P)


def test_the_nnx_optimizers_refuse_an_unsafe_structure() -> None:
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = optax.MultiSteps(_guard(), 2)
    with pytest.raises(TypeError, match=r"must come from jaxamp.skip_nonfinite"):
        jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    # Flax's own optimizer calls tx.update through MultiSteps: the guard sees it.
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(model)
    with pytest.raises(ValueError, match="wrapped in optax.MultiSteps"):
        optimizer.update(model, grads)


def test_inject_hyperparams_around_a_guard_factory_is_safe_and_counts_every_call() -> None:
    """Known safe: it reads no gradient. Its own count (and so a schedule it derives)
    advances on every call, skipped ones too, as PyTorch's scheduler.step() does."""
    tx = optax.inject_hyperparams(lambda learning_rate: _guard(optax.sgd(learning_rate)))(
        learning_rate=0.1
    )
    state = tx.init(P)
    bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), P)
    updates, state = tx.update(bad, state, P)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert int(state.count) == 1 and int(jaxamp.metrics(state)["skipped_steps"]) == 1


def _reference(around: Callable[[Any], Any], inner: Callable[[], Any]) -> Any:
    return around(inner())


# make test-slow: CI's matrix cells (tests/matrix, the composition axis) hold each
# safe structure against plain optax.
@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(st.lists(st.sampled_from(["ok", "ok", "inf", "nan"]), min_size=3, max_size=5))
@pytest.mark.parametrize("name", list(SAFE))
def test_a_safe_structure_trains_as_plain_optax_and_keeps_state_on_a_skip(
    name: str, batches: list[str]
) -> None:
    around = SAFE[name]
    tx = around(_guard())
    ref = around(optax.adam(0.1))
    params, state = P, tx.init(P)
    ref_params, ref_state = P, ref.init(P)
    for k, kind in enumerate(batches):
        true = jax.tree.map(lambda x, k=k: jnp.cos(x * (k + 1)), P)
        if kind != "ok":
            true = {**true, "w": true["w"].at[1].set(jnp.inf if kind == "inf" else jnp.nan)}
        scaled = jaxamp.scale(jaxamp.get_loss_scale(state), true)
        before = (params, jax.tree.leaves(state))
        params, state = jaxamp.step(tx, scaled, state, params)
        if kind == "ok":
            u, ref_state = ref.update(true, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, u)
            # The guard divides by a power of two, exactly; the step is compiled as one
            # program (XLA may reorder Adam's arithmetic): float32 rounding per step.
            eps = np.finfo(np.float32).eps
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
                np.testing.assert_allclose(a, b, rtol=4 * eps, atol=8 * eps * 0.1 * (k + 1))
        else:
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before[0]), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert bool(jaxamp.metrics(state)["skipped"])
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))
