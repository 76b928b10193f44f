"""The finite check: whether gradients hold an inf or NaN, in as few reads as possible.

Each large leaf is reduced on its own, in place; the small leaves (biases, norm
scales) are checked one reduction per dtype. ``sum(x - x)`` is finite iff every
``x`` is (see :func:`leaf_finite`), so each reduction reads its leaves once and
XLA fuses it with their producer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._utils.dtypes import is_inexact, times_wide
from jaxamp._utils.jax_compat import typed_spec

# Leaves up to this many elements (biases, norm scales) are checked together, one
# reduction per dtype: on a GPU each reduction is a kernel launch, and a model's many
# small leaves would cost more in launches than in reading. At worst the small leaves
# are copied once (kilobytes); large leaves are each read once, in place.
SMALL_LEAF = 2**14


def leaf_finite(leaf: Any) -> jax.Array:
    """Whether a floating leaf is free of inf and NaN: one fused read of it.

    ``x - x`` is 0 for every finite ``x`` and NaN for inf or NaN, and a sum of zeros
    is NaN exactly when one term is: no false alarm from overflow (a plain sum has
    those), NaN caught on every backend (``max(abs(x))`` misses it where min/max
    drop NaN), and a float reduction XLA fuses with the leaf's producer
    (``all(isfinite(x))`` writes a bool mask first on XLA:CPU). float8 is reduced
    in float32 (``float8_e4m3fn`` has no inf).
    """
    return jnp.isfinite(_self_difference_sum(jnp.asarray(leaf)))


def _self_difference_sum(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32) if x.dtype.itemsize == 1 else x
    return jnp.sum(x - x)


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


def as_finite(finite: Any, fn: str) -> jax.Array:
    """``finite`` as a bool[] array, or a clear error naming it."""
    finite = jnp.asarray(finite)
    if finite.shape != () or finite.dtype != jnp.bool_:
        raise ValueError(
            f"{fn}: `finite` must be a scalar bool (as unscale_and_check returns it), got "
            f"{finite.dtype}{list(finite.shape)}."
        )
    return finite


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
        if is_inexact(leaf):
            result = result & leaf_finite(leaf)
    return agree(result, axis_name)


def unscaled(tree: Any, scale: jax.Array | None) -> Any:
    """``tree``'s inexact leaves times ``1 / scale`` (taken in float32 or wider);
    ``scale=None``: ``tree`` as it is."""
    if scale is None:
        return tree
    return jax.tree.map(
        lambda x: times_wide(x, scale, reciprocal=True) if is_inexact(x) else x, tree
    )


def checked_alone(leaf: Any) -> bool:
    """Whether the finite check reads this floating leaf on its own (not joined).

    Large leaves, complex ones, and leaves sharded in their type (an Explicit mesh:
    flattening one has no one sharding, and JAX refuses the reshape).
    """
    leaf = jnp.asarray(leaf)
    return leaf.size > SMALL_LEAF or jnp.iscomplexobj(leaf) or typed_spec(leaf) is not None


def check_groups(tree: Any) -> tuple[list[jax.Array], list[int | None]]:
    """The inexact leaves to check: large ones alone, small ones joined per dtype;
    and each group's leaf index (None for a joined group)."""
    groups: list[jax.Array] = []
    owners: list[int | None] = []
    small: dict[Any, list[jax.Array]] = {}
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        if not is_inexact(leaf):
            continue
        leaf = jnp.asarray(leaf)
        if checked_alone(leaf):
            groups.append(leaf)
            owners.append(i)
        else:
            small.setdefault(leaf.dtype, []).append(leaf)
    # A joined group is each small leaf's own ``sum(x - x)`` (NaN iff the leaf has an
    # inf or NaN), stacked: no array joins the leaves themselves, whose shardings may
    # differ (a concatenation let XLA's propagation on an Auto mesh shard a replicated
    # bias's outputs after it).
    groups.extend(
        jnp.stack([_self_difference_sum(x) for x in xs]) if len(xs) > 1 else xs[0]
        for xs in small.values()
    )
    owners.extend([None] * len(small))
    return groups, owners


def group_flags(
    grads: Any, scale: jax.Array | None, prepare: Callable[[Any], Any] | None = None
) -> tuple[jax.Array, list[int | None]]:
    """Whether each check group of the *unscaled* gradients is finite on this device.

    Returns ``(flags, owners)``: ``flags`` is bool[n_groups]; ``owners[k]`` is the
    index (in ``jax.tree.leaves(prepare(grads))``) of the one large leaf group ``k``
    checks, or None for a group of small leaves joined per dtype.

    The scaled gradients are read once. While the scale is >= 1, unscaling
    multiplies by at most 1 and cannot overflow, so that is the answer. Below 1 it
    can (60000 / 0.5 overflows float16), so a ``lax.cond`` on the scale, a run-time
    fact rather than a configuration flag, then also checks the unscaled values.
    That branch is taken only while the scale is below 1; XLA's cost analysis counts
    its bytes anyway. ``scale=None``: the gradients are not scaled. ``prepare`` maps
    ``grads`` to the scaled gradients inside each reduction (an accumulation
    window's mean), so the cond's operand is never a derived tree.
    """
    prepare = prepare or (lambda g: g)
    groups, owners = check_groups(prepare(grads))
    flags = jnp.stack([leaf_finite(g) for g in groups]) if groups else jnp.ones((0,), bool)
    if scale is None:
        return flags, owners

    def also_unscaled(flags: jax.Array, grads: Any) -> jax.Array:
        groups, _ = check_groups(unscaled(prepare(grads), scale))
        if not groups:
            return flags
        return flags & jnp.stack([leaf_finite(g) for g in groups])

    # Both branches return a value derived from `flags`, so they have one type under
    # shard_map too (varying over the mapped axes). `scale > 0` always holds (states
    # are validated); it gives `flags` the scale's type as well, which the re-check
    # reads: a per-device (stacked) state varies where replicated gradients do not.
    flags = flags & (scale > 0)
    return lax.cond(scale >= 1, lambda f, g: f, also_unscaled, flags, grads), owners
