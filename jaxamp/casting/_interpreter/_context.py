"""One autocast trace: its configuration, where it is in the program, and its memos."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxamp.casting._interpreter._casts import cast_jit
from jaxamp.casting._rules._primitives import Handlers
from jaxamp.casting._rules._rules import FLOAT32
from jaxamp.casting._rules._scopes import module_match, runs_as_written, scope_parts


@dataclasses.dataclass
class Context:
    """One autocast trace: its configuration and per-trace memo tables.

    Every memo is keyed by the object it describes (with that object kept
    alive and checked by identity) plus everything else its answer depends on,
    and lives only as long as this trace.
    """

    dtype: np.dtype
    rules: Mapping[str, str]
    unknown_higher_order: str
    # Kind of higher-order primitive -> its handler (``_handlers.HANDLERS``).
    handlers: Handlers
    modules: tuple[tuple[str, Any], ...] = ()
    axis_env: tuple[tuple[Any, int], ...] = ()
    # False inside a custom_jvp rule, whose tangent ops must stay linear
    # (JAX transposes them): even its constants' casts are plain casts.
    saturate: bool = True
    # Re-bind every equation under its own traceback and name stack (what
    # ``jax.core.eval_jaxpr`` does), so the result's equations point at the
    # user's source lines and module scopes (``find_overflow``).
    source_info: bool = False
    # Re-bind every equation under its own traceback and name stack but keep
    # the float32 regions: the program is the one that runs, with each op at
    # its user's line (``find_overflow``, and ``jaxamp.audit``'s HLO rows).
    lines: bool = False
    # True inside a loop body or a cond branch. There the forward and the backward
    # pass land in different HLO computations, so XLA cannot CSE a rematerialised
    # op into the forward and its checkpoint needs no optimisation barriers
    # (``prevent_cse=False``, as JAX advises for remat inside scan): less to
    # compile. Outside, the barriers stay: without them XLA merges the bfloat16
    # upcasts of the forward and the backward and keeps more temporaries live.
    in_region: bool = False
    # The name stack around the jaxpr being evaluated (module scopes, markers).
    stack: str = ""
    # Inner jaxprs already autocast during this trace (key -> (jaxpr, result)).
    cache: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Casts already made: (id(value), dtype, saturating) -> (value, cast).
    casts: dict[tuple[int, Any], tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # The values a trace-time constant can hold, where known (``_constants``):
    # id(value) -> (value, distinct values). Keyed by the value, not its jaxpr
    # variable, so a fill built inside a nested jit keeps them outside it.
    known: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Resolved per-module rules per name stack.
    scoped: dict[str, tuple[bool, Mapping[str, str]]] = dataclasses.field(default_factory=dict)
    # Per name stack, where its rules differ from ``rules`` and why: primitive
    # name -> the ``modules=`` pattern that set it; ``"*"`` -> what makes the
    # whole scope run as written. Read by ``jaxamp.audit``'s per-op view.
    origins: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # The FP8 plan of this trace (``_fp8.Plan``), or None: no FP8.
    fp8: Any = None
    # The ids of the equations enclosing the jaxpr being evaluated, from the
    # outer one: where an inner jaxpr called at several places is called from.
    site: tuple[int, ...] = ()

    def sub(self, **changes: Any) -> Context:
        """A context for an inner trace: the same caches, no casts (other tracers)."""
        return dataclasses.replace(self, casts={}, **changes)

    def at(self, stack: str) -> Context:
        """This context under the name stack ``stack`` (the same trace and memos)."""
        return dataclasses.replace(self, stack=stack)

    @property
    def cached(self) -> bool:
        """Whether pure ops are bound through cached jits; not with ``lines``,
        where a cached trace would keep the source info of its first use."""
        return not self.lines

    def rules_at(self, stack: str | None = None) -> tuple[bool, Mapping[str, str]]:
        """``(run as written?, rules)`` for equations traced under ``stack`` (this
        context's own by default): the markers and ``modules=`` patterns on it."""
        stack = self.stack if stack is None else stack
        hit = self.scoped.get(stack)
        if hit is not None:
            return hit
        parts = scope_parts(stack)
        marker = runs_as_written(parts)
        full, origin = bool(marker), {"*": marker} if marker else {}
        rules = self.rules
        if self.modules and not full:
            for pattern, value in self.modules:
                if module_match(pattern, parts):
                    if value == FLOAT32:
                        full, origin["*"] = True, f"modules[{pattern!r}]='float32'"
                        break
                    rules = {**rules, **value}
                    origin.update(dict.fromkeys(value, f"modules[{pattern!r}]"))
        if self.fp8 is not None and not full:
            rules = self.fp8.scope_rules(parts, stack, rules)
        self.scoped[stack], self.origins[stack] = (full, rules), origin
        return full, rules

    def memo(self, key: Any, owner: Any, make: Callable[[], Any]) -> Any:
        """``make()``, once per (key, owner) and everything in this context
        that changes how an inner jaxpr is evaluated."""
        key = (key, self.axis_env, self.saturate, self.in_region)
        if self.fp8 is not None:  # a call site with an FP8 exclusion inside is its own
            key += (self.fp8.exclusions_under(self.site),)
        hit = self.cache.get(key)
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = make()
        self.cache[key] = (owner, value)
        return value

    def cast(self, x: Any, dtype: Any, const: bool = False) -> Any:
        """A cast, made once per (value, dtype) in this trace; saturating for a
        trace-time constant (`const`), plain (inf beyond the range) otherwise."""
        dtype = np.dtype(dtype)
        saturate = const and self.saturate
        key = (id(x), dtype, saturate)
        hit = self.casts.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        src = np.dtype(x.dtype)
        y = cast_jit(src, dtype, saturate)(x)
        self.casts[key] = (x, y)
        if dtype.itemsize > src.itemsize:
            # An exact upcast: casting the result back down gives `x` again.
            for s in (False, True):
                self.casts[(id(y), src, s)] = (y, x)
        return y
