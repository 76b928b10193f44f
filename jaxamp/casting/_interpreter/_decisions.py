"""Why autocast ran each equation in its dtype: the per-op log ``jaxamp.audit`` shows.

The interpreter reports each decision where it makes it (``note``), with the
phrase the deciding code returned (``_rules.choose``, the FP8 plan, a float32
region, a handler) and the op class ``Context.rules_at`` put in force, so the
log says what autocast did, not what a second copy of its rules would guess.
Nothing is logged unless ``recording()`` is active; otherwise a note costs one
context-variable read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxamp._utils import jax_compat
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._rules import _scopes
from jaxamp.casting._rules._rules import AS_WRITTEN, DEFAULT_RULES, FOLLOW
from jaxamp.casting._rules._scopes import join, scope_parts

if TYPE_CHECKING:
    from jaxamp.casting._interpreter._context import Context

__all__ = ["OpRow"]

_LOG: ContextVar[list[OpRow] | None] = ContextVar("jaxamp_autocast_log", default=None)
# Per recording: (id(eqn), call site, name stack) -> (the equation, kept alive so
# that its id stays its own; its row's index in the log).
_SEEN: ContextVar[dict[Any, tuple[Any, int]]] = ContextVar("jaxamp_autocast_seen")
_LIBRARIES = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (__import__("jax"), __import__("jaxamp"))
    if getattr(m, "__file__", None)
) + (os.sep + "site-packages" + os.sep,)


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One equation autocast evaluated: the dtype it ran in and why.

    Attributes:
      primitive: the JAX primitive (``"dot_general"``, ``"exp"``, ``"add"``, ...).
      dtype: what it ran in (``"bfloat16"``, ``"float32"``; ``"float8_e4m3fn"``
        for an FP8 product).
      op_class: the op class in force where it stands (``"lower"``,
        ``"float32"``, ``"elementwise"``, ``"follow"``, ``"widest"``,
        ``"as_written"``).
      rule: where that class comes from: ``"DEFAULT_RULES"``, ``"rules="``,
        ``"modules['ln']"``, ``"full_precision"``, ``"nested autocast"``, or a
        function torch runs in float32 (``"softmax (FLOAT32_FUNCTIONS)"``).
      reason: why this dtype (the decision's own words).
      module: the module path inside the autocast function (Flax module and
        ``jax.named_scope`` names).
      source: the user's ``file:line (function)`` the equation was traced from.
      layer: for a product FP8 may run (under ``fp8=``), the name
        ``jaxamp.fp8(select=...)``, ``jaxamp.fp8_select`` and
        ``jaxamp.fp8_health`` give its layer: the module path, or, where the
        products of one module path read different weights (equinox's layers
        are scoped by class) or there is none, the path of the weight it
        reads in `f`'s arguments (``mlp/0/layers/1/weight``). ``""`` otherwise.
    """

    primitive: str
    dtype: str
    op_class: str
    rule: str
    reason: str
    module: str
    source: str
    layer: str = ""


@contextlib.contextmanager
def recording() -> Iterator[list[OpRow]]:
    """Collects the notes of every autocast trace run inside it, in order."""
    log: list[OpRow] = []
    token, seen = _LOG.set(log), _SEEN.set({})
    try:
        yield log
    finally:
        _LOG.reset(token)
        _SEEN.reset(seen)


_FRESH = itertools.count(1)


def fresh_trace() -> Any:
    """A context in which JAX traces again instead of answering from its caches.

    A jitted step traced before would otherwise come back from JAX's trace cache
    without running autocast, so nothing would be noted. JAX keys its trace and
    jit caches by the "trace context" of its config; ``jax_xla_profile_version``
    is part of it and is read only when it is positive (then it names an XLA
    profile to compile with), so a fresh negative value changes the key and
    nothing else. Private (``jax._src.config``); without it, caches are used.
    """
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - a JAX without it
        return contextlib.nullcontext()
    state = getattr(config, "jax_xla_profile_version", None)
    return state(-next(_FRESH)) if callable(state) else contextlib.nullcontext()


def active() -> bool:
    return _LOG.get() is not None


