"""The only place where jaxamp relies on JAX behaviour that is not public API.

Supported JAX versions: 0.5.0 (``make test-oldest``) to 0.10.2 (``make test``); the
0.11 spelling of ``scan``'s parameters is read too (``scan_counts``).

Everything else in ``jaxamp.casting`` uses ``jax.make_jaxpr``,
``jax.extend.core`` and ``Primitive.bind`` / ``Primitive.get_bind_params``.
What is left here is small, and ``tests/utils/test_jax_compat.py`` checks each piece
so that a JAX upgrade that changes one of them fails loudly in CI instead of
silently miscasting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Primitive

__all__ = [
    "CUSTOM_VJP_ENTERED",
    "HAS_SHARD_MAP",
    "aval_of",
    "bind",
    "custom_jvp_rule",
    "custom_vjp_bwd",
    "custom_vjp_fwd",
    "eqn_context",
    "inlinable_call",
    "is_unspecified",
    "name_stack",
    "name_stack_items",
    "outputs_as_list",
    "scan_counts",
    "shard_map_call",
    "source_info_context",
    "traceback_frames",
]

#: ``jax.shard_map`` (public since JAX 0.7; before, jax.experimental.shard_map
#: had other parameter names). Without it autocast runs shard_map as written.
HAS_SHARD_MAP: bool = hasattr(jax, "shard_map") and callable(getattr(jax, "shard_map", None))


def _custom_vjp_entered() -> bool:
    try:
        from jax._src import custom_derivatives
    except ImportError:  # pragma: no cover
        return False
    return not hasattr(custom_derivatives, "custom_vjp_call_jaxpr_p")


#: Whether a ``jax.custom_vjp`` function appears in jaxprs as ``custom_vjp_call``
#: (``call_jaxpr``, ``fwd_jaxpr_thunk``, ``bwd``, ``out_trees``), which autocast
#: enters. JAX 0.5 writes ``custom_vjp_call_jaxpr`` with other params there:
#: autocast then runs such functions as written, in their original dtypes, with
#: a warning that says so.
CUSTOM_VJP_ENTERED: bool = _custom_vjp_entered()


def aval_of(x: Any) -> Any:
    """The abstract value (shape, dtype, weak type) of an array or tracer.

    ``jax.typeof`` since JAX 0.6; ``jax.core.get_aval`` before (removed in 0.10).
    """
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # pragma: no cover - old JAX
        typeof = jax.core.get_aval
    return typeof(x)


def _typed_sharding(x: Any) -> Any:
    """The sharding in ``x``'s type: ``x`` an array, a tracer or an abstract value."""
    aval = x if isinstance(x, jax.core.AbstractValue | jax.ShapeDtypeStruct) else aval_of(x)
    return getattr(aval, "sharding", None)


def typed_spec(x: Any) -> Any:
    """The PartitionSpec in ``x``'s type (Explicit mesh axes), or None if it has none.

    ``x`` is an array, a tracer or an abstract value (``jax.typeof``'s result).
    """
    spec = getattr(_typed_sharding(x), "spec", None)
    return spec if spec is not None and any(p is not None for p in spec) else None


def like_sharded(x: Any, other: Any) -> Any:
    """``x`` resharded to ``other``'s typed sharding where the two types differ.

    Only values sharded in their type (an Explicit mesh) can differ; there
    ``lax.select`` and ``lax.cond`` need their cases in one sharding. The target
    names its mesh (the one in the sharded type), so this works under ``jax.jit``
    over a mesh that no ``jax.set_mesh`` made current. ``jax.sharding.reshard``
    exists in every JAX that has Explicit axes.
    """
    want, have = typed_spec(other), typed_spec(x)
    if want == have:
        return x
    mesh = _typed_sharding(other if want is not None else x).mesh
    spec = want if want is not None else jax.sharding.PartitionSpec()
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def varying_axes(x: Any) -> frozenset[str]:
    """The shard_map axes ``x``'s type varies over (empty outside shard_map).

    ``aval.manual_axis_type.varying`` since JAX 0.10, ``aval.vma`` from 0.7 to 0.9.
    """
    aval = x if isinstance(x, jax.core.AbstractValue | jax.ShapeDtypeStruct) else aval_of(x)
    mat = getattr(aval, "manual_axis_type", None)
    varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(varying or ())


