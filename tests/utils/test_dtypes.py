"""Checks of ``jaxamp/_utils/dtypes.py``'s rules on dtypes."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._utils.dtypes import narrows

FLOATS = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64]


@pytest.mark.parametrize("src, dst", itertools.product(FLOATS, FLOATS))
def test_a_cast_narrows_exactly_when_the_sources_largest_value_does_not_survive_it(src, dst):
    # The reference is the cast itself: float32's largest value cast to bfloat16
    # rounds up past bfloat16's largest (inf), float16's fits bfloat16.
    with np.errstate(over="ignore"):
        survives = np.isfinite(np.asarray(jnp.finfo(src).max, src).astype(dst).astype(np.float64))
    assert narrows(np.dtype(src), np.dtype(dst)) == (not survives)


@pytest.mark.parametrize("other", [jnp.int32, jnp.bool_, jnp.complex64])
def test_only_real_floating_casts_narrow(other):
    assert not narrows(np.dtype(jnp.float32), np.dtype(other))
    assert not narrows(np.dtype(other), np.dtype(jnp.float16))
