"""What a restore hands back, checked on the host: every loss-scale state, spike
history and per-leaf record in the restored tree, as the constructors check them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.tree import INT32_MAX, render_path
from jaxamp._utils.variables import held_value
from jaxamp.loss_scale import LossScaleState, Mode
from jaxamp.skip import NonfiniteLeaves, SpikeState

# The array fields of a loss-scale state (all but the static mode).
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LossScaleState) if f.name != "mode")


def _validate_loss_scale(state: LossScaleState, where: str) -> None:
    """Checks a state built outside the constructors in full, as ``replace`` checks
    every field it is given (-1 in ``max_consecutive_nonfinite`` is None, as stored)."""
    values = {name: getattr(state, name) for name in _FIELD_NAMES}
    if int(values["max_consecutive_nonfinite"]) == -1:
        values["max_consecutive_nonfinite"] = None
    try:
        state.replace(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} holds an invalid loss-scale state: {e}") from None


def _validate_record(stats: NonfiniteLeaves, where: str) -> None:
    """Checks a restored record on the host: an int32 vector, one entry per leaf.

    Leading device axes (a pmap-replicated state) are allowed.
    """
    counts = np.asarray(jax.device_get(stats.signed_counts))
    problems = []
    if counts.ndim < 1:
        problems.append(f"signed_counts must be a vector (one entry per leaf), got {counts.shape}")
    if counts.dtype != np.int32:
        problems.append(f"signed_counts must be int32, got {counts.dtype}")
    elif counts.size and int(counts.min()) < -INT32_MAX:
        problems.append(f"signed_counts must be >= -(2**31 - 1), got {int(counts.min())}")
    if stats.layout is not None and counts.ndim >= 1 and counts.shape[-1] != len(stats.layout):
        problems.append(
            f"signed_counts has {counts.shape[-1]} entries but the params have "
            f"{len(stats.layout)} leaves"
        )
    if problems:
        raise ValueError(
            f"{where} holds an invalid per-leaf non-finite record: " + "; ".join(problems) + "."
        )


def _validate_spikes(state: SpikeState, where: str) -> None:
    """Checks a restored spike state on the host: counters in range, recorded values finite."""
    host = jax.device_get(state)
    window = int(jnp.shape(host.losses)[-1])
    count, skips = int(jnp.max(host.count)), int(jnp.min(host.skips))
    problems = []
    if jnp.shape(host.grad_norms) != jnp.shape(host.losses):
        problems.append("losses and grad_norms differ in shape")
    if not 0 <= int(jnp.min(host.count)) <= count < 2 * window:
        problems.append(f"count must be in [0, {2 * window}), got {count}")
    if skips < 0:
        problems.append(f"skips must be >= 0, got {skips}")
    filled = min(count, window)
    for name in ("losses", "grad_norms"):
        ring = jnp.asarray(getattr(host, name))[..., :filled]
        if not bool(jnp.all(jnp.isfinite(ring))):
            problems.append(f"{name} holds a non-finite recorded value")
    if problems:
        raise ValueError(f"{where} holds an invalid spike state: " + "; ".join(problems) + ".")


def _host_view(x: Any) -> Any:
    """A leaf as this process can read it: a replicated or local part, never a gather."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


def _is_loss_scale(node: Any) -> bool:
    """A LossScaleState, or one flattened into a mapping of its fields (``nnx.state``)."""
    if isinstance(node, LossScaleState):
        return True
    return isinstance(node, Mapping) and all(f in node for f in _FIELD_NAMES)


def _from_fields(node: Mapping[str, Any]) -> LossScaleState:
    # nnx keeps the static mode in the graph, not in the state: the field ranges
    # are checked under the scaling mode that has no mode-specific rule.
    values = {f: held_value(node[f]) for f in _FIELD_NAMES}
    return LossScaleState(**values, mode=Mode.STATIC)


def _is_record(node: Any) -> bool:
    """A per-leaf record, or one flattened into a mapping of its field (``nnx.state``)."""
    if isinstance(node, NonfiniteLeaves):
        return True
    # Its one leaf: the layout is static (tree structure), so nnx's mapping lacks it.
    return isinstance(node, Mapping) and set(node) == {"signed_counts"}


def validate_restored(tree: Any, where: str) -> None:
    """Checks every loss-scale state, spike state and per-leaf record in a restored tree."""
    found = [
        (path, leaf if isinstance(leaf, LossScaleState) else _from_fields(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_loss_scale)[0]
        if _is_loss_scale(leaf)
    ]
    for path, node in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, SpikeState) or _is_record(x)
    )[0]:
        if isinstance(node, SpikeState):
            _validate_spikes(jax.tree.map(_host_view, node), f"{where} at `{render_path(path)}`")
        elif _is_record(node):
            counts = held_value(node[0] if isinstance(node, tuple) else node["signed_counts"])
            layout = node.layout if isinstance(node, NonfiniteLeaves) else None
            record = NonfiniteLeaves(_host_view(counts), layout)
            _validate_record(record, f"{where} at `{render_path(path)}`")
    if not found:
        return
    # One transfer, of the loss-scale scalars only.
    host = jax.device_get([jax.tree.map(_host_view, state) for _, state in found])
    for (path, state), values in zip(found, host, strict=True):
        label = f"{where} at `{render_path(path)}`"
        shapes = {np.shape(x) for x in jax.tree.leaves(values)}
        # A replicated state (a leading device axis, as with pmap) is checked per replica.
        lead = shapes.pop() if len(shapes) == 1 else ()
        for index in np.ndindex(*lead):
            replica = jax.tree.map(lambda x, i=index: np.asarray(x)[i], values)
            at = f"{label} (replica {index})" if lead else label
            try:
                _validate_loss_scale(replica, at)
            except ValueError as e:
                raise ValueError(
                    f"{e} A restore takes every number from the checkpoint and only the mode "
                    f"from the target (here {state.mode.value!r})."
                ) from None
