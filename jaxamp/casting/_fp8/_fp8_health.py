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

A product in a function the interpreter traces apart (a scan body, a remat
region) cannot hand its tracers to the loss's trace: the region collects its
products (``apart``), takes their probes as extra inputs and returns their
forward statistics as extra outputs, a scan's stacked per iteration; the
caller records them (``adopt``) and ``fp8_health`` pools each product's
iterations (``pool``). A nested ``jit`` is inlined under ``fp8_health``.

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

from jaxamp._utils import jax_compat
from jaxamp.casting._fp8 import _fp8_gemm
from jaxamp.casting._fp8._fp8_health_stats import _F32, STATS, Static, measured_dot

__all__ = ["STATS", "fp8_health"]

#: What tracing a function that reads a concrete value of a traced argument raises.
_CONCRETE_ONLY = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)
#: The name of a product outside any module (audit's empty module path).
UNNAMED = "dot_general"


@dataclasses.dataclass
class _Collector:
    """The products of one trace: their names, scaling, iteration shapes (``(L,)`` for
    a product a scan runs L times, ``()`` for one run once) and forward statistics, in
    program order; `probes`: one per product, None while counting."""

    probes: list[Any] | None
    trace: Any = None
    names: list[str] = dataclasses.field(default_factory=list)
    rowwise: list[bool] = dataclasses.field(default_factory=list)
    shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    forward: list[Any] = dataclasses.field(default_factory=list)
    unmeasured: list[str] = dataclasses.field(default_factory=list)

    def add(self, name: str, rowwise: bool, shape: tuple[int, ...]) -> int:
        """Records one product (or a body's, run `shape` times); returns its index."""
        self.names.append(_unique(name, self.names + self.unmeasured))
        self.rowwise.append(rowwise)
        self.shapes.append(shape)
        return len(self.names) - 1

    def skip(self, name: str) -> None:
        """Records a product not measured, named apart from the measured ones only:
        a trace may run a region more than once (a branch whose output forms
        settle after two traces), and a layer is named once."""
        name = _unique(name, self.names)
        if name not in self.unmeasured:
            self.unmeasured.append(name)


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


def collecting() -> bool:
    """Whether an ``fp8_health`` trace is collecting FP8 products now."""
    return _active() is not None


@contextlib.contextmanager
def apart(probes: Sequence[Any] | None = None) -> Iterator[_Collector]:
    """Collects the products of a function traced apart from its caller (a scan body,
    a remat region), entered inside it: counts them, or with `probes` (one per
    product, as ``probes_for`` gives them) measures them. The caller then hands
    the body's figures out through the region's own inputs and outputs and
    ``adopt``s them."""
    sub = _Collector(probes=None if probes is None else list(probes))
    sub.trace = jax_compat.current_trace()
    with _collecting(sub):
        yield sub


def counting(body: Callable[..., Any]) -> tuple[Callable[..., Any], list[_Collector]]:
    """`body` counting its products apart (``apart``) each time it is traced, and
    a list holding the collector of its last trace."""
    found: list[_Collector] = []

    def counted(*xs: Any) -> Any:
        with apart() as sub:
            found[:] = [sub]
            return body(*xs)

    return counted, found


def probes_for(count: int) -> list[Any] | None:
    """The probes of the next `count` products of the active collector (None while
    counting): a region's products take them as inputs."""
    col = _active()
    if col is None or col.probes is None or not _here(col):
        return None
    i = len(col.names)
    if i + count > len(col.probes):
        raise _changed()
    return col.probes[i : i + count]


def adopt(sub: _Collector, shape: tuple[int, ...], forward: Sequence[Any] = ()) -> None:
    """Records in the active collector the products `sub` collected in a region run
    `shape` times (``(L,)``: a scan's L iterations), with their `forward` statistics
    as the region returned them (stacked over `shape`) when measuring."""
    col = _active()
    assert col is not None
    # A region in a trace no handler hands the figures out of (a cond branch, a
    # while body, a jit, remat or vmap around the autocast call) is not measured, as
    # a product written there is not (``dot``): ``probes_for`` gave it none.
    measured = sub.names if _here(col) else []
    for name, rowwise, s in zip(measured, sub.rowwise, sub.shapes, strict=False):
        col.add(name.partition("#")[0], rowwise, (*shape, *s))
    for name in [*sub.names[len(measured) :], *sub.unmeasured]:
        col.skip(name.partition("#")[0])
    if col.probes is not None:
        col.forward.extend(forward)


def _here(col: _Collector) -> bool:
    """Whether `col` collects in the trace JAX is tracing in now. Values made in
    another (a while body, a cond branch, a jit with shardings, shard_map, a jit,
    remat or vmap around the autocast call) cannot leave with the loss."""
    return jax_compat.current_trace() is col.trace


def _changed() -> RuntimeError:
    return RuntimeError(
        "jaxamp.fp8_health: the loss function ran more FP8 products than when it was "
        "counted; it must trace the same program each time it is traced"
    )


