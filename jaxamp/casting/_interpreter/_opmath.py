"""Ops on an activation computed in float32 and rounded once to its dtype.

torch computes an op of a float16 tensor and a scalar (a Python number, a 0-dim
float32 tensor) at its float32 "opmath" precision and rounds the result once to
float16: ``h * 1e-9`` with ``h = 4096`` is 4.11e-6 (a float16 subnormal), not
``h * 0``. autocast does the same where a scalar operand would change in the low
dtype: a Python scalar (or a concrete 0-d constant) beyond its range or below its
smallest normal number, and a 0-dim float32 value known only at run time (an
argument, a scalar parameter, a scalar computed in `f`), whose value autocast
cannot check. The result stays an activation in the low dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.extend.core import Literal

from jaxamp._utils.dtypes import is_float_dtype
from jaxamp._utils.tree import is_tracer
from jaxamp.casting._interpreter._casts import bind, cast, region_fn
from jaxamp.casting._rules._rules import ACT, CONST, FLOAT32_DTYPE, NONE, SCALAR, promote

if TYPE_CHECKING:
    from collections.abc import Sequence

    from jaxamp.casting._interpreter._context import Context

#: Ops where a scalar is a fill or a bound (``jnp.where(m, x, -1e9)``,
#: ``jnp.maximum(x, -1e30)``): a literal there saturates, as any constant does,
#: and a run-time scalar is cast down (the same values as in float32 and rounded:
#: rounding is monotone and these ops pick one of their operands).
FILL_POSITIONS: frozenset[str] = frozenset({"select_n", "max", "min", "clamp"})


def _concrete_scalar(x: Any, mark: int) -> bool:
    return mark == CONST and np.ndim(x) == 0 and not is_tracer(x)


def opmath_reason(
    eqn: Any,
    vals: Sequence[Any],
    marks: Sequence[int],
    dtypes: Sequence[Any],
    floats: Sequence[int],
    layouts: Sequence[int],
    low: np.dtype,
) -> str | None:
    """Why `eqn`, about to run in `low` on an activation, runs in float32 and rounds
    once instead (the phrase ``audit`` shows), or None.

    A Python scalar (not a fill) that `low` cannot hold: beyond its range, or so
    small it would become 0 or subnormal (``(x @ w) * 1e5 * 1e-5``). Or a 0-dim
    float32 run-time value broadcast into the result (``SCALAR``, not a constant):
    cast down, ``1e-9`` would be 0 and ``1e-7`` 19 % off in float16.
    """
    if low.itemsize >= 4 or eqn.primitive.name in FILL_POSITIONS:
        return None
    fi = jax.numpy.finfo(low)
    runtime = False
    for i in floats:
        v, x = eqn.invars[i], vals[i]
        if isinstance(v, Literal) or _concrete_scalar(x, marks[i]):
            a = np.abs(np.asarray(x, np.float64))
            if np.any(np.isfinite(a) & ((a > float(fi.max)) | ((a > 0) & (a < float(fi.tiny))))):
                return f"a Python scalar {low.name} cannot hold"
        elif layouts[i] == SCALAR and marks[i] == NONE:
            runtime |= np.dtype(dtypes[i]).itemsize > low.itemsize
    return f"a float32 0-dim operand {low.name} would round" if runtime else None


def eval_opmath(
    eqn: Any,
    vals: Sequence[Any],
    marks: Sequence[int],
    dtypes: Sequence[Any],
    floats: Sequence[int],
    ctx: Context,
    low: np.dtype,
) -> list[Any]:
    """`eqn` in float32 with its scalars exact, the results rounded once to `low`:
    ``h * 1e5`` is ``h`` times 1e5 (inf only where the product overflows), never
    ``h`` times a saturated 65504.

    With a run-time scalar (a parameter: its gradient reads the activation) the
    op is one checkpoint of the low-precision activation and the scalars, so the
    backward pass keeps the activation as it is, not a float32 copy of it.
    """
    wide = promote(low, FLOAT32_DTYPE)
    acts = [i for i in floats if marks[i] == ACT and not isinstance(eqn.invars[i], Literal)]
    if (
        ctx.config.cached
        and len(acts) == 1
        and any(is_tracer(vals[i]) and marks[i] != ACT for i in floats)
    ):
        return _checkpointed(eqn, vals, dtypes, acts[0], ctx, low, wide)
    args = list(vals)
    for i in floats:
        if isinstance(eqn.invars[i], Literal):
            args[i] = np.asarray(vals[i], wide)[()]
        elif np.ndim(vals[i]) == 0 and not is_tracer(vals[i]):
            args[i] = np.asarray(vals[i], wide)
        elif dtypes[i] != wide:
            args[i] = cast(ctx, vals[i], wide)
    outs = bind(eqn, args, eqn.params, ctx.config.cached)
    return [cast(ctx, o, low) if is_float_dtype(o.dtype) else o for o in outs]


def _checkpointed(
    eqn: Any,
    vals: Sequence[Any],
    dtypes: Sequence[Any],
    act: int,
    ctx: Context,
    low: np.dtype,
    wide: np.dtype,
) -> list[Any]:
    """``eval_opmath`` as one ``region_fn`` step of the activation at `act`."""
    refs: list[tuple[Any, ...]] = []
    extra: list[Any] = []
    for i, v in enumerate(eqn.invars):
        if i == act:
            refs.append(("x",))
        elif isinstance(v, Literal):
            lit = np.asarray(v.val)
            refs.append(("lit", lit.tolist(), np.dtype(v.aval.dtype).str, lit.tobytes()))
        else:
            x = vals[i]
            if is_float_dtype(dtypes[i]) and np.dtype(dtypes[i]) != wide:
                x = cast(ctx, x, wide) if is_tracer(x) else np.asarray(x, wide)
            refs.append(("e", len(extra)))
            extra.append(x)
    step = (eqn.primitive, tuple(sorted(eqn.params.items())), tuple(refs))
    nout = len(eqn.outvars)
    fn = region_fn((step,), tuple((0, o) for o in range(nout)), wide, not ctx.position.in_region)
    x = vals[act] if np.dtype(dtypes[act]) == low else cast(ctx, vals[act], low)
    outs = fn(x, *extra)
    return [cast(ctx, o, low) if is_float_dtype(o.dtype) else o for o in outs]
