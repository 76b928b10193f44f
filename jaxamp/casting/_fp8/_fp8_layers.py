"""The name an FP8 product goes by: its *layer*, the key of ``jaxamp.fp8(select=...)``,
``jaxamp.fp8_select``, ``jaxamp.fp8_health`` and ``audit``'s ``layer`` column.

A module path names a layer where the model names its modules: linen's, the nnx
modules autocast is given, ``jax.named_scope``. It does not everywhere. Equinox
scopes each call by its class, so every ``eqx.nn.Linear`` of a model shares one
path; an nnx module built from its state inside the traced function, or a plain
function of a dict of weights, has no path at all. A layer is the weight its
product reads, and the trace knows which array of `f`'s arguments that is
(``_fp8_roots``): there the product is named by that array's path inside its
argument (``mlp/0/layers/1/weight``, ``attn/query/kernel``), as
``jax.tree_util`` spells it.

So a product's layer is its module path when the products on that path all read
the same arrays of `f` (a module called twice is one layer), and the path of the
weight it reads otherwise. Of the arguments a product reads, only the one most
products read holds its weight: the input a first layer multiplies is an array
of `f` too, of the batch argument. Where the batch is read as often (the q, k and
v projections each read it), the argument with more of the arrays read holds
the weights; then the first (``jax.grad`` differentiates the first argument:
parameters come first). Two arguments with weights at the same path
(two models of one class) are told apart by the argument's name
(``g/layers/0/weight``, ``d/layers/0/weight``).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

__all__ = ["argument_names", "inner_path", "layer_names"]

#: Where an input of `f` sits: (its argument, its path inside that argument).
Name = tuple[str, str]


def argument_names(
    f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], is_leaf: Any = None
) -> list[Name]:
    """Each leaf of ``(args, kwargs)`` (flattened with `is_leaf`, as the caller does):
    its argument (`f`'s parameter name where the signature gives one, else its
    position) and its path inside it (``""``: the argument is the array)."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_leaf)[0]:
        where, key = path[0], path[1]
        if where == jax.tree_util.SequenceKey(0):
            i = key.idx
            arg = positional[i] if i < len(positional) else f"args[{i}]"
        else:
            arg = str(key.key)
        out.append((arg, inner_path(path[2:])))
    return out


def inner_path(path: Sequence[Any]) -> str:
    """``layers/0/weight``: a key path as a module path is written; an nnx Variable's
    ``.value`` (the array it holds) left out."""
    if path and path[-1] == jax.tree_util.GetAttrKey("value"):
        path = path[:-1]
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def layer_names(
    products: Sequence[tuple[str, frozenset[int]]], roots: Mapping[int, Name]
) -> list[str]:
    """The layer of each product, given as ``(module path, the ids of the arrays of
    `f` it reads)``; `roots`: the name of each input of `f`, in `f`'s argument order
    (its constants have none)."""
    counts: collections.Counter[str] = collections.Counter()
    arrays: dict[str, set[int]] = collections.defaultdict(set)
    for _, reads in products:
        counts.update({roots[r][0] for r in reads if r in roots})
        for r in reads:
            if r in roots:
                arrays[roots[r][0]].add(r)
    position = {}
    for arg, _ in roots.values():
        position.setdefault(arg, len(position))

    def weights(reads: frozenset[int]) -> list[Name]:
        # Of the arguments it reads, the one most products read holds its weight;
        # where the batch is read as often (each of q, k, v reads it), the one
        # with more of the arrays read; then the first (parameters come first:
        # ``jax.grad`` differentiates the first argument).
        args = {roots[r][0] for r in reads if r in roots}
        if not args:
            return []
        arg = min(args, key=lambda a: (-counts[a], -len(arrays[a]), position[a]))
        return sorted(roots[r] for r in reads if r in roots and roots[r][0] == arg)

    found = [weights(reads) for _, reads in products]
    # Two arguments holding weights at the same path (two models of one class)
    # are told apart by their argument's name.
    args_at: dict[str, set[str]] = collections.defaultdict(set)
    for names in found:
        for arg, path in names:
            args_at[path or arg].add(arg)
    qualify = set().union(*(a for a in args_at.values() if len(a) > 1))

    def name(names: list[Name]) -> str:
        return "+".join(
            f"{arg}/{path}" if path and arg in qualify else path or arg for arg, path in names
        )

    weight = [name(names) for names in found]
    read_by: dict[str, set[str]] = collections.defaultdict(set)
    for (path, _), w in zip(products, weight, strict=True):
        read_by[path].add(w)
    return [
        path if (path and len(read_by[path]) == 1) or not w else w
        for (path, _), w in zip(products, weight, strict=True)
    ]
