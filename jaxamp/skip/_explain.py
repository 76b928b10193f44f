"""``jaxamp.explain``: why steps were skipped, in words, from the optimizer state alone.

Host side, like [`jaxamp.check_health`][jaxamp.check_health]: it reads the small per-leaf record
([`jaxamp.types.NonfiniteLeaves`][jaxamp.types.NonfiniteLeaves]) and the spike counters the guarded
step keeps
on the device, and names leaves by their key paths in ``params``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.errors import named
from jaxamp._utils.optional import OVERWRITE_WITH_GRADIENT, loaded
from jaxamp._utils.tree import find_one, holds_tracer, is_array, is_float_array
from jaxamp.loss_scale import LossScaleState, get_loss_scale
from jaxamp.skip import _record
from jaxamp.skip._multi_transform import MultiTransformState
from jaxamp.skip._record import NonfiniteLeaves
from jaxamp.skip._skip_nonfinite import SkipNonfiniteState
from jaxamp.skip._spikes import SpikeState

__all__ = ["Explanation", "explain"]

_STATES = (SkipNonfiniteState, MultiTransformState)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Explanation:
    """What [`jaxamp.explain`][jaxamp.explain] found; ``str()`` of it says it in words.

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
    found = find_one(
        opt_state,
        _STATES,
        what="jaxamp.skip_nonfinite / jaxamp.multi_transform states",
        hint="pass the state of the one optimizer that skips steps.",
    )
    if found is None:
        raise ValueError(
            "found no jaxamp.skip_nonfinite / jaxamp.multi_transform state in `opt_state`; "
            "pass the state of the one optimizer that skips steps."
        )
    return found


def _unpack(opt_state: Any, params: Any) -> tuple[Any, Any]:
    """``(opt_state, params)`` from a TrainState, an nnx Optimizer + model, or as given.

    ``params`` is what the optimizer was initialised with: the ``params`` collection
    of Flax's fp8 layout, never its ``_overwrite_with_gradient`` metadata, which no
    optimizer sees (as in Flax's ``TrainState.create``).
    """
    nnx = loaded("flax.nnx")
    if nnx is not None and isinstance(opt_state, nnx.Optimizer):
        from jaxamp.skip._nnx_state import pure

        if params is None:
            raise TypeError(
                "jaxamp.explain(optimizer, model): pass the model the nnx optimizer updates."
            )
        graph = getattr(opt_state, "graph", None)
        kwargs = {} if graph is None else {"graph": graph}
        opt_state, params = pure(opt_state.opt_state), nnx.state(params, opt_state.wrt, **kwargs)
    elif params is None and hasattr(opt_state, "opt_state") and hasattr(opt_state, "params"):
        opt_state, params = opt_state.opt_state, opt_state.params  # a (jaxamp or Flax) TrainState
    elif params is None:
        raise TypeError(
            "jaxamp.explain: pass the params the optimizer updates "
            "(explain(opt_state, params)), or a TrainState alone."
        )
    if isinstance(params, Mapping) and OVERWRITE_WITH_GRADIENT in params:
        params = params["params"]
    return opt_state, params


def _equinox_params(tree: Any) -> list[Any]:
    """What an equinox user gives ``tx.init`` of a whole model ``tree``:
    ``eqx.filter(model, eqx.is_array)``, or ``eqx.is_inexact_array`` (an integer array
    has no gradient); other leaves (activation functions, flags, names, Python numbers)
    are fields, not params."""
    return [
        jax.tree.map(lambda x, keep=keep: x if keep(x) else None, tree)
        for keep in (is_array, is_float_array)
    ]


def _check_layout(record: NonfiniteLeaves, lead: tuple[int, ...], params: Any) -> list[str]:
    """The key paths of ``params``' leaves, if they are the leaves the record tracks.

    ``lead``: the record's leading device axes (a pmap-replicated state), which
    replicated params may carry too.
    """
    got = _record.leaf_layout(params)
    n = record.signed_counts.shape[-1]
    for filtered in _equinox_params(params) if len(got) != n else []:
        if len(_record.leaf_layout(filtered)) == n:  # an equinox model passed whole
            got = _record.leaf_layout(filtered)
            break
    if len(got) != n:
        raise ValueError(
            f"jaxamp.explain: `params` has {len(got)} leaves but the optimizer state tracks "
            f"{n}: pass the params this optimizer was initialised with."
        )
    if record.layout is not None:  # None: a record built by hand, only its length to check
        wrong = [
            (i, path, shape, want)
            for i, ((path, shape), want) in enumerate(zip(got, record.layout.entries, strict=True))
            if (path, shape) != want and (path, shape) != (want[0], lead + want[1])
        ]
        if wrong:
            i, path, shape, (want_path, want_shape) = wrong[0]
            more = f" ({len(wrong) - 1} more leaves differ)" if len(wrong) > 1 else ""
            raise ValueError(
                f"jaxamp.explain: `params` is not the tree this optimizer state was "
                f"initialised with: its leaf {i} is `{path}` of shape {shape}, where tx.init "
                f"saw `{want_path}` of shape {want_shape}{more}. Pass the params the optimizer "
                "updates (or the TrainState alone, or the nnx optimizer and its model)."
            )
    return [path for path, _ in got]


@renamed_parameter("opt_state", "state", removed_in="0.5")
def explain(state: Any, /, params: Any = None) -> Explanation:
    """Which gradient leaves overflowed on the last skipped step, and how often each has.

    Reads what [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] /
    [`jaxamp.multi_transform`][jaxamp.multi_transform] keep in their state at no cost to a finite
    step. Host side: call it where you log (it reads a few small arrays from the device), not inside
    ``jit``.

    Args:
      state: an optimizer state containing one ``skip_nonfinite`` or
        ``multi_transform`` state (any nesting), a ``TrainState`` (then leave out
        ``params``), or a [`jaxamp.nnx.Optimizer`][jaxamp.nnx.Optimizer] (then pass the model);
        positional-only.
      params: the params the optimizer updates (names the leaves by key path);
        for an nnx optimizer, the model.

    Returns:
      An [`Explanation`][jaxamp.types.Explanation]; ``print`` it for the sentence.

    Raises:
      TypeError: ``state`` is a bare ``LossScaleState`` (it keeps no record).
      ValueError: no such state, or ``params`` other than the optimizer was
        initialised with (another number of leaves, or other key paths or shapes),
        naming the first leaf that differs.

    Examples:
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
    opt_state = state
    if isinstance(opt_state, LossScaleState):
        raise TypeError(
            "jaxamp.explain: the state is a LossScaleState, which holds the scale and its "
            "counters only; the per-leaf record is in the optimizer state. Pass the state of "
            "the jaxamp.skip_nonfinite / jaxamp.multi_transform optimizer (what tx.init and "
            "the step return), a TrainState, or the nnx optimizer and its model."
        )
    opt_state, params = _unpack(opt_state, params)
    with named("explain"):
        state = _find(opt_state)
    leaves: NonfiniteLeaves | None = state.nonfinite_leaves
    if leaves is None:
        raise ValueError(
            "jaxamp.explain: this optimizer state keeps no per-leaf record (it was built by "
            "hand, not by tx.init(params))."
        )
    if holds_tracer(leaves):
        raise TypeError(
            "jaxamp.explain reads the optimizer state on the host: call it outside jax.jit "
            "(where you log), on the state the jitted step returned."
        )
    ls = get_loss_scale(opt_state)
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
    paths = _check_layout(leaves, signed.shape[:-1], params)
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
