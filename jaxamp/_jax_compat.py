"""The only place where jaxamp relies on JAX behaviour that is not public API.

Everything else in :mod:`jaxamp.autocast` uses ``jax.make_jaxpr``,
``jax.extend.core`` and ``Primitive.bind`` / ``Primitive.get_bind_params``.
What is left here is small, and ``tests/test_jax_compat.py`` checks each piece
so that a JAX upgrade that changes one of them fails loudly in CI instead of
silently miscasting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Primitive

__all__ = ["HAS_SHARD_MAP", "bind", "name_stack", "outputs_as_list", "shard_map_call"]

#: ``jax.shard_map`` (public since JAX 0.7; before, jax.experimental.shard_map
#: had other parameter names). Without it autocast runs shard_map as written.
HAS_SHARD_MAP: bool = hasattr(jax, "shard_map") and callable(getattr(jax, "shard_map", None))


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
