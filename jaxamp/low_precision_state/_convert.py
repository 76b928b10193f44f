"""``convert_state``: an optimizer state moved into the form another ``tx`` keeps it in.

Both states are read as the wrapped optimizers see them: each stored moment as its
values and each ``LowPrecisionState`` as the state it wraps. Those two views must be the
same tree (leaf shapes included); the result is ``tx.init(params)``'s structure, built
abstractly, holding the source's values, each moment stored in the target's form.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp._utils.tree import render_path
from jaxamp.low_precision_state._stored import Quantized8, Rounded16, is_stored
from jaxamp.low_precision_state._transformation import LowPrecisionState

__all__ = ["convert_state"]

#: The key each conversion rounds from: converting the same state twice gives the same
#: bits.
_SEED = 0

_HOW = (
    "Pass the optimizer the state was built with, with jaxamp.low_precision_state added "
    "around or removed from the optimizer itself (the same optax transformations, wrappers "
    "and params otherwise); a checkpoint is restored into the structure of the optimizer "
    "that saved it (its tx.init(params)), then converted."
)


def _is_node(x: Any) -> bool:
    return isinstance(x, LowPrecisionState) or is_stored(x)


def _unwrap(tree: Any, counts: dict[str, Any], prefix: tuple[Any, ...] = ()) -> Any:
    """``tree`` with each ``LowPrecisionState`` replaced by the state it wraps; its count
    goes into ``counts`` under the path the wrapped state takes."""
    items, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)
    out = []
    for path, x in items:
        if isinstance(x, LowPrecisionState):
            counts[render_path(prefix + path)] = x.count
            x = _unwrap(x.inner_state, counts, prefix + path)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _wrap(
    target: Any, leaves: Iterator[Any], counts: dict[str, Any], prefix: tuple[Any, ...] = ()
) -> Any:
    """``target``'s structure, its leaves taken from ``leaves`` in ``_unwrap``'s order,
    each ``LowPrecisionState`` counting on from the source's at its place (else 0)."""
    items, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_node)
    out = []
    for path, x in items:
        if isinstance(x, LowPrecisionState):
            count = counts.get(render_path(prefix + path), 0)
            inner = _wrap(x.inner_state, leaves, counts, prefix + path)
            out.append(LowPrecisionState(jnp.asarray(count, x.count.dtype), inner))
        else:
            out.append(next(leaves))
    return jax.tree.unflatten(treedef, out)


def _shape(x: Any) -> tuple[int, ...]:
    if isinstance(x, Quantized8):
        return tuple(x.codes.shape)
    if isinstance(x, Rounded16):
        return tuple(x.values.shape)
    return tuple(jnp.shape(x))


_LEAF = jax.tree.structure(0)


def _is_leaf(x: Any) -> bool:
    """A stored moment (read as its values) or an array."""
    return is_stored(x) or jax.tree.structure(x) == _LEAF


def _children(x: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``x``'s children with their keys, and its one-level structure."""
    return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)


def _describe(x: Any) -> str:
    if _is_leaf(x):
        return f"a leaf of shape {_shape(x)}"
    return f"a {type(x).__name__} {_children(x)[1]}"


def _difference(a: Any, b: Any, path: tuple[Any, ...] = ()) -> str | None:
    """Where the trees ``a`` (the source) and ``b`` (the target) first differ, stored
    moments read as leaves of their shape, or None."""
    if _is_leaf(a) and _is_leaf(b) and _shape(a) == _shape(b):
        return None
    a_items, a_def = _children(a)
    b_items, b_def = _children(b)
    if _is_leaf(a) or _is_leaf(b) or a_def != b_def:
        where = render_path(path)
        return f"at {where}, `opt_state` has {_describe(a)} and tx.init(params) {_describe(b)}"
    for (key, x), (_, y) in zip(a_items, b_items, strict=True):
        found = _difference(x, y, (*path, *key))
        if found is not None:
            return found
    return None


def _kept(source: Any, target: Any) -> bool:
    """Whether ``_convert_leaf`` returns `source` itself."""
    if is_stored(target):
        return is_stored(source) and jax.tree.structure(source) == jax.tree.structure(target)
    return not is_stored(source) and getattr(source, "dtype", None) == target.dtype


def _convert_leaf(source: Any, target: Any, key: jax.Array) -> Any:
    """``source`` (a stored moment or an array) in ``target``'s form and dtype."""
    if _kept(source, target):
        return source  # in the target's form already: kept bit for bit
    value = source.value() if is_stored(source) else jnp.asarray(source)
    if isinstance(target, Quantized8):
        return Quantized8.store(value, key, target.block_size, target.dtype)
    if isinstance(target, Rounded16):
        return Rounded16.store(value, key, target.dtype)
    return value.astype(target.dtype)


