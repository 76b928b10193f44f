"""FP8 matrix products inside ``autocast``: the plan of one trace (which products run FP8).

``autocast(f, dtype=jnp.bfloat16, fp8=jaxamp.fp8())`` runs every eligible
``"lower"``-class ``dot_general`` of `f` as an FP8 product with current scaling
(``_fp8_gemm.fp8_dot_general``); everything else runs as bfloat16 autocast
does. Which products are eligible is decided here, once per trace, before any
equation is evaluated (``plan``):

* its rule where it stands is ``"lower"`` (``rules=`` / ``modules=`` of autocast,
  ``full_precision`` regions and float64 products are not touched);
* it has no batch dimensions (a Linear layer's product), unless
  ``batched=True``: attention's score and value products lose several times
  bfloat16's precision in e4m3, and Transformer Engine and torchao run only
  Linear GEMMs in FP8;
* M, N and K (the products of its lhs free, rhs free and contracting
  dimensions) are multiples of 16. XLA's GPU GEMM rewriter pads every
  non-batch dimension of an FP8 operand to a multiple of 16 before it calls
  cuBLASLt (``PadShapeToMultipleOf16`` / ``PadOperandToMultipleOf16`` in
  ``CreateF8CustomCall``, ``xla/service/gpu/transforms/gemm_rewriter.cc``:
  "as required by cuBLASLt FP8 gemms"), then slices the result: two copies
  and a padded GEMM where bfloat16 needs none. Such products stay bfloat16;
* it is not a product of the model's first or last matrix-product layer
  (``first_last_bf16``), unless a ``modules=`` rule of ``jaxamp.fp8`` says
  otherwise. The layers are the model's, not the program's: a layer is
  known by the arrays its product reads. The first and the last ``"lower"`` ``dot_general``
  of `f`'s forward program that run once per call (loop bodies, the repeated
  blocks of ``scan`` and ``while_loop``, are not searched; calls, ``remat``,
  custom derivatives, ``shard_map`` and ``cond`` branches are) name them;
  then every product that reads an array of `f` (an input leaf or a constant
  it closes over) that one of those two reads is excluded too: its weight, or
  the input it multiplies, read directly or through casts, transposes and
  reshapes, wherever the product runs (a second call of the model, a loop
  body that reads the weight as a constant). So a model applied to two
  batches keeps both calls' first and last layers in bfloat16, a tied
  embedding read by the first and the last product is one weight, and a
  weight shared by the first layer and a middle one keeps both in bfloat16.
  The two products themselves are known by their site (the equations that
  enclose them, their equation and their name stack), so one reading only
  computed values (a weight normalised inside `f`) is excluded there alone,
  and the same layer code, or the same ``jax.jit`` / ``jax.checkpoint`` layer
  function, called on other weights is another layer. A scanned body's
  product reads a slice of stacked weights, no array of `f`: it runs FP8. On
  a transformer whose embedding is a lookup this keeps the LM head (or the
  tied ``attend``) and the first projection in bfloat16; on a classifier, its
  first and last ``Dense``.

A ``modules=`` rule of ``jaxamp.fp8`` is matched like autocast's: a pattern
against each module's name and class, or, with a ``/``, its path; the last
matching pattern wins, and it overrides the first/last default either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._fp8 import _fp8_gemm, _fp8_health
from jaxamp.casting._fp8._fp8_config import Fp8Config
from jaxamp.casting._fp8._fp8_layers import Name, layer_names
from jaxamp.casting._fp8._fp8_roots import NONE, SAME_VALUES, Roots, subjaxpr_roots
from jaxamp.casting._rules import _rules
from jaxamp.casting._rules._scopes import join, module_match, module_path, scope_parts

__all__ = ["Plan", "plan"]

#: The key a scope's rules carry when an FP8 decision depends on the scope; its
#: value is the ``modules=`` verdict, ``(pattern, on)``, or None (no rule). A new
#: mapping per such scope also keeps autocast's per-call-site cache apart.
FP8_KEY = "jaxamp.fp8"
#: Higher-order primitives whose body runs more than once per call.
_LOOPS = frozenset({"scan", "while"})


#: A product as the plan names it: the ids of the equations that enclose it from
#: the outer jaxpr (its call site: one layer function called four times is four
#: products), the id of its own equation, and its name stack.
Site = tuple[tuple[int, ...], int, str]


class _Product(NamedTuple):
    """A product the plan may exclude: where it is, and what it reads."""

    site: tuple[Any, ...]  # the equations enclosing it, from the outer jaxpr
    eqn: Any
    stack: str
    reads: Roots  # its two operands' roots
    once: bool  # it runs once per call of `f` (not in a loop body)

    @property
    def key(self) -> Site:
        return (tuple(map(id, self.site)), id(self.eqn), self.stack)


@dataclasses.dataclass
class Plan:
    """The FP8 decisions of one autocast trace (``Context.fp8``)."""

    config: Fp8Config
    compute: np.dtype
    # Each product of the first and last layers -> (the equations of its site,
    # kept alive so that their ids stay theirs; "first" or "last").
    excluded: dict[Site, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    # Each product that may run FP8 -> its layer (``_fp8_layers``).
    layers: dict[Site, str] = dataclasses.field(default_factory=dict)
    # Each product whose layer a ``select=`` entry names -> that entry, ``(layer,
    # on, why)``.
    chosen: dict[Site, tuple[str, bool, str]] = dataclasses.field(default_factory=dict)
    # The equations of the sites above, kept alive so that their ids stay theirs.
    alive: list[Any] = dataclasses.field(default_factory=list)

    def under(self, site: tuple[int, ...]) -> tuple[tuple[Site, ...], tuple[str, ...]]:
        """What the call at `site` decides for its own products (``Context.memoized``: an
        inner jaxpr evaluated there is not the one evaluated at another call site): the
        products it excludes, and the layers of its products, in program order (a layer
        function called on each weight names, measures and reports each layer)."""
        n = len(site)
        off = [k for k, c in self.chosen.items() if not c[1]]
        excluded = tuple(k for k in [*self.excluded, *off] if k[0][:n] == site)
        return excluded, tuple(v for k, v in self.layers.items() if k[0][:n] == site)

    def layer(self, eqn: Any, site: tuple[int, ...], stack: str) -> str:
        """The layer of the product `eqn` at `site` under `stack` (``""``: none found)."""
        return self.layers.get((site, id(eqn), stack), "")

    def scope_rules(self, parts: list[str], stack: str, rules: Mapping[str, str]) -> Any:
        """`rules` for the scope `stack`, marked where an FP8 decision depends on it."""
        verdict = None
        for pattern, on in self.config.modules:
            if module_match(pattern, parts):
                verdict = (pattern, on)
        if verdict is None and not any(k[2] == stack for k in self.excluded):
            return rules
        return {**rules, FP8_KEY: verdict}

    def refusal(self, eqn: Any, site: tuple[int, ...], stack: str, rules: Mapping[str, str]) -> str:
        """Why this product, at `site` under `stack`, stays out of FP8 by the config
        (``""``: it does not)."""
        chosen = self.chosen.get((site, id(eqn), stack))
        if chosen is not None and not chosen[1]:
            return f"jaxamp.fp8(select=...) keeps {chosen[0]!r} out" + (
                f": {chosen[2]}" if chosen[2] else ""
            )
        verdict = rules.get(FP8_KEY)
        if verdict is not None:
            pattern, on = verdict
            return "" if on else f"jaxamp.fp8(modules={{{pattern!r}: False}})"
        hit = self.excluded.get((site, id(eqn), stack))
        return f"the model's {hit[1]} matrix-product layer (first_last_bf16)" if hit else ""

    def dot(
        self, eqn: Any, args: list[Any], params: Mapping[str, Any], target: np.dtype,
        rules: Mapping[str, str], site: tuple[int, ...], stack: str, entered: bool,
    ) -> tuple[list[Any] | None, str]:  # fmt: skip
        """The FP8 product for a ``"lower"`` ``dot_general`` bound on `args` (or None:
        it stays in `target`) at `site` under `stack`, and why (``jaxamp.audit``'s
        per-op view). `entered`: the equation's source info is in force already."""
        if target != self.compute:
            return None, ""
        refusal = self.refusal(eqn, site, stack, rules)
        if refusal:
            return None, f"not FP8: {refusal}"
        lhs, rhs = args
        dims = _dims(params)
        if dims[1][0] and not self.config.batched:
            return None, (
                "not FP8: a batched product (attention): bf16 by default; "
                "jaxamp.fp8(batched=True) runs it in FP8"
            )
        if not _fp8_gemm.eligible(lhs.shape, rhs.shape, dims):
            m, n, k = _fp8_gemm.mnk(lhs.shape, rhs.shape, dims)
            return None, (
                f"not FP8: M, N, K = {m}, {n}, {k}, not all multiples of 16 (XLA would "
                "pad each FP8 operand for cuBLASLt)"
            )
        if np.dtype(lhs.dtype) != target or np.dtype(rhs.dtype) != target:
            return None, "not FP8: an operand is not in the autocast dtype"
        pref = params.get("preferred_element_type")
        gemm = _fp8_gemm.Gemm(
            dims=dims,
            rowwise=self.config.scaling == "rowwise",
            out_dtype=np.dtype(pref) if pref is not None else target,
            lhs_dtype=np.dtype(lhs.dtype),
            rhs_dtype=np.dtype(rhs.dtype),
            out_sharding=params.get("out_sharding"),
        )
        # Under the equation's own source info: the FP8 GEMMs, forward and
        # backward, carry the user's line and module path into the HLO metadata
        # (what ``jaxamp.audit`` reads), not autocast's, unless the interpreter has
        # entered it already (``Config.lines``: a second time would repeat the
        # module path).
        with contextlib.nullcontext() if entered else jax_compat.source_info_context(eqn):
            name = self.layer(eqn, site, stack) or module_path(scope_parts(stack))
            outs = [_fp8_health.dot(lhs, rhs, gemm, name)]
        on, chosen = rules.get(FP8_KEY), self.chosen.get((site, id(eqn), stack))
        why = f" (jaxamp.fp8(modules={{{on[0]!r}: True}}))" if on else ""
        if chosen is not None and chosen[2]:
            why += f" (jaxamp.fp8(select=...): {chosen[2]})"
        return (
            outs,
            f"FP8 {self.config.scaling}: float8_e4m3fn operands, float8_e5m2 gradients{why}",
        )


