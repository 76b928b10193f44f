"""autocast's handlers, by kind of higher-order primitive (``_primitives.Kind``)."""

from __future__ import annotations

from jaxamp._utils import jax_compat
from jaxamp.casting._interpreter import _calls, _loops
from jaxamp.casting._interpreter._interpret import Handler
from jaxamp.casting._rules._primitives import Kind

#: Kind -> handler. A kind missing here (``custom_vjp_call_jaxpr``, JAX 0.5's
#: custom_vjp; ``shard_map`` without a public ``jax.shard_map``) runs as
#: ``unknown_higher_order`` says.
HANDLERS: dict[Kind, Handler] = {
    Kind.JIT: _calls.eval_call,
    Kind.CALL: _calls.eval_call,
    Kind.REMAT: _calls.eval_remat,
    Kind.CUSTOM_JVP: _calls.eval_custom_jvp,
    Kind.CUSTOM_VJP: _calls.eval_custom_vjp,
    Kind.SCAN: _loops.eval_scan,
    Kind.WHILE: _loops.eval_while,
    Kind.COND: _loops.eval_cond,
}
if jax_compat.HAS_SHARD_MAP:
    HANDLERS[Kind.SHARD_MAP] = _calls.eval_shard_map
