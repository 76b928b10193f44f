"""Reading HLO text (``lowered.as_text(dialect="hlo")``, ``compiled.as_text()``).

HLO text is XLA's printed form, not a stable API; this reads only what
``jaxamp.audit`` needs and tolerates what it does not know: each instruction's
name, result type, opcode, operands and attributes, the computation it is in
(and which instruction calls that computation), and the stack-frame tables
(``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames``) that
XLA prints before the computations since 2025, which ``metadata={...
stack_frame_id=N}`` refers to (older XLA printed ``source_file`` /
``source_line`` in the metadata itself; both are read).
"""

from __future__ import annotations

import dataclasses
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_TABLE_ROW = re.compile(r'^(\d+)\s+(?:"(.*)"|\{(.*)\})\s*$')
_KV = re.compile(r"(\w+)=(\d+)")
_PARTITIONS = re.compile(r"^HloModule\s.*\bnum_partitions=(\d+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-,\s%]+)\}?")


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # "f32[32,64]" (layout dropped), or a tuple type
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    computation: str

    @property
    def dtype(self) -> str:
        return self.type.split("[")[0].lstrip("(")

    @property
    def dims(self) -> tuple[int, ...]:
        inner = self.type.partition("[")[2].partition("]")[0]
        return tuple(int(d) for d in inner.split(",") if d.strip().isdigit())

    def attr(self, key: str) -> str | None:
        m = re.search(rf'{key}="((?:[^"\\]|\\.)*)"', self.attrs)
        if m is not None:
            return m.group(1)
        m = re.search(rf"{key}=([^,\s}}]+)", self.attrs)
        return m.group(1) if m is not None else None


@dataclasses.dataclass
class Module:
    instrs: dict[str, Instr]
    computations: dict[str, list[str]]  # computation -> instruction names, in order
    callers: dict[str, str]  # computation -> the instruction that calls it
    files: dict[int, str]
    functions: dict[int, str]
    locations: dict[int, tuple[int, int, int]]  # id -> (file id, function id, line)
    frames: dict[int, tuple[int, int]]  # id -> (location id, parent frame id or 0)
    partitions: int = 1  # ``num_partitions`` of the module: how many devices share its SPMD program

    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, ins in self.instrs.items():
            for o in ins.operands:
                out.setdefault(o, []).append(name)
        return out

    def frames_of(self, ins: Instr) -> list[tuple[str, int, str]]:
        """``(file, line, function)`` of `ins`'s source, innermost first."""
        file, line = ins.attr("source_file"), ins.attr("source_line")
        if file is not None and line is not None:  # older XLA: one location
            return [(file, int(line), "")]
        out: list[tuple[str, int, str]] = []
        frame = int(ins.attr("stack_frame_id") or 0)
        seen: set[int] = set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            loc, parent = self.frames[frame]
            f_id, fn_id, line_no = self.locations.get(loc, (0, 0, 0))
            out.append((self.files.get(f_id, "?"), line_no, self.functions.get(fn_id, "?")))
            # The printed parent is one more than the parent's own id (checked
            # on f -> g -> h: h's frame prints its own id as its parent).
            frame = parent - 1
        return out


def _split_operands(text: str) -> tuple[list[str], str]:
    """The operand names of ``op(<text>`` and what follows the closing parenthesis."""
    depth, end = 1, len(text)
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                end = i
                break
    args, rest = text[:end], text[end + 1 :]
    if "%" in args:
        names = re.findall(r"%([\w.\-]+)", args)
    else:  # pre-optimization text: bare names, no operand types
        names = [a.strip() for a in args.split(",") if re.fullmatch(r"[\w.\-]+", a.strip())]
    return names, rest


def parse(text: str) -> Module:
    instrs: dict[str, Instr] = {}
    comps: dict[str, list[str]] = {}
    callers: dict[str, str] = {}
    tables: dict[str, dict[int, str]] = {}
    table = None
    comp = ""
    partitions = 1
    for line in text.splitlines():
        if (p := _PARTITIONS.match(line)) is not None:
            partitions = int(p.group(1))
            continue
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = tables.setdefault(stripped, {})
            continue
        row = _TABLE_ROW.match(stripped)
        if table is not None and row is not None:
            table[int(row.group(1))] = row.group(2) if row.group(2) is not None else row.group(3)
            continue
        m = _INSTR.match(line)
        if m is not None and comp:
            name, typ, op, tail = m.groups()
            operands, attrs = _split_operands(tail)
            instrs[name] = Instr(name, typ.split("{")[0], op, operands, attrs, comp)
            comps[comp].append(name)
            for called in _CALLS.findall(attrs):
                for c in re.split(r"[,\s%]+", called):
                    if c:
                        callers.setdefault(c, name)
            continue
        h = _HEADER.match(stripped)
        if h is not None and not stripped.startswith("HloModule"):
            table, comp = None, h.group(1)
            comps.setdefault(comp, [])
    kv = {k: {i: dict((a, int(b)) for a, b in _KV.findall(v)) for i, v in rows.items()}
          for k, rows in tables.items() if k in ("FileLocations", "StackFrames")}  # fmt: skip
    return Module(
        instrs,
        comps,
        callers,
        tables.get("FileNames", {}),
        tables.get("FunctionNames", {}),
        {
            i: (d.get("file_name_id", 0), d.get("function_name_id", 0), d.get("line", 0))
            for i, d in kv.get("FileLocations", {}).items()
        },
        {
            i: (d.get("file_location_id", 0), d.get("parent_frame_id", 0))
            for i, d in kv.get("StackFrames", {}).items()
        },
        partitions,
    )
