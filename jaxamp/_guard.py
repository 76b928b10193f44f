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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp import _leaf_stats, _spikes
from jaxamp import _scaling as ls_lib
from jaxamp._conversion_checks import check_scale_read
from jaxamp._jax_compat import aval_of
from jaxamp._loss_scale import LossScaleState
from jaxamp._tree import agree, is_float_leaf, like, zeros_of

_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


class Call(NamedTuple):
    """What one optimizer call was given besides the trees.

    Attributes:
      extra_args: forwarded to every inner ``update`` (``value=``, ...).
      verdict: ``None``: the gradients are scaled, unscale and check them here;
        a bool scalar: the user's ``finite=`` (already unscaled and checked).
      to_params: ``jaxamp.step``: return the new params instead of updates.
    """

    extra_args: dict[str, Any]
    verdict: Any
    to_params: bool


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
        if not is_float_leaf(u) or jnp.iscomplexobj(u) or u.dtype.itemsize not in _BITS:
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


class Record(NamedTuple):
    """What a part's skip branch needs to update the per-leaf record.

    Attributes:
      stats: the record as the part receives it (threaded through the parts).
      positions: where the part's leaves sit among all the params' leaves.
      owner: for every leaf, the index of the part it belongs to.
      parts_finite: bool[n_parts]: which parts' gradients were finite.
      known: per leaf of the part, whether the finite check read it alone.
      flags: the check's agreed flags for the part's groups (None: nothing checked).
      alone: the groups that read one leaf alone, in the order of the True
        entries of ``known``.
    """

    stats: _leaf_stats.NonfiniteLeaves
    positions: list[int]
    owner: list[int]
    parts_finite: jax.Array
    known: list[bool]
    flags: jax.Array | None
    alone: list[int]


def _run_part(
    part: Part,
    take: jax.Array | None,
    unscale: Any,
    call: Call,
    axis_name: Any,
    record: Record | None,
) -> tuple[Any, Any, Any]:
    """One part's update under ``lax.cond(take, ...)``; ``take=None``: unchecked, no cond.

    Also returns the per-leaf record after this part: the skip branch writes which
    of the part's leaves were non-finite; the taken branch hands it through
    unchanged, so a finite step runs no op for it.
    """
    prepare = part.prepare or (lambda g: g)

    def apply(state: Any, grads: Any, params: Any, nonfinite: Any, stats: Any, _: Any) -> Any:
        grads = unscale(prepare(grads))
        updates, state = part.inner.update(grads, state, params, **call.extra_args)
        if not call.to_params:
            return updates, state, stats
        updates = _opaque(updates, nonfinite)
        return optax.apply_updates(params, updates), state, stats

    if take is None:  # nothing is checked: no cond, and so nothing to round either
        grads = unscale(prepare(part.grads))
        updates, state = part.inner.update(grads, part.state, part.params, **call.extra_args)
        out = optax.apply_updates(part.params, updates) if call.to_params else updates
        return out, state, None

    def skip(shapes: Any, state: Any, grads: Any, params: Any, _: Any, stats: Any, flags: Any):
        if call.to_params:
            out = params
        else:
            out = zeros_of(shapes[0])
        if record is not None:
            bad = _leaf_stats.bad_leaves(unscale(prepare(grads)), axis_name, record.known)
            if record.alone:  # the large leaves' flags, from the finite check
                leaves = [j for j, k in enumerate(record.known) if k]
                picked = flags[jnp.array(record.alone, jnp.int32)]
                bad = bad.at[jnp.array(leaves, jnp.int32)].set(~picked)
            stats = _leaf_stats.skipped(
                stats, bad, record.positions, record.owner, record.parts_finite
            )
        return like(out, shapes[0]), like(state, shapes[1]), stats

    stats = None if record is None else record.stats
    flags = None if record is None else record.flags
    operands = (part.state, part.grads, part.params, (~take).astype(jnp.int32), stats, flags)
    return cond_traced_once(take, apply, skip, *operands)


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


def guarded(
    ls: LossScaleState,
    parts: list[Part],
    call: Call,
    axis_name: Any,
    spikes: Spikes | None = None,
    record: tuple[_leaf_stats.NonfiniteLeaves, list[list[int]] | None] | None = None,
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
        updated in the parts' skip branches.

    Returns:
      An ``Outcome``; the scale advances with "every part finite".
    """
    check_scale_read(ls)  # trace time: gradients never scaled by this dynamic scale
    sizes = [len(jax.tree.leaves((p.prepare or (lambda g: g))(p.grads))) for p in parts]
    # Per part: the check's agreed flags (None: the skip branch reads every leaf),
    # which leaves the check read alone, and their groups' indices in the flags.
    flags: list[Any] = [None] * len(parts)
    known: list[list[bool]] = [[False] * n for n in sizes]
    alone: list[list[int]] = [[] for _ in parts]
    if call.verdict is not None:
        verdict = ls_lib.as_finite(call.verdict, "jaxamp.step")
        unscale = lambda g: g
        takes: list[Any] = [verdict] * len(parts)
    else:
        unscale = lambda g: ls_lib.unscale(ls, g)
        local = [ls_lib.local_finite_groups(ls, p.grads, p.prepare) for p in parts]
        if local and local[0][0] is not None:
            # One collective for all parts' groups.
            agreed = agree(jnp.concatenate([f for f, _ in local]), axis_name)
            takes, start = [], 0
            for i, (_, owners) in enumerate(local):
                mine = agreed[start : start + len(owners)]
                start += len(owners)
                takes.append(jnp.all(mine))
                flags[i] = mine
                for o, k in sorted((o, k) for k, o in enumerate(owners) if o is not None):
                    known[i][o] = True
                    alone[i].append(k)
        else:
            takes = [None] * len(parts)
    checked = [t for t in takes if t is not None]
    every = jnp.all(jnp.stack(checked)) if checked else jnp.array(True)
    stats, owner = None, []
    if record is not None and checked:
        stats, positions = record
        # One part: its leaves (those of `prepare(grads)`: an accumulation window's
        # mean, not the window) are all the leaves, in order.
        positions = positions or [list(range(n)) for n in sizes]
        _leaf_stats.check_length(stats, sum(sizes))
        owner = [0] * sum(sizes)
        for i, pos in enumerate(positions):
            for j in pos:
                owner[j] = i
        parts_finite = jnp.stack(takes)
    new_spikes = None
    if spikes is not None:
        squares = sum(
            _spikes.sum_of_squares(unscale((p.prepare or (lambda g: g))(p.grads))) for p in parts
        )
        values = _spikes.agree_values(jnp.stack([spikes.loss, jnp.sqrt(squares)]), axis_name)
        spike = _spikes.decide(spikes.rule, spikes.state, values[0], values[1], every)
        takes = [~spike if t is None else t & ~spike for t in takes]
        new_spikes = _spikes.record(spikes.rule, spikes.state, values[0], values[1], every, spike)
    outs, states = [], []
    for i, (part, take) in enumerate(zip(parts, takes, strict=True)):
        rec = None
        if stats is not None:
            rec = Record(stats, positions[i], owner, parts_finite, known[i], flags[i], alone[i])
        out, state, got = _run_part(part, take, unscale, call, axis_name, rec)
        stats = got if stats is not None else None
        outs.append(out)
        states.append(state)
    return Outcome(outs, states, ls_lib.update(ls, every), stats, every, new_spikes)