def dot(lhs: Any, rhs: Any, gemm: _fp8_gemm.Gemm, name: str) -> Any:
    """The FP8 product ``Plan.dot`` emits, named `name` (its layer): measured
    when an ``fp8_health`` trace is collecting in this very trace, else exactly
    ``fp8_dot_general``."""
    col = _active()
    if col is None:
        return _fp8_gemm.fp8_dot_general(lhs, rhs, gemm)
    name = name or UNNAMED
    if not _here(col):
        col.skip(name)
        return _fp8_gemm.fp8_dot_general(lhs, rhs, gemm)
    i = col.add(name, gemm.rowwise, ())
    if col.probes is None:  # counting
        return _fp8_gemm.fp8_dot_general(lhs, rhs, gemm)
    if i >= len(col.probes):
        raise _changed()
    out, fwd = measured_dot(lhs, rhs, col.probes[i], Static(gemm, lhs.ndim, rhs.ndim))
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


def pool(stat: str, value: Any, axis: Any = None) -> Any:
    """One figure of a cast pooled over the instances that cast as many elements each
    (a scan's iterations, a ``vmap``'s examples, a ``shard_map``'s devices) along
    `axis` (None: all): the largest amax, the mean of the fractions."""
    return value.max(axis) if stat == "amax" else value.mean(axis)


def _report(col: _Collector, backward: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for name, rowwise, shape, fwd, bwd in zip(
        col.names, col.rowwise, col.shapes, col.forward, backward, strict=True
    ):
        if 0 in shape:  # a scan of no iterations: no cast ran, nothing to pool
            continue
        casts = {"lhs": fwd[..., 0, :], "rhs": fwd[..., 1, :]}
        if rowwise:
            casts.update(grad_dgrad=bwd[..., 0, :], grad_wgrad=bwd[..., 1, :])
            casts.update(rhs_dgrad=fwd[..., 2, :], lhs_wgrad=fwd[..., 3, :])
        else:
            casts["grad"] = bwd[..., 0, :]
        axes = tuple(range(len(shape)))
        out[name] = {
            c: {s: pool(s, row[..., j], axes) for j, s in enumerate(STATS)}
            for c, row in casts.items()
        }
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
    of equal shards).

    Products in a ``lax.scan`` body inside the autocast function (``nn.scan``,
    ``nnx.scan``, a ``fori_loop`` with static bounds) are measured every
    iteration, and each product of the body (a scanned layer) has one entry,
    pooled over its iterations: the largest amax, the mean of the fractions
    (a scan of length 0 runs none: no entry).
    Products in a ``jax.checkpoint`` / ``nn.remat`` region or a nested ``jit``
    inside the autocast function are measured as inline ones are (the remat
    stays a remat; the jit is inlined, the same values). Not measured, and
    named in a warning: products in a ``while_loop`` body (not
    reverse-differentiable), a ``cond`` branch, a custom derivative, a
    ``shard_map`` or a ``jit`` with shardings or donation inside the autocast
    function (a scan or remat there included), and an autocast call made
    inside a ``jit`` or ``checkpoint`` of the loss's own (traced apart from the
    loss: put the ``jit`` or remat inside the autocast function instead).

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
        col = _Collector(probes=None)

        def with_probes(*all_args: Any, **kw: Any) -> Any:
            col.probes = list(all_args[-1])
            out = measured(col, *all_args[:-1], **kw)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, col.forward)

        grad_fn = jax.value_and_grad(with_probes, argnums=(*positions, len(args)), has_aux=True)
        # Inside a shard_map body each device measures its own shard: the probes, whose
        # cotangents carry the backward figures, vary over the mesh axes as those do.
        # One per product, stacked over the iterations of the scans it runs in.
        probes = [
            jax_compat.varying_over(jnp.zeros((*s, 2, len(STATS)), _F32), _fp8_gemm.manual_axes())
            for s in count.shapes
        ]
        (loss, (aux, forward)), grads = grad_fn(*args, probes, **kwargs)
        # A jit or remat around an autocast call traces its function once: the
        # counting pass met its products, the measured pass reuses the jaxpr and
        # never meets them.
        unmeasured = list(dict.fromkeys(col.unmeasured + count.unmeasured))
        if unmeasured:
            warnings.warn(
                "jaxamp.fp8_health: these FP8 products are traced apart from the loss (a "
                "while loop body, cond branch, custom derivative, shard_map or jit with "
                "shardings inside autocast, a jit or remat around an autocast call, or an "
                f"autocast call on no differentiated argument) and are not measured: {unmeasured}",
                UserWarning,
                stacklevel=2,
            )
        health = _report(dataclasses.replace(col, forward=forward), grads[-1])
        value = (loss, aux) if has_aux else loss
        grads = grads[0] if single else tuple(grads[:-1])
        return (value, health), grads

    return run
