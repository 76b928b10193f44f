"""One train-step builder per variant: the same model, loss, data and AdamW for all.

Every step has the signature ``step(params, opt_state, aux, batch) -> (params,
opt_state, aux, loss)`` and is jitted with ``donate_argnums=(0, 1, 2)``: params,
optimizer state and any loss-scale state are donated, as in a real training
loop. ``aux`` holds a peer library's loss-scale state (``None`` where the scale
lives inside the optax state or there is none).

Params are float32. Every variant except the plain floor scales the loss, takes
the gradient of the scaled loss, unscales and checks it, and skips the step when
it is not finite, each the way its library's documentation shows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import optax
from flax.training.dynamic_scale import DynamicScale

import jaxamp

StepFn = Callable[[Any, Any, Any, Any], tuple[Any, Any, Any, jax.Array]]

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
INIT_SCALE = 2.0**15


def adamw() -> optax.GradientTransformation:
    """The inner optimizer every variant uses."""
    return optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named train step and how to build its initial state.

    Attributes:
      name: short key used in the table, the JSON and ``--only``.
      description: what the step does, one line.
      init: ``params -> (params, opt_state, aux)``.
      step: the un-jitted step function.
      is_jaxamp: whether the step is one of jaxamp's (checked for host traffic in the test).
    """

    name: str
    description: str
    init: Callable[[Any], tuple[Any, Any, Any]]
    step: StepFn
    is_jaxamp: bool = False
    # The optax-style optimizer state inside a step's state (for jaxamp.metrics).
    opt_state_of: Callable[[tuple[Any, Any, Any]], Any] = lambda state: state[1]