def _paths(parts: list[list[str]]) -> set[str]:
    """The module paths of name stacks (their scope names)."""
    return {p for p in map(module_path, parts) if p}


def _dims(params: Mapping[str, Any]) -> _fp8_gemm.DotDims:
    dims = params["dimension_numbers"]
    return tuple(tuple(tuple(int(i) for i in d) for d in pair) for pair in dims)  # type: ignore[return-value]


def plan(
    config: Fp8Config | None,
    jaxpr: Jaxpr,
    compute: np.dtype,
    rules_at: Callable[[str], tuple[bool, Mapping[str, str]]],
    names: Sequence[Name] | None = None,
) -> Plan | None:
    """The FP8 plan of autocast's trace of `jaxpr` in `compute`; `rules_at`: ``(run as
    written?, rules)`` under a name stack, before any FP8 mark; `names`: where each
    input of `jaxpr` sits in `f`'s arguments (``_fp8_layers.argument_names``)."""
    if config is None:
        return None
    found: list[_Product] = []  # every product that may run FP8
    stacks: set[str] = set()

    def walk(
        jaxpr: Jaxpr, outer: str, site: tuple[Any, ...], once: bool, ins: list[Roots]
    ) -> list[Roots]:
        """Walks `jaxpr`, its inputs' roots `ins`; returns its outputs' roots."""
        roots: dict[Any, Roots] = dict(zip(jaxpr.invars, ins, strict=True))
        roots.update((v, frozenset({id(v)})) for v in jaxpr.constvars)

        def of(v: Any) -> Roots:
            return NONE if isinstance(v, Literal) else roots.get(v, NONE)

        for eqn in jaxpr.eqns:
            stack = join(outer, jax_compat.name_stack(eqn))
            stacks.add(stack)
            full, rules = rules_at(stack)
            name = eqn.primitive.name
            rule = _rules.AS_WRITTEN if full else rules.get(name, _rules.FOLLOW)
            if name in SAME_VALUES:
                pairs = zip(eqn.outvars, eqn.invars, strict=False)
                roots.update((o, of(i)) for o, i in pairs)
            elif name == "dot_general":
                dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars]
                # A batched product is no layer unless it may run FP8 itself.
                kind = config.batched or not _dims(eqn.params)[1][0]
                if (
                    kind
                    and rule == _rules.LOWER
                    and all(is_float_dtype(d) and d.itemsize <= 4 for d in dtypes)
                ):
                    reads = of(eqn.invars[0]) | of(eqn.invars[1])
                    found.append(_Product(site, eqn, stack, reads, once))
            elif rule != _rules.AS_WRITTEN:
                # Loop bodies run more than once per call: no first or last layer
                # there (a product of theirs may still read one's weight), but
                # their module names count for the patterns.
                inner = once and name not in _LOOPS
                subs = subjaxpr_roots(eqn, [of(v) for v in eqn.invars])
                outs = [walk(sub, stack, (*site, eqn), inner, given) for sub, given in subs]
                if len(subs) == 1 and name not in _LOOPS:  # a call: its results
                    roots.update(zip(eqn.outvars, outs[0], strict=False))
        return [of(v) for v in jaxpr.outvars]

    walk(jaxpr, "", (), True, [frozenset({id(v)}) for v in jaxpr.invars])
    parts = [scope_parts(s) for s in stacks]
    for pattern, _ in config.modules:
        if not any(module_match(pattern, p) for p in parts):
            warnings.warn(
                f"jaxamp.fp8(modules={{{pattern!r}: ...}}) matches no module of the "
                f"function autocast traced (its module paths: "
                f"{sorted(_paths(parts))[:8]}); check the name, "
                "class or path",
                UserWarning,
                stacklevel=2,
            )
    result = Plan(config, np.dtype(compute))
    _name_layers(result, found, jaxpr, names)
    layers = [p for p in found if p.once]
    if config.first_last_bf16 and layers:
        # The first and last layers are the model's, not the program's: every
        # product that reads an array the first (last) product of the program
        # reads, its weight or the input it multiplies, is that layer called
        # again (the model applied to a second batch, or in a loop).
        for layer, which in ((layers[-1], "last"), (layers[0], "first")):
            for p in found:
                if p is layer or p.reads & layer.reads:
                    result.excluded[p.key] = ((*p.site, p.eqn), which)
    return result


def _name_layers(
    result: Plan, found: list[_Product], jaxpr: Jaxpr, names: Sequence[Name] | None
) -> None:
    """Each product's layer in `result`, and the ``select=`` entry naming it; warns of
    an entry that names no product."""
    roots = dict(zip(map(id, jaxpr.invars), names or (), strict=False))
    products = [(module_path(scope_parts(p.stack)), p.reads) for p in found]
    select = {c[0]: c for c in result.config.select}
    for p, layer in zip(found, layer_names(products, roots), strict=True):
        result.layers[p.key] = layer
        result.alive.append((*p.site, p.eqn))
        if layer in select:
            result.chosen[p.key] = select[layer]
    unknown = sorted(set(select) - set(result.layers.values()))
    if unknown:
        warnings.warn(
            f"jaxamp.fp8(select=...) names {unknown[:4]}, no layer of the function autocast "
            f"traced (its layers: {sorted(set(result.layers.values()))[:8]}); a selection "
            "is for the function and arguments jaxamp.fp8_select measured",
            UserWarning,
            stacklevel=3,
        )
