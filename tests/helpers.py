"""Shared test helpers: scale trajectories, small training problems, a custom-VJP op, walks of
a jaxpr's equations, exactly representable test numbers, the simulated device count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

FIELDS = ("scale", "growth_tracker", "hysteresis_tracker", "nonfinite_streak", "skipped_steps")


@functools.partial(jax.jit, static_argnames=())
def _scan(state, overflow):
    def body(s, ovf):
        s = jaxamp.update(s, ~ovf)
        return s, tuple(getattr(s, f) for f in FIELDS)

    return jax.lax.scan(body, state, overflow)


def trajectory(state: jaxamp.LossScaleState, finite) -> dict[str, np.ndarray]:
    """Per-step state fields after each `update(state, finite[i])`, run as one jitted scan."""
    _, outs = _scan(state, ~jnp.asarray(finite, bool))
    return {f: np.asarray(v) for f, v in zip(FIELDS, outs, strict=False)}


def mlp_init(key, sizes=(4, 8, 3)):
    """A tiny two-layer MLP's params: {'l0': {'w','b'}, 'l1': {...}}."""
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        key, k = jax.random.split(key)
        params[f"l{i}"] = {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
    return params


def mlp_loss(params, x, y):
    h = x
    for i in range(len(params)):
        h = h @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
        if i + 1 < len(params):
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def batches(n, key=0, batch=16, d_in=4, d_out=3):
    k = jax.random.PRNGKey(key)
    kx, ky = jax.random.split(k)
    xs = jax.random.normal(kx, (n, batch, d_in))
    ys = jax.random.normal(ky, (n, batch, d_out))
    return xs, ys


def assert_trees_equal(a, b):
    """Bit-for-bit equality of two pytrees (structure, dtypes and values)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for x, y in zip(la, lb, strict=False):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(
            np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8)
        )


@jax.custom_vjp
def tanh_proj(x, w):
    """``tanh(x @ w)`` with a hand-written VJP (a user's custom derivative)."""
    return jnp.tanh(x @ w)


def _tanh_proj_fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def _tanh_proj_bwd(res, g):
    x, w, y = res
    gy = g * (1 - y * y)
    return gy @ w.T, x.T @ gy


tanh_proj.defvjp(_tanh_proj_fwd, _tanh_proj_bwd)


#: The simulated CPU devices of tests/multidevice and tests/matrix
#: (``XLA_FLAGS=--xla_force_host_platform_device_count=8``; see tests/conftest.py).
N_DEV = 8


def all_equations(jaxpr, skip: tuple[str, ...] = ()):
    """Every equation of `jaxpr` (closed or not) and of the jaxprs its equations hold,
    depth first (an inner jaxpr once per equation that holds it); the inner jaxprs of
    equations whose primitive is named in `skip` are not entered."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in skip:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    yield from all_equations(sub, skip)


def equations(jaxpr, primitive: str = "dot_general") -> list:
    """Every `primitive` equation of `jaxpr` (closed or not), in order, sub-jaxprs
    included (an inner jaxpr once per equation that holds it)."""
    return [e for e in all_equations(jaxpr) if e.primitive.name == primitive]


def _with_producers(jaxpr, skip: tuple[str, ...] = ()):
    """``all_equations`` (same order), each with the map from the variables of its
    own jaxpr to the equations that produce them."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
        yield eqn, producers
        if eqn.primitive.name in skip:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    yield from _with_producers(sub, skip)


def _dequantized_from(var, producers) -> np.dtype:
    """The FP8 dtype `var` was dequantized from (``convert(q) * scale``, the form
    ``_fp8_gemm.dequantize`` emits for XLA's FP8 GEMM rewriter), else its own."""
    eqn = producers.get(var)
    if eqn is not None and eqn.primitive.name == "mul":
        for v in eqn.invars:
            conv = producers.get(v)
            if conv is not None and conv.primitive.name == "convert_element_type":
                src = np.dtype(conv.invars[0].aval.dtype)
                if "float8" in src.name:
                    return src
    return np.dtype(var.aval.dtype)


def dot_input_dtypes(jaxpr, primitive: str = "dot_general") -> list[tuple[np.dtype, ...]]:
    """Input dtypes of every `primitive` in `jaxpr` (closed or not), sub-jaxprs included;
    an FP8 operand dequantized just before the product counts as its FP8 dtype."""
    return [
        tuple(_dequantized_from(v, producers) for v in e.invars)
        for e, producers in _with_producers(jaxpr)
        if e.primitive.name == primitive
    ]


def dyadic(seed, shape, denom):
    """Small multiples of 1/denom (float32): their products and sums of a few are exact in
    float16, so a difference from float32 is the program's, not rounding's."""
    return jnp.asarray(np.random.default_rng(seed).integers(-4, 5, shape) / denom, jnp.float32)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
