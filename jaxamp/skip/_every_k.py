"""Gradient accumulation with PyTorch's semantics: ``skip_nonfinite(..., every_k=k)``.

Calls 1..k-1 of a window add the scaled gradients to an accumulator and change
nothing else; call k runs one guarded step on the window's mean and resets the
accumulator by replacement, so an overflowing micro-batch costs one window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxamp._utils.dtypes import is_inexact
from jaxamp._utils.finite import agree, leaf_flags
from jaxamp._utils.jax_compat import aval_of
from jaxamp._utils.tree import like, zeros_of
from jaxamp.skip._guard import cond_traced_once


class Window(NamedTuple):
    """An accumulation window's last call: the sum so far and the incoming gradients.

    ``every_k``'s guarded step reads the window's mean through ``Part.prepare``
    (``mean(Window)``), so the mean is never materialised as a tree of its own.
    """

    acc: Any
    grads: Any


#: ``window_step(grads, state, prepare, loss) -> (out, state)``: one guarded step.
WindowStep = Callable[..., tuple[Any, Any]]


def _add(a: Any, g: Any) -> Any:
    return a + g.astype(a.dtype) if is_inexact(a) else a


def _fresh_zeros(acc: Any, count: jax.Array) -> Any:
    """Zeros for each leaf of ``acc``, each computed apart: the reset of a window's sum.

    By replacement: ``acc * 0`` would keep an overflowed micro-batch's NaN. And not
    ``zeros_like``: XLA merges equal broadcasts, so leaves of one shape would share one
    zero buffer, which the cond then copies into each of its outputs (a read and a
    write per leaf, where a broadcast is a write). Each leaf's zero is
    ``(count + i) * 0`` instead, ``count`` the window's positive run-time size and
    ``i`` the leaf's index: a float the compiler cannot fold (``x * 0`` is NaN for
    an infinite ``x``), exactly +0.0 for every finite ``count + i``, and a different
    expression for every leaf.
    """
    count = count.astype(jnp.float32)
    leaves, treedef = jax.tree.flatten(acc)
    zeros = [
        like(jnp.full(a.shape, ((count + i) * 0.0).astype(a.dtype), a.dtype), aval_of(a))
        if is_inexact(a)
        else jnp.zeros_like(a)
        for i, a in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, zeros)


def _agreed(acc: Any, axis_name: Any) -> Any:
    """The window's sum, non-finite on every device in each leaf non-finite on one.

    Mid-window, whether the window is still finite is read off the sum itself
    (``stepped``, and through it every model-state write), and each device holds
    only its own: so each leaf that overflowed on some device gets one element of
    every device's copy poisoned (a scalar write in place; the window ends skipped
    anyway), and the per-leaf record at the window's end names the leaves that
    overflowed, as it does with ``every_k=1``.
    """
    leaves, treedef = jax.tree.flatten(acc)
    flags, owners = leaf_flags(leaves, None)
    if not owners:
        return acc
    ok = agree(flags, axis_name)
    for k, i in enumerate(owners):
        x = leaves[i]
        if x.size:
            first = (0,) * x.ndim
            leaves[i] = x.at[first].set(jnp.where(ok[k], x[first], jnp.nan))
    return jax.tree.unflatten(treedef, leaves)


def accumulate(
    every_k: int,
    grads: Any,
    state: Any,
    params: Any,
    window_step: WindowStep,
    to_params: bool,
    loss: Any,
    axis_name: Any = None,
) -> tuple[Any, Any]:
    """One call of a window: add ``grads`` to ``state.acc``, or end the window with one
    guarded step on its mean (``window_step``). ``loss`` is None without a spike rule;
    ``axis_name``: the mapped axis the tx agrees over."""

    def finish(grads: Any, state: Any) -> tuple[Any, Any]:
        # The window's mean over the micro-batches it holds: k, or more when a
        # window saved under a larger every_k is restored here (it ends now, as
        # one step of the right size, never k-times too large).
        count = state.mini_step + 1

        def mean(window: Window) -> Any:
            return jax.tree.map(
                lambda a, g: (
                    (_add(a, g) / count.astype(a.dtype)).astype(a.dtype) if is_inexact(a) else g
                ),
                window.acc,
                window.grads,
            )

        # One guarded step on the mean, computed where it is read.
        window_loss = None
        if loss is not None:
            window_loss = (state.spikes.pending + loss) / count.astype(jnp.float32)
            state = state._replace(spikes=state.spikes._replace(pending=jnp.zeros_like(loss)))
        out, state = window_step(Window(state.acc, grads), state, mean, window_loss)
        zeros = _fresh_zeros(state.acc, count)
        # The counter's 0 likewise (a constant would be copied into the output), in
        # its type: per-device (varying) under shard_map, as `count` is.
        restart = (count.astype(jnp.float32) * 0.0).astype(state.mini_step.dtype)
        return out, state._replace(acc=zeros, mini_step=restart)

    def add(shapes: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        out = params if to_params else zeros_of(shapes[0])
        acc = jax.tree.map(_add, state.acc, grads)
        if axis_name is not None:
            acc = _agreed(acc, axis_name)
        state = state._replace(acc=acc, mini_step=state.mini_step + 1)
        if loss is not None:
            state = state._replace(
                spikes=state.spikes._replace(pending=state.spikes.pending + loss)
            )
        return like((out, state), shapes)

    return cond_traced_once(state.mini_step >= every_k - 1, finish, add, grads, state)
