"""One autocast trace: what it runs (``Config``), where the walk is (``Position``), its memos.

A ``Context`` bundles the three with the trace's FP8 plan, built when the context is
(``Context.start``), and the casts made at one tracing level. It is frozen: going into
an inner jaxpr makes a new one (``sub``, ``at``) over the same ``Memo``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from jax.extend.core import Jaxpr

from jaxamp.casting._fp8._fp8 import Plan, plan
from jaxamp.casting._fp8._fp8_config import Fp8Config
from jaxamp.casting._rules._primitives import Handlers
from jaxamp.casting._rules._rules import FLOAT32
from jaxamp.casting._rules._scopes import module_match, runs_as_written, scope_parts

#: ``(run as written?, rules)`` in force under one name stack.
ScopeRules = tuple[bool, Mapping[str, str]]


@dataclasses.dataclass(frozen=True)
class Config:
    """What one autocast trace runs, the same from its start to its end."""

    dtype: np.dtype
    rules: Mapping[str, str]
    unknown_higher_order: str
    # Kind of higher-order primitive -> its handler (``_handlers.HANDLERS``).
    handlers: Handlers
    modules: tuple[tuple[str, Any], ...] = ()
    # Re-bind every equation under its own traceback and name stack (what
    # ``jax.core.eval_jaxpr`` does), so the result's equations point at the
    # user's source lines and module scopes (``find_overflow``).
    source_info: bool = False
    # Re-bind every equation under its own traceback and name stack but keep
    # the float32 regions: the program is the one that runs, with each op at
    # its user's line (``find_overflow``, and ``jaxamp.audit``'s HLO rows).
    lines: bool = False

    @property
    def cached(self) -> bool:
        """Whether pure ops are bound through cached jits; not with ``lines``,
        where a cached trace would keep the source info of its first use."""
        return not self.lines

    def scope_rules(self, stack: str) -> tuple[bool, Mapping[str, str], dict[str, str]]:
        """``(run as written?, rules, origins)`` under ``stack`` from the markers on it
        and the ``modules=`` patterns (the FP8 plan's marks aside); origins: primitive
        name -> the pattern that set its rule, ``"*"`` -> what runs the scope as written."""
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
        return full, rules, origin


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the walk is in the program; going in makes a new one."""

    # The name stack around the jaxpr being evaluated (module scopes, markers).
    stack: str = ""
    # The ids of the equations enclosing the jaxpr being evaluated, from the
    # outer one: where an inner jaxpr called at several places is called from.
    site: tuple[int, ...] = ()
    axis_env: tuple[tuple[Any, int], ...] = ()
    # False inside a custom_jvp rule, whose tangent ops must stay linear
    # (JAX transposes them): even its constants' casts are plain casts.
    saturate: bool = True
    # True inside a loop body or a cond branch. There the forward and the backward
    # pass land in different HLO computations, so XLA cannot CSE a rematerialised
    # op into the forward and its checkpoint needs no optimisation barriers
    # (``prevent_cse=False``, as JAX advises for remat inside scan): less to
    # compile. Outside, the barriers stay: without them XLA merges the bfloat16
    # upcasts of the forward and the backward and keeps more temporaries live.
    in_region: bool = False


@dataclasses.dataclass
class Memo:
    """The memo tables of one trace, shared by every position in it.

    Every memo is keyed by the object it describes (with that object kept
    alive and checked by identity) plus everything else its answer depends on,
    and lives only as long as this trace.
    """

    # Inner jaxprs already autocast during this trace (key -> (jaxpr, result)).
    cache: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # The values a trace-time constant can hold, where known (``_constants``):
    # id(value) -> (value, distinct values). Keyed by the value, not its jaxpr
    # variable, so a fill built inside a nested jit keeps them outside it.
    known: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # Resolved rules per name stack, FP8 marks included.
    scoped: dict[str, ScopeRules] = dataclasses.field(default_factory=dict)
    # Per name stack, where its rules differ from ``Config.rules`` and why
    # (``Config.scope_rules``'s origins). Read by ``jaxamp.audit``'s per-op view.
    origins: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Context:
    """One autocast trace at one position of its walk."""

    config: Config
    # The FP8 plan of this trace, or None: no FP8.
    fp8: Plan | None
    position: Position
    memo: Memo
    # Casts already made at this tracing level (an inner trace has other
    # tracers): (id(value), dtype, saturating) -> (value, cast). ``_casts.cast``.
    casts: dict[tuple[int, Any, bool], tuple[Any, Any]]

    @classmethod
    def start(
        cls, config: Config, fp8: Fp8Config | None, jaxpr: Jaxpr, names: Any = None
    ) -> Context:
        """The context at the top of `jaxpr`, with the FP8 plan of its trace; `names`:
        where its inputs sit in `f`'s arguments (``_fp8_layers.argument_names``)."""
        seen: dict[str, ScopeRules] = {}

        def unmarked(stack: str) -> ScopeRules:
            if stack not in seen:
                seen[stack] = config.scope_rules(stack)[:2]
            return seen[stack]

        return cls(config, plan(fp8, jaxpr, config.dtype, unmarked, names), Position(), Memo(), {})

    def sub(self, **changes: Any) -> Context:
        """A context for an inner trace at a `changes`d position: the same memos,
        no casts (other tracers)."""
        return dataclasses.replace(
            self, position=dataclasses.replace(self.position, **changes), casts={}
        )

    def at(self, stack: str) -> Context:
        """This context under the name stack ``stack`` (the same trace and memos)."""
        return dataclasses.replace(self, position=dataclasses.replace(self.position, stack=stack))

    def inside(self, eqn: Any) -> Context:
        """This context inside the higher-order equation `eqn`: its call site extended
        (the same trace, memos and casts)."""
        site = (*self.position.site, id(eqn))
        return dataclasses.replace(self, position=dataclasses.replace(self.position, site=site))

    def rules_at(self, stack: str | None = None) -> ScopeRules:
        """``(run as written?, rules)`` for equations traced under ``stack`` (this
        context's own by default): the markers and ``modules=`` patterns on it."""
        stack = self.position.stack if stack is None else stack
        hit = self.memo.scoped.get(stack)
        if hit is not None:
            return hit
        full, rules, origin = self.config.scope_rules(stack)
        if self.fp8 is not None and not full:
            rules = self.fp8.scope_rules(scope_parts(stack), stack, rules)
        self.memo.scoped[stack], self.memo.origins[stack] = (full, rules), origin
        return full, rules

    def memoized(self, key: Any, owner: Any, make: Callable[[], Any]) -> Any:
        """``make()``, once per (key, owner) and everything in this context
        that changes how an inner jaxpr is evaluated."""
        pos = self.position
        key = (key, pos.axis_env, pos.saturate, pos.in_region)
        if self.fp8 is not None:  # a call site with FP8 exclusions or layers of its own
            key += (self.fp8.under(pos.site),)
        hit = self.memo.cache.get(key)
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = make()
        self.memo.cache[key] = (owner, value)
        return value
