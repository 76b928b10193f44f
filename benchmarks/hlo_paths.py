"""What a finite step runs, read off a compiled step's optimized HLO text.

XLA's ``cost_analysis()`` is static: for a ``conditional`` it counts the branch that
costs most, whichever one a step takes. A guarded step has two kinds of conditional,
the update (taken on a finite step) and, in older versions, a re-check of the
gradients that ran only while the loss scale was below 1; both are ``lax.cond``\\ s
whose ``true`` branch is what a finite step runs (the last of
``branch_computations``). So the *finite path* of a module is the same module with
every conditional replaced by a ``call`` of that branch; its bytes are what XLA's own
cost analysis says of that module. ``every_k``'s window conditional is reduced the
same way: to the call that ends a window (the update), the costly one.

Everything here reads the text of ``compiled.as_text()``: no figure depends on the
machine's speed.
"""

from __future__ import annotations

import re
from typing import Any

import jax

# Ops that launch no kernel: they name buffers or are resolved at compile time.
_NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}
# `%name = shape op(`; a tuple shape holds spaces: `(f32[2]{0}, s32[]) conditional(`.
_OP = re.compile(r"= (\(.*?\)|\S+) ([\w-]+)\(")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE = re.compile(r"true_computation=(%[\w.-]+)")
# Computations an op runs in place (a GPU command buffer's `call`, a loop's body):
# their ops are kernels of the step. A fusion's `calls=` is one kernel, not followed.
_RUNS = re.compile(r"\b(?:to_apply|body|condition)=(%[\w.-]+)")
_COND_LINE = re.compile(r"^(\s*(?:ROOT )?%[\w.-]+ = .*?) conditional\((.*)$")
_METADATA = re.compile(r"metadata=\{[^}]*\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2}
_BYTES |= {"f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# Ops that only move a buffer's bytes to another buffer (XLA's copy insertion and
# layout changes); asynchronous copies come as a start/done pair, counted once.
_COPIES = {"copy", "copy-start"}


def computations(text: str) -> dict[str, list[str]]:
    """The HLO module's computations by name (``ENTRY`` for the entry), their op lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0]
            out[name] = []
        elif name is not None and line.strip() not in ("", "}"):
            out[name].append(line.strip())
    return out


def taken_branch(line: str) -> str | None:
    """The branch computation a finite step runs for a ``conditional`` op line."""
    branches = _BRANCHES.search(line)
    if branches:
        return branches.group(1).split(", ")[-1]
    true = _TRUE.search(line)
    return true.group(1) if true else None


def finite_step_kernels(text: str) -> dict[str, int]:
    """The kernels a finite step runs in compiled HLO text, counted per ``op shape``.

    The entry computation's ops plus, for each conditional, its last branch: the
    ``true`` branch of a ``lax.cond``, which is the update taken on a finite step;
    ``call`` and ``while`` computations are followed (once). Fused computations
    count once (one kernel); parameters, constants, bitcasts and tuple plumbing
    launch nothing and are left out.
    """
    comps = computations(text)

    def walk(name: str) -> dict[str, int]:
        got: dict[str, int] = {}
        for line in comps.get(name, []):
            m = _OP.search(line)
            if m is None or m.group(2) in _NO_KERNEL:
                continue
            shape = "(tuple)" if m.group(1).startswith("(") else m.group(1)
            key = f"{m.group(2)} {shape}"
            got[key] = got.get(key, 0) + 1
            inner: list[str] = []
            if m.group(2) == "conditional":
                inner = [b for b in [taken_branch(line)] if b]
            elif m.group(2) in ("call", "while"):
                inner = _RUNS.findall(line)
            for sub in inner:
                for k, v in walk(sub).items():
                    got[k] = got.get(k, 0) + v
        return got

    return walk("ENTRY")


def _array_bytes(shape: str) -> int:
    m = _ARRAY.match(shape)
    if m is None or m.group(1) not in _BYTES:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _BYTES[m.group(1)]


_CALLS = re.compile(r"\bcalls=(%[\w.-]+)")
# Ops that only move or reinterpret bytes: a fusion made of nothing else is a copy kernel
# (XLA:CPU wraps a layout-changing copy in one: `%wrapped_copy = ... fusion(...)`).
_MOVES = {"parameter", "copy", "transpose", "bitcast", "reshape", "tuple", "get-tuple-element"}


def _is_copy_fusion(comps: dict[str, list[str]], line: str) -> bool:
    called = _CALLS.search(line)
    body = comps.get(called.group(1), []) if called else []
    ops = [m.group(2) for m in map(_OP.search, body) if m is not None]
    return bool(ops) and set(ops) <= _MOVES and any(o in ("copy", "transpose") for o in ops)


def _copies_in(comps: dict[str, list[str]], name: str, taken_only: bool) -> list[dict[str, Any]]:
    """The copy kernels a computation runs (``copy`` ops, and fusions that only copy or
    transpose: ``kind`` "copy" or "layout"), with those of the computations it runs in
    place (conditionals: their taken branch only, or every branch)."""
    out = []
    for line in comps.get(name, []):
        m = _OP.search(line)
        if m is None:
            continue
        op = m.group(2)
        kind = "copy" if op in _COPIES else None
        if op == "fusion" and _is_copy_fusion(comps, line):
            kind = "layout"
        if kind is not None:
            meta = _OP_NAME.search(line)
            shape = m.group(1)
            out.append(
                {
                    "kind": kind,
                    "shape": shape,
                    "bytes": _array_bytes(shape),
                    "op_name": meta.group(1) if meta else "",
                }
            )
        inner: list[str] = []
        if op == "conditional":
            branches = _BRANCHES.search(line)
            if taken_only or not branches:
                inner = [b for b in [taken_branch(line)] if b]
            else:
                inner = branches.group(1).split(", ")
        elif op in ("call", "while"):
            inner = _RUNS.findall(line)
        for sub in inner:
            out.extend(_copies_in(comps, sub, taken_only))
    return out


def branch_copies(text: str) -> list[dict[str, Any]]:
    """Per conditional of the entry computation, the copy ops each branch runs.

    Returns one dict per conditional: its ``name``, and ``branches``, a list (in
    ``branch_computations`` order, so the last is what a finite step takes) of lists
    of ``{"kind", "shape", "bytes", "op_name"}``, one per copy kernel the branch runs
    (nested conditionals: their taken branch): a ``copy`` op ("copy": what XLA
    inserts for a buffer handed through or shared), or a fusion that only copies or
    transposes ("layout": a layout change XLA did not fuse into the consumers). A
    copy fused with other work into one kernel is not listed.
    """
    comps = computations(text)
    out = []
    for line in comps.get("ENTRY", []):
        m = _OP.search(line)
        if m is None or m.group(2) != "conditional":
            continue
        branches = _BRANCHES.search(line)
        names = branches.group(1).split(", ") if branches else [taken_branch(line)]
        out.append(
            {
                "name": line.split(" = ")[0].strip().removeprefix("ROOT "),
                "branches": [_copies_in(comps, b, taken_only=True) for b in names if b],
            }
        )
    return out


def _split_operands(s: str) -> list[str]:
    """The comma-separated operands at the start of ``s`` (just after ``op(``)."""
    depth, cur, args = 0, "", []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return [*args, cur.strip()]
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    raise ValueError(f"unbalanced operand list: {s[:80]!r}")


def finite_path_text(text: str) -> str:
    """The module with every ``conditional`` replaced by a ``call`` of its taken branch
    (the last of ``branch_computations``, or ``true_computation``) on that branch's
    operand."""
    lines = []
    for line in text.splitlines():
        m = _COND_LINE.match(line)
        if m is not None:
            args = _split_operands(m.group(2))
            branch = taken_branch(line)
            branches = _BRANCHES.search(line)
            # Operands: the branch index (or predicate), then one per branch.
            k = len(branches.group(1).split(", ")) if branches else 1
            meta = _METADATA.search(line)
            line = f"{m.group(1)} call({args[k]}), to_apply={branch}"
            line += f", {meta.group(0)}" if meta else ""
        lines.append(line)
    return "\n".join(lines)


def hlo_bytes(text: str) -> float:
    """XLA's cost analysis (``bytes accessed``) of an HLO module given as text."""
    from jax._src.lib import xla_client
    from jaxlib import _hlo  # the HLO text parser, beside the compiler

    module = _hlo.hlo_module_from_text(text)
    cost = xla_client._xla.hlo_module_cost_analysis(jax.devices()[0].client, module)
    return float(cost.get("bytes accessed", float("nan")))


def finite_path_bytes(text: str) -> float:
    """Bytes accessed on the finite path: XLA's cost analysis of ``finite_path_text``."""
    return hlo_bytes(finite_path_text(text))
