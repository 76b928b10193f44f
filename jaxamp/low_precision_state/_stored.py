"""How one moment is stored between steps: 8-bit block codes, or bfloat16.

Each is a pytree node whose children are the arrays a checkpoint saves; the dtype the
wrapped optimizer built the moment in is static, so the state converts back to the
wrapped optimizer's own (``convert_state``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils import draws
from jaxamp.low_precision_params import _round_with_draw
from jaxamp.low_precision_state import _codes


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype the wrapped optimizer computes a stored moment in: float32, or float64
    for a float64 moment."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized8:
    """A moment as uint8 codes (its shape) and a float32 scale per block of
    ``block_size`` along its last axis (``jaxamp.low_precision_state(..., "8bit")``).

    Attributes:
      codes: uint8, the moment's shape.
      scales: float32, ``shape[:-1] + (ceil(shape[-1] / block_size),)``: a power of two
        (NaN for a non-finite block) with the block's code in its sign (negative: the
        non-negative family) and in its two lowest bits (the code's index in its
        family), so not itself the block's factor: ``value()`` decodes it.
      dtype: the dtype the wrapped optimizer built the moment in.
      block_size: elements per block.
    """

    codes: jax.Array
    scales: jax.Array
    dtype: np.dtype = dataclasses.field(metadata={"static": True})
    block_size: int = dataclasses.field(metadata={"static": True})

    @classmethod
    def store(cls, x: jax.Array, key: jax.Array, block_size: int, dtype: Any) -> Quantized8:
        codes, scales = _codes.quantize(x, key, block_size)
        return cls(codes, scales, np.dtype(dtype), block_size)

    def restore(self, x: jax.Array, key: jax.Array) -> Quantized8:
        """``x`` stored as this moment's next value."""
        codes, scales = _codes.requantize(x, key, self.block_size, self.codes, self.scales)
        return dataclasses.replace(self, codes=codes, scales=scales)

    def value(self) -> jax.Array:
        x = _codes.dequantize(self.codes, self.scales, self.block_size)
        return x.astype(compute_dtype(self.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rounded16:
    """A moment as bfloat16, rounded stochastically from the float32 the wrapped
    optimizer computed (``jaxamp.low_precision_state(..., jnp.bfloat16)``).

    Attributes:
      values: bfloat16, the moment's shape.
      dtype: the dtype the wrapped optimizer built the moment in.
    """

    values: jax.Array
    dtype: np.dtype = dataclasses.field(metadata={"static": True})

    @classmethod
    def store(cls, x: jax.Array, key: jax.Array, dtype: Any) -> Rounded16:
        return cls(_round(x, key), np.dtype(dtype))

    def restore(self, x: jax.Array, key: jax.Array) -> Rounded16:
        # A bfloat16 value rounds to itself: an unchanged moment stays bit for bit.
        return dataclasses.replace(self, values=_round(x, key))

    def value(self) -> jax.Array:
        return self.values.astype(compute_dtype(self.dtype))


def _round(x: jax.Array, key: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    rounded = _round_with_draw(x, draws.uniform(key, x.shape), jnp.bfloat16)
    # Beyond bfloat16's largest value a moment is stored as inf, as the 8-bit code stores
    # a NaN scale, so that a guard sees it and skips: the rounding's saturation (right
    # for a weight, whose next update pulls it back) would clip a moment silently.
    big = jnp.abs(x) > jnp.finfo(jnp.bfloat16).max.astype(jnp.float32)
    return jnp.where(big, (jnp.sign(x) * jnp.inf).astype(jnp.bfloat16), rounded)


Stored = Quantized8 | Rounded16


def is_stored(x: Any) -> bool:
    return isinstance(x, (Quantized8, Rounded16))