def convert_state(
    opt_state: Any, /, tx: optax.GradientTransformation | optax.MultiSteps, params: Any
) -> Any:
    """``opt_state``'s values in the state ``tx.init(params)`` would build.

    Moves an optimizer state between float32 moments and
    [`jaxamp.low_precision_state`][jaxamp.low_precision_state]'s bfloat16 or 8-bit
    ones, both ways, and between those (8 bits and bfloat16, another block size,
    another mapping per moment), wherever the wrapper sits: inside
    ``jaxamp.skip_nonfinite``, in an ``optax.chain``, around ``optax.MultiSteps``. The
    way to restore a checkpoint into another dtype: restore it with orbax into the
    structure of the optimizer that saved it, then convert.

    Each stored moment of ``opt_state`` is decoded to its values, and each
    ``LowPrecisionState`` read as the state it wraps; what is left must be the tree
    ``tx``'s wrapped optimizers build, leaf shapes included. Each moment ``tx`` stores
    is then stored in its form (rounded stochastically from a fixed key, so converting
    twice gives the same bits; a moment already stored in that form is kept bit for
    bit); every other leaf (step counts, the loss scale, hyperparameters, moments
    below ``min_size``) is carried over, cast to the dtype ``tx.init`` gives it. A
    ``LowPrecisionState``'s step count is the source's at the same place, or 0 where
    the source had none.

    Args:
      opt_state: the state to convert (concrete arrays).
      tx: the optimizer whose state to build.
      params: the params ``tx.init`` takes (arrays or ``jax.ShapeDtypeStruct``);
        only their shapes and dtypes are read.

    Returns:
      A state with ``tx.init(params)``'s structure, shapes and dtypes.

    Raises:
      TypeError: if ``tx`` is not an optax optimizer.
      ValueError: if the two states differ beyond the form of their moments, naming
        the first place where they do.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> params = {"w": jnp.ones((64, 256))}
      >>> plain = optax.adam(1e-3)
      >>> state = plain.init(params)  # e.g. restored from a float32 checkpoint
      >>> tx = jaxamp.low_precision_state(optax.adam(1e-3), "8bit")
      >>> small = jaxamp.convert_state(state, tx, params)
      >>> small.inner_state[0].mu["w"].codes.dtype
      dtype('uint8')
      >>> jaxamp.convert_state(small, plain, params)[0].mu["w"].dtype
      dtype('float32')
    """
    # Duck-typed, as low_precision_state takes it: optax.MultiSteps is an object with
    # init and update, not a GradientTransformation.
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(
            "convert_state: `tx` must be the optax optimizer whose state to build (an "
            f"optax.GradientTransformation), got {type(tx).__name__}."
        )
    target = jax.eval_shape(tx.init, params)
    counts: dict[str, Any] = {}
    source = _unwrap(opt_state, counts)
    target_values = _unwrap(target, {})
    sources, source_def = jax.tree.flatten(source, is_leaf=is_stored)
    targets, target_def = jax.tree.flatten(target_values, is_leaf=is_stored)
    found = None
    if source_def != target_def or any(
        _shape(s) != _shape(t) for s, t in zip(sources, targets, strict=True)
    ):
        found = _difference(source, target_values) or f"{source_def} against {target_def}"
    if found is not None:
        raise ValueError(
            "convert_state: `opt_state` is not a state of `tx` (read with each stored moment "
            f"as its values and each LowPrecisionState as the state it wraps): {found}. {_HOW}"
        )

    # One program per set of devices, not a dozen eager ops per leaf (each leaf's
    # rounding would dispatch, and compile on a restored state's shapes, its own). A
    # restored state can hold leaves committed to different devices (a scalar on one,
    # the moments on a mesh): one jit cannot take both. Leaves kept as they are stay
    # out of it, each with its own buffer and sharding.
    leaves = list(sources)
    groups: dict[Any, list[int]] = {}
    for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
        if not _kept(s, t):
            groups.setdefault(_devices(s), []).append(i)
    anywhere = groups.pop(None, [])
    if anywhere:  # uncommitted: they join any program
        first = next(iter(groups), None)
        groups[first] = groups.get(first, []) + anywhere
    for indices in groups.values():
        converted = jax.jit(functools.partial(_convert_leaves, targets=targets, indices=indices))(
            [sources[i] for i in indices]
        )
        for i, x in zip(indices, converted, strict=True):
            leaves[i] = x
    return _wrap(target, iter(leaves), counts)


def _devices(source: Any) -> frozenset[Any] | None:
    """The devices `source`'s committed arrays are on (None: none committed)."""
    found: set[Any] = set()
    for x in jax.tree.leaves(source):
        if isinstance(x, jax.Array) and getattr(x, "committed", getattr(x, "_committed", False)):
            found |= x.sharding.device_set
    return frozenset(found) or None


def _convert_leaves(sources: list[Any], targets: list[Any], indices: list[int]) -> list[Any]:
    """``sources`` (the leaves at `indices`) in their targets' forms, each rounded from
    the key of its index in the whole state (the same bits however they are grouped)."""
    key = jax.random.key(_SEED)
    return [
        _convert_leaf(s, targets[i], jax.random.fold_in(key, i))
        for s, i in zip(sources, indices, strict=True)
    ]
