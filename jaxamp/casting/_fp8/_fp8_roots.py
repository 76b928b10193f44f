"""The roots of a value in the FP8 plan's walk: which arrays of the traced function
(its inputs, the constants it closes over) a value holds unchanged.

A product's weight reaches it cast, transposed or resharded, through nested calls
and loop constants; the plan names a layer by the arrays its product reads, so that
a model called twice has the same first and last layers in both calls.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Jaxpr

from jaxamp._utils import jax_compat
from jaxamp.casting._rules._layouts import RELAYOUT
from jaxamp.casting._rules._primitives import open_jaxpr, subjaxprs

#: A value's roots: the ids of the arrays of `f` (its inputs, the constants it
#: closes over) whose values it holds unchanged, only laid out again: a weight
#: as a product reads it (cast to bfloat16, transposed, reshaped).
Roots = frozenset[int]
NONE: Roots = frozenset()
#: Ops whose results hold their operands' values (``Roots``).
SAME_VALUES = RELAYOUT | {
    "reduce_precision", "sharding_constraint", "mesh_cast", "reshard", "pvary", "device_put",
}  # fmt: skip


def subjaxpr_roots(eqn: Any, ins: list[Roots]) -> list[tuple[Jaxpr, list[Roots]]]:
    """Each inner jaxpr of `eqn`, with the roots of its inputs given `ins`, those
    of `eqn`'s inputs. A loop body's carry and scanned slices change from one
    iteration to the next: only its constants hand on the caller's arrays."""
    name, params = eqn.primitive.name, eqn.params
    found = []
    for key, sub in subjaxprs(params):
        inner, _ = open_jaxpr(sub)
        n = len(inner.invars)
        if name == "cond":
            given = ins[1:]  # after the branch index
        elif name == "scan":
            given = ins[: jax_compat.scan_counts(params)[0]]
        elif name == "while":
            first = 0 if key == "cond_jaxpr" else params["cond_nconsts"]
            given = ins[first : first + params[f"{key.partition('_')[0]}_nconsts"]]
        else:
            given = ins if len(ins) == n else []
        found.append((inner, (list(given) + [NONE] * n)[:n]))
    return found
