"""Uniform random bits for stochastic rounding, computed in the kernel that uses them.

``jax.random`` draws with threefry: twenty rounds of 32-bit arithmetic per pair of
words, which XLA on CPU runs as a loop over whole arrays, each round reading and
writing two ``uint32`` arrays (over 50 bytes per element for one draw, more than the
optimizer step it serves; tests/utils/test_draws.py measures it). Stochastic rounding
needs less: bits uniform and unrelated between neighbouring elements, keys and steps.
Here each element's bits are a hash of two words drawn from the key and of its index
along each axis, with MurmurHash3's 32-bit finalizer (a bijection of ``uint32`` in
which every input bit flips each output bit with probability close to 1/2): a few
elementwise integer operations that XLA fuses into the kernel that reads them, on
every backend. They depend on the key and the element's index only, not on the
array's shape, so a shard of an array draws what the same elements of the whole do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ODD = np.uint32(0x9E3779B9)  # 2**32 / golden ratio: spreads consecutive indices


def _mix(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``uint32`` random bits of ``shape``: a function of ``key`` and each element's
    index only."""
    k = jax.random.bits(key, (2,), jnp.uint32)
    h = jnp.broadcast_to(_mix(k[0]), shape)
    for axis in range(len(shape)):
        i = lax.broadcasted_iota(jnp.uint32, shape, axis)
        # The index is hashed before it meets the rest: ``mix(h + i * odd)`` would make
        # each row (and each key's) bits a window of one sequence ``mix(j * odd)``,
        # rows whose offsets ``h`` fall within a row length of each other repeating
        # each other's bits, shifted.
        h = _mix(_mix(i * _ODD + k[1]) ^ h)
    return h


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniform in [0, 1) with ``2**-24`` resolution."""
    return (bits(key, shape) >> 8).astype(jnp.float32) * np.float32(2.0**-24)
