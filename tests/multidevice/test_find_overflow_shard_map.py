"""jaxamp.find_overflow inside ``jax.shard_map`` bodies, on 8 simulated devices.

0.3 bound a shard_map as a whole: a float16 matmul overflowing on one device
came out as the float32 shard_map making inf, with the advice that "the program
does this without mixed precision too" although the float32 program is finite
(issue 31). Now the body is evaluated op by op on every device's block, with
the collectives between them, and the report names the op inside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.casting.test_find_overflow import assert_advice_works, marker_line
from tests.helpers import N_DEV


def _mesh(shape=(N_DEV,), names=("x",)) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


MESH = _mesh()


def sharded_loss(w, x):
    def body(w, x):
        h = x @ w  # HERE
        return jax.lax.psum(jnp.sum(h.astype(jnp.float32)), "x")  # CAST

    return jax.shard_map(body, mesh=MESH, in_specs=(P(), P("x")), out_specs=P())(w, x) * 1e-6


def _one_big_block(value: float, device: int = 5) -> jax.Array:
    """x of 16 rows, 2 per device: ones, except `value` in `device`'s block."""
    x = np.ones((2 * N_DEV, 4), np.float32)
    x[2 * device : 2 * device + 2] = value
    return jnp.asarray(x)


def test_float16_matmul_on_one_device_is_reported():
    w, x = jnp.full((4, 4), 300.0), _one_big_block(100.0)  # 4 * 300 * 100 = 120000 there
    assert np.isfinite(sharded_loss(w, x))  # the float32 program is finite
    report = jaxamp.find_overflow(sharded_loss, scale=1.0)(w, x)
    assert report.found and report.low_precision, str(report)
    assert (report.primitive, report.pass_, report.dtype) == ("dot_general", "forward", "float16")
    assert report.line == marker_line(sharded_loss)
    assert report.function == "sharded_loss.<locals>.body"
    # Computed on that device's block (the other blocks give 1200).
    assert report.magnitude == pytest.approx(120000.0)
    assert "without mixed precision too" not in report.advice
    assert "No float16 op overflowed" not in report.advice
    (after,) = assert_advice_works(report, sharded_loss, w, x)
    assert not after.found
    # A finite program inside shard_map: nothing, not even a float32 op.
    assert not jaxamp.find_overflow(sharded_loss, scale=1.0)(w, _one_big_block(1.0)).found


def test_gradient_overflow_in_shard_map_gets_a_checked_loss_scale():
    w, x = jnp.ones((4, 4)), _one_big_block(1.0)
    # The gradient of every h is loss_scale * 1e-6 (psum's transpose hands each
    # device its cotangent): 2**40 * 1e-6 = 1.1e6 overflows where it is cast back
    # to float16 (the transpose of h.astype(jnp.float32)).
    report = jaxamp.find_overflow(sharded_loss, scale=2.0**40)(w, x)
    assert report.found and report.low_precision and report.pass_ == "backward", str(report)
    assert report.primitive == "convert_element_type"
    assert report.line == marker_line(sharded_loss, "# CAST")
    assert report.magnitude == pytest.approx(2.0**40 * 1e-6, rel=1e-6)
    scale = report.suggested_loss_scale
    assert scale is not None and scale < 2.0**40
    assert_advice_works(report, sharded_loss, w, x)
    # ... and it is not needlessly small: 4x larger overflows again.
    assert jaxamp.find_overflow(sharded_loss, scale=4 * scale)(w, x).found


MESH2 = _mesh((2, 4), ("a", "b"))


def scan_loss(w, x):
    """A scan inside an unchecked shard_map (check_vma=False) over one of two axes."""

    def body(w, x):
        def step(total, xi):
            h = xi @ w  # HERE
            return total + jnp.sum(h.astype(jnp.float32)), None

        total, _ = jax.lax.scan(step, jnp.float32(0.0), x.reshape(2, -1, 4))
        return jax.lax.psum(total, "a")

    mapped = jax.shard_map(body, mesh=MESH2, in_specs=(P(), P("a")), out_specs=P(), check_vma=False)
    return mapped(w, x) * 1e-6


def test_scan_inside_unchecked_shard_map_on_a_2d_mesh():
    # 'a' splits 16 rows into 2 blocks of 8, each scanned as 2 steps of 4 rows:
    # rows 12-15 are block 1's step 1.
    x = np.ones((16, 4), np.float32)
    x[12:] = 100.0
    w, x = jnp.full((4, 4), 300.0), jnp.asarray(x)
    assert np.isfinite(scan_loss(w, x))
    report = jaxamp.find_overflow(scan_loss, scale=1.0)(w, x)
    assert report.found and report.low_precision, str(report)
    assert (report.primitive, report.pass_) == ("dot_general", "forward")
    assert report.line == marker_line(scan_loss)
    assert report.scan_iterations == (1,)
    assert report.magnitude == pytest.approx(120000.0)