def _plain(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    tx = adamw()

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux, value

    return Variant(
        "plain",
        "optax adamw, no scaling, no check (the floor)",
        lambda p: (p, tx.init(p), None),
        step,
    )


def _jaxamp_loss_grad(
    loss: Callable[[Any, Any], jax.Array], params: Any, opt_state: Any, batch: Any
) -> tuple[jax.Array, Any]:
    """Scaled loss -> scaled gradients, with the scale read from the optax state."""
    return jaxamp.value_and_grad(loss)(opt_state, params, batch)


def _jaxamp_optax(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    tx = jaxamp.skip_nonfinite(adamw(), jaxamp.dynamic_scale(INIT_SCALE))

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = _jaxamp_loss_grad(loss, params, opt_state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux, value

    return Variant(
        "jaxamp_optax",
        "jaxamp.skip_nonfinite(adamw, dynamic_scale) + optax.apply_updates",
        lambda p: (p, tx.init(p), None),
        step,
        is_jaxamp=True,
    )


def _jaxamp_step(loss: Callable[[Any, Any], jax.Array], use_cond: bool) -> Variant:
    tx = jaxamp.skip_nonfinite(adamw(), jaxamp.dynamic_scale(INIT_SCALE))

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = _jaxamp_loss_grad(loss, params, opt_state, batch)
        if use_cond:
            params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        else:  # the design jaxamp.step avoids: compute the step, then select it away
            ls = opt_state.loss_scale
            unscaled, finite = jaxamp.unscale_and_check(ls, grads)
            updates, inner = tx.update.inner.update(unscaled.tree, opt_state.inner_state, params)
            new = (optax.apply_updates(params, updates), inner)
            params, inner = jaxamp.select_tree(finite, new, (params, opt_state.inner_state))
            opt_state = opt_state._replace(inner_state=inner, loss_scale=jaxamp.update(ls, finite))
        return params, opt_state, aux, value

    if use_cond:
        name, desc = "jaxamp_step", "jaxamp.step (lax.cond around update + apply)"
    else:
        name, desc = "jaxamp_step_select", "jaxamp fused step, compute-then-select design"
    return Variant(name, desc, lambda p: (p, tx.init(p), None), step, is_jaxamp=True)


def _jaxamp_step_no_record(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    """``jaxamp_step`` with the per-leaf record left out: what the record costs."""
    base = _jaxamp_step(loss, use_cond=True)

    def init(p: Any) -> Any:
        params, opt_state, aux = base.init(p)
        return params, opt_state._replace(nonfinite_leaves=None), aux

    return Variant(
        "jaxamp_step_no_record",
        "jaxamp.step without the per-leaf non-finite record (what jaxamp.explain reads)",
        init,
        base.step,
        is_jaxamp=True,
    )


def _jaxamp_spikes(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    rule = jaxamp.spike_rule()  # OLMo-core's defaults: 128 steps, 6 sigmas
    tx = jaxamp.skip_nonfinite(adamw(), jaxamp.dynamic_scale(INIT_SCALE), spikes=rule)

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = _jaxamp_loss_grad(loss, params, opt_state, batch)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params, value=value)
        return params, opt_state, aux, value

    return Variant(
        "jaxamp_spikes",
        "jaxamp.step with spike skipping (spike_rule(): loss and gradient norm)",
        lambda p: (p, tx.init(p), None),
        step,
        is_jaxamp=True,
    )


EVERY_K = 4


def _optax_multisteps(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    tx = optax.MultiSteps(adamw(), every_k_schedule=EVERY_K)

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux, value

    return Variant(
        "optax_multisteps",
        f"optax.MultiSteps(adamw, {EVERY_K}): accumulation, no scaling",
        lambda p: (p, tx.init(p), None),
        step,
    )


def _jaxamp_every_k(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    tx = jaxamp.skip_nonfinite(adamw(), jaxamp.dynamic_scale(INIT_SCALE), every_k=EVERY_K)

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = _jaxamp_loss_grad(loss, params, opt_state, batch)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, aux, value

    return Variant(
        "jaxamp_every_k",
        f"jaxamp.step, skip_nonfinite(adamw, every_k={EVERY_K})",
        lambda p: (p, tx.init(p), None),
        step,
        is_jaxamp=True,
    )


def _jaxamp_nnx(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    """The same step through Flax NNX: params held by a module, jaxamp.nnx.Optimizer.

    The step's state is the two nnx States (the module's Params, the optimizer's
    state), split and merged inside the jitted step as NNX's functional API does.
    """
    from flax import nnx

    tx = jaxamp.skip_nonfinite(adamw(), jaxamp.dynamic_scale(INIT_SCALE))

    class Holder(nnx.Module):
        def __init__(self, params: Any) -> None:
            self.params = nnx.data(jax.tree.map(nnx.Param, params))

    graphdefs: list[Any] = []

    def init(p: Any) -> Any:
        holder = Holder(p)
        optimizer = jaxamp.nnx.Optimizer(holder, tx, wrt=nnx.Param)
        graphdef, params, rest = nnx.split((holder, optimizer), nnx.Param, ...)
        graphdefs[:] = [graphdef]
        return params, rest, None

    def step(params: Any, rest: Any, aux: Any, batch: Any) -> Any:
        holder, optimizer = nnx.merge(graphdefs[0], params, rest)

        def loss_of(h: Holder) -> jax.Array:
            return loss(nnx.to_pure_dict(nnx.state(h, nnx.Param))["params"], batch)

        value, grads = jaxamp.nnx.value_and_grad(loss_of)(optimizer, holder)
        optimizer.update(holder, grads)
        _, params, rest = nnx.split((holder, optimizer), nnx.Param, ...)
        return params, rest, aux, value

    def opt_state_of(state: Any) -> Any:
        return nnx.merge(graphdefs[0], state[0], state[1])[1].opt_state

    return Variant(
        "jaxamp_nnx",
        "jaxamp.nnx.Optimizer.update (nnx split / merge in the step)",
        init,
        step,
        is_jaxamp=True,
        opt_state_of=opt_state_of,
    )


def _jmp(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    tx = adamw()

    # The jmp state travels as its two array leaves: jmp.DynamicLossScale's __post_init__
    # rejects the placeholders that `jit(...).lower` unflattens it with. Same program.
    def step(params: Any, opt_state: Any, aux: tuple[jax.Array, jax.Array], batch: Any) -> Any:
        ls = jmp.DynamicLossScale(*aux)
        # As jmp's README: scale the loss, unscale the grads, all_finite, adjust, select_tree.
        value, grads = jax.value_and_grad(lambda p: ls.scale(loss(p, batch)))(params)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        new_ls = ls.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, (new_ls.loss_scale, new_ls.counter), ls.unscale(value)

    def init(p: Any) -> Any:
        ls = jmp.DynamicLossScale(jnp.asarray(INIT_SCALE, jnp.float32))
        return p, tx.init(p), (ls.loss_scale, jnp.asarray(ls.counter))

    return Variant("jmp", "jmp.DynamicLossScale + all_finite + select_tree", init, step)


def _flax(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    tx = adamw()

    def step(params: Any, opt_state: Any, ds: DynamicScale, batch: Any) -> Any:
        # As flax's docs / imagenet example: value_and_grad wrapper, then jnp.where selects.
        grad_fn = ds.value_and_grad(lambda p: loss(p, batch))
        ds, finite, value, grads = grad_fn(params)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, finite)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        params = jax.tree.map(select, new_params, params)
        return params, opt_state, ds, value

    def init(p: Any) -> Any:
        return p, tx.init(p), DynamicScale(scale=INIT_SCALE)

    return Variant("flax_dynamic_scale", "flax DynamicScale + jnp.where select", init, step)


def _apply_if_finite(loss: Callable[[Any, Any], jax.Array]) -> Variant:
    # optax.apply_if_finite has no loss scale of its own: the scale is a fixed
    # INIT_SCALE applied and removed by hand around it (a static loss scale).
    tx = optax.apply_if_finite(adamw(), max_consecutive_errors=5)

    def step(params: Any, opt_state: Any, aux: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(lambda p: loss(p, batch) * INIT_SCALE)(params)
        grads = jax.tree.map(lambda g: g * (1.0 / INIT_SCALE), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux, value / INIT_SCALE

    return Variant(
        "optax_apply_if_finite",
        "optax.apply_if_finite(adamw), static scale by hand",
        lambda p: (p, tx.init(p), None),
        step,
    )


VARIANT_NAMES = (
    "plain",
    "jaxamp_optax",
    "jaxamp_step",
    "jaxamp_step_select",
    "jaxamp_step_no_record",
    "jaxamp_spikes",
    "jaxamp_nnx",
    "jmp",
    "flax_dynamic_scale",
    "optax_apply_if_finite",
    "optax_multisteps",
    "jaxamp_every_k",
)


def build_variants(
    loss: Callable[[Any, Any], jax.Array], only: tuple[str, ...] | None = None
) -> list[Variant]:
    """All variants (or those named in ``only``, plus ``plain``) for ``loss(params, batch)``."""
    all_variants = [
        _plain(loss),
        _jaxamp_optax(loss),
        _jaxamp_step(loss, use_cond=True),
        _jaxamp_step(loss, use_cond=False),
        _jaxamp_step_no_record(loss),
        _jaxamp_spikes(loss),
        _jaxamp_nnx(loss),
        _jmp(loss),
        _flax(loss),
        _apply_if_finite(loss),
        _optax_multisteps(loss),
        _jaxamp_every_k(loss),
    ]
    if only:
        unknown = set(only) - set(VARIANT_NAMES)
        if unknown:
            raise ValueError(f"unknown variant(s) {sorted(unknown)}; choose from {VARIANT_NAMES}")
        all_variants = [v for v in all_variants if v.name == "plain" or v.name in only]
    return all_variants


def jit_step(variant: Variant) -> Callable[..., Any]:
    """The variant's step under ``jax.jit`` with params, opt state and aux donated."""
    return jax.jit(variant.step, donate_argnums=(0, 1, 2))
