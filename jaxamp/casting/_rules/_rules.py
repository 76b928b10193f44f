"""autocast's op table and the one pure function that picks an equation's dtype.

The table is data (``DEFAULT_RULES``: primitive name -> op class), like the
rule dicts of ``jax.experimental.jet``; ``choose`` reads it. Nothing here
touches a trace: the interpreter (``_interpret``) asks ``choose`` for a dtype
and then casts and binds. The user's rules are checked against it in ``_resolve``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

LOWER = "lower"
FLOAT32 = "float32"
ELEMENTWISE = "elementwise"
FOLLOW = "follow"
WIDEST = "widest"
AS_WRITTEN = "as_written"
OP_CLASSES = (LOWER, FLOAT32, ELEMENTWISE, FOLLOW, WIDEST, AS_WRITTEN)

#: Matrix products and convolutions, and so everything built on them (``@``,
#: ``einsum``, ``Dense``, ``Conv``, attention projections, RNN cells).
LOWER_PRECISION_OPS: frozenset[str] = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)

#: Numerically sensitive ops, run in float32 even when fed float16/bfloat16.
#: Sums, products and cumulative sums/products cover mean, variance, norms and
#: losses; ``reduce_max`` makes softmax / log-softmax / logsumexp subtract their
#: maximum in float32. ``square`` is ``pow(x, 2)`` (float32 in torch.autocast).
#: Linear algebra and FFTs have no float16 kernels (torch runs ``linalg_*`` and
#: ``fft_*`` in float32 too).
FLOAT32_OPS: frozenset[str] = frozenset(
    {
        # elementwise
        "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
        "rsqrt", "div", "erf_inv", "tan", "sinh", "cosh", "asin", "acos",
        "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a",
        "random_gamma_grad", "zeta", "bessel_i0e", "bessel_i1e",
        # reductions
        "reduce_sum", "reduce_prod", "reduce_max", "cumsum", "cumprod",
        "cumlogsumexp",
        # linear algebra and FFT
        "cholesky", "cholesky_update", "eig", "eigh", "lu", "qr", "svd",
        "triangular_solve", "householder_product", "geqrf", "geqp3", "schur",
        "hessenberg", "tridiagonal", "tridiagonal_solve", "fft",
    }
)  # fmt: skip

#: Elementwise and data-movement ops that run in float32 when all their
#: results feed float32-list ops (or ``f``'s float32 outputs).
ELEMENTWISE_OPS: frozenset[str] = frozenset(
    {
        "add", "sub", "mul", "neg", "abs", "sign", "max", "min", "select_n",
        "clamp", "sqrt", "cbrt", "tanh", "logistic", "sin", "cos", "erf",
        "erfc", "floor", "ceil", "round", "rem", "nextafter", "copy", "copy_p",
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
        "slice", "dynamic_slice", "gather", "pad", "rev", "reduce_precision",
        "convert_element_type",
    }
)  # fmt: skip

#: Elementwise ops that XLA computes inexactly in float16: its ``logistic``
#: (and so ``sigmoid``, ``silu``) flushes every input below -11.09 to 0, where
#: its expansion's ``exp(-x)`` overflows. On an activation they run in float32
#: and round once to the activation's dtype, as torch's kernels do ("opmath").
OPMATH_OPS: frozenset[str] = frozenset({"logistic"})

#: torch.autocast's promote list (``cat``, ``stack``, ``index_put``, ``atan2``,
#: ...): these run in the widest input dtype and never cast an input down.
WIDEST_OPS: frozenset[str] = frozenset({"concatenate", "dynamic_update_slice", "atan2"})

#: Ops that run in the dtypes the un-autocast function gave them: their
#: semantics or their params (a combiner jaxpr, a callback's result types, a
#: bit width) are tied to the original dtype. ``custom_linear_solve`` (behind
#: ``jnp.linalg.solve``) keeps its matvec and its solver in one precision.
AS_WRITTEN_OPS: frozenset[str] = frozenset(
    {
        "bitcast_convert_type", "pure_callback", "io_callback", "debug_callback",
        "scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub",
        "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
        "scatter_max", "scatter-apply", "scatter_apply", "reduce", "reduce_window",
        "select_and_scatter", "select_and_scatter_add", "select_and_gather_add",
        "custom_linear_solve",
    }
)  # fmt: skip

#: Primitive name -> op class. Primitives not listed are ``"follow"``.
DEFAULT_RULES: Mapping[str, str] = MappingProxyType(
    {
        **{name: ELEMENTWISE for name in sorted(ELEMENTWISE_OPS)},
        **{name: WIDEST for name in sorted(WIDEST_OPS)},
        **{name: LOWER for name in sorted(LOWER_PRECISION_OPS)},
        **{name: FLOAT32 for name in sorted(FLOAT32_OPS)},
        **{name: AS_WRITTEN for name in sorted(AS_WRITTEN_OPS)},
    }
)

#: Library functions that torch runs as float32-list ops, where JAX writes
#: them as named nested jits (``jax.nn.log_softmax``): run wholly in float32.
FLOAT32_FUNCTIONS: frozenset[str] = frozenset({"softmax", "log_softmax", "logsumexp"})

# Value marks, carried beside each value while a jaxpr is evaluated:
#: parameters, inputs and what is computed from them alone: values known only
#: at run time, in the dtype ``f`` gives them.
NONE = 0
#: an activation: a value autocast put in the lower-precision dtype (a matmul's
#: output and what "follow" ops compute from it).
ACT = 1
#: a float32-list op's result, and what is computed from it, until a "lower"
#: op: it promotes an activation it meets, as torch's type promotion does
#: after torch's float32-list ops. Reductions are float32-list ops, so a
#: normalisation ``(x - mean) * rstd * scale`` or a softmax shift ``x - max``
#: runs in float32 and rounds once, at the next matmul, as Flax's norm layers
#: with ``dtype=`` and torch's norm kernels do (a BatchNorm of bfloat16
#: activations loses most of its gradient accuracy to a bfloat16 ``x - mean``).
F32 = 2
#: float32 by the user's request: an explicit cast to float32 in ``f``, a
#: ``keep_float32`` marker, a while loop's carry. It promotes everything it
#: meets until a "lower" op.
PIN = 3
#: a trace-time constant: a literal, a constant ``f`` closes over, and what is
#: computed from constants and boolean masks alone (``jnp.where(mask, 0.0,
#: -1e9)``). The only values whose casts down saturate: a sentinel such as
#: ``finfo(float32).min`` must stay finite in float16. Otherwise like NONE.
CONST = 4

# How a floating input is laid out into an equation's result (``_analysis``):
#: of the result's own size (an input, a target, a mask, a computed value), or
#: any operand of a subtraction or comparison (a per-row target, a threshold).
OWN = 0
#: a 0-dimensional value broadcast into the result: a Python or 0-d constant, a
#: scalar parameter (torch does not promote with a 0-dim tensor either).
SCALAR = 1
#: a vector broadcast into the result: a per-channel scale, a per-row weight, a
#: layer scale, a per-feature offset.
VECTOR = 2
#: a vector added to a matmul's or convolution's result (a Dense / Linear / Conv
#: bias).
BIAS = 3

FLOAT32_DTYPE = np.dtype(np.float32)


@functools.cache
def promote(a: np.dtype, b: np.dtype) -> np.dtype:
    return np.dtype(jnp.promote_types(a, b))


class FloatIn(NamedTuple):
    """What [`choose`][jaxamp.casting._rules._rules.choose] reads of one floating input.

    Attributes:
      dtype: its current dtype.
      mark: its mark (``NONE``, ``ACT``, ``F32``, ``PIN``, ``CONST``).
      strong: False for a weakly typed Python scalar, which follows the other
        inputs as in JAX and PyTorch.
      layout: how it is laid out into the result (``OWN``, ``SCALAR``,
        ``VECTOR``, ``BIAS``; ``_analysis.input_layouts``).
    """

    dtype: np.dtype
    mark: int
    strong: bool
    layout: int


def choose(
    rule: str, ins: Sequence[FloatIn], compute: np.dtype, demanded: bool
) -> tuple[np.dtype, int, str]:
    """The dtype an equation runs in, the mark of its results, and why (the
    phrase ``jaxamp.audit`` shows for the equation: it comes from this decision,
    so the explanation cannot drift from the rule).

    Args:
      rule: the equation's op class (not ``"as_written"``).
      ins: its floating inputs.
      compute: the autocast dtype.
      demanded: every use of the results is float32 (``_analysis``).

    Where a wider value meets an activation in an op outside the float32
    list, the op follows torch's type promotion (float32): a wider value is
    never rounded, clipped or flushed to 0 where float32 and torch keep it
    (``_keeps_float32``). Cast down to the activation instead: a scalar (torch
    does not promote with a 0-dim tensor), a Dense / Conv bias (torch's
    ``Linear`` and ``conv`` cast theirs), and a trace-time constant vector
    whose values the lower dtype holds.
    """
    kinds = [x.dtype for x in ins if x.strong] or [x.dtype for x in ins]
    widest = functools.reduce(promote, kinds[1:], kinds[0])
    marks = {x.mark for x in ins}
    wide = promote(widest, FLOAT32_DTYPE)
    if rule == LOWER:
        if widest.itemsize > compute.itemsize and widest.itemsize > 4:
            return widest, NONE, "a float64 product is not cast down"
        return compute, ACT, "a matrix product: runs in the autocast dtype"
    if rule == FLOAT32:
        return wide, PIN if PIN in marks else F32, "a float32-list op"
    if rule == ELEMENTWISE and demanded:
        return wide, NONE, "every use of its result is float32 (a float32-list op, f's output)"
    if PIN in marks:  # the user's float32 promotes what it meets
        return wide, PIN, "promoted: meets a value f made float32 (astype, keep_float32)"
    if F32 in marks:  # torch's type promotion after a float32-list op
        return wide, F32, "promoted: meets a float32-list op's result (torch's type promotion)"
    if rule == WIDEST:
        mark = ACT if ACT in marks and widest == compute else NONE
        return widest, mark, "runs in its widest input's dtype"
    if rule in (ELEMENTWISE, FOLLOW):
        if ACT in marks and widest.itemsize <= 4:
            if any(_keeps_float32(x, compute) for x in ins):
                why = "promoted: a float32 input, parameter, target or mask (torch's promotion)"
                return wide, F32, why
            why = "follows the activation (a scalar, a Dense bias or a constant is cast down)"
            return compute, ACT, why
        return widest, NONE, "no activation among its inputs: runs in its inputs' dtype"
    raise ValueError(f"autocast: unknown op class {rule!r}")


def _keeps_float32(x: FloatIn, compute: np.dtype) -> bool:
    """Whether a wider input meeting an activation makes the op promote.

    A run-time value (an input, a parameter) of dimension >= 1 promotes, as a
    float32 tensor does in torch's type promotion: cast down, a layer scale of
    1e-6 keeps 3 digits in float16, a factor of 1e-8 becomes 0 and an offset
    of 1e5 inf. Two exceptions are cast down:

    * a ``BIAS``, the vector a Dense, Conv or Linear layer adds to its matmul:
      torch's ``Linear`` and ``conv`` cast it with the product, and promoting
      it would keep every layer's output, and what the activation function
      after it saves for the backward pass, in float32 (twice the bytes);
    * a trace-time constant vector: ``_constants.const_mark`` keeps the CONST
      mark only for values the lower dtype holds, or a sentinel fill that
      saturates.

    Scalars follow the activation (a 0-dim tensor does not promote in torch);
    an op runs in float32 and rounds once with a Python scalar it cannot hold
    or a run-time 0-dim float32 value, as torch's opmath (``_opmath``).
    """
    if not x.strong or x.mark not in (NONE, CONST) or x.dtype.itemsize <= compute.itemsize:
        return False
    return x.layout == OWN or (x.layout == VECTOR and x.mark == NONE)