def note(
    eqn: Any, ctx: Context, dtype: Any, why: str, rule: tuple[str, str] | None = None,
    layer: str = "",
) -> None:  # fmt: skip
    """Logs `eqn` (evaluated under ``ctx.position.stack``) as run in `dtype` because of `why`;
    `rule`: ``(op class, origin)`` where the class is not the scope's (a handler's);
    `layer`: an FP8 candidate product's layer (``OpRow.layer``)."""
    log = _LOG.get()
    if log is None:
        return
    name = eqn.primitive.name
    op_class, origin = rule or rule_of(ctx, name)
    if origin == "nested autocast":
        return  # the nested autocast logged its own decision when it was traced
    dtype = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    frames = jax_compat.traceback_frames(eqn)
    row = OpRow(
        name, dtype, op_class, origin, why, module_path(ctx.position.stack), user_frame(frames),
        layer,
    )  # fmt: skip
    # A loop body or cond branch is evaluated more than once (until the dtypes
    # it carries settle): one row per equation and call site, the last decision.
    seen, key = _SEEN.get(), (id(eqn), ctx.position.site, ctx.position.stack)
    hit = seen.get(key)
    if hit is not None and hit[0] is eqn:
        log[hit[1]] = row
        return
    seen[key] = (eqn, len(log))
    log.append(row)


def note_outs(
    eqn: Any, ctx: Context, outs: list[Any], why: str, rule: tuple[str, str] | None = None
) -> None:
    """Logs `eqn` as run in its first floating result's dtype (nothing if none is)."""
    if active():
        for x in outs:
            dtype = getattr(x, "dtype", None)
            if dtype is not None and is_float_dtype(dtype):
                note(eqn, ctx, dtype, why, rule)
                return


def note_region(jaxpr: Any, eqns: Any, ctx: Context, opmath: bool) -> None:
    """Logs the equations `eqns` (indices into `jaxpr`) of a pointwise region:
    they run in float32 together, rounded once (``_analysis.pointwise_region``)."""
    if not active():
        return
    root = jaxpr.eqns[eqns[0]].primitive.name
    if opmath:
        why = (
            f"{root} of an activation and the pointwise ops around it: in float32, "
            f"rounded once to {ctx.config.dtype.name} (torch's opmath)"
        )
    else:
        why = (
            f"float32 region: {root} (a float32-list op) of an activation and the "
            "pointwise ops around it, in float32 (one fused, rematerialised region)"
        )
    for j in eqns:
        eqn = jaxpr.eqns[j]
        note(eqn, ctx.at(join(ctx.position.stack, jax_compat.name_stack(eqn))), np.float32, why)


def rule_of(ctx: Context, name: str) -> tuple[str, str]:
    """``(op class, origin)`` of primitive `name` under ``ctx.position.stack``, read from the
    rules ``Context.rules_at`` resolved there and the origins it kept."""
    full, rules = ctx.rules_at()
    origins = ctx.memo.origins.get(ctx.position.stack, {})
    if full:
        return AS_WRITTEN, origins.get("*", "full_precision")
    op_class = rules.get(name, FOLLOW)
    if name in origins:
        return op_class, origins[name]
    # The table merged with the user's rules= (``_config``): a class other than
    # the table's is the user's.
    return op_class, "rules=" if op_class != DEFAULT_RULES.get(name, FOLLOW) else "DEFAULT_RULES"


def module_path(stack: str) -> str:
    """The module path of a name stack (``_scopes.module_path``), without JAX's
    transformation wrappers."""
    return _scopes.module_path(scope_parts(stack))


def user_frame(frames: list[tuple[str, int, str]]) -> str:
    """``file:line (function)`` of the innermost frame outside JAX, jaxamp and
    installed packages (the user's line), else of the innermost frame."""
    for file, line, fn in frames:
        if not file.startswith(_LIBRARIES) and os.sep + "site-packages" + os.sep not in file:
            return f"{os.path.basename(file)}:{line} ({fn})" if fn else f"{file}:{line}"
    if frames:
        file, line, fn = frames[0]
        return f"{os.path.basename(file)}:{line} ({fn})"
    return "?"
