"""The matrix's composition axis: the guard inside and around optax's structures.

Each composition is a mode (``modes.Mode``) whose ``tx`` puts ``jaxamp.skip_nonfinite``
somewhere among optax transformations. One that jaxamp accepts (``ACCEPTED``) must
train as the same structure built around the plain inner optimizer (``reference``),
the reference skipping the calls the guard skips; on a skipped call nothing but the
documented counters moves (``inject_hyperparams``' count, when it wraps the guard's
factory, counts every call: ``always``). One that jaxamp refuses (``REFUSED``) must
raise at trace time a ``ValueError`` whose message names the fix (a regex), by
``tx.init``, ``jaxamp.get_loss_scale``, ``jaxamp.value_and_grad``, ``jaxamp.step`` or
``jaxamp.TrainState``, whichever the path reaches first.

The guard alone and ``jaxamp.multi_transform`` (what ``optax.partition`` must become)
are the product's ``plain`` and ``multi`` modes; ``tests/loss_scale/test_placement.py``
holds the same structures against every reader, on a toy model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from tests.matrix.models import label_of

LR = 1e-2
# Gradients of the matrix's losses have a global norm of about 1: this one clips
# some calls and not others.
CLIP = 0.5

Guard = Callable[[Any], Any]  # inner optimizer -> skip_nonfinite(inner, ...)


def _adam() -> Any:
    return optax.adam(LR)


def _kernels(params: Any) -> Any:
    """``masked``'s mask: the kernels in, biases and BatchNorm's scale out."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: "kernel" in jax.tree_util.keystr(p), params
    )


def _stored(dtype: Any) -> Any:
    """adam with its moments in ``dtype`` (jaxamp.low_precision_state): every moment,
    the matrix's small ones too, in blocks of a few per row (the kernels' rows are 16
    and 4 wide), so that rows hold several blocks and sharded rows whole ones."""
    return jaxamp.low_precision_state(_adam(), dtype, block_size=4, min_size=0)


def _labels(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda p, _: label_of(jax.tree_util.keystr(p).strip("[]'")), params
    )


def _inject(factory: Callable[..., Any]) -> Any:
    return optax.inject_hyperparams(factory)(learning_rate=LR)


@dataclasses.dataclass(frozen=True)
class Accepted:
    """``build(guard)``: the jaxamp structure; ``reference()``: the same around plain optax;
    ``always``: the top-level fields of the state that advance on every call."""

    build: Callable[[Guard], Any]
    reference: Callable[[], Any]
    always: tuple[str, ...] = ()


ACCEPTED: dict[str, Accepted] = {
    # Around the guard: the structures known safe.
    "chain_of_one": Accepted(lambda g: optax.chain(g(_adam())), lambda: optax.chain(_adam())),
    "named_chain_of_one": Accepted(
        lambda g: optax.named_chain(("guard", g(_adam()))),
        lambda: optax.named_chain(("guard", _adam())),
    ),
    "flatten": Accepted(lambda g: optax.flatten(g(_adam())), lambda: optax.flatten(_adam())),
    "inject_around": Accepted(
        lambda g: _inject(lambda learning_rate: g(optax.adam(learning_rate))),
        lambda: _inject(lambda learning_rate: optax.adam(learning_rate)),
        always=("count",),
    ),
    # Inside the guard: each refusal's fix.
    "inject_inside": Accepted(lambda g: g(_inject(optax.adam)), lambda: _inject(optax.adam)),
    "guard_chain": Accepted(
        lambda g: g(
            optax.chain(optax.clip_by_global_norm(CLIP), _adam(), optax.add_decayed_weights(LR))
        ),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP), _adam(), optax.add_decayed_weights(LR)
        ),
    ),
    "guard_masked": Accepted(
        lambda g: g(optax.masked(_adam(), _kernels)), lambda: optax.masked(_adam(), _kernels)
    ),
    "guard_multisteps": Accepted(
        lambda g: g(optax.MultiSteps(_adam(), 2)), lambda: optax.MultiSteps(_adam(), 2)
    ),
    "guard_mechanize": Accepted(
        lambda g: g(optax.contrib.mechanize(_adam())), lambda: optax.contrib.mechanize(_adam())
    ),
    # The moments stored in 8 or 16 bits (issue 45): the stored state is the state the
    # skipped calls keep, the reference the same storage without the guard.
    "guard_stored_8bit": Accepted(lambda g: g(_stored("8bit")), lambda: _stored("8bit")),
    "guard_stored_bf16": Accepted(
        lambda g: g(_stored(jnp.bfloat16)), lambda: _stored(jnp.bfloat16)
    ),
}

