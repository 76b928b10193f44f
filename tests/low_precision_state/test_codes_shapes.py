"""The 8-bit block code on the shapes a model's leaves take at the edges: rows shorter
than a block (a ``Dense(1)`` head's kernel, ``(n, 1)``) and empty moments; against the
float32 values, within ``_codes.bound``."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.low_precision_state import _codes

BLOCK = 256


@jax.jit
def _round_trips(x, key):
    """quantize, dequantize and requantize of ``x``, compiled as one program per shape
    (run op by op, each operation would compile on its own for every shape)."""
    codes, scales = _codes.quantize(x, key, BLOCK)
    again = _codes.requantize(x, jax.random.fold_in(key, 1), BLOCK, codes, scales)
    return codes, scales, _codes.dequantize(codes, scales, BLOCK), again


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4), (2, 0, 5)])
def test_an_empty_moment_round_trips(shape) -> None:
    codes, scales, values, again = _round_trips(jnp.zeros(shape), jax.random.key(0))
    assert codes.shape == shape and scales.shape == _codes.n_blocks(shape, BLOCK)
    assert values.shape == shape
    assert again[0].shape == shape


@pytest.mark.parametrize("shape", [(512, 1), (64, 3), (8, 300)])
def test_short_rows_round_trip_within_bound(shape) -> None:
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    _, _, got, _ = _round_trips(jnp.asarray(x), jax.random.key(3))
    assert (np.abs(np.asarray(got, np.float64) - x) <= _codes.bound(x, BLOCK)).all()


def _largest_intermediate(f, *args) -> int:
    jaxpr = jax.make_jaxpr(f)(*args)

    def sizes(jp):
        for eqn in jp.eqns:
            for v in eqn.outvars:
                yield int(np.prod(v.aval.shape)) if hasattr(v.aval, "shape") else 0
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from sizes(sub)

    return max(sizes(jaxpr.jaxpr))


def test_a_row_shorter_than_a_block_is_not_padded_to_one() -> None:
    # A (n, 1) moment is n blocks of one element: padding each to BLOCK elements made
    # every temporary of a step BLOCK times the moment (a 4 MB head, 1 GB of temporaries).
    # Only the traced programs are read: abstract arrays stand in for the moment.
    x = jax.ShapeDtypeStruct((1024, 1), jnp.float32)
    codes, scales = jax.eval_shape(lambda x: _codes.quantize(x, jax.random.key(0), BLOCK), x)
    for f, args in [
        (lambda x: _codes.quantize(x, jax.random.key(0), BLOCK), (x,)),
        (lambda c, s: _codes.dequantize(c, s, BLOCK), (codes, scales)),
        (
            lambda x, c, s: _codes.requantize(x, jax.random.key(1), BLOCK, c, s),
            (x, codes, scales),
        ),
    ]:
        assert _largest_intermediate(f, *args) <= 2 * x.size