def like_varying(x: Any, other: Any) -> Any:
    """``x`` made to vary over the shard_map axes ``other``'s type varies over.

    Inside shard_map (``check_vma``) the two branches of a ``lax.cond`` must agree on
    them: zeros built in one branch vary over none, the updates of the other over
    the mapped axis. Marking a value varying is free (no data moves).
    """
    return varying_over(x, varying_axes(other))


def varying_over(x: Any, names: Any) -> Any:
    """``x`` made to vary over the shard_map axes `names` too (free: no data moves)."""
    missing = tuple(sorted(frozenset(names) - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # JAX 0.7 to 0.9


def name_stack(eqn: Any) -> str:
    """The ``jax.named_scope`` stack an equation was traced under, as ``a/b/c``.

    ``JaxprEqn.source_info.name_stack`` is not documented API, but it is what
    JAX prints into HLO metadata, and ``str()`` of it is the slash-joined
    scope names (transformations wrap them, e.g. ``transpose(jvp(scope))``).
    """
    source_info = getattr(eqn, "source_info", None)
    stack = getattr(source_info, "name_stack", None)
    return "" if stack is None else str(stack)


def name_stack_items(eqn: Any) -> tuple[tuple[str, str], ...]:
    """An equation's name stack as ``(kind, name)`` pairs, outermost first.

    `kind` is ``"transform"`` (``jvp``, ``transpose``, ``vmap``: the
    transformations the equation was traced under) or ``"scope"`` (a
    ``jax.named_scope``, e.g. a Flax module's name). ``NameStack.stack`` holds
    ``Scope`` and ``Transform`` objects with a ``name`` in JAX 0.5 to 0.10;
    without it, the string form is read: ``transpose(jvp(a))/b``.
    """
    stack = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    if stack is None:
        return ()
    items = getattr(stack, "stack", None)
    if items is not None:
        return tuple(
            ("transform" if type(e).__name__ == "Transform" else "scope", str(e.name))
            for e in items
        )
    out: list[tuple[str, str]] = []  # pragma: no cover - a future NameStack
    for part in str(stack).split("/"):
        while "(" in part:
            name, _, part = part.partition("(")
            out.append(("transform", name))
        part = part.rstrip(")")
        if part:
            out.append(("scope", part))
    return tuple(out)


def traceback_frames(eqn: Any) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the frames an equation was traced at, innermost first.

    ``eqn.source_info.traceback`` is a ``jaxlib`` ``Traceback`` whose
    ``frames`` (``file_name``, ``line_num``, ``function_name``) are innermost
    first, JAX 0.5 to 0.10. An equation evaluated again by autocast keeps its
    traceback only under ``source_info_context``.
    """
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = getattr(traceback, "frames", None) or []
    return [(str(f.file_name), int(f.line_num), str(f.function_name)) for f in frames]


def source_info_context(eqn: Any) -> Any:
    """A context that makes the equations traced in it carry `eqn`'s source info.

    ``jax.core.eval_jaxpr`` binds each equation under
    ``source_info_util.user_context(eqn.source_info.traceback, name_stack=...)``
    (the current name stack plus the equation's own), so that a jaxpr evaluated
    again keeps the user's tracebacks and ``jax.named_scope`` stacks. Private
    (``jax._src.source_info_util``), unchanged from JAX 0.5 to 0.10.
    """
    from jax._src import source_info_util

    source_info = getattr(eqn, "source_info", None)
    if source_info is None:
        return contextlib.nullcontext()
    stack = source_info_util.current_name_stack() + source_info.name_stack
    return source_info_util.user_context(source_info.traceback, name_stack=stack)


def bind(prim: Primitive, args: list[Any], params: dict[str, Any]) -> Any:
    """Binds `prim` on `args` the way ``jax.core.eval_jaxpr`` does.

    ``get_bind_params`` turns jaxpr-valued equation params into the callables
    ``bind`` expects. It returned ``(subfuns, params)`` in JAX < 0.4.36 and
    returns one dict (subfuns under the ``"subfuns"`` key) since.
    """
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
        return prim.bind(*subfuns, *args, **bind_params)
    return prim.bind(*args, **bind_params)


def outputs_as_list(prim: Primitive, out: Any) -> list[Any]:
    """The outputs of a bind as a list (``shard_map`` returns an iterable tree)."""
    if prim.multiple_results:
        return list(out)
    return [out]


def shard_map_call(fn: Callable[..., Any], args: list[Any], params: dict[str, Any]) -> list[Any]:
    """Re-issues a ``shard_map`` equation through the public ``jax.shard_map``.

    A shard_map body can only be traced inside the manual-axes context that
    ``jax.shard_map`` sets up, so autocast calls it again with the equation's
    own mesh and specs instead of re-tracing the body on its own. The param
    names are those of JAX >= 0.6 (``check_vma``, ``newly_manual_axes``).
    """
    mapped = jax.shard_map(
        lambda *xs: tuple(fn(*xs)),
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=frozenset(params.get("newly_manual_axes", frozenset())),
        check_vma=params.get("check_vma", True),
    )
    return list(mapped(*args))


# --------------------------------------------------------------------------
# Sharding: meshes and jit params.
# --------------------------------------------------------------------------


def eqn_context(eqn: Any) -> Any:
    """The trace context an equation was traced under, to bind it under again.

    ``JaxprEqn.ctx.manager`` (JAX >= 0.4.36) restores the abstract mesh
    (``jax.sharding.auto_axes`` traces its body under another mesh than its
    caller, and JAX checks that an op's context mesh matches its inputs'),
    the compute type and the XLA metadata, as ``jax.core.eval_jaxpr`` does.
    """
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def inlinable_call(params: dict[str, Any]) -> bool:
    """Whether a call equation can be evaluated inline: no donation, no shardings."""
    if any(params.get("donated_invars", ())):
        return False
    shardings = list(params.get("in_shardings", ())) + list(params.get("out_shardings", ()))
    return all(is_unspecified(s) for s in shardings)


def is_unspecified(sharding: Any) -> bool:
    """Whether a ``jit`` equation's in/out sharding was left to the compiler."""
    return type(sharding).__name__ == "UnspecifiedValue"


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(consts, carry)``: how many of a ``scan`` equation's inputs are each.

    The body takes the constants, then the carry, then the scanned inputs. JAX up
    to 0.10 names the two counts; JAX 0.11 packs the inputs as one flat tree of
    ``(consts, carry, xs)`` in ``ft_in`` instead.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


# --------------------------------------------------------------------------
# Custom derivative rules as jaxprs (their params are JAX-internal objects).
# --------------------------------------------------------------------------


def custom_jvp_rule(params: dict[str, Any], num_args: int) -> tuple[Any, Any, list[bool]]:
    """``(jvp_jaxpr, consts, out_zeros)`` of a ``custom_jvp_call`` with every tangent.

    The jaxpr takes the non-constant primals, then one tangent per primal, and
    returns the primal outputs then the tangents that are not symbolic zeros.
    """
    zeros = [False] * num_args
    if "jvp_jaxpr_fun" in params:  # newer JAX: a WrappedFun
        jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    else:  # JAX 0.5.0: a plain thunk
        jaxpr, consts, out_zeros = params["jvp_jaxpr_thunk"](*zeros)
    return jaxpr, consts, list(out_zeros)


def custom_vjp_fwd(params: dict[str, Any], nonzeros: list[bool]) -> tuple[Any, Any, Any]:
    """``(fwd_jaxpr, consts, out_trees)`` of a ``custom_vjp_call``.

    The jaxpr maps the non-constant primals to ``(*residuals, *outputs)``, with
    residuals that are inputs forwarded left out; ``out_trees()`` then returns
    ``(out_tree, res_tree, input_forwards)``.
    """
    jaxpr, consts = params["fwd_jaxpr_thunk"].call_wrapped(*nonzeros)
    return jaxpr, consts, params["out_trees"]


def custom_vjp_bwd(params: dict[str, Any]) -> Callable[..., list[Any]]:
    """The user's ``bwd`` as ``f(*residuals, *cotangents) -> cotangents`` (zeros instantiated)."""
    from jax._src import ad_util

    bwd = params["bwd"]

    def call(*args: Any) -> list[Any]:
        outs = bwd.call_wrapped(*args)
        return [
            jax.numpy.zeros(o.aval.shape, o.aval.dtype) if isinstance(o, ad_util.Zero) else o
            for o in outs
        ]

    return call


def current_trace() -> Any:
    """The trace JAX is tracing in now (``jax._src.core.trace_ctx``: not public API).

    Values made in another trace (a nested ``jit``'s, a loop body's) cannot be
    handed to this one: the FP8 health collector compares traces to know
    whether a product's statistics may leave with the caller's results."""
    from jax._src import core

    return core.trace_ctx.trace
