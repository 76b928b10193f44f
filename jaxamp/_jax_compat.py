"""The only place where jaxamp relies on JAX behaviour that is not public API.

Everything else in :mod:`jaxamp.autocast` uses ``jax.make_jaxpr``,
``jax.extend.core`` and ``Primitive.bind`` / ``Primitive.get_bind_params``.
What is left here is small, and ``tests/test_jax_compat.py`` checks each piece
so that a JAX upgrade that changes one of them fails loudly in CI instead of
silently miscasting.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import Primitive

__all__ = [
    "CUSTOM_VJP_ENTERED",
    "EXPLICIT_CAST_SCOPE",
    "HAS_SHARD_MAP",
    "KEEP_ACCUMULATION_SCOPE",
    "aval_of",
    "bind",
    "custom_jvp_rule",
    "custom_vjp_bwd",
    "custom_vjp_fwd",
    "hooks_paused",
    "is_unspecified",
    "name_stack",
    "outputs_as_list",
    "shard_map_call",
    "user_intent_hooks",
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


def name_stack(eqn: Any) -> str:
    """The ``jax.named_scope`` stack an equation was traced under, as ``a/b/c``.

    ``JaxprEqn.source_info.name_stack`` is not documented API, but it is what
    JAX prints into HLO metadata, and ``str()`` of it is the slash-joined
    scope names (transformations wrap them, e.g. ``transpose(jvp(scope))``).
    """
    source_info = getattr(eqn, "source_info", None)
    stack = getattr(source_info, "name_stack", None)
    return "" if stack is None else str(stack)


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
# Trace-time hooks: what the user wrote that a jaxpr cannot show.
# --------------------------------------------------------------------------

#: ``jax.named_scope`` put around a matmul called with an explicit
#: ``preferred_element_type``: jnp fills that param in by default, so the
#: jaxpr alone cannot tell an explicit float32 accumulation from the default.
KEEP_ACCUMULATION_SCOPE = "jaxamp_preferred_element_type"

#: ``jax.named_scope`` of the ``copy`` that stands for an explicit
#: ``x.astype(float32)`` of a float32 value (JAX drops identity casts).
EXPLICIT_CAST_SCOPE = "jaxamp_explicit_cast"

_hook_state = threading.local()
_hook_lock = threading.Lock()
_hook_users = 0
_saved: list[tuple[Any, str, Any]] = []


def _explicit_cast_codes() -> tuple[Any, ...]:
    from jax._src.lax import lax as lax_internal
    from jax._src.numpy import lax_numpy

    return (lax_numpy.astype.__code__, lax_internal.convert_element_type.__code__)


def _make_convert_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    from jax._src.core import Tracer, is_concrete
    from jax._src.lax import lax as lax_internal

    codes = _explicit_cast_codes()

    def convert(
        operand: Any, new_dtype: Any = None, weak_type: bool = False, *args: Any, **kwargs: Any
    ) -> Any:
        # `x.astype(jnp.float32)` on a float32 tracer is dropped by JAX; while
        # autocast traces `f`, keep it as an (identity) equation so that the
        # explicit cast is visible to the autocast rules.
        if (
            getattr(_hook_state, "depth", 0)
            and new_dtype is not None
            and isinstance(operand, Tracer)
            and not is_concrete(operand)
            and not args
            and not kwargs.get("sharding")
            and operand.aval.dtype == new_dtype
            and bool(operand.aval.weak_type) == bool(weak_type)
            and jax.numpy.issubdtype(new_dtype, jax.numpy.floating)
            and sys._getframe(1).f_code in codes
        ):
            # An identity convert_element_type is dropped at bind time too: a
            # marked copy stands for it.
            with jax.named_scope(EXPLICIT_CAST_SCOPE):
                return lax_internal.copy_p.bind(operand)
        return original(operand, new_dtype, weak_type, *args, **kwargs)

    return convert


def _from_jax(frame: Any) -> bool:
    name = frame.f_globals.get("__name__", "")
    return bool(name == "jax" or name.startswith("jax."))


def _make_accumulation_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        # Only a caller outside JAX asked for it: jnp's own matmul / einsum call
        # the public jax.lax.dot_general with their default accumulation type
        # (JAX 0.5 does).
        if (
            getattr(_hook_state, "depth", 0)
            and kwargs.get("preferred_element_type") is not None
            and not _from_jax(sys._getframe(1))
        ):
            with jax.named_scope(KEEP_ACCUMULATION_SCOPE):
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    return call


def _install() -> None:
    from jax._src.lax import lax as lax_internal

    targets = [(lax_internal, "_convert_element_type", _make_convert_hook)]
    for name in ("einsum", "matmul", "dot", "tensordot", "inner", "vdot"):
        targets.append((jax.numpy, name, _make_accumulation_hook))
    for name in ("dot_general", "dot"):
        targets.append((jax.lax, name, _make_accumulation_hook))
    for module, name, make in targets:
        original = getattr(module, name, None)
        if original is None:
            continue
        _saved.append((module, name, original))
        setattr(module, name, make(original))


@contextlib.contextmanager
def user_intent_hooks() -> Iterator[None]:
    """While active in this thread, explicit casts and accumulation types stay visible.

    Two things a user writes leave no trace in a jaxpr: ``x.astype(float32)``
    on a float32 value (JAX drops it) and ``preferred_element_type=float32``
    on a float32 matmul (jnp sets it by default). During autocast's own trace
    of `f` this keeps the first as a ``copy`` under ``EXPLICIT_CAST_SCOPE`` and
    marks the second with ``KEEP_ACCUMULATION_SCOPE``. The patched functions
    are private JAX functions and public jnp / lax attributes; the patch is
    installed while any thread traces and only acts in tracing threads.
    Checked by ``tests/test_jax_compat.py``.
    """
    global _hook_users
    with _hook_lock:
        if _hook_users == 0:
            try:
                _install()
            except Exception:  # a JAX layout this shim does not know: no hooks
                _restore()
        _hook_users += 1
    _hook_state.depth = getattr(_hook_state, "depth", 0) + 1
    try:
        yield
    finally:
        _hook_state.depth -= 1
        with _hook_lock:
            _hook_users -= 1
            if _hook_users == 0:
                _restore()


def _restore() -> None:
    while _saved:
        module, name, original = _saved.pop()
        setattr(module, name, original)


@contextlib.contextmanager
def hooks_paused() -> Iterator[None]:
    """Turns the hooks off in this thread (while autocast traces its own code)."""
    depth = getattr(_hook_state, "depth", 0)
    _hook_state.depth = 0
    try:
        yield
    finally:
        _hook_state.depth = depth


def is_unspecified(sharding: Any) -> bool:
    """Whether a ``jit`` equation's in/out sharding was left to the compiler."""
    return type(sharding).__name__ == "UnspecifiedValue"


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
