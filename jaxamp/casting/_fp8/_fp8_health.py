"""FP8 health: per FP8 product, how much of each cast saturates or flushes to zero.

``jaxamp.fp8_health(loss_fn)`` is ``jax.value_and_grad`` that also returns, for
every FP8 product autocast runs inside `loss_fn`, three statistics of each of
its FP8 casts: the amax of the values cast, the fraction of them that
saturate (are inf or NaN) and the fraction that flush to zero (nonzero,
rounded to 0 in FP8 under the product's scale). Forward: the two e4m3
operands; backward: the e5m2 gradient (one cast tensorwise; rowwise two, one
per backward product, each with its own scales).

The backward statistics exist only once ``jax.grad`` runs the products'
backward rules, after the loss is computed. They leave as a gradient: each
product takes a zero "probe" input, and its backward rule returns the
statistics as the probe's cotangent, so they come out of the same
``value_and_grad`` call as the parameters' gradients, with no host transfer
and no state. The probes' count is known only after a trace of `loss_fn`:
``fp8_health`` traces it once more (``jax.eval_shape``) to count the products.

Nothing here runs without ``fp8_health``: ``Plan.dot`` calls ``dot``, which is
``fp8_dot_general`` itself unless a collector is active in this very trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._utils import jax_compat
from jaxamp.casting._fp8 import _fp8_gemm

__all__ = ["STATS", "fp8_health"]

#: The statistics of one cast, in the order of its row.
STATS = ("amax", "saturated", "flushed")
_F32 = np.dtype(np.float32)
#: What tracing a function that reads a concrete value of a traced argument raises.
_CONCRETE_ONLY = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)
#: The name of a product outside any module (audit's empty module path).
UNNAMED = "dot_general"


def cast_stats(
    x: Any, dtype: np.dtype, reduce_axes: Sequence[int] | None, inv_dtype: np.dtype
) -> Any:
    """``[amax, saturated, flushed]`` (float32) of `x`'s cast to `dtype` as
    ``_fp8_gemm.quantize`` makes it with `reduce_axes` and `inv_dtype`.

    ``flushed`` compares the FP8 values themselves with the float32 ones: the
    elements that are finite and nonzero before the cast and zero after it.
    ``saturated`` counts the inf and NaN elements: under current scaling a
    finite element never exceeds the FP8 maximum (the scale maps the amax to
    it), so non-finite input is the only way a cast overflows. The
    quantization repeats the product's own, operand for operand, its scale
    rounded to the same `inv_dtype` (the rounding moves the flush threshold):
    XLA computes it once (CSE)."""
    x32 = x.astype(_F32)
    q, _ = _fp8_gemm.quantize(x, dtype, reduce_axes, inv_dtype)
    finite = jnp.isfinite(x32)
    flushed = finite & (x32 != 0) & (q.astype(_F32) == 0)
    # One variadic reduction reads the operand once for all its statistics
    # (separate reductions would read it once each; benchmarks/fp8_health_cost.py),
    # except a tensorwise amax: quantize's own reduction, which XLA computes once.
    counts = ((~finite).astype(jnp.int32), flushed.astype(jnp.int32))
    zero = np.int32(0)
    if reduce_axes is None:
        amax = jnp.max(jnp.abs(x32))
        saturated, flushed = lax.reduce(
            counts, (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim))
        )
    else:
        amax, saturated, flushed = lax.reduce(
            (jnp.abs(x32), *counts),
            (np.float32(-np.inf), zero, zero),
            lambda a, b: (lax.max(a[0], b[0]), a[1] + b[1], a[2] + b[2]),
            tuple(range(x.ndim)),
        )
    n = np.float32(max(x.size, 1))
    return jnp.stack([amax, saturated.astype(_F32) / n, flushed.astype(_F32) / n])


@dataclasses.dataclass(frozen=True)
class _Static:
    """A product's static part with its operands' ranks (the backward's axes)."""

    gemm: _fp8_gemm.Gemm
    nl: int
    nr: int

    def reduce_axes(self) -> tuple[Any, ...]:
        """The amax axes of the forward's lhs and rhs, the gradient's casts for the
        dgrad and the wgrad, and (rowwise) the rhs cast again for the dgrad and the
        lhs for the wgrad (None: tensorwise, which casts each once)."""
        if not self.gemm.rowwise:
            return None, None, None, None, None, None
        (lc, rc), _ = self.gemm.dims
        d_dims, _ = _fp8_gemm.dgrad_dims(self.gemm.dims, self.nl, self.nr)
        w_dims, _ = _fp8_gemm.wgrad_dims(self.gemm.dims, self.nl, self.nr)
        return lc, rc, d_dims[0][0], w_dims[0][1], d_dims[0][1], w_dims[0][0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _measured_dot(lhs: Any, rhs: Any, probe: Any, static: _Static) -> tuple[Any, Any]:
    """``(fp8_dot_general(lhs, rhs), forward statistics)``; the backward statistics
    are `probe`'s cotangent (`probe` itself is never read)."""
    return _measured_fwd(lhs, rhs, probe, static)[0]


def _measured_fwd(lhs: Any, rhs: Any, probe: Any, static: _Static) -> tuple[tuple[Any, Any], Any]:
    # The product's own forward and backward rule, whatever they are.
    out, vjp = jax.vjp(functools.partial(_fp8_gemm.fp8_dot_general, gemm=static.gemm), lhs, rhs)
    al, ar, _, _, ar_dgrad, al_wgrad = static.reduce_axes()
    inv = _fp8_gemm.scale_dtype(static.gemm)
    rows = [cast_stats(lhs, _fp8_gemm.E4M3, al, inv), cast_stats(rhs, _fp8_gemm.E4M3, ar, inv)]
    if static.gemm.rowwise:
        # Rowwise, each backward product contracts other axes than the forward: it
        # casts the forward's operands to e4m3 again, with their own scales.
        # (Measured in the backward pass instead, beside those quantizations, the
        # step's bytes are the same on XLA:CPU and its HLO 11 % longer.)
        rows += [
            cast_stats(rhs, _fp8_gemm.E4M3, ar_dgrad, inv),
            cast_stats(lhs, _fp8_gemm.E4M3, al_wgrad, inv),
        ]
    return (out, jnp.stack(rows)), (vjp, probe)


def _measured_bwd(
    static: _Static, res: tuple[Any, Any], cts: tuple[Any, Any]
) -> tuple[Any, Any, Any]:
    vjp, probe = res
    g, _ = cts
    _, _, ad, aw, _, _ = static.reduce_axes()
    inv = _fp8_gemm.scale_dtype(static.gemm)
    dgrad = cast_stats(g, _fp8_gemm.E5M2, ad, inv)
    # Tensorwise both backward products read the one e5m2 cast of the gradient.
    wgrad = cast_stats(g, _fp8_gemm.E5M2, aw, inv) if static.gemm.rowwise else dgrad
    dl, dr = vjp(g)
    # Inside shard_map the probe varies over every manual axis (``fp8_health``), the
    # statistics over those the gradient does: the cotangent must have the probe's type.
    return dl, dr, jax_compat.like_varying(jnp.stack([dgrad, wgrad]), probe)


_measured_dot.defvjp(_measured_fwd, _measured_bwd)


@dataclasses.dataclass
class _Collector:
    """The products of one ``fp8_health`` trace: their names, scaling and forward
    statistics, in program order; `probes`: None while counting."""

    probes: Any
    trace: Any = None
    names: list[str] = dataclasses.field(default_factory=list)
    rowwise: list[bool] = dataclasses.field(default_factory=list)
    forward: list[Any] = dataclasses.field(default_factory=list)
    unmeasured: list[str] = dataclasses.field(default_factory=list)


_local = threading.local()


def _active() -> _Collector | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _collecting(col: _Collector) -> Iterator[_Collector]:
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(col)
    try:
        yield col
    finally:
        stack.pop()


def dot(lhs: Any, rhs: Any, gemm: _fp8_gemm.Gemm, name: str) -> Any:
    """The FP8 product ``Plan.dot`` emits, named `name` (its layer): measured
    when an ``fp8_health`` trace is collecting in this very trace, else exactly
    ``fp8_dot_general``."""
    col = _active()
    if col is None:
        return _fp8_gemm.fp8_dot_general(lhs, rhs, gemm)
    name = _unique(name or UNNAMED, col.names + col.unmeasured)
    if jax_compat.current_trace() is not col.trace:
        # A nested jit's, loop body's or remat's trace: its values cannot leave
        # with the loss.
        col.unmeasured.append(name)
        return _fp8_gemm.fp8_dot_general(lhs, rhs, gemm)
    i = len(col.names)
    col.names.append(name)
    col.rowwise.append(gemm.rowwise)
    if col.probes is None:  # counting
        return _fp8_gemm.fp8_dot_general(lhs, rhs, gemm)
    if i >= col.probes.shape[0]:
        raise RuntimeError(
            "jaxamp.fp8_health: the loss function ran more FP8 products than when it was "
            "counted; it must trace the same program each time it is traced"
        )
    out, fwd = _measured_dot(lhs, rhs, col.probes[i], _Static(gemm, lhs.ndim, rhs.ndim))
    col.forward.append(fwd)
    return out


def _unique(name: str, taken: list[str]) -> str:
    """`name`, or ``name#k`` for its k-th product (a layer called twice, or with two)."""
    if name not in taken:
        return name
    k = 2
    while f"{name}#{k}" in taken:
        k += 1
    return f"{name}#{k}"


def _report(
    names: list[str], rowwise: list[bool], forward: list[Any], backward: Any
) -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for i, name in enumerate(names):
        casts = {"lhs": forward[i][0], "rhs": forward[i][1]}
        if rowwise[i]:
            casts.update(grad_dgrad=backward[i][0], grad_wgrad=backward[i][1])
            casts.update(rhs_dgrad=forward[i][2], lhs_wgrad=forward[i][3])
        else:
            casts["grad"] = backward[i][0]
        out[name] = {c: dict(zip(STATS, row, strict=True)) for c, row in casts.items()}
    return out


def fp8_health(
    fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[tuple[Any, dict[str, Any]], Any]]:
    """``jax.value_and_grad(fun)`` that also measures every FP8 product inside `fun`.

    `fun` runs ``jaxamp.autocast(..., fp8=jaxamp.fp8(...))`` somewhere (its
    model, or all of it). The returned function gives ``((value, health),
    grads)``: ``value`` and ``grads`` as ``jax.value_and_grad(fun, argnums,
    has_aux)`` gives them, and ``health`` a dict of scalar arrays, one entry per
    FP8 product named by its layer as ``jaxamp.audit``'s per-op rows name it
    (``OpRow.layer``: its module path, ``Dense_1``, ``decoder/mlp/fc1``, or the
    path of the weight it reads where module paths do not tell layers apart,
    ``mlp/0/layers/1/weight``; ``dot_general`` where neither exists; ``name#2``
    for the second product of the same name), holding one dict per cast:
    ``"lhs"`` and ``"rhs"`` (the forward's e4m3 operands) and ``"grad"`` (the
    backward's e5m2 gradient); rowwise, whose backward products contract other
    axes and so cast again with their own scales, ``"grad_dgrad"`` and
    ``"grad_wgrad"`` for the gradient and ``"rhs_dgrad"`` and ``"lhs_wgrad"``
    for the forward's operands cast to e4m3 again; each with ``"amax"`` (the largest magnitude
    cast), ``"saturated"`` (the fraction of elements that are inf or NaN: under
    current scaling the only ones past the FP8 range) and ``"flushed"`` (the
    fraction that are nonzero and become 0 in FP8).

    Jit-safe: no host transfer; return ``health`` from the train step as
    metrics. It costs a few reductions per cast (docs/fp8.md gives the
    measured bytes and flops); ``fun`` is traced one more time to count its
    products. Without ``fp8_health`` nothing is measured and the program is
    unchanged. Called inside a ``shard_map`` body (a per-device step), each
    device measures its own shard: the figures vary over the mesh axes, to be
    reduced like the loss (``lax.pmax`` the amax, ``lax.pmean`` the fractions
    of equal shards). Products that autocast runs inside a nested ``jit`` with
    shardings, a loop body, ``remat`` or ``shard_map`` are not measured (a
    warning names them).

    Args:
      fun: the loss function, returning a scalar loss (or ``(loss, aux)`` with
        `has_aux`).
      argnums: the positional arguments to differentiate, as in ``jax.value_and_grad``.
      has_aux: whether `fun` returns ``(loss, aux)``.

    Returns:
      A function of `fun`'s arguments returning ``((value, health), grads)``.

    Examples:
      >>> model = flax.linen.Dense(32)
      >>> x = jnp.ones((16, 64))
      >>> params = model.init(jax.random.key(0), x)
      >>> fwd = jaxamp.autocast(model.apply, dtype=jnp.bfloat16,
      ...                       fp8=jaxamp.fp8(first_last_bf16=False))
      >>> loss_fn = lambda p: jnp.mean(fwd(p, x) ** 2)
      >>> (loss, health), grads = jaxamp.fp8_health(loss_fn)(params)
      >>> sorted(health)
      ['Dense']
      >>> sorted(health["Dense"]), sorted(health["Dense"]["grad"])
      (['grad', 'lhs', 'rhs'], ['amax', 'flushed', 'saturated'])
    """
    if not callable(fun):
        raise TypeError(f"jaxamp.fp8_health: fun must be callable, got {type(fun).__name__}")
    single = not isinstance(argnums, tuple | list)
    try:  # numpy integers too, as jax.value_and_grad reads them
        nums = tuple(operator.index(n) for n in ((argnums,) if single else argnums))
    except TypeError:
        nums = ()
    if not nums or any(isinstance(n, bool) for n in ((argnums,) if single else argnums)):
        raise TypeError(
            f"jaxamp.fp8_health: argnums must be an int or a sequence of ints, got {argnums!r}"
        )

    def measured(col: _Collector, *args: Any, **kwargs: Any) -> Any:
        col.trace = jax_compat.current_trace()
        with _collecting(col):
            return fun(*args, **kwargs)

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> tuple[tuple[Any, dict[str, Any]], Any]:
        if any(not -len(args) <= a < len(args) for a in nums):
            # jax would count the probes appended to the arguments.
            raise TypeError(
                f"jaxamp.fp8_health: differentiating with respect to argnums={argnums!r} "
                f"requires more positional arguments, but the function was called with "
                f"{len(args)} positional arguments."
            )
        positions = [a % len(args) for a in nums]
        differentiated = list(dict.fromkeys(positions))

        # Traced on the differentiated arguments only, as jax.value_and_grad traces
        # them: the others stay as the caller passed them (a numpy batch read with
        # numpy), and an autocast call on them alone runs as its own jit in both
        # passes, so both count the same products.
        def counted(count: _Collector, *vals: Any) -> Any:
            full = list(args)
            for i, v in zip(differentiated, vals, strict=True):
                full[i] = v
            return measured(count, *full, **kwargs)

        diff = [args[i] for i in differentiated]
        count = _Collector(probes=None)
        try:
            jax.eval_shape(functools.partial(counted, count), *diff)
        except _CONCRETE_ONLY:
            # eval_shape stages every op: Python control flow on a concrete
            # argument not differentiated meets a tracer there, not under
            # jax.value_and_grad. Count in value_and_grad's own regime (eagerly,
            # the forward runs once more; under jit, a trace).
            count = _Collector(probes=None)
            jax.vjp(functools.partial(counted, count), *diff)
        n = len(count.names)
        col = _Collector(probes=None)

        def with_probes(*all_args: Any, **kw: Any) -> Any:
            col.probes = all_args[-1]
            out = measured(col, *all_args[:-1], **kw)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, col.forward)

        grad_fn = jax.value_and_grad(with_probes, argnums=(*positions, len(args)), has_aux=True)
        # Inside a shard_map body each device measures its own shard: the probes, whose
        # cotangents carry the backward figures, vary over the mesh axes as those do.
        probes = jax_compat.varying_over(
            jnp.zeros((n, 2, len(STATS)), _F32), _fp8_gemm.manual_axes()
        )
        (loss, (aux, forward)), grads = grad_fn(*args, probes, **kwargs)
        # A nested jit or remat traces its function once: the counting pass met its
        # products, the measured pass reuses the jaxpr and never meets them.
        unmeasured = list(dict.fromkeys(col.unmeasured + count.unmeasured))
        if unmeasured:
            warnings.warn(
                "jaxamp.fp8_health: these FP8 products are traced apart from the loss (a "
                "nested jit, loop body, remat or shard_map, or an autocast call on no "
                f"differentiated argument) and are not measured: {unmeasured}",
                UserWarning,
                stacklevel=2,
            )
        health = _report(col.names, col.rowwise, forward, grads[-1])
        value = (loss, aux) if has_aux else loss
        grads = grads[0] if single else tuple(grads[:-1])
        return (value, health), grads

    return run
