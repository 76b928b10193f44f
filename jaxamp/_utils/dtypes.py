"""Which values jaxamp touches, and the dtype its scale arithmetic runs in.

Two predicates, for two jobs: autocast and policies cast *real floating* values
(:func:`is_float_dtype`, :func:`is_float`); loss scaling multiplies every *inexact*
leaf, complex included (:func:`is_inexact`). Integer, bool, ``float0`` and key
leaves, and ``None``, are never touched by either.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: The half-precision dtypes: what autocast computes in, what loss scaling protects.
HALF_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


@functools.cache
def is_float_dtype(dtype: Any) -> bool:
    """True for a real floating dtype (float8 to float64); False for complex, ints,
    bools and extended dtypes (PRNG keys)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes
        return False


@functools.cache
def is_narrow_range(dtype: Any) -> bool:
    """True for a real floating dtype whose range is narrower than float32's (float16,
    the float8 family): finite float32 values overflow it. bfloat16 has float32's range."""
    return is_float_dtype(dtype) and bool(jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp)


@functools.cache
def narrows(src: Any, dst: Any) -> bool:
    """True when a cast from the real floating `src` to the real floating `dst` can
    overflow: `dst`'s largest finite value is below `src`'s (float32 to float16 or
    bfloat16, bfloat16 to float16). Otherwise the cast only rounds (or is exact)."""
    return (
        is_float_dtype(src)
        and is_float_dtype(dst)
        and float(jnp.finfo(dst).max) < float(jnp.finfo(src).max)
    )


def is_float(x: Any) -> bool:
    """True for a value (an array, a NumPy or Python scalar) of a real floating dtype."""
    dtype = getattr(x, "dtype", None)
    return is_float_dtype(np.result_type(x) if dtype is None else dtype)


def is_inexact(x: Any) -> bool:
    """True for a floating or complex leaf (an array or a Python float); float8 included."""
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


def times_wide(x: Any, factor: jax.Array, *, reciprocal: bool = False) -> jax.Array:
    """``x * factor`` (or ``x / factor``) computed in :func:`wide_dtype`, in ``x``'s dtype.

    A float16 loss times a scale of 2**15 must not overflow the scale itself, and
    the reciprocal of 2**24 underflows float16: both are taken in float32 or wider.
    """
    x = jnp.asarray(x)
    wide = wide_dtype(x.dtype)
    f = factor.astype(wide)
    return (x.astype(wide) * (1.0 / f if reciprocal else f)).astype(x.dtype)
