"""What an equation's name stack says: jaxamp's markers, and which module it ran in.

``full_precision``, a nested ``autocast`` and ``keep_float32`` leave
``jax.named_scope`` markers; Flax names module calls (``_flax`` adds what it
does not). Each equation's rules are read from its name stack:
``Context.rules_at``.
"""

from __future__ import annotations

import fnmatch
import re

#: Equations traced under it run as written (``full_precision``).
FULL_PRECISION_SCOPE = "jaxamp_full_precision"
#: Equations of a nested ``autocast``: it already applied its own rules.
AUTOCAST_SCOPE = "jaxamp_autocast"
#: The ``reduce_precision`` identity that ``keep_float32`` leaves in a jaxpr.
KEEP_FLOAT32_SCOPE = "jaxamp_keep_float32"
#: Scopes that name no module: jaxamp's own markers and remat's recomputation.
MARKERS = (AUTOCAST_SCOPE, FULL_PRECISION_SCOPE, KEEP_FLOAT32_SCOPE, "rematted_computation")


def join(outer: str, inner: str) -> str:
    """Two name stacks, one inside the other, as one."""
    return f"{outer}/{inner}" if outer and inner else outer or inner


#: The scope ``jnp.einsum`` opens (``named_call`` with its subscripts, ``BTD,DF->BTF``):
#: an op's name, not a module's, so a module path never holds it (an ``nnx.Einsum``'s
#: product is its module's, ``proj``, not ``proj/BTD,DF->BTF``).
_EINSUM = re.compile(
    r"[A-Za-z.\s]*(?:,[A-Za-z.\s]*)+(?:->[A-Za-z.\s]*)?|[A-Za-z.\s]*->[A-Za-z.\s]*"
)


def scope_parts(stack: str) -> list[str]:
    """The scope names of a name stack, outermost first, without the transformations
    JAX wraps them in: ``vmap(eqx.nn.MLP)/Linear`` (a model called under ``jax.vmap``,
    as equinox models are) and ``transpose(jvp(head))`` name ``eqx.nn.MLP`` and
    ``head``, so ``modules=`` patterns and ``full_precision`` hold there too; and
    without ``jnp.einsum``'s subscripts (``_EINSUM``)."""
    parts, depth, cur = [], 0, ""
    for ch in stack + "/":
        if ch == "/" and depth == 0:
            while re.fullmatch(r"[\w.-]+\((.*)\)", cur):
                cur = cur[cur.index("(") + 1 : -1]
            parts += [p for p in cur.split("/") if p and not _EINSUM.fullmatch(p)]
            cur = ""
            continue
        depth += (ch == "(") - (ch == ")")
        cur += ch
    return parts


def module_path(parts: list[str]) -> str:
    """The module path of the scope names `parts` (``scope_parts``): linen's module
    names and autocast's nnx ``rel[Class]`` scopes, each relative to the one before
    (``decoder[Decoder]/blocks/0[Block]``: ``decoder/blocks/0``), and the user's
    ``jax.named_scope``s, without the ``[Class]`` suffixes and jaxamp's markers."""
    names = (p.partition("[")[0] for p in parts)
    return "/".join(n for n in names if n and not n.startswith(MARKERS))


def runs_as_written(parts: list[str]) -> str:
    """What makes a name stack run as written: ``"full_precision"`` or ``"nested
    autocast"`` (its own rules are already applied), or ``""``: nothing."""
    for p in parts:
        if p.startswith(FULL_PRECISION_SCOPE):
            return "full_precision"
        if p.startswith(AUTOCAST_SCOPE):
            return "nested autocast"
    return ""


def module_match(pattern: str, parts: list[str]) -> bool:
    """Whether `pattern` names a module on the name stack `parts`.

    A pattern matches a module path ("Block_0/LayerNorm_1", nnx "blocks/0/ln"),
    a module name, or a class name (linen auto-names are ``Class_N``; a
    ``[Class]`` scope names the class of the module whose scope precedes it).
    """
    names = []
    for p in parts:
        name, _, cls = p.partition("[")
        if name:
            names.append(name)
        if cls:
            names.append(cls.rstrip("]"))
        head, _, tail = name.rpartition("_")
        if head and tail.isdigit():
            names.append(head)
    if "/" in pattern:
        # A path names a module: its rule covers the ops of its submodules too.
        path = [n for n in (p.partition("[")[0] for p in parts) if n]
        for i in range(len(path), 0, -1):
            prefix = "/".join(path[:i])
            if fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, "*/" + pattern):
                return True
        return False
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)
