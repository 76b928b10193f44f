"""``jaxamp.fp8``: what a user asks of FP8 (``Fp8Config``), checked where it is written.

How a trace applies it (which products run FP8, and why) is ``_fp8.plan``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Fp8Config", "fp8", "resolve"]

SCALINGS = ("tensorwise", "rowwise")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """What ``jaxamp.fp8(...)`` returns; pass it as ``autocast(..., fp8=...)``.

    Attributes:
      scaling: ``"tensorwise"`` or ``"rowwise"``.
      modules: ``(pattern, on)`` pairs, in the order given.
      first_last_bf16: keep the first and last matrix-product layers in the
        autocast dtype.
      batched: run products with batch dimensions (attention's) in FP8 too.
      select: ``(layer, on, why)`` triples of a layer selection
        (``jaxamp.fp8_select``), sorted by layer: a layer whose ``on`` is
        False keeps its products in the autocast dtype, `why` saying why.
    """

    scaling: str = "tensorwise"
    modules: tuple[tuple[str, bool], ...] = ()
    first_last_bf16: bool = True
    batched: bool = False
    select: tuple[tuple[str, bool, str], ...] = ()


def fp8(
    scaling: str = "tensorwise",
    *,
    modules: Mapping[str, bool] | None = None,
    first_last_bf16: bool = True,
    batched: bool = False,
    select: Mapping[str, bool] | None = None,
) -> Fp8Config:
    """FP8 matrix products for ``jaxamp.autocast``, with current scaling.

    ``jaxamp.autocast(f, dtype=jnp.bfloat16, fp8=jaxamp.fp8())`` runs every
    Linear-kind matrix product (a ``dot_general`` without batch dimensions:
    ``@`` of a weight, ``Dense``, an ``einsum`` projection) of `f` that autocast
    runs in bfloat16 as an FP8 GEMM instead: both operands
    scaled by ``fp8 max / amax`` of this step's values and rounded to
    float8_e4m3fn, accumulated in float32, multiplied back and rounded once to
    bfloat16. In the backward pass the incoming gradient is scaled the same
    way into float8_e5m2, and the input gradient (dgrad) and the weight
    gradient (wgrad) are each one FP8 GEMM. The scales come from each call's
    own operands (current scaling): there is no state to carry or checkpoint,
    and an unmodified linen, nnx or equinox model trains in FP8. On a mesh the
    amax is the global one (every device computes the same scales).

    Products whose M, N or K is not a multiple of 16 stay in bfloat16 (XLA
    would pad them for the cuBLASLt FP8 kernel), as do the first and last
    matrix-product layers by default (the embedding projection, the LM head or
    classifier, as Megatron's ``first_last_layers_bf16``). Products with batch
    dimensions (attention's ``q @ k.T`` and ``p @ v``) stay in bfloat16 unless
    ``batched=True``: as in Transformer Engine and torchao, which run only the
    Linear layers' GEMMs in FP8, since e4m3 costs attention several times
    bfloat16's error. Convolutions stay in bfloat16.

    Args:
      scaling: ``"tensorwise"`` (one scale per operand; default) or
        ``"rowwise"`` (one scale per row of the lhs and per column of the rhs,
        i.e. per index of the dimensions that are not contracted; they factor
        out of the sum, so an outlier costs only its own row's precision).
      modules: per-module overrides, module pattern -> True (FP8, even for a
        first or last layer) or False (stay in the autocast dtype). Patterns
        are matched as autocast's ``modules=`` (name, class, or a path with
        ``/``); the last matching pattern wins.
      first_last_bf16: keep the model's first and last matrix-product layers
        out of FP8 (default True). They are named by the first and the last
        product of the forward program outside loop bodies, and are the arrays
        those read: every product reading the same weight (or the same input
        of `f`), directly or cast, transposed or reshaped, stays out too, in
        every call of the model (a model applied to two batches, or again in a
        loop) and for a weight tied to another layer.
      batched: also run products with batch dimensions (attention's score and
        value products, a ``vmap``'d matmul inside `f`) in FP8 (default False).
      select: a layer selection, layer -> bool, as ``jaxamp.fp8_select``
        returns it (an ``Fp8Selection``, or a plain dict of it read back from
        JSON or a checkpoint, edited or not). A key is matched exactly (not as
        a pattern) against each product's layer, which ``jaxamp.audit``'s
        per-op rows print (``OpRow.layer``: the module path, or the path of the
        weight the product reads where module paths do not tell layers apart);
        False keeps that layer's products in the autocast dtype, True leaves
        them to the rules above (FP8 where they are eligible). A key naming no
        layer of the traced function is warned of. An ``Fp8Selection`` also
        gives ``audit`` the measured reason of each decision.

    Returns:
      An ``Fp8Config`` for ``autocast(..., fp8=...)``.

    Raises:
      ValueError: `scaling` is not ``"tensorwise"`` or ``"rowwise"``.
      TypeError: a `modules` key is not a pattern string or a value is not a bool;
        a `select` key is not a layer name (str) or a value is not a bool.

    Examples:
      >>> model = flax.linen.Dense(32)
      >>> params = model.init(jax.random.key(0), jnp.ones((16, 64)))
      >>> fwd = jaxamp.autocast(
      ...     model.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8(first_last_bf16=False)
      ... )
      >>> fwd(params, jnp.ones((16, 64))).dtype  # an FP8 GEMM; f's output dtype
      dtype('float32')
    """
    if scaling not in SCALINGS:
        raise ValueError(
            f"jaxamp.fp8: scaling={scaling!r}; write scaling='tensorwise' (one scale per "
            "operand) or scaling='rowwise' (one per row / column)"
        )
    pairs = []
    for pattern, on in (modules or {}).items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"jaxamp.fp8: modules keys are module name patterns, got {pattern!r}")
        if not isinstance(on, bool):
            raise TypeError(
                f"jaxamp.fp8: modules[{pattern!r}]={on!r}; write True to run the module's "
                "matrix products in FP8 or False to keep them in the autocast dtype"
            )
        pairs.append((pattern, on))
    if not isinstance(first_last_bf16, bool):
        raise TypeError(
            f"jaxamp.fp8: first_last_bf16 must be True or False, got {first_last_bf16!r}"
        )
    if not isinstance(batched, bool):
        raise TypeError(f"jaxamp.fp8: batched must be True or False, got {batched!r}")
    return Fp8Config(
        scaling=scaling,
        modules=tuple(pairs),
        first_last_bf16=first_last_bf16,
        batched=batched,
        select=_selected(select),
    )


def _selected(select: Mapping[str, bool] | None) -> tuple[tuple[str, bool, str], ...]:
    """`select` as ``Fp8Config.select``: sorted, each layer's reason (an ``Fp8Selection``'s
    ``reasons``; a plain mapping has none)."""
    if select is None:
        return ()
    if not isinstance(select, Mapping):
        raise TypeError(
            f"jaxamp.fp8: select={select!r}; write select=jaxamp.fp8_select(...) or a dict "
            "of layer -> bool (what it returns, read back from JSON or a checkpoint)"
        )
    reasons = getattr(select, "reasons", {})
    out = []
    for path, on in select.items():
        if not isinstance(path, str):
            raise TypeError(f"jaxamp.fp8: select keys are layer names (str), got {path!r}")
        if not isinstance(on, bool):
            raise TypeError(
                f"jaxamp.fp8: select[{path!r}]={on!r}; write True (FP8 where eligible) or "
                "False (keep the layer's products in the autocast dtype)"
            )
        out.append((path, on, str(reasons.get(path, ""))))
    return tuple(sorted(out))


def resolve(value: Any) -> Fp8Config | None:
    """autocast's ``fp8=`` argument: None / False (off), True (defaults) or an ``Fp8Config``."""
    if value is None or value is False:
        return None
    if value is True:
        return Fp8Config()
    if isinstance(value, Fp8Config):
        return value
    raise TypeError(
        f"autocast: fp8={value!r}; write fp8=jaxamp.fp8() (tensorwise current scaling), "
        "fp8=jaxamp.fp8(scaling='rowwise'), or fp8=None"
    )
