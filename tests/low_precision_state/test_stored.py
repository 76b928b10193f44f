"""How one moment is stored: ``Quantized8`` and ``Rounded16`` round trips, as pytrees.

The values come back within the storage's precision of a float64 reference (one
bfloat16 ulp for ``Rounded16``, ``_codes.bound`` for ``Quantized8``), in the dtype the
wrapped optimizer computes in; the static fields survive flatten/unflatten and jit; a
value already representable is stored bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxamp.low_precision_state import Quantized8, Rounded16, _codes

BF16 = np.dtype(jnp.bfloat16)

# Compiled once per shape (run op by op, each operation would compile on its own).
_store8 = jax.jit(Quantized8.store, static_argnums=(2, 3))
_store16 = jax.jit(Rounded16.store, static_argnums=2)
_restore = jax.jit(lambda s, x, key: s.restore(x, key))
_value = jax.jit(lambda s: s.value())
_identity = jax.jit(lambda t: t)


def _x(shape=(5, 70), seed=0) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 30, shape[:-1] + (1,))
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized8_round_trip(dtype) -> None:
    x = _x()
    q = _store8(x, jax.random.key(0), 32, dtype)
    assert q.codes.dtype == np.uint8 and q.codes.shape == x.shape
    assert q.scales.dtype == np.float32 and q.scales.shape == (5, 3)
    assert q.dtype == np.dtype(dtype) and q.block_size == 32
    v = _value(q)
    assert v.dtype == np.float32  # the wrapped optimizer computes in float32
    err = np.abs(np.asarray(v, np.float64) - np.asarray(x, np.float64))
    assert (err <= _codes.bound(np.asarray(x), 32)).all()
    # restore: the next value stored in the same form, within the same bound.
    y = x * 1.5 + 1.0
    r = _restore(q, y, jax.random.key(1))
    assert (r.dtype, r.block_size) == (q.dtype, q.block_size)
    err = np.abs(np.asarray(_value(r), np.float64) - np.asarray(y, np.float64))
    assert (err <= _codes.bound(np.asarray(y), 32)).all()
    # An unchanged value keeps its bytes under any key.
    same = _restore(q, v, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(same.codes), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(same.scales), np.asarray(q.scales))


def _ulp(x: np.ndarray) -> np.ndarray:
    """bfloat16's ulp at ``x`` (8 significant bits): stochastic rounding lands on one of
    the two neighbours, less than this away."""
    return 2.0 ** (np.floor(np.log2(np.abs(x))) - 7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rounded16_round_trip(dtype) -> None:
    x = _x()
    r = _store16(x, jax.random.key(0), dtype)
    assert r.values.dtype == BF16 and r.values.shape == x.shape
    assert r.dtype == np.dtype(dtype)
    v = _value(r)
    assert v.dtype == np.float32
    x64 = np.asarray(x, np.float64)
    assert (np.abs(np.asarray(v, np.float64) - x64) < _ulp(x64)).all()
    y = np.asarray(x * -3.0, np.float64)
    out = _restore(r, jnp.asarray(y, jnp.float32), jax.random.key(1))
    assert out.dtype == r.dtype
    assert (np.abs(np.asarray(_value(out), np.float64) - y) < _ulp(y)).all()


def test_a_bfloat16_value_restores_to_itself() -> None:
    values = np.random.default_rng(2).standard_normal((8, 64)).astype(ml_dtypes.bfloat16)
    values[0, :4] = [0.0, -0.0, 1e-30, -3e38]
    r = Rounded16(jnp.asarray(values), np.dtype(np.float32))
    for seed in range(4):
        out = _restore(r, _value(r), jax.random.key(seed))
        np.testing.assert_array_equal(
            np.asarray(out.values).view(np.uint16), values.view(np.uint16)
        )


def test_a_moment_beyond_bfloat16s_range_is_stored_as_inf_never_clipped() -> None:
    """float32 values above bfloat16's largest (3.3895e38) have no bfloat16 above them
    but inf: stored as inf with their sign on every draw, so a guard sees them (the
    8-bit code stores a NaN scale there); bfloat16's largest itself, and values that
    round to it from below, stay finite."""
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    f32max = float(np.finfo(np.float32).max)
    x = jnp.asarray([[3.40e38, -f32max, big, -big, np.nextafter(np.float32(big), 0)] + [1.0] * 3])
    for seed in range(8):
        out = np.asarray(_value(_store16(x, jax.random.key(seed), np.dtype(np.float32))))
        np.testing.assert_array_equal(out[0, :2], [np.inf, -np.inf])
        np.testing.assert_array_equal(out[0, 2:4], [big, -big])
        assert np.isfinite(out[0, 4]) and abs(out[0, 4]) <= big


def _x64():
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # JAX < 0.7

    return enable_x64()


def test_float64_moments_compute_in_float64() -> None:
    with _x64():
        x = jnp.asarray(np.linspace(-1, 1, 64), jnp.float64)
        q8 = jax.jit(lambda x, k: Quantized8.store(x, k, 16, x.dtype).value())
        r16 = jax.jit(lambda x, k: Rounded16.store(x, k, x.dtype).value())
        assert q8(x, jax.random.key(0)).dtype == np.float64
        assert r16(x, jax.random.key(0)).dtype == np.float64


@pytest.mark.parametrize("kind", ["q8", "r16"])
def test_pytree_keeps_static_fields(kind) -> None:
    x = _x()
    key = jax.random.key(0)
    s = _store8(x, key, 16, jnp.bfloat16) if kind == "q8" else _store16(x, key, jnp.bfloat16)
    leaves, treedef = jax.tree.flatten(s)
    # The children are the arrays a checkpoint saves; dtype and block size are static.
    assert [leaf.dtype for leaf in leaves] == ([np.uint8, np.float32] if kind == "q8" else [BF16])
    back = jax.tree.unflatten(treedef, leaves)
    assert type(back) is type(s) and back.dtype == np.dtype(jnp.bfloat16)
    if kind == "q8":
        assert back.block_size == 16
    # Through jit (as a train state is): the same node, the same static fields.
    out = _identity(s)
    assert type(out) is type(s) and out.dtype == s.dtype
    assert jax.tree.structure(out) == treedef
    for a, b in zip(jax.tree.leaves(out), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A tree.map over the stored state maps the arrays, not the static fields.
    zeroed = jax.tree.map(jnp.zeros_like, s)
    assert type(zeroed) is type(s) and zeroed.dtype == s.dtype
