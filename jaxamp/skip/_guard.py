"""The one guarded step: unscale, check, run or skip under ``lax.cond``, update the scale.

Every public path that can skip an update (``skip_nonfinite``'s ``update``,
``multi_transform``'s ``update``, ``jaxamp.step`` with either, with or without
``finite=``) goes through ``guarded``. A grads value flows like this::

    scaled grads ──unscale──▶ check (one fused reduction per leaf, agreed over
         │                    axis_name) ──▶ finite
         └──────────────▶ lax.cond(finite,
                            apply: inner.update(unscale(grads)) [+ apply_updates],
                            skip:  zero updates [or the params] and the inner state as it was)
    loss-scale state ──update(finite)──▶ next loss-scale state

The skip is a ``lax.cond`` around the whole update rather than a select after
it, which would keep a second copy of the optimizer state alive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._utils.conversion_checks import check_scale_read, check_step_input
from jaxamp._utils.dtypes import is_inexact
from jaxamp._utils.finite import agree, as_finite, floating_leaves, leaf_flags, unscaled
from jaxamp._utils.jax_compat import aval_of
from jaxamp._utils.tree import like, zeros_of
from jaxamp.loss_scale import LossScaleState, advance
from jaxamp.skip import _record, _spikes

_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


class Call(NamedTuple):
    """What one optimizer call was given besides the trees.

    Attributes:
      extra_args: forwarded to every inner ``update`` (``value=``, ...).
      verdict: ``None``: the gradients are scaled, unscale and check them here;
        a bool scalar: the user's ``finite=`` (already unscaled and checked).
      to_params: ``jaxamp.step``: return the new params instead of updates.
      unscaled: the gradients came as a ``jaxamp.types.Unscaled`` (already divided by the
        scale): check them, never unscale them again.
    """

    extra_args: dict[str, Any]
    verdict: Any
    to_params: bool
    unscaled: bool = False


class Part(NamedTuple):
    """One independently skipped group: an inner optimizer and its share of the trees."""

    inner: optax.GradientTransformationExtraArgs
    state: Any
    grads: Any
    params: Any
    # Maps ``grads`` to the scaled gradients inside the check and the cond's branches,
    # so that a derived tree (an accumulation window's mean) is never materialised.
    prepare: Any = None


def _opaque(updates: Any, zero: jax.Array) -> Any:
    """The updates rounded to their dtype, as ``tx.update`` hands them out of its cond.

    Fused with the parameter add, ``p + u`` would let the compiler contract u's last
    multiply and the add into one FMA and differ from ``tx.update`` +
    ``apply_updates`` in the last bit. Adding to u's bits an integer the compiler
    cannot see is zero keeps the two forms equal bit for bit: ``zero`` is
    ``int(not finite)``, an operand of the cond, and this runs only in the branch
    taken when ``finite`` holds. Free: in registers, no memory traffic.
    """

    def one(u: Any) -> Any:
        if not is_inexact(u) or jnp.iscomplexobj(u) or u.dtype.itemsize not in _BITS:
            return u
        bits = _BITS[u.dtype.itemsize]
        return lax.bitcast_convert_type(
            lax.bitcast_convert_type(u, bits) + zero.astype(bits), u.dtype
        )

    return jax.tree.map(one, updates)


def cond_traced_once(pred: jax.Array, taken: Any, other: Any, *operands: Any) -> Any:
    """``lax.cond(pred, taken, other)`` that traces ``taken`` (an inner update) once.

    ``other`` is called as ``other(shapes, *operands)`` with ``taken``'s output
    shapes, read off the trace ``lax.cond`` has just made of ``taken``: it traces
    its true branch first (JAX 0.5 to 0.10). Were that order ever to change,
    ``other`` falls back to ``jax.eval_shape`` (a second trace, the same result).
    """
    seen: list[Any] = []

    def first(*ops: Any) -> Any:
        out = taken(*ops)
        # The type, sharding included: on an Explicit mesh the other branch must match it.
        seen.append(jax.tree.map(lambda x: aval_of(jnp.asarray(x)), out))
        return out

    def second(*ops: Any) -> Any:
        return other(seen[0] if seen else jax.eval_shape(taken, *ops), *ops)

    return lax.cond(pred, first, second, *operands)


class Spikes(NamedTuple):
    """A spike rule for one guarded call: the rule, its state, and the step's loss."""

    rule: _spikes.SpikeRule
    state: _spikes.SpikeState
    loss: jax.Array


