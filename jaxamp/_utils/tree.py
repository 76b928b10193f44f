"""Pytree helpers shared by the loss-scaling core and the optax transformations.

Only *inexact* leaves (floating and complex arrays, float8 included) are ever
touched: integer, bool and ``float0`` leaves (what ``jax.grad(..., allow_int=True)``
returns for integer inputs) and ``None`` pass through unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils import jax_compat

__all__ = ["all_finite", "select_tree"]


INT32_MAX = 2**31 - 1


def saturating_inc(x: jax.Array, by: Any = 1) -> jax.Array:
    """``x + by`` for an int32 counter, staying at ``2**31 - 1`` instead of wrapping negative."""
    return jnp.where(x < INT32_MAX, x + jnp.asarray(by, jnp.int32), x)


@functools.cache
def is_float_dtype(dtype: Any) -> bool:
    """True for a real floating dtype (float8 to float64); False for complex, ints,
    bools and extended dtypes (PRNG keys). What autocast and policies cast."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes
        return False


def is_float_leaf(x: Any) -> bool:
    """True for a floating or complex array (or Python float) leaf; float8 included."""
    if isinstance(x, float | complex):
        return True
    dtype = getattr(x, "dtype", None)
    # float0 is a structured numpy dtype, not a subtype of inexact.
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def wide_dtype(dtype: Any) -> np.dtype:
    """The dtype scale arithmetic runs in for a leaf: float32, or the leaf's own if wider.

    Narrow floats (float16, bfloat16, the float8 family) are widened to float32:
    ``jnp.promote_types`` refuses float8, and ``1 / 2**24`` underflows float16.
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize >= 4 and jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return np.dtype(np.float32)


def map_float_leaves(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
    """Applies ``fn`` to every floating leaf of ``tree``; other leaves pass through."""
    return jax.tree.map(lambda x: fn(x) if is_float_leaf(x) else x, tree)


def leaf_finite(leaf: Any) -> jax.Array:
    """Whether a floating leaf is free of inf and NaN: one fused read of it.

    ``x - x`` is 0 for every finite ``x`` and NaN for inf or NaN, and a sum of zeros
    is NaN exactly when one term is: no false alarm from overflow (a plain sum has
    those), NaN caught on every backend (``max(abs(x))`` misses it where min/max
    drop NaN), and a float reduction XLA fuses with the leaf's producer
    (``all(isfinite(x))`` writes a bool mask first on XLA:CPU). float8 is reduced
    in float32 (``float8_e4m3fn`` has no inf).
    """
    x = jnp.asarray(leaf)
    if x.dtype.itemsize == 1:
        x = x.astype(jnp.float32)
    return jnp.isfinite(jnp.sum(x - x))


def agree(pred: jax.Array, axis_name: Any) -> jax.Array:
    """ANDs boolean ``pred`` (any shape) across a mapped axis; a no-op for ``None``."""
    if axis_name is None:
        return pred
    try:
        # Collectives have no bool reduction: the min of 0/1 is a logical AND.
        return lax.pmin(pred.astype(jnp.int32), axis_name).astype(jnp.bool_)
    except NameError as e:
        raise NameError(
            f"axis_name={axis_name!r} is not a mapped axis here. Pass the axis name of the "
            "enclosing shard_map / pmap, or axis_name=None under jax.jit with sharded "
            "arrays (the finiteness check is then a global reduction)."
        ) from e


def check_axis_name(axis_name: Any, fn: str) -> Any:
    """Validates an ``axis_name`` argument at construction: None, a str or a tuple of str."""
    names = axis_name if isinstance(axis_name, tuple | list) else (axis_name,)
    if axis_name is not None and not (names and all(isinstance(n, str) for n in names)):
        raise TypeError(
            f"{fn}: axis_name must be None, a string or a tuple of strings naming the axis of "
            f"the enclosing shard_map / pmap, got {axis_name!r}."
        )
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def all_finite(tree: Any, *, axis_name: Any = None) -> jax.Array:
    """Whether every floating leaf of ``tree`` is free of inf and NaN.

    One reduction per leaf, combined as scalars: nothing is concatenated or
    materialised, and each leaf is read once.

    Args:
      tree: any pytree; non-floating leaves and ``None`` are ignored.
      axis_name: name (or tuple of names) of a mapped axis (``pmap``,
        ``shard_map``, ``vmap``) to agree over: if any device sees a
        non-finite value, every device gets ``False``.

    Returns:
      A ``bool[]`` scalar array (``True`` for an empty tree).

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> bool(jaxamp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    result = jnp.array(True)
    for leaf in jax.tree.leaves(tree):
        if is_float_leaf(leaf):
            result = result & leaf_finite(leaf)
    return agree(result, axis_name)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``pred ? on_true : on_false`` over two pytrees of one structure.

    A device-side select (``lax.select``), so it never syncs with the host. For
    skipping an optimizer step prefer [`jaxamp.step`][jaxamp.step], which skips the whole
    update instead of computing it and selecting it away.

    Args:
      pred: a scalar boolean (array or Python bool).
      on_true: the pytree returned where ``pred`` holds.
      on_false: a pytree of the same structure, shapes and dtypes.

    Returns:
      A pytree like ``on_true``.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
      {'w': Array([0., 0.], dtype=float32)}
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(
            f"select_tree: `pred` must be a scalar bool, got {pred.dtype}{list(pred.shape)}."
        )
    true_leaves, true_def = jax.tree.flatten(on_true)
    false_leaves, false_def = jax.tree.flatten(on_false)
    if true_def != false_def:
        raise ValueError(
            "select_tree: `on_true` and `on_false` must have the same tree structure, got "
            f"{true_def} and {false_def}."
        )

    def select(a: Any, b: Any) -> Any:
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                "select_tree: leaves must match in shape and dtype, got "
                f"{a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}."
            )
        # On an Explicit mesh both cases must have one sharding: ``on_false``'s.
        a = jax_compat.like_sharded(a, b)
        return lax.select(pred, a, b)  # a scalar predicate: no sharding of its own

    return jax.tree.unflatten(
        true_def, [select(a, b) for a, b in zip(true_leaves, false_leaves, strict=True)]
    )


def like(old: Any, new_types: Any) -> Any:
    """``old`` with each leaf in the type of ``new_types`` (abstract values): its dtype,
    its sharding on an Explicit mesh and the shard_map axes it varies over, as
    ``lax.cond`` wants of two branches."""

    def cast(o: Any, n: Any) -> Any:
        if o is None:
            return o
        if getattr(o, "dtype", None) != n.dtype:
            o = jnp.asarray(o).astype(n.dtype)
        return jax_compat.like_varying(jax_compat.like_sharded(o, n), n)

    return jax.tree.map(cast, old, new_types)


def zeros_of(new_types: Any) -> Any:
    """Zeros of each abstract value's shape, dtype and (Explicit mesh) sharding."""
    return like(jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), new_types), new_types)


def path_key(entry: Any) -> Any:
    """The plain str / int that one jax key-path entry stands for."""
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def render_path(path: Sequence[Any]) -> str:
    """A key path as orbax names it, and every jaxamp message: ``opt_state.loss_scale.scale``."""
    return ".".join(str(path_key(e)) for e in path) or "<root>"
