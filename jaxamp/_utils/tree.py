"""Pytree plumbing: saturating counters, selecting and retyping trees, key paths, lookups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils import jax_compat

__all__ = ["select_tree"]

INT32_MAX = 2**31 - 1


def saturating_inc(x: jax.Array, by: Any = 1) -> jax.Array:
    """``x + by`` for an int32 counter, staying at ``2**31 - 1`` instead of wrapping negative."""
    return jnp.where(x < INT32_MAX, x + jnp.asarray(by, jnp.int32), x)


def check_axis_name(axis_name: Any, fn: str) -> Any:
    """Validates an ``axis_name`` argument at construction: None, a str or a tuple of str."""
    names = axis_name if isinstance(axis_name, tuple | list) else (axis_name,)
    if axis_name is not None and not (names and all(isinstance(n, str) for n in names)):
        raise TypeError(
            f"{fn}: axis_name must be None, a string or a tuple of strings naming the axis of "
            f"the enclosing shard_map / pmap, got {axis_name!r}."
        )
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def static_int(value: Any, name: str, fn: str, minimum: int) -> int:
    """A count fixed at construction (``every_k``) as a Python int: an int, a NumPy
    integer or a concrete integer scalar array; bools, floats and tracers are refused."""
    kind = getattr(getattr(value, "dtype", None), "kind", "i" if isinstance(value, int) else "")
    if is_tracer(value):
        raise TypeError(
            f"{fn}: {name} must be known when the transformation is built (it fixes the "
            f"program's shape), got a traced value. Pass a Python int; under "
            f"optax.inject_hyperparams, list {name!r} in static_args."
        )
    if isinstance(value, bool) or kind not in ("i", "u") or jnp.ndim(value) != 0:
        raise TypeError(f"{fn}: {name} must be an int >= {minimum}, got {value!r}.")
    count = int(value)
    if count < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {count}.")
    return count


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


def is_tracer(x: Any) -> bool:
    """A value JAX is tracing (inside ``jit``, ``grad``, ``vmap``, ``scan``...), whose
    value is not known on the host."""
    return isinstance(x, jax.core.Tracer)


def holds_tracer(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is traced: then nothing of it can be read on the host."""
    return any(is_tracer(x) for x in jax.tree.leaves(tree))


def is_none(x: Any) -> bool:
    """``is_leaf=`` for reading ``None`` as a leaf, as optax and equinox read updates."""
    return x is None


def is_array(x: Any) -> bool:
    """A JAX or NumPy array, what ``eqx.is_array`` keeps of a model: its other leaves
    (activation functions, flags, names, Python numbers) are fields, not params."""
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def is_float_array(x: Any) -> bool:
    """An array of a floating or complex dtype: what ``eqx.is_inexact_array`` keeps, and
    ``eqx.filter_grad`` differentiates (a Python float is a field)."""
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def path_key(entry: Any) -> Any:
    """The plain str / int that one jax key-path entry stands for."""
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def render_path(path: Sequence[Any]) -> str:
    """A key path as orbax names it, and every jaxamp message: ``opt_state.loss_scale.scale``."""
    return ".".join(str(path_key(e)) for e in path) or "<root>"


def find_one(tree: Any, types: type | tuple[type, ...], *, what: str, hint: str) -> Any:
    """The one node of ``types`` inside ``tree`` (any nesting), or None if there is none.

    The one lookup rule of every "the X inside an optimizer state": none is None (the
    caller says whether that is an error), several are an error, named by ``what``
    (``"LossScaleStates"``) with the path of each, followed by ``hint`` (what to pass
    instead).
    """
    is_node = lambda x: isinstance(x, types)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]
    found = [(path, x) for path, x in leaves if is_node(x)]
    if len(found) > 1:
        paths = [render_path(path) for path, _ in found]
        at = ", ".join(paths[:-1]) + " and " + paths[-1]
        raise ValueError(f"found {len(found)} {what} in the optimizer state, at {at}; {hint}")
    return found[0][1] if found else None