class Outcome(NamedTuple):
    """What ``guarded`` returns.

    Attributes:
      outs: per part, its updates (or new params with ``to_params``).
      inner_states: per part, its new inner state.
      loss_scale: the next loss-scale state (advanced with ``finite``).
      nonfinite_leaves: the next per-leaf record (None without one, or unchecked).
      finite: bool[]: every part's gradients finite.
      spikes: the next spike state (None without a rule).
    """

    outs: list[Any]
    inner_states: list[Any]
    loss_scale: LossScaleState
    nonfinite_leaves: Any
    finite: jax.Array
    spikes: Any


class Checked(NamedTuple):
    """What the finite check found, per part.

    Attributes:
      unscale: maps scaled gradients to unscaled ones (the identity for ``finite=``).
      takes: per part, whether its gradients are finite (None: nothing is checked).
      flags: all the parts' per-leaf flags, agreed, in part order (None: none read).
      owners: per part, the leaf (in its ``prepare(grads)``) each of its flags is about.
    """

    unscale: Callable[[Any], Any]
    takes: list[Any]
    flags: Any
    owners: list[list[int]]


def _check(ls: LossScaleState, parts: list[Part], call: Call, axis_name: Any) -> Checked:
    """Unscales and checks every part's gradients, with one collective for all of them."""
    n = len(parts)
    if call.verdict is not None:
        # Agreed like a verdict of our own: a `finite` each device computed from
        # its own gradients would send devices down different branches (and the
        # skip branch's collective would wait for devices that never reach it).
        verdict = agree(as_finite(call.verdict, "jaxamp.step"), axis_name)
        return Checked(lambda g: g, [verdict] * n, None, [[]] * n)
    scale = ls.scale if ls.enabled and not call.unscaled else None
    unscale = lambda g: unscaled(g, scale)
    if not ls.check_finite:
        return Checked(unscale, [None] * n, None, [[]] * n)
    local = [leaf_flags(p.grads, scale, p.prepare) for p in parts]
    agreed = agree(jnp.concatenate([f for f, _ in local]), axis_name)
    takes, start = [], 0
    for _, owners in local:
        takes.append(jnp.all(agreed[start : start + len(owners)]))
        start += len(owners)
    return Checked(unscale, takes, agreed, [owners for _, owners in local])


def _judge_spikes(
    spikes: Spikes, parts: list[Part], check: Checked, every: jax.Array, axis_name: Any
) -> tuple[list[Any], _spikes.SpikeState]:
    """Each part's take with the spike verdict, and the next spike state."""
    squares = sum(_spikes.sum_of_squares(check.unscale(_prepared(p))) for p in parts)
    values = _spikes.agree_values(jnp.stack([spikes.loss, jnp.sqrt(squares)]), axis_name)
    spike = _spikes.decide(spikes.rule, spikes.state, values[0], values[1], every)
    takes = [~spike if t is None else t & ~spike for t in check.takes]
    return takes, _spikes.record(spikes.rule, spikes.state, values[0], values[1], every, spike)


def _prepared(part: Part) -> Any:
    return part.grads if part.prepare is None else part.prepare(part.grads)


def _in_params_dtype(grads: Any, params: Any) -> Any:
    """Each unscaled gradient in its param's dtype where that is wider: PyTorch's master
    gradients. float16 gradients of float32 params (a compressed all-reduce) would
    overflow the inner optimizer's float16 arithmetic (a squared gradient) from finite
    values; widening is exact, and free where the dtypes already agree (no op)."""
    if params is None:
        return grads

    def one(g: Any, p: Any) -> Any:
        if g is None or not (is_inexact(g) and is_inexact(p)):
            return g
        wide = jnp.result_type(p)
        return g.astype(wide) if jnp.dtype(wide).itemsize > g.dtype.itemsize else g

    return jax.tree.map(one, grads, params, is_leaf=lambda x: x is None)


