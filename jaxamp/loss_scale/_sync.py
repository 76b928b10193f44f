"""A cheap host-side check that every device of every process holds the same loss-scale state."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.errors import named
from jaxamp._utils.tree import render_path
from jaxamp.loss_scale._lookup import get_loss_scale

_WIDTH = 8  # bytes kept per leaf: enough for any scalar dtype up to 64 bits
_STATIC = "static configuration"


def _local_values(leaf: Any) -> np.ndarray:
    """Every element this process holds of ``leaf``: each addressable shard's copy."""
    if isinstance(leaf, jax.Array):
        parts = [np.asarray(s.data).reshape(-1) for s in leaf.addressable_shards]
        return np.concatenate(parts)
    return np.asarray(leaf).reshape(-1)


def _bits(values: np.ndarray) -> np.ndarray:
    """(n, _WIDTH) uint8: each value's bytes, zero-padded (exact, NaN-safe comparison)."""
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(values.size, values.itemsize)
    out = np.zeros((values.size, _WIDTH), np.uint8)
    out[:, : min(values.itemsize, _WIDTH)] = raw[:, :_WIDTH]
    return out


def _show(row: np.ndarray, dtype: np.dtype | None) -> str:
    if dtype is None:  # the static part: a digest, not a value
        return f"digest {row.tobytes().hex()}"
    return str(np.frombuffer(row[: dtype.itemsize].tobytes(), dtype)[0].item())


@renamed_parameter("opt_state_or_loss_scale_state", "state", removed_in="0.5")
def check_in_sync(state: Any, /) -> None:
    """Raises if the loss-scale state differs between devices or between processes.

    The skip decision and the loss scale must be the same everywhere, or the
    replicas drift apart. They stay so by construction under ``jit`` over a
    mesh and under ``shard_map`` / ``pmap`` with ``axis_name``; this check
    catches what breaks it from outside: processes that restored different
    checkpoints or built differently configured optimizers, or per-device code
    run without ``axis_name``.

    Host side and collective: call it in *every* process at the same point
    (after a restore, where you log), outside a jitted step. It reads each
    loss-scale leaf's local copies (a few scalars) and, with several processes,
    all-gathers 8 bytes per leaf plus a digest of the static configuration with
    ``jax.experimental.multihost_utils.process_allgather``; every process then
    raises the same error, so none is left waiting.

    Args:
      state: a [`LossScaleState`][jaxamp.LossScaleState] or an optax state
        containing one (or what holds that: a ``TrainState``, an nnx optimizer); replicated, or
        stacked along a leading device axis (pmap).

    Raises:
      RuntimeError: naming the fields that differ and each process's value.
      ValueError: if the state holds no loss-scale state, or several.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> jaxamp.check_in_sync(tx.init({"w": jnp.ones(2)}))  # one process, one device: quiet
    """
    with named("check_in_sync"):
        state = get_loss_scale(state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [render_path(path) for path, _ in flat]
    dtypes: list[np.dtype | None] = []
    firsts, others = [], []  # per leaf: this process's first copy, and one that differs
    for _, leaf in flat:
        bits = _bits(_local_values(leaf))
        differs = (bits != bits[0]).any(axis=1)
        dtypes.append(np.dtype(leaf.dtype))
        firsts.append(bits[0])
        others.append(bits[int(np.argmax(differs))])
    # The static part (the mode) is not an array: compare a digest of the tree structure.
    names.append(_STATIC)
    dtypes.append(None)
    digest = np.frombuffer(hashlib.sha256(repr(treedef).encode()).digest()[:_WIDTH], np.uint8)
    firsts.append(digest)
    others.append(digest)
    table = np.stack([np.stack(firsts), np.stack(others)])  # (2, n_fields, _WIDTH)

    n = jax.process_count()
    if n > 1:
        from jax.experimental import multihost_utils

        tables = np.asarray(multihost_utils.process_allgather(table))  # (n, 2, fields, W)
    else:
        tables = table[None]

    problems = []
    for i, (name, dtype) in enumerate(zip(names, dtypes, strict=True)):
        first, other = tables[:, 0, i], tables[:, 1, i]
        within = [
            f"process {p} holds {_show(first[p], dtype)} and {_show(other[p], dtype)}"
            for p in range(n)
            if (first[p] != other[p]).any()
        ]
        if within:
            problems.append(
                f"`{name}` differs between the copies of one process ({'; '.join(within)})"
            )
        if (first != first[0]).any():
            shown = ", ".join(f"process {p}: {_show(first[p], dtype)}" for p in range(n))
            problems.append(f"`{name}` differs between processes ({shown})")
    if problems:
        raise RuntimeError(
            "the loss-scale state is not the same on every device: "
            + "; ".join(problems)
            + ". Every process must build the same optimizer and restore the same "
            "checkpoint (one orbax CheckpointManager over the global arrays, called from "
            "every process); under shard_map / pmap, pass axis_name= to "
            "jaxamp.skip_nonfinite so that every device makes the same skip decision."
        )
