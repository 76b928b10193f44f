"""``jaxamp.explain``: why steps were skipped, in words, from the optimizer state alone.

Host side, like :func:`jaxamp.check_health`: it reads the small per-leaf record
(:class:`jaxamp.NonfiniteLeaves`) and the spike counters the guarded step keeps on
the device, and names leaves by their key paths in ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxamp import _metrics as ls_lib
from jaxamp._leaf_stats import NonfiniteLeaves
from jaxamp._multi_transform import MultiTransformState
from jaxamp._spikes import SpikeState
from jaxamp._transform import SkipNonfiniteState
from jaxamp._tree import render_path

__all__ = ["Explanation", "explain"]

_STATES = (SkipNonfiniteState, MultiTransformState)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`jaxamp.explain` found; ``str()`` of it says it in words.

    Attributes:
      skipped_steps: steps skipped so far because their gradients held inf or NaN.
      loss_scale: the loss scale now.
      last: key paths of the gradient leaves that held inf or NaN on the last
        such step (empty before the first).
      counts: key path -> on how many skipped steps that leaf held inf or NaN,
        only leaves that ever did, most frequent first.
      n_leaves: how many gradient leaves are tracked.
      spike_skips: steps skipped as spikes (``None`` without a spike rule).
      last_was_spike: whether the last step was skipped as a spike (``None``
        without a spike rule).
    """

    skipped_steps: int
    loss_scale: float
    last: tuple[str, ...]
    counts: dict[str, int]
    n_leaves: int
    spike_skips: int | None = None
    last_was_spike: bool | None = None

    def __str__(self) -> str:
        lines = []
        # A state that does not scale (bfloat16's check-only) has a scale of 1: not news.
        scale = f"loss scale {self.loss_scale:g}" if self.loss_scale != 1 else ""
        if self.skipped_steps == 0:
            lines.append(
                "No step has been skipped for non-finite gradients"
                + (f" ({scale})." if scale else ".")
            )
        else:
            lines.append(
                f"{self.skipped_steps} step(s) skipped because their gradients held inf or NaN"
                + (f"; the {scale.replace('loss scale', 'loss scale is now')}." if scale else ".")
            )
            if self.last:
                lines.append(
                    f"On the last one, {len(self.last)} of {self.n_leaves} gradient leaves held "
                    "inf or NaN: " + ", ".join(self.last) + "."
                )
            else:
                lines.append(
                    "On the last one no gradient leaf held inf or NaN: the step was skipped by "
                    "a finite= verdict (e.g. a non-finite loss or a check of your own)."
                )
            often = [f"{path} ({n}x)" for path, n in self.counts.items()]
            if often:
                lines.append("Non-finite so far, most often first: " + ", ".join(often) + ".")
        if self.spike_skips is not None:
            last = "was" if self.last_was_spike else "was not"
            lines.append(
                f"{self.spike_skips} step(s) skipped as loss or gradient-norm spikes; the last "
                f"step {last} one."
            )
        return "\n".join(lines)


def _find(opt_state: Any) -> Any:
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _STATES))
        if isinstance(x, _STATES)
    ]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ValueError(
            f"jaxamp.explain: found {what} jaxamp.skip_nonfinite / jaxamp.multi_transform "
            "state(s) in `opt_state`; pass the state of the one optimizer that skips steps."
        )
    return found[0]


def _unpack(opt_state: Any, params: Any) -> tuple[Any, Any]:
    """``(opt_state, params)`` from a TrainState, an nnx Optimizer + model, or as given."""
    from jaxamp import nnx as jnnx  # the nnx glue imports flax.nnx: only when asked

    if isinstance(opt_state, jnnx.Optimizer):
        if params is None:
            raise TypeError(
                "jaxamp.explain(optimizer, model): pass the model the nnx optimizer updates."
            )
        from flax import nnx

        return jnnx._pure(opt_state.opt_state), jnnx._pure(nnx.state(params, opt_state.wrt))
    if params is None and hasattr(opt_state, "opt_state") and hasattr(opt_state, "params"):
        return opt_state.opt_state, opt_state.params  # a (jaxamp or Flax) TrainState
    if params is None:
        raise TypeError(
            "jaxamp.explain: pass the params the optimizer updates "
            "(explain(opt_state, params)), or a TrainState alone."
        )
    return opt_state, params


def explain(opt_state: Any, params: Any = None) -> Explanation:
    """Which gradient leaves overflowed on the last skipped step, and how often each has.

    Reads what :func:`jaxamp.skip_nonfinite` / :func:`jaxamp.multi_transform`
    keep in their state at no cost to a finite step. Host side: call it where
    you log (it reads a few small arrays from the device), not inside ``jit``.

    Args:
      opt_state: an optimizer state containing one ``skip_nonfinite`` or
        ``multi_transform`` state (any nesting), a ``TrainState`` (then leave out
        ``params``), or a :class:`jaxamp.nnx.Optimizer` (then pass the model).
      params: the params the optimizer updates (names the leaves by key path);
        for an nnx optimizer, the model.

    Returns:
      An :class:`Explanation`; ``print`` it for the sentence.

    Raises:
      ValueError: no such state, or ``params`` with another number of leaves
        than the optimizer was built for.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}}
      >>> grads = {"dense": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.ones(1)}}
      >>> params, state = jaxamp.step(tx, grads, tx.init(params), params)
      >>> print(jaxamp.explain(state, params))
      1 step(s) skipped because their gradients held inf or NaN; the loss scale is now 16384.
      On the last one, 1 of 2 gradient leaves held inf or NaN: dense.kernel.
      Non-finite so far, most often first: dense.kernel (1x).
    """
    opt_state, params = _unpack(opt_state, params)
    state = _find(opt_state)
    leaves: NonfiniteLeaves | None = state.nonfinite_leaves
    if leaves is None:
        raise ValueError(
            "jaxamp.explain: this optimizer state keeps no per-leaf record (it was built by "
            "hand, not by tx.init(params))."
        )
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(leaves)):
        raise TypeError(
            "jaxamp.explain reads the optimizer state on the host: call it outside jax.jit "
            "(where you log), on the state the jitted step returned."
        )
    ls = ls_lib.get_loss_scale(opt_state)
    spikes: SpikeState | None = state.spikes
    host = jax.device_get(
        (leaves.signed_counts, ls.skipped_steps, ls.scale)
        + (() if spikes is None else (spikes.skips, spikes.skipped))
    )
    signed = np.asarray(host[0])
    last, count = signed < 0, np.abs(signed)
    # Replicated states (pmap) carry leading device axes: any / max over them.
    last = last.reshape(-1, last.shape[-1]).any(axis=0)
    count = count.reshape(-1, count.shape[-1]).max(axis=0)
    paths = [render_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if len(paths) != last.shape[0]:
        raise ValueError(
            f"jaxamp.explain: `params` has {len(paths)} leaves but the optimizer state tracks "
            f"{last.shape[0]}: pass the params this optimizer was initialised with."
        )
    order = sorted((i for i in range(len(paths)) if count[i] > 0), key=lambda i: -count[i])
    return Explanation(
        skipped_steps=int(np.max(host[1])),
        loss_scale=float(np.min(host[2])),
        last=tuple(paths[i] for i in range(len(paths)) if last[i]),
        counts={paths[i]: int(count[i]) for i in order},
        n_leaves=len(paths),
        spike_skips=None if spikes is None else int(np.max(host[3])),
        last_was_spike=None if spikes is None else bool(np.any(host[4])),
    )
