"""The module path of an HLO instruction, from its ``op_name`` metadata."""

from __future__ import annotations

import re

from jaxamp.casting._interpreter import _decisions


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


def module_path(op_name: str) -> str:
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
        names = [n for n in _decisions.module_path("/".join(segment)).split("/") if n]
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