# name -> (the structure, the regex its refusal must match: the fix, by name)
REFUSED: dict[str, tuple[Callable[[Guard], Any], str]] = {
    "chain_guard_last": (
        lambda g: optax.chain(optax.clip_by_global_norm(CLIP), g(_adam())),
        r"after other transformations.*Put them inside: jaxamp\.skip_nonfinite\(optax\.chain",
    ),
    "chain_guard_first": (
        lambda g: optax.chain(g(_adam()), optax.add_decayed_weights(LR)),
        r"before other transformations.*Put them inside: jaxamp\.skip_nonfinite\(optax\.chain",
    ),
    "named_chain_guard_last": (
        lambda g: optax.named_chain(("clip", optax.clip(1.0)), ("guard", g(_adam()))),
        r"after other transformations in an optax\.named_chain.*jaxamp\.skip_nonfinite\(",
    ),
    "multisteps": (
        lambda g: optax.MultiSteps(g(_adam()), 2),
        r"wrapped in optax\.MultiSteps.*jaxamp\.skip_nonfinite\(inner, loss_scale, every_k=k\)",
    ),
    "apply_if_finite": (
        lambda g: optax.apply_if_finite(g(_adam()), 3),
        r"wrapped in optax\.apply_if_finite.*max_consecutive_nonfinite=N\)\) alone",
    ),
    "mechanize": (
        lambda g: optax.contrib.mechanize(g(_adam())),
        r"wrapped in optax\.contrib\.mechanize.*skip_nonfinite\(optax\.contrib\.mechanize\(inner\)",
    ),
    "masked": (
        lambda g: optax.masked(g(_adam()), _kernels),
        r"wrapped in optax\.masked.*optax\.set_to_zero\(\)",
    ),
    "partition": (
        lambda g: optax.partition({"a": g(_adam()), "b": optax.sgd(LR)}, _labels),
        r"wrapped in optax\.partition.*jaxamp\.multi_transform\(transforms, param_labels",
    ),
    "stored_around": (
        lambda g: jaxamp.low_precision_state(g(_adam()), "8bit"),
        r"holds a loss scale.*jaxamp\.skip_nonfinite\(jaxamp\.low_precision_state\(optimizer",
    ),
    "lookahead": (
        lambda g: optax.lookahead(g(_adam()), 2, 0.5),
        r"wrapped in optax\.lookahead.*without lookahead",
    ),
}

NAMES = (*ACCEPTED, *REFUSED)


def tx(name: str, guard: Guard) -> Any:
    return ACCEPTED[name].build(guard) if name in ACCEPTED else REFUSED[name][0](guard)


def inner_leaves(opt_state: Any, always: tuple[str, ...], *, reference: bool) -> list[Any]:
    """The state to compare: the reference's whole state; jaxamp's with the guard's
    state replaced by its inner optimizer's (the structure around it kept). The
    fields in ``always`` are left out (``counters`` holds them)."""
    if always:
        opt_state = opt_state._replace(**dict.fromkeys(always))
    if reference:
        return jax.tree.leaves(opt_state)
    get = lambda s: s["inner_state"] if isinstance(s, dict) else s.inner_state  # noqa: E731
    is_guard = lambda s: (
        isinstance(s, jaxamp.types.SkipNonfiniteState)
        or (  # noqa: E731
            isinstance(s, dict) and "inner_state" in s and "loss_scale" in s
        )
    )
    return jax.tree.leaves(
        jax.tree.map(lambda s: get(s) if is_guard(s) else s, opt_state, is_leaf=is_guard)
    )


def counters(opt_state: Any, always: tuple[str, ...]) -> dict[str, Any]:
    """The fields in ``always``: they move on every call, skipped ones too."""
    return {f: getattr(opt_state, f) for f in always}
