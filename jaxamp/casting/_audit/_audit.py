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
from collections.abc import Callable
from typing import Any, ClassVar

import jax

from jaxamp._utils.optional import loaded
from jaxamp.casting._audit import _hlo_text
from jaxamp.casting._interpreter._decisions import (
    OpRow,
    fresh_trace,
    module_path,
    recording,
    user_frame,
)
from jaxamp.casting._rules._scopes import AUTOCAST_SCOPE, FULL_PRECISION_SCOPE

__all__ = ["AuditReport", "MatmulRow", "OpRow", "audit"]

_GEMM_TARGETS = {
    "__cublas$lt$matmul$f8": "cuBLASLt FP8 GEMM",
    "__cublas$lt$matmul": "cuBLASLt GEMM",
    "__cublas$gemm": "cuBLAS GEMM",
}
_PASSTHROUGH = {"parameter", "convert", "bitcast", "copy", "transpose", "reshape", "broadcast"}


@dataclasses.dataclass(frozen=True)
class MatmulRow:
    """One matrix product or convolution of the compiled program.

    Attributes:
      kernel: how XLA runs it (``"cuBLASLt FP8 GEMM"``, ``"cuBLAS GEMM"``,
        ``"Triton GEMM"``, ``"dot"``, ``"convolution"``, a custom call target).
      requested: operand and result dtypes in the program XLA was given, e.g.
        ``"f8e4m3fn x f8e4m3fn -> f32"`` (``"?"``: XLA made this product itself).
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


def _split_scopes(op_name: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in op_name:
        if ch == "/" and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch == "(") - (ch == ")")
        cur += ch
    return [*parts, cur]


# Scope names JAX's lowering adds to op_names, which the jaxpr (and
# ``report.ops``) has not: a nested jit's ``jit(f)`` (pjit), ``checkpoint``
# (remat), ``closed_call`` (a scan body), and the pairs ``while/body``
# (``cond``, ``body_pred``) and ``cond/branch_<i>_fun``.
_LOWERING = re.compile(r"(?:p?jit|pmap|xla_pmap)\(.*\)|checkpoint|closed_call")
_LOWERING_PAIRS = {
    "while": re.compile(r"body|cond|body_pred"),
    "cond": re.compile(r"branch_\d+_fun"),
}


def _module_path(op_name: str) -> str:
    """``jit(f)/transpose(jvp(jaxamp_autocast))/M/mid/dot_general`` -> ``M/mid``: the
    module path ``report.ops`` gives the equation, without what the lowering added."""
    parts, kept = _split_scopes(op_name)[:-1], []
    i = 0
    while i < len(parts):
        pair = _LOWERING_PAIRS.get(parts[i])
        if pair is not None and i + 1 < len(parts) and pair.fullmatch(parts[i + 1]):
            i += 2
            continue
        if not _LOWERING.fullmatch(parts[i]):
            kept.append(parts[i])
        i += 1
    # A rematerialised forward inside its transpose enters the scopes again
    # under a transformation (JAX's own name stack: ``transpose(jvp(outer))/
    # jvp(outer)``): where the names from a transformed part on repeat the path
    # so far, they re-enter it rather than extend it.
    path: list[str] = []
    for segment in _segments(kept):
        names = [n for n in module_path("/".join(segment)).split("/") if n]
        if path and names[: len(path)] == path:
            names = names[len(path) :]
        path += names
    return "/".join(path)


def _segments(parts: list[str]) -> list[list[str]]:
    """`parts` cut before each transformed part (``jvp(...)``) after the first."""
    out: list[list[str]] = [[]]
    for p in parts:
        if re.fullmatch(r"[\w.-]+\(.*\)", p) and out[-1]:
            out.append([])
        out[-1].append(p)
    return out


def _is_matmul(ins: _hlo_text.Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    target = ins.attr("custom_call_target") or ""
    return ins.opcode == "custom-call" and (target in _GEMM_TARGETS or "conv" in target)


def _op_names(mod: _hlo_text.Module) -> dict[str, str]:
    """Each instruction's op_name as the optimized HLO spells it: the text JAX
    gives XLA names a called computation's instructions relative to their
    ``call`` (``dot_general`` under ``jit(f)/jit(layer)``), which XLA inlines."""
    full: dict[str, str] = {}

    def name_of(ins: _hlo_text.Instr) -> str:
        if ins.name not in full:
            own = ins.attr("op_name") or ""
            caller = mod.instrs.get(mod.callers.get(ins.computation, ""))
            if caller is not None and caller.opcode == "call":
                outer = name_of(caller)
                if outer and not own.startswith(outer):
                    own = f"{outer}/{own}" if own else outer
            full[ins.name] = own
        return full[ins.name]

    for ins in mod.instrs.values():
        name_of(ins)
    return full


# A product XLA runs is matched to the one autocast asked for by what survives
# XLA's passes and the SPMD partitioner unchanged: its op_name and the user's
# line. The shape does not survive: the partitioner gives each device a shard
# (each dimension divided by the mesh axes it is split over, padded up where it
# does not divide; a split contraction leaves it whole), and XLA merges
# adjacent dimensions (a (batch, seq, features) product run as a 2-D one). So
# among the requests of one op_name and line (a layer's input and weight
# gradients; one line called for several layers) a product answers the ones
# whose global shape it can be a shard of (`_shard_of`): each run of adjacent
# global dimensions, divided by a factor, is one of its dimensions, the
# factors multiplying to a divisor of the module's ``num_partitions`` (1 off a
# mesh: the shape itself). Not the sharding: the compiled text keeps it on
# parameters only, and before partitioning only an Explicit mesh or a
# ``with_sharding_constraint`` annotates a product (on an Auto mesh the
# partitioner chooses). Not an ordinal among a line's products: the compiled
# text is a schedule, in which a layer's two gradients, independent of each
# other, come in either order.
def _key(mod: _hlo_text.Module, ins: _hlo_text.Instr, op_name: str) -> tuple[str, str]:
    return (op_name, user_frame(mod.frames_of(ins)))


@dataclasses.dataclass
class _Request:
    dims: tuple[int, ...]  # the product's global result shape
    dtypes: str
    taken: bool = False


def _shard_of(whole: tuple[int, ...], part: tuple[int, ...], partitions: int) -> bool:
    """Whether `part` can be one device's shard of a `whole`-shaped result (see above)."""
    big, small = [d for d in whole if d != 1], [d for d in part if d != 1]

    def fits(i: int, j: int, left: int) -> bool:  # `left`: the partitions not yet spent
        if j == len(small):  # what remains is split down to size 1
            return left % _size(tuple(big[i:])) == 0
        run = 1
        for k in range(i, len(big)):
            run *= big[k]
            for f in (f for f in range(1, left + 1) if left % f == 0):
                if -(-run // f) == small[j] and fits(k + 1, j + 1, left // f):
                    return True
        return False

    return fits(0, 0, partitions)


def _fitting(group: list[_Request], dims: tuple[int, ...], partitions: int) -> list[_Request]:
    """The requests of `group` a compiled product of shape `dims` can answer: those it is
    a shard of, else (XLA transposed it) those whose size it divides, else all of them
    if they agree (XLA padded it: cuBLASLt FP8 operands to multiples of 16)."""
    fit = [r for r in group if _shard_of(r.dims, dims, partitions)]
    if not fit:
        size = _size(dims)
        fit = [r for r in group if _size(r.dims) % size == 0
               and partitions % (_size(r.dims) // size) == 0]  # fmt: skip
    if not fit and len({r.dtypes for r in group}) == 1:
        fit = group
    return fit


def _dtypes(mod: _hlo_text.Module, ins: _hlo_text.Instr, n: int) -> str:
    ops = [mod.instrs[o].dtype for o in ins.operands[:n] if o in mod.instrs]
    return " x ".join(ops) + f" -> {ins.dtype}"


def _kernel(mod: _hlo_text.Module, ins: _hlo_text.Instr) -> str:
    if ins.opcode == "custom-call":
        target = ins.attr("custom_call_target") or "custom-call"
        return _GEMM_TARGETS.get(target, target)
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
    requests: dict[tuple[str, str], list[_Request]] = {}
    names = _op_names(pre)
    for ins in pre.instrs.values():
        if _is_matmul(ins):
            key = _key(pre, ins, names[ins.name])
            requests.setdefault(key, []).append(_Request(ins.dims, _dtypes(pre, ins, 2)))
    products = [ins for ins in post.instrs.values() if _is_matmul(ins)]
    fits = [
        _fitting(requests.get(_key(post, ins, ins.attr("op_name") or ""), []), ins.dims,
                 post.partitions)
        for ins in products
    ]  # fmt: skip
    chosen: list[_Request | None] = [f[0] if len(f) == 1 else None for f in fits]
    for r in chosen:
        if r is not None:
            r.taken = True
    # The rest in order; the last request that fits also answers the products XLA
    # makes more of (a nested jit called twice is one computation before XLA
    # inlines it, an unrolled loop body, a GEMM split in two).
    for i, fit in enumerate(fits):
        if chosen[i] is None and fit:
            r = next((r for r in fit if not r.taken), fit[-1])
            r.taken, chosen[i] = True, r
    rows = []
    for ins, request in zip(products, chosen, strict=True):
        op_name = ins.attr("op_name") or ""
        requested = request.dtypes if request is not None else "?"
        executed, kernel = _dtypes(post, ins, 2), _kernel(post, ins)
        accumulation = "f32" if "FP8" in kernel else ins.dtype
        rows.append(MatmulRow(
            kernel, requested, executed, accumulation, ins.type,
            "backward" if "transpose(" in op_name else "forward", _module_path(op_name),
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
            converts.append((_size(ins.dims),
                f"{src.type if src else '?'} -> {ins.type} at "
                f"{_module_path(ins.attr('op_name') or '') or '-'} "
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


def _size(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
