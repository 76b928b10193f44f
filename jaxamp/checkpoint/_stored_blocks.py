"""Restoring 8-bit moments into an optimizer built with another ``block_size``: an error
that names it.

A checkpoint of [`jaxamp.low_precision_state`][jaxamp.low_precision_state]'s 8-bit moments
holds their codes and one scale per block; the block size is the optimizer's configuration,
not saved (the decode needs it, the arrays do not hold it). Restored into another block
size, the scales' shape differs and orbax refuses it with a padding error;
[`jaxamp.checkpoint.restore`][jaxamp.checkpoint.restore] says which moment, which block sizes
the checkpoint's scales fit, and how to move the state to the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxamp._utils.tree import render_path
from jaxamp.low_precision_state import Quantized8, is_stored


def _saved_with(n: int, k: int) -> str:
    """The block size (a power of two) that cuts a last axis of ``n`` into ``k`` blocks."""
    if k <= 1:
        return f"a block_size of {n} or more"
    fits = [1 << e for e in range(n.bit_length()) if -(-n // (1 << e)) == k]
    return f"block_size={fits[0]}" if fits else "no power-of-two block_size (not this shape)"


def explain(saved_tree: Any, target: Any, child: Callable[[Any, Any], Any], where: str) -> None:
    """Raises naming ``block_size`` when a saved 8-bit moment's scales have another shape than
    the target's (the optimizer that saved it cut its last axis into other blocks)."""
    for path, node in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_stored)[0]:
        if not isinstance(node, Quantized8):
            continue
        saved = saved_tree
        for entry in (*path, jax.tree_util.GetAttrKey("scales")):
            saved = child(saved, entry)
        shape = getattr(saved, "shape", None)
        if shape is None or tuple(shape) == tuple(node.scales.shape):
            continue
        n = node.codes.shape[-1]
        raise ValueError(
            f"{where} holds the 8-bit moment {render_path(path)} (last axis {n}) in "
            f"{tuple(shape)[-1]} blocks, where the target's block_size={node.block_size} "
            f"makes {node.scales.shape[-1]}: it was saved by jaxamp.low_precision_state with "
            f"{_saved_with(n, tuple(shape)[-1])}. A checkpoint does "
            "not record the block size: restore into a target built with the block_size the "
            "run was saved with, then move the state to the new one with "
            "jaxamp.convert_state(state, new_tx, params)."
        )
