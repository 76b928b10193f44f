"""Matching each product XLA runs to the product autocast asked for.

``pre`` is the HLO text JAX gives XLA (what autocast asked for), ``post`` the
optimized text XLA will run; both parsed by ``_hlo_text``.
"""

from __future__ import annotations

import dataclasses

from jaxamp.casting._audit import _hlo_text
from jaxamp.casting._interpreter._decisions import user_frame

GEMM_TARGETS = {
    "__cublas$lt$matmul$f8": "cuBLASLt FP8 GEMM",
    "__cublas$lt$matmul": "cuBLASLt GEMM",
    "__cublas$gemm": "cuBLAS GEMM",
}


def is_matmul(ins: _hlo_text.Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    target = ins.attr("custom_call_target") or ""
    return ins.opcode == "custom-call" and (target in GEMM_TARGETS or "conv" in target)


def dtypes(mod: _hlo_text.Module, ins: _hlo_text.Instr, requested: bool = False) -> str:
    """``"bf16 x bf16 -> f32"``: its two operands' dtypes and its result's. With
    `requested`, an operand dequantized from FP8 right before the product counts
    as its FP8 dtype (``"f8e4m3fn x f8e4m3fn -> bf16"``)."""
    ops = [
        (_dequantized_from(mod, o) if requested else None) or mod.instrs[o].dtype
        for o in ins.operands[:2]
        if o in mod.instrs
    ]
    return " x ".join(ops) + f" -> {ins.dtype}"


# What XLA's GPU GEMM rewriter lets stand between an FP8 dequantization and the
# product (``MatchFp8Param`` in ``xla/service/gpu/transforms/gemm_rewriter.cc``).
_COMMUTING = {"bitcast", "broadcast", "copy", "dynamic-slice", "pad", "reshape", "slice",
              "transpose"}  # fmt: skip


def _producer(mod: _hlo_text.Module, name: str) -> _hlo_text.Instr | None:
    """The instruction `name` is, past the ``Sharding`` annotations JAX puts around
    every value on an Explicit mesh (the partitioner removes them before the
    rewriter runs)."""
    ins = mod.instrs.get(name)
    while (
        ins is not None
        and ins.opcode == "custom-call"
        and ins.attr("custom_call_target") == "Sharding"
        and ins.operands
    ):
        ins = mod.instrs.get(ins.operands[0])
    return ins


def _dequantized_from(mod: _hlo_text.Module, name: str) -> str | None:
    """The f8 dtype of ``convert(f8) * scale`` (or ``/ scale``) that `name` is, past
    the commuting ops; None if it is not one."""
    ins = _producer(mod, name)
    while ins is not None and ins.opcode in _COMMUTING and ins.operands:
        ins = _producer(mod, ins.operands[0])
    if ins is None or ins.opcode not in ("multiply", "divide"):
        return None
    for o in ins.operands[:1] if ins.opcode == "divide" else ins.operands:
        conv = _producer(mod, o)
        if conv is not None and conv.opcode == "convert" and conv.operands:
            src = _producer(mod, conv.operands[0])
            if src is not None and src.dtype.startswith("f8"):
                return src.dtype
    return None


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
            return left % size(tuple(big[i:])) == 0
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
        n = size(dims)
        fit = [r for r in group if size(r.dims) % n == 0
               and partitions % (size(r.dims) // n) == 0]  # fmt: skip
    if not fit and len({r.dtypes for r in group}) == 1:
        fit = group
    return fit


def requests(
    pre: _hlo_text.Module, post: _hlo_text.Module, products: list[_hlo_text.Instr]
) -> list[str]:
    """The dtypes autocast asked for (in `pre`, the text JAX gave XLA) of each of
    `products` (products of `post`, the optimized text); ``"?"``: XLA made it."""
    asked: dict[tuple[str, str], list[_Request]] = {}
    names = _op_names(pre)
    for ins in pre.instrs.values():
        if is_matmul(ins):
            key = _key(pre, ins, names[ins.name])
            asked.setdefault(key, []).append(_Request(ins.dims, dtypes(pre, ins, requested=True)))
    fits = [
        _fitting(asked.get(_key(post, ins, ins.attr("op_name") or ""), []), ins.dims,
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
    return [r.dtypes if r is not None else "?" for r in chosen]


def size(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
