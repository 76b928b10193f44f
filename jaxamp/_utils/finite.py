"""The finite check: whether gradients hold an inf or NaN, in as few reads as possible.

Each leaf is reduced on its own, in place: ``sum(x - x)`` is finite iff every ``x`` is
(see :func:`leaf_finite`), so each reduction reads its leaf once and XLA fuses it with
the leaf's producer. Only while a loss scale is below 1 are the leaves read again,
unscaled (:func:`leaf_flags`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._utils.dtypes import is_inexact, times_wide


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


def floating_leaves(tree: Any) -> list[int]:
    """The indices in ``jax.tree.leaves(tree)`` of its floating (checked) leaves."""
    return [i for i, leaf in enumerate(jax.tree.leaves(tree)) if is_inexact(leaf)]


def _leaf_sums(leaves: list[Any], owners: list[int]) -> jax.Array:
    """float32[n]: each owned leaf's ``sum(x - x)`` (0, or NaN if the leaf holds an inf or
    NaN; a complex one's as real + imag), one reduction per leaf, stacked."""
    sums = [_self_difference_sum(leaves[i]) for i in owners]
    sums = [(s.real + s.imag if jnp.iscomplexobj(s) else s).astype(jnp.float32) for s in sums]
    return jnp.stack(sums)


def leaf_flags(
    grads: Any, scale: jax.Array | None, prepare: Callable[[Any], Any] | None = None
) -> tuple[jax.Array, list[int]]:
    """Whether each floating leaf of the *unscaled* gradients is finite on this device.

    Returns ``(flags, owners)``: ``flags`` is bool[n], one per floating leaf of
    ``prepare(grads)``, and ``owners[k]`` the index in ``jax.tree.leaves(prepare(grads))``
    of the leaf ``flags[k]`` is about. One flag per leaf costs what one per group
    would (each leaf is its own reduction anyway), and the per-leaf record of
    non-finite leaves takes its flags from here instead of reading any leaf again.

    The scaled gradients are read once. While the scale is >= 1, unscaling
    multiplies by at most 1 and cannot overflow, so that is the answer. Below 1 it
    can (60000 / 0.5 overflows float16), so a ``lax.cond`` on the scale, a run-time
    fact rather than a configuration flag, then also checks the unscaled values.
    Its branch for a scale >= 1 is the ``isfinite`` of the sums, which would run
    anyway: a finite step runs no extra kernel for the cond and copies nothing
    through it. XLA's cost analysis counts the other branch's read of the gradients
    in its static figure all the same. (Unscaling in registers inside the one read
    would need no cond, but XLA:CPU then writes the scale's broadcast to memory,
    once per leaf shape, for its reduction kernels.) ``scale=None``: the gradients
    are not scaled. ``prepare`` maps ``grads`` to the scaled gradients inside each
    reduction (an accumulation window's mean), so the cond's operand is never a
    derived tree.
    """
    prepare = prepare or (lambda g: g)
    leaves = jax.tree.leaves(prepare(grads))
    owners = floating_leaves(leaves)
    if not owners:
        return jnp.ones((0,), jnp.bool_), owners
    sums = _leaf_sums(leaves, owners)
    if scale is None:
        return jnp.isfinite(sums), owners
    # `scale > 0` always holds (states are validated); both branches read it, so their
    # results have one type under shard_map (a per-device state varies where
    # replicated gradients do not).
    positive = scale > 0

    def as_is(sums: jax.Array, grads: Any) -> jax.Array:
        return jnp.isfinite(sums) & positive

    def also_unscaled(sums: jax.Array, grads: Any) -> jax.Array:
        again = _leaf_sums(jax.tree.leaves(unscaled(prepare(grads), scale)), owners)
        return jnp.isfinite(sums + again) & positive

    return lax.cond(scale >= 1, as_is, also_unscaled, sums, grads), owners
