"""How autocast casts a value and binds an op.

A cast that narrows a float saturates finite values at the target's largest
finite number instead of making them inf (see ``cast_jit``); pure ops are bound
through one cached, inlined ``jit`` per (primitive, params) (see ``_op_jit``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp import _jax_compat
from jaxamp._autocast import _rules
from jaxamp._autocast._rules import is_float


def _saturates(src: np.dtype, dst: np.dtype) -> bool:
    return is_float(src) and is_float(dst) and float(jnp.finfo(dst).max) < float(jnp.finfo(src).max)


SATURATING_CAST_NAME = "jaxamp_saturating_cast"
#: The primitives of a saturating cast's body, in order (how a traced region
#: recognises one: ``_loops``).
SATURATING_CAST_OPS = ["clamp", "abs", "eq", "select_n", "convert_element_type"]


@functools.lru_cache(maxsize=64)
def cast_jit(src: np.dtype, dst: np.dtype, saturate: bool = True) -> Callable[[Any], Any]:
    """``x -> x.astype(dst)``, saturating finite values beyond `dst`'s range.

    Why: a float32 value that float32 arithmetic keeps finite (a mask built
    from ``finfo(float32).min``, a large constant) must not become inf in
    float16 or bfloat16 (a fully masked softmax row would then give NaN).
    Infinities and NaN pass unchanged, so overflow detection still sees them.
    The derivative is the plain cast (a straight-through clip), so the
    backward pass keeps no mask. Bound as one inlined jit per dtype pair so
    grad linearizes it once.
    """
    if not (saturate and _saturates(src, dst)):
        return jax.jit(lambda x: lax.convert_element_type(x, dst), inline=True)
    hi = float(jnp.finfo(dst).max)

    def saturate(x: Any) -> Any:
        clipped = lax.clamp(np.asarray(-hi, src), x, np.asarray(hi, src))
        inf = lax.eq(lax.abs(x), np.asarray(np.inf, src))
        return lax.convert_element_type(lax.select(inf, x, clipped), dst)

    saturate.__name__ = SATURATING_CAST_NAME
    cast = jax.custom_jvp(saturate)
    cast.defjvp(lambda p, t: (cast(p[0]), lax.convert_element_type(t[0], dst)))
    return jax.jit(cast, inline=True)


def host_cast(value: Any, dtype: Any) -> Any:
    """A literal cast on the host, saturating finite values like ``Context.cast``."""
    v = np.asarray(value)
    if _saturates(v.dtype, np.dtype(dtype)) and np.isfinite(v).all():
        hi = float(jnp.finfo(dtype).max)
        v = np.clip(v, -hi, hi)
    return np.asarray(v, dtype=dtype)[()]


# Primitives bound through `_op_jit`: pure, context-free ops (no effects, no
# axis names, no sharding), i.e. those the op table classifies plus a few
# common "follow" ones.
_JITTED_OPS: frozenset[str] = (
    _rules.LOWER_PRECISION_OPS
    | _rules.FLOAT32_OPS
    | _rules.ELEMENTWISE_OPS
    | _rules.WIDEST_OPS
    | frozenset(
        {
            "split", "stop_gradient", "iota", "eq", "ne", "lt", "le", "gt", "ge",
            "and", "or", "not", "xor", "is_finite", "argmax", "argmin", "reduce_min",
            "reduce_and", "reduce_or", "sort",
        }
    )
)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _op_jit(prim: Any, items: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    """One inlined ``jit`` per (primitive, params).

    Why: autocast binds the ops of an already-traced program one by one, and
    under ``grad`` JAX linearizes each bind afresh, while a model written with
    ``jnp`` calls small inlined jits whose linearization JAX caches per program.
    Binding through one jit per (primitive, params) gets the same cache: the
    ops of 48 identical layers are linearized once, not 48 times. ``inline``
    leaves the traced program exactly as a direct bind would.
    """
    params = dict(items)
    return jax.jit(lambda *args: prim.bind(*args, **params), inline=True)


def bind(eqn: Any, args: list[Any], params: Any = None, cached: bool = True) -> list[Any]:
    """Binds `eqn`'s primitive on `args`; pure ops through one cached jit each,
    unless not `cached` (a cached trace keeps the source info of its first use)."""
    prim = eqn.primitive
    params = eqn.params if params is None else params
    if cached and prim.name in _JITTED_OPS and not eqn.effects:
        try:
            fn = _op_jit(prim, tuple(sorted(params.items())))
        except TypeError:  # an unhashable param
            pass
        else:
            return _jax_compat.outputs_as_list(prim, fn(*args))
    out = _jax_compat.bind(prim, args, params)
    return _jax_compat.outputs_as_list(prim, out)
