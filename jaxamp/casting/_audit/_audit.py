"""``jaxamp.audit``: what precision each matrix product really runs in, after XLA.

autocast decides the dtype of every product in the program it gives XLA; XLA
may still run it otherwise: its GPU GEMM rewriter turns an FP8 product into a
cuBLASLt FP8 call only for the shapes it matches (else an f16 GEMM), XLA:CPU
has no FP8 or bfloat16 GEMM and computes them in float32, and a float32 value
somewhere upstream makes a product float32. ``audit`` compiles the function,
reads the program XLA was given (the request) and the one it will run (the
optimized HLO), and lists every matrix product and convolution with both,
where it comes from (module path and source line, from the HLO metadata), and
a flag wherever they disagree. Before XLA, it lists autocast's own choice for
each equation it evaluated and why (``ops``, from ``_decisions``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax

from jaxamp._utils.optional import loaded
from jaxamp.casting._audit import _health, _hlo_text
from jaxamp.casting._audit._match import GEMM_TARGETS, dtypes, is_matmul, requests, size
from jaxamp.casting._audit._names import module_path
from jaxamp.casting._interpreter._decisions import OpRow, fresh_trace, recording, user_frame
from jaxamp.casting._rules._scopes import AUTOCAST_SCOPE, FULL_PRECISION_SCOPE

__all__ = ["AuditReport", "MatmulRow", "OpRow", "audit"]

_PASSTHROUGH = {"parameter", "convert", "bitcast", "copy", "transpose", "reshape", "broadcast"}


@dataclasses.dataclass(frozen=True)
class MatmulRow:
    """One matrix product or convolution of the compiled program.

    Attributes:
      kernel: how XLA runs it (``"cuBLASLt FP8 GEMM"``, ``"cuBLAS GEMM"``,
        ``"Triton GEMM"``, ``"dot"``, ``"convolution"``, a custom call target).
      requested: operand and result dtypes in the program XLA was given, e.g.
        ``"f8e4m3fn x f8e4m3fn -> bf16"``, an operand dequantized from FP8 right
        before the product counted as FP8 (``"?"``: XLA made this product itself).
      executed: operand and result dtypes XLA runs.
      accumulation: the accumulation dtype (the product's result type in HLO;
        float32 for cuBLASLt FP8, which always accumulates in float32).
      shape: the result shape, as one device runs it (a shard of it on a mesh).
      pass_: ``"forward"`` or ``"backward"`` (a transposed product).
      module: the module path (Flax module names, ``jax.named_scope``s).
      source: the user's ``file:line (function)`` it was traced from.
      flags: what autocast asked for that XLA does not do, or worth a look.
    """

    kernel: str
    requested: str
    executed: str
    accumulation: str
    shape: str
    pass_: str
    module: str
    source: str
    flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditReport:
    """What ``jaxamp.audit`` found: ``matmuls``, ``converts`` and ``ops``;
    ``str()`` is a table of each (converts of at least ``LARGE`` elements).

    Attributes:
      platform: the backend compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``).
      matmuls: one `MatmulRow` per product / convolution, in program order.
      converts: every standalone (unfused) dtype conversion, as ``(element
        count, description)``: an extra pass over memory that a fused cast
        would not cost. ``large_converts`` / ``converts_of_at_least(n)`` keep
        the large ones.
      ops: autocast's choice for each floating equation it evaluated, before
        XLA, in trace order: one `OpRow` (primitive, dtype, op class and where
        the class comes from, why, module path, source line). Empty when `fn`
        runs no ``autocast``.
    """

    platform: str
    matmuls: tuple[MatmulRow, ...]
    converts: tuple[tuple[int, str], ...]
    ops: tuple[OpRow, ...] = ()

    #: The element count from which ``large_converts`` lists a convert (4 MiB of float32).
    LARGE: ClassVar[int] = 2**20

    @property
    def flagged(self) -> tuple[MatmulRow, ...]:
        return tuple(r for r in self.matmuls if r.flags)

    @property
    def large_converts(self) -> tuple[str, ...]:
        """The standalone converts of at least ``LARGE`` (2**20) elements."""
        return self.converts_of_at_least(self.LARGE)

    def converts_of_at_least(self, elements: int) -> tuple[str, ...]:
        """The standalone converts of at least `elements` elements.

        A method of the report rather than an argument of ``audit``, whose
        keyword arguments are all `fn`'s."""
        return tuple(text for size, text in self.converts if size >= elements)

    def health_table(self, health: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
        """`health` (what ``jaxamp.fp8_health`` returned for a step of the audited
        function) as a table beside the products: per FP8 product and cast, the
        amax, the fractions saturated and flushed to zero, the kernel XLA runs
        the product on, and a flag for a cast with inf / NaN or at least 0.1 %
        flushed. Reads the arrays (a host transfer): call it outside the step.

        A method of the report, not of ``audit``: audit compiles the function
        and never runs it, and the health of a cast is a figure of the values."""
        rows = _health.table(self.matmuls, self.ops, health)
        flagged = sum(1 for r in rows if r[-1])
        lines = [f"FP8 health: {len(health)} products, {flagged} casts flagged"]
        lines += _table(("layer", "cast", "amax", "saturated", "flushed", "kernel", "flags"), rows)
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [f"jaxamp.audit ({self.platform}): {len(self.matmuls)} products, "
                 f"{len(self.flagged)} flagged"]  # fmt: skip
        lines += _table(
            ("pass", "module", "requested", "executed", "kernel", "source", "flags"),
            [(r.pass_, r.module or "-", r.requested, r.executed, r.kernel, r.source,
              "; ".join(r.flags)) for r in self.matmuls],
        )  # fmt: skip
        lines += [f"large convert: {c}" for c in self.large_converts]
        if self.ops:
            lines.append(f"autocast's choices ({len(self.ops)} ops, before XLA):")
            lines += _table(
                ("module", "op", "dtype", "class (rule)", "source", "why"),
                [(r.module or "-", r.primitive, r.dtype, f"{r.op_class} ({r.rule})", r.source,
                  r.reason) for r in self.ops],
            )  # fmt: skip
        return "\n".join(lines)


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """`rows` under `head` in aligned columns, the last one left ragged."""
    rows = [head, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    ]


def _kernel(mod: _hlo_text.Module, ins: _hlo_text.Instr) -> str:
    if ins.opcode == "custom-call":
        target = ins.attr("custom_call_target") or "custom-call"
        return GEMM_TARGETS.get(target, target)
    caller = mod.instrs.get(mod.callers.get(ins.computation, ""))
    if caller is not None and caller.opcode == "fusion":
        if "__triton_gemm" in caller.attrs:
            return f"Triton {ins.opcode}"
        kind = re.search(r'"kind":"(\w+)"', caller.attrs)
        return f"{ins.opcode} ({kind.group(1).strip('_') if kind else 'fusion'})"
    return ins.opcode


def _flags(requested: str, executed: str, kernel: str, op_name: str, platform: str) -> list[str]:
    req_in = requested.split(" -> ")[0].split(" x ")
    ex_in = executed.split(" -> ")[0].split(" x ")
    flags = []
    if any(d.startswith("f8") for d in req_in) and "FP8" not in kernel:
        if not any(d.startswith("f8") for d in ex_in) or kernel in ("dot", "convolution"):
            why = " (XLA:CPU has no FP8 GEMM)" if platform == "cpu" else ""
            flags.append(f"FP8 requested, XLA runs it on {'/'.join(sorted(set(ex_in)))}{why}")
    low = {"bf16", "f16"}
    if set(req_in) & low and not set(ex_in) & low and not any(d.startswith("f8") for d in ex_in):
        why = " (XLA:CPU has no half-precision GEMM)" if platform == "cpu" else ""
        flags.append(f"{'/'.join(sorted(set(req_in)))} requested, XLA runs it in float32{why}")
    inside = AUTOCAST_SCOPE in op_name and FULL_PRECISION_SCOPE not in op_name
    if inside and req_in and all(d == "f32" for d in req_in):
        flags.append("float32 product inside autocast (a rule, keep_float32 or a float32 input)")
    return flags


def _function_only(f: Callable[..., Any]) -> Callable[..., Any]:
    """Arguments of the audited function given to ``audit`` itself (0.4's interim call
    form): a ``TypeError`` saying what to write, not Python's count of arguments."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not args and list(kwargs) == ["fun"]:  # fun= by keyword, as its signature allows
            args, kwargs = (kwargs["fun"],), {}
        if len(args) != 1 or kwargs:
            raise TypeError(
                "jaxamp.audit takes the function only and returns the function to call with "
                "its arguments, as jax.make_jaxpr does: write "
                "jaxamp.audit(fun)(*args, **kwargs)."
            )
        return f(*args)

    return wrapper


@_function_only
def audit(fun: Callable[..., Any]) -> Callable[..., AuditReport]:
    """``jaxamp.audit(fun)(*args, **kwargs)`` compiles ``fun(*args, **kwargs)`` and lists
    every matrix product as XLA will run it.

    For each ``dot`` / convolution (and the GEMM custom calls XLA makes of
    them) of the optimized HLO: the dtypes in the program JAX gave XLA (what
    autocast asked for), the dtypes and kernel XLA runs, the accumulation
    dtype, forward or backward, the module path and the user's source line
    (from the HLO metadata). Flagged: an FP8 product XLA does not run as an
    FP8 GEMM, a bfloat16 / float16 one it runs in float32, a float32 product
    inside ``autocast``. ``converts`` lists the unfused dtype conversions
    (``large_converts``: those of at least 2**20 elements;
    ``converts_of_at_least(n)``: of at least `n`). Works on any backend: on the CPU every FP8 and
    bfloat16 product is flagged, since XLA:CPU computes them in float32. On a
    mesh (a ``jit`` with ``in_shardings`` or sharded inputs, Auto or Explicit
    axes) it lists the program one device runs: each product's shape is its
    shard, with the request of the product it is a shard of.

    ``ops`` is the view before XLA: for each floating equation every
    ``autocast`` inside `fn` evaluated, the dtype it chose, the op class in
    force and where it comes from (``DEFAULT_RULES``, ``rules=``, a
    ``modules=`` pattern, ``full_precision``), and why (a promotion, a float32
    region, an FP8 product or the FP8 exclusion that kept it out). `fun` is
    traced afresh for it, even if JAX has traced it before.

    The function comes first and its arguments in a second call, as in
    ``jax.make_jaxpr(fun)(*args)``.

    Args:
      fun: the function, e.g. a training step (jitted or not).

    Returns:
      A function of ``fun``'s arguments (arrays, or ``jax.ShapeDtypeStruct``s)
      returning an [`AuditReport`][jaxamp.types.AuditReport]; print it for a table.

    Raises:
      TypeError: if arguments of ``fun`` are given to ``audit`` itself.

    Examples:
      >>> f = jaxamp.autocast(lambda x, w: x @ w, dtype=jnp.bfloat16)
      >>> report = jaxamp.audit(f)(jnp.ones((16, 32)), jnp.ones((32, 16)))
      >>> report.matmuls[0].requested
      'bf16 x bf16 -> bf16'
      >>> report.ops[0].primitive, report.ops[0].dtype, report.ops[0].op_class
      ('dot_general', 'bfloat16', 'lower')
    """
    if not callable(fun):
        raise TypeError(f"jaxamp.audit: fun must be callable, got {type(fun).__name__}")

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> AuditReport:
        return _audit(fun, args, kwargs)

    return run


def _audit(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> AuditReport:
    lower = getattr(fn, "lower", None) or _nnx_lower(fn) or jax.jit(fn).lower
    with recording() as ops, fresh_trace():
        lowered = lower(*args, **kwargs)
    # eqx.filter_jit's lower() wraps JAX's Lowered in its own (whose as_text takes no
    # dialect and whose compile() returns equinox's Compiled): read the JAX one inside.
    if not isinstance(lowered, jax.stages.Lowered):
        lowered = getattr(lowered, "lowered", lowered)
    try:
        pre_text = lowered.as_text(dialect="hlo", debug_info=True)
    except TypeError:  # pragma: no cover - JAX without debug_info
        pre_text = lowered.as_text(dialect="hlo")
    compiled = lowered.compile()
    pre, post = _hlo_text.parse(pre_text), _hlo_text.parse(compiled.as_text())
    platform = jax.devices()[0].platform
    products = [ins for ins in post.instrs.values() if is_matmul(ins)]
    rows = []
    for ins, requested in zip(products, requests(pre, post, products), strict=True):
        op_name = ins.attr("op_name") or ""
        executed, kernel = dtypes(post, ins), _kernel(post, ins)
        accumulation = "f32" if "FP8" in kernel else ins.dtype
        rows.append(MatmulRow(
            kernel, requested, executed, accumulation, ins.type,
            "backward" if "transpose(" in op_name else "forward", module_path(op_name),
            user_frame(post.frames_of(ins)),
            tuple(_flags(requested, executed, kernel, op_name, platform)),
        ))  # fmt: skip
    converts = []
    for ins in post.instrs.values():
        if ins.opcode != "convert" or not ins.dims:
            continue
        comp = post.computations.get(ins.computation, [])
        if all(post.instrs[n].opcode in _PASSTHROUGH for n in comp):
            src = post.instrs.get(ins.operands[0]) if ins.operands else None
            converts.append((size(ins.dims),
                f"{src.type if src else '?'} -> {ins.type} at "
                f"{module_path(ins.attr('op_name') or '') or '-'} "
                f"({user_frame(post.frames_of(ins))})"
            ))  # fmt: skip
    return AuditReport(
        platform=platform, matmuls=tuple(rows), converts=tuple(converts), ops=tuple(ops)
    )


def _nnx_lower(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``lower`` of `fn` when it is an nnx module or a method bound to one
    (``jaxamp.autocast(model)``): a pure function of the module's state, as
    ``nnx.jit`` traces it, so a forward that writes state (BatchNorm statistics)
    writes it to a copy inside the trace, not to the module outside it."""
    nnx = loaded("flax.nnx")
    if nnx is None:
        return None
    whole = nnx.graph.is_graph_node(fn)
    module = fn if whole else getattr(fn, "__self__", None)
    if module is None or not nnx.graph.is_graph_node(module):
        return None
    method = type(fn).__call__ if whole else fn.__func__
    graphdef, state = nnx.split(module)

    def pure(state: Any, *args: Any, **kwargs: Any) -> Any:
        return method(nnx.merge(graphdef, state), *args, **kwargs)

    return functools.partial(jax.jit(pure).lower, state)