def _run_part(
    part: Part,
    take: jax.Array | None,
    unscale: Callable[[Any], Any],
    call: Call,
    read_flags: bool,
    axis_name: Any,
) -> tuple[Any, Any, Any]:
    """One part's update under ``lax.cond(take, ...)``; ``take=None``: unchecked, no cond.

    The cond's operands and results are the part's inner state, gradients and params
    (and updates or new params) only, so a finite step hands nothing through its
    branch unchanged: XLA copies what a branch returns as it got it.

    ``read_flags``: the gradients were not checked here (``finite=``) and there is a
    per-leaf record, so the skip branch says which leaves are finite, agreed over
    ``axis_name``, and the taken branch that all are. The third result is those
    flags (None without ``read_flags``).
    """
    prepare = part.prepare or (lambda g: g)

    def apply(state: Any, grads: Any, params: Any, nonfinite: Any) -> Any:
        grads = _in_params_dtype(unscale(prepare(grads)), params)
        updates, state = part.inner.update(grads, state, params, **call.extra_args)
        ok = jnp.ones((len(floating_leaves(grads)),), jnp.bool_) if read_flags else None
        if not call.to_params:
            return updates, state, ok
        updates = _opaque(updates, nonfinite)
        return optax.apply_updates(params, updates), state, ok

    if take is None:  # nothing is checked: no cond, and so nothing to round either
        grads = _in_params_dtype(unscale(prepare(part.grads)), part.params)
        updates, state = part.inner.update(grads, part.state, part.params, **call.extra_args)
        out = optax.apply_updates(part.params, updates) if call.to_params else updates
        return out, state, None

    def skip(shapes: Any, state: Any, grads: Any, params: Any, _: Any) -> Any:
        out = params if call.to_params else zeros_of(shapes[0])
        ok = None
        if read_flags:
            ok = agree(leaf_flags(unscale(prepare(grads)), None)[0], axis_name)
        return like(out, shapes[0]), like(state, shapes[1]), like(ok, shapes[2])

    operands = (part.state, part.grads, part.params, (~take).astype(jnp.int32))
    return cond_traced_once(take, apply, skip, *operands)


def _leaf_ok(
    stats: _record.NonfiniteLeaves,
    positions: list[list[int]] | None,
    parts: list[Part],
    flags: jax.Array,
    owners: list[list[int]],
) -> jax.Array:
    """bool[n_leaves]: per leaf of the params (record order), whether it was finite.

    ``flags`` are the parts' per-leaf flags in part order, ``owners[i]`` the leaves of
    part ``i`` (in its ``prepare(grads)``) they are about; a leaf with no flag (not
    floating) counts as finite.
    """
    sizes = [len(jax.tree.leaves(_prepared(p))) for p in parts]
    # One part: its leaves (those of `prepare(grads)`: an accumulation window's mean,
    # not the window) are all the leaves, in order.
    positions = positions or [list(range(n)) for n in sizes]
    _record.check_length(stats, sum(sizes))
    where = [int(flags.shape[0])] * sum(sizes)  # the index of a True appended to flags
    start = 0
    for pos, own in zip(positions, owners, strict=True):
        for k, leaf in enumerate(own):
            where[pos[leaf]] = start + k
        start += len(own)
    if where == list(range(len(where))):  # every leaf floating, one part: as they are
        return flags
    return jnp.concatenate([flags, jnp.ones((1,), jnp.bool_)])[np.asarray(where)]


def guarded(
    ls: LossScaleState,
    parts: list[Part],
    call: Call,
    axis_name: Any,
    spikes: Spikes | None = None,
    record: tuple[_record.NonfiniteLeaves, list[list[int]] | None] | None = None,
) -> Outcome:
    """Runs each part's inner update if its gradients are finite; updates the scale once.

    Args:
      ls: the loss-scale state the gradients were scaled with.
      parts: the groups; each is checked and skipped on its own.
      call: the call's extra args, the user's verdict (if any) and the output kind.
      axis_name: mapped axis over which the finiteness is agreed.
      spikes: a spike rule: a finite step it calls a spike is skipped in every
        part (in the same cond), and the scale does not move for it.
      record: the per-leaf record of non-finite gradients, and per part where its
        leaves sit among all the leaves (None: one part, every leaf in order); it is
        updated after the conds from the check's per-leaf flags (one small fusion,
        written in place) and does not move on a step where every part is finite.

    Returns:
      An ``Outcome``; the scale advances with "every part finite".
    """
    if not call.unscaled:  # trace time: gradients never scaled by this dynamic scale
        check_scale_read(ls)
    check_step_input(ls)
    check = _check(ls, parts, call, axis_name)
    checked = [t for t in check.takes if t is not None]
    every = jnp.all(jnp.stack(checked)) if checked else jnp.array(True)
    takes, new_spikes = check.takes, None
    if spikes is not None:
        takes, new_spikes = _judge_spikes(spikes, parts, check, every, axis_name)
    # Which leaves are finite: the check's flags, or (``finite=``) the skip branches'.
    read_flags = record is not None and bool(checked) and check.flags is None
    outs, states, oks = [], [], []
    for part, take in zip(parts, takes, strict=True):
        out, state, ok = _run_part(part, take, check.unscale, call, read_flags, axis_name)
        outs.append(out)
        states.append(state)
        oks.append(ok)
    stats = None
    if record is not None and checked:
        flags, owners = check.flags, check.owners
        if flags is None:
            flags = jnp.concatenate(oks)
            owners = [floating_leaves(_prepared(p)) for p in parts]
        ok = _leaf_ok(record[0], record[1], parts, flags, owners)
        stats = _record.after_step(record[0], ok, every)
    return Outcome(outs, states, advance(ls, every), stats, every, new_spikes)
