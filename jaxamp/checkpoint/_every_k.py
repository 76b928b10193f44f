"""Restoring into an optimizer built with another ``every_k``: an error that names it.

With ``every_k > 1`` a ``skip_nonfinite`` state holds the window being accumulated
(``acc``, ``mini_step``); with 1 it holds none. orbax sees only a tree that does not
match (and suggests a partial restore, which would drop a window in progress), so
[`jaxamp.checkpoint.restore`][jaxamp.checkpoint.restore] says what differs and what to do.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxamp._utils.tree import path_key


def _windows(tree: Any) -> int:
    """How many ``every_k`` window counters (``mini_step`` holding an array) a tree has:
    a target (any pytree: ``SkipNonfiniteState``, a ``TrainState``, an nnx state) or
    orbax's metadata of a saved one (nested mappings, sequences and named tuples)."""
    found = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [path_key(e) for e in path]
        if "mini_step" in keys:
            found.add(tuple(keys[: keys.index("mini_step")]))
    return len(found)


def explain(saved_tree: Any, target: Any, where: str) -> None:
    """Raises naming ``every_k`` when the checkpoint and the target disagree on whether the
    optimizer accumulates a window (``every_k > 1`` keeps one in its state, 1 does not)."""
    saved, wanted = _windows(saved_tree), _windows(target)
    if saved == wanted:
        return
    if saved > wanted:
        what = "with every_k > 1 (its state holds a gradient window)"
        into = "a target built with every_k=1"
    else:
        what = "with every_k=1 (its state holds no gradient window)"
        into = "a target built with every_k > 1"
    raise ValueError(
        f"{where} was saved by an optimizer {what}, restored into {into}. Build the "
        "optimizer with the every_k the run was saved with to resume it. To change every_k, "
        "restore with the saved one, then carry its inner optimizer state and loss-scale "
        "state into a fresh state built with the new every_k: "
        "tx.init(params)._replace(inner_state=old.inner_state, loss_scale=old.loss_scale) "
        "(a window in progress is dropped)."
    )
