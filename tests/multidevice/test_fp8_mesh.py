"""FP8 autocast on 8 simulated devices: every replica scales with the global amax
(issue 33, part 1).

The operands are split over the devices by rows, each device's block with its
own magnitude and one block holding an outlier, so a device that scaled with
its own block's amax would round its block differently from one device
holding the whole array (``test_the_data_tells_local_from_global_scales``
checks that the difference is visible). Each run is compared with the
single-device FP8 run of the same arrays: the forward, the input gradient and
the weight gradient.

Tensorwise, the amax is global everywhere: on Auto and Explicit meshes it is a
reduction over the global array (XLA's partitioner adds the all-reduce), in
``shard_map`` a ``pmax`` over the manual axes. Rowwise, meshes are global too;
in ``shard_map`` each device scales its own rows, which is the global row scale
wherever the contraction is not split across devices (the forward and the
input gradient here); the weight gradient contracts over the split rows, so
there each device scales its partial sum with its own amax before the psum
(same result on every device, not the single device's bits: documented).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.casting.test_fp8 import E4M3, E5M2, fp8_bound
from tests.helpers import N_DEV

BF16, F32 = jnp.bfloat16, jnp.float32


def _blocks(rng, shape, outlier_block: int) -> jax.Array:
    """Rows in 8 blocks, block i scaled by 1.37**i, one entry of `outlier_block` 1e4."""
    x = rng.standard_normal(shape)
    rows = shape[0] // N_DEV
    for i in range(N_DEV):
        x[i * rows : (i + 1) * rows] *= 1.37**i
    x[outlier_block * rows, 1] = 1e4
    return jnp.asarray(x, BF16)


def _arrays():
    rng = np.random.default_rng(0)
    x = _blocks(rng, (128, 32), outlier_block=5)
    w = jnp.asarray(rng.standard_normal((32, 16)), BF16)
    c = _blocks(rng, (128, 16), outlier_block=2)  # the cotangent of the output
    return x, w, c


@functools.cache
def _run(scaling: str):
    f = jaxamp.autocast(
        lambda x, w: x @ w, dtype=BF16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
    )

    def run(x, w, c):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(c))

    return run


def _shard_map_run(scaling: str, autocast_outside: bool):
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
    fp8 = jaxamp.fp8(scaling, first_last_bf16=False)

    def body(x, w):
        return x @ w

    if autocast_outside:
        sharded = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
        f = jaxamp.autocast(sharded, dtype=BF16, fp8=fp8)
    else:
        f = jax.shard_map(
            jaxamp.autocast(body, dtype=BF16, fp8=fp8),
            mesh=mesh,
            in_specs=(P("data"), P()),
            out_specs=P("data"),
        )

    def run(x, w, c):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(c))

    return mesh, run


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _assert_same_as_one_device(got, scaling: str, parts=("y", "dx", "dw")) -> None:
    want = jax.jit(_run(scaling))(*_arrays())
    for name, g, w in zip(("y", "dx", "dw"), got, want, strict=True):
        if name not in parts:
            continue
        if name == "dw":
            # Contracts over the split rows: the partial sums are added in
            # another order; one bfloat16 step.
            assert _rel(g, w) <= 2.0**-8, (name, _rel(g, w))
        else:
            # Each row is one device's alone: with the global scales its sums
            # are the same float32 sums as on one device, bit for bit. (A
            # tolerance relative to the whole array's max, 1e4 outlier
            # included, would pass per-device scales too.)
            np.testing.assert_array_equal(
                np.asarray(g, np.float32), np.asarray(w, np.float32), name
            )


def test_the_data_tells_local_from_global_scales():
    """Each device's block run alone (its own amax) differs from its rows of the
    one-device run by far more than the tolerance the mesh runs must meet."""
    x, w, c = _arrays()
    for scaling in ["tensorwise"]:
        whole = jax.jit(_run(scaling))(x, w, c)
        rows = 128 // N_DEV
        block = jax.jit(_run(scaling))(x[:rows], w, c[:rows])
        assert _rel(block[0], whole[0][:rows]) > 2.0**-5  # the forward
        assert _rel(block[1], whole[1][:rows]) > 2.0**-5  # the input gradient


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_auto_mesh_scales_with_the_global_amax(scaling):
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
    x, w, c = _arrays()
    rows = NamedSharding(mesh, P("data"))
    got = jax.jit(_run(scaling))(jax.device_put(x, rows), w, jax.device_put(c, rows))
    assert got[0].sharding.spec == P("data")
    _assert_same_as_one_device(got, scaling)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_explicit_mesh_scales_with_the_global_amax(scaling):
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,))
    x, w, c = _arrays()
    with jax.set_mesh(mesh):
        xs, cs = jax.device_put(x, P("data")), jax.device_put(c, P("data"))
        got = jax.jit(_run(scaling))(xs, w, cs)
        assert jax.typeof(got[0]).sharding.spec == P("data", None)
        assert jax.typeof(got[1]).sharding.spec == P("data", None)  # dx like x
    _assert_same_as_one_device(got, scaling)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_explicit_mesh_products_keep_the_form_xla_fuses(scaling):
    # On an Explicit mesh JAX wraps every value in a Sharding annotation (the
    # partitioner removes them before the GEMM rewriter runs); past them, each
    # product has the form fp8_dots checks: forward, dgrad and wgrad.
    from tests.casting.test_fp8 import fp8_dots

    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,))
    x, w, c = _arrays()
    with jax.set_mesh(mesh):
        xs, cs = jax.device_put(x, P("data")), jax.device_put(c, P("data"))
        text = jax.jit(_run(scaling)).lower(xs, w, cs).as_text(dialect="hlo")
    dots = fp8_dots(text, rowwise=scaling == "rowwise")
    assert sorted(kind for _, kind in dots) == ["e4m3", "e5m2", "e5m2"]


@pytest.mark.parametrize(
    "autocast_outside", [True, False], ids=["autocast(shard_map)", "shard_map(autocast)"]
)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_shard_map_scales_with_the_global_amax(scaling, autocast_outside):
    mesh, run = _shard_map_run(scaling, autocast_outside)
    x, w, c = _arrays()
    rows = NamedSharding(mesh, P("data"))
    got = jax.jit(run)(jax.device_put(x, rows), w, jax.device_put(c, rows))
    # Rowwise, the weight gradient contracts over the split rows: each device
    # scales its own partial sum (the module docstring); its psum is the same
    # everywhere (w is replicated), so only the bits differ from one device's.
    parts = ("y", "dx", "dw") if scaling == "tensorwise" else ("y", "dx")
    _assert_same_as_one_device(got, scaling, parts)
    if scaling == "rowwise":
        # Within FP8's bound of the exact product (each device's scales are valid
        # scales), plus the bfloat16 rounding of each device's partial sum.
        a, b = np.asarray(x, np.float64), np.asarray(c, np.float64)
        exact = np.einsum("mk,mn->kn", a, b)
        bound = fp8_bound("mk,mn->kn", a, b, E4M3, E5M2, 128)
        bound += 2.0**-8 * np.einsum("mk,mn->kn", np.abs(a), np.abs(b))
        assert np.all(np.abs(np.asarray(got[2], np.float64) - exact) <= bound)


def test_shard_map_keeps_a_model_called_twice_its_first_and_last_layers():
    # In the shard_map body JAX marks each replicated weight varying (pvary)
    # before the product that meets the sharded batch: still the same weight,
    # so both calls' first and last layers stay bfloat16, the middle ones FP8.
    from tests.casting.test_fp8 import _dot_dtypes, mlp, mlp_params

    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
    spec = P("data")
    body = jax.shard_map(
        lambda p, a, b: (mlp(p, a), mlp(p, b)),
        mesh=mesh,
        in_specs=(P(), spec, spec),
        out_specs=(spec, spec),
    )
    f = jaxamp.autocast(body, dtype=BF16, fp8=jaxamp.fp8())
    x = jnp.ones((N_DEV * 32, 32), F32)
    bf, f8 = "bfloat16", "float8_e4m3fn"
    assert _dot_dtypes(f, mlp_params(), x, x) == [bf, f8, f8, bf] * 2


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_health_inside_a_shard_map_step(scaling):
    """A per-device step (shard_map around value_and_grad, gradients psum'd): each
    device's figures are those of its shard (varying over the mesh axis), the
    gradients exactly jax.value_and_grad's in the same body."""
    x, w, c = _arrays()
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
    f = jaxamp.autocast(
        lambda w, x: x @ w, dtype=BF16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
    )

    def loss(w, x, c):
        return jnp.sum((f(w, x) * c).astype(F32))

    def body(w, x, c):
        (value, health), grad = jaxamp.fp8_health(loss)(w, x, c)
        ref_value, ref_grad = jax.value_and_grad(loss)(w, x, c)
        same = jnp.all(grad == ref_grad) & (value == ref_value)
        amax = jax.lax.pmax(health["w"]["lhs"]["amax"], "data")
        per_device = jax.tree.map(lambda a: a[None], health["w"])
        return jax.lax.pmin(same.astype(jnp.int32), "data"), amax, per_device

    run = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P(), P("data"))
    )
    same, amax, per_device = jax.jit(run)(w, x, c)
    assert int(same) == 1
    assert float(amax) == float(jnp.max(jnp.abs(x.astype(F32))))
    # One amax per device: the largest of its own rows.
    rows = x.astype(F32).reshape(N_DEV, -1, x.shape[1])
    np.testing.assert_array_equal(per_device["lhs"]["amax"], jnp.max(jnp.abs(rows), axis=(1, 2)))
