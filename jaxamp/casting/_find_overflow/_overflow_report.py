"""What [`jaxamp.find_overflow`][jaxamp.find_overflow] reports about the op it found.

The advice in it is ``_overflow_advice``'s, each piece checked before it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._utils.dtypes import is_float
from jaxamp.casting._find_overflow import _overflow_eval, _overflow_where

__all__ = ["OverflowReport", "build"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverflowReport:
    """What [`jaxamp.find_overflow`][jaxamp.find_overflow] found: the first op that overflowed, if
    any.

    Attributes:
      found: whether some op made an inf or NaN from finite inputs.
      primitive: that op's primitive name (``"dot_general"``, ``"exp"``, ...).
      pass_: ``"forward"`` or ``"backward"`` (the gradient computation).
      dtype: the dtype of the non-finite result (``"float16"``, ``"float32"``, ...).
      low_precision: False when no float16 / bfloat16 op overflowed and the
        report names a float32 op instead.
      nonfinite: ``"inf"`` or ``"nan"``.
      module_path: the Flax module path the op ran in (linen
        ``Block_1/Mlp_0/Dense_0``, nnx ``blocks/0/mlp``), or None outside modules.
      module_class: the class of that module where known (nnx), else None.
      name_stack: the op's full ``jax.named_scope`` stack, for reference.
      file: the innermost source frame outside JAX, Flax,
      line: the innermost source frame outside JAX, Flax,
      function: the innermost source frame outside JAX, Flax,
        optax, chex and jaxamp (the user's or the model package's code).
      scan_iterations: the iteration index of each ``scan`` / ``while`` loop
        around the op, outermost first (``()`` outside loops).
      magnitude: the largest finite absolute value of the op's result computed
        in float32 (for a float32 op, or where that fails, the largest finite
        absolute input).
      magnitude_source: ``"float32"`` or ``"inputs"``: how `magnitude` was found.
      dtype_max: the largest finite value of `dtype` (65504 for float16).
      ratio: ``magnitude / dtype_max`` where that means something, else None.
      loss_scale: the loss scale the run used.
      compute_dtype: autocast's lower-precision dtype for the run.
      opaque: True when the op is a higher-order primitive that find_overflow
        cannot enter: the overflow is somewhere inside it.
      suggested_loss_scale: for a backward overflow caused by the loss scale, a
        scale under which the loss, run again, no longer overflows there.
      suggested_modules: the ``modules=`` / ``rules=`` to pass
      suggested_rules: the ``modules=`` / ``rules=`` to pass
        to ``autocast`` (the caller's own, plus one ``"float32"`` entry) under
        which the loss, run again, no longer overflows at this op; None when
        that did not help or was not tried.
      suggested_dtype: ``"bfloat16"`` when running in bfloat16 was tried and
        this op no longer overflows, else None.
      advice: what to do, in words; only what was checked by running again.
    """

    found: bool
    compute_dtype: str
    loss_scale: float
    primitive: str | None = None
    pass_: str | None = None
    dtype: str | None = None
    low_precision: bool = False
    nonfinite: str | None = None
    module_path: str | None = None
    module_class: str | None = None
    name_stack: str = ""
    file: str | None = None
    line: int | None = None
    function: str | None = None
    scan_iterations: tuple[int, ...] = ()
    magnitude: float | None = None
    magnitude_source: str | None = None
    dtype_max: float | None = None
    ratio: float | None = None
    opaque: bool = False
    suggested_loss_scale: float | None = None
    suggested_modules: Mapping[str, Any] | None = None
    suggested_rules: Mapping[Any, str] | None = None
    suggested_dtype: str | None = None
    advice: str = ""

    @property
    def scan_iteration(self) -> int | None:
        """The innermost loop iteration the op ran in, or None outside loops."""
        return self.scan_iterations[-1] if self.scan_iterations else None

    def __str__(self) -> str:
        if not self.found:
            return (
                f"find_overflow: nothing overflowed. Every {self.compute_dtype} and float32 "
                f"result of the forward and backward pass (loss scale {self.loss_scale:g}) "
                "is finite or only passes on a non-finite input."
            )
        what = "" if self.low_precision else " (no float16 / bfloat16 op overflowed)"
        if self.opaque:
            what = f" (somewhere inside it: find_overflow cannot enter a {self.primitive})"
        lines = [
            f"find_overflow: the first op to overflow is {self.primitive} in the "
            f"{self.pass_} pass: its {self.dtype} result holds {self.nonfinite} "
            f"from finite inputs{what}.",
        ]
        if self.module_path is not None:
            cls = f" ({self.module_class})" if self.module_class else ""
            lines.append(f"  module:    {self.module_path}{cls}")
        if self.file is not None:
            lines.append(f"  source:    {self.file}:{self.line}, in {self.function}")
        if self.scan_iterations:
            its = ", ".join(str(i) for i in self.scan_iterations)
            lines.append(f"  loop:      iteration {its} (outermost first)")
        if self.magnitude is not None:
            how = "in float32" if self.magnitude_source == "float32" else "(largest input)"
            size = f"  magnitude: {self.magnitude:.4g} {how}"
            if self.ratio is not None:
                size += f" = {self.ratio:.3g}x {self.dtype}'s max ({self.dtype_max:g})"
            lines.append(size)
        lines.append(f"  advice:    {self.advice}")
        return "\n".join(lines)


# --------------------------------------------------------------------------
# The report of one run.
# --------------------------------------------------------------------------


def build(finding: _overflow_eval.Finding | None, low: np.dtype, scale: float) -> OverflowReport:
    """The report of `finding` (None: nothing overflowed), without advice."""
    if finding is None:
        return OverflowReport(found=False, compute_dtype=low.name, loss_scale=scale)
    eqn, stack = finding.eqn, finding.frame.stack
    path, cls = _overflow_where.module_path(stack)
    file, line, function = _overflow_where.source(eqn) or (None, None, None)
    dtype_max = float(jnp.finfo(finding.dtype).max)
    magnitude, source = _magnitude(finding)
    exact = magnitude is not None and source == "float32" and finding.low_precision
    return OverflowReport(
        found=True,
        compute_dtype=low.name,
        loss_scale=scale,
        primitive=eqn.primitive.name,
        pass_="backward" if ("transform", "transpose") in stack else "forward",
        dtype=finding.dtype.name,
        low_precision=finding.low_precision,
        nonfinite=finding.kind,
        module_path=path,
        module_class=cls,
        name_stack=_overflow_where.stack_str(stack),
        file=file,
        line=line,
        function=function,
        scan_iterations=finding.frame.iterations,
        magnitude=magnitude,
        magnitude_source=source,
        dtype_max=dtype_max,
        ratio=magnitude / dtype_max if exact else None,
        opaque=finding.opaque,
    )


def _magnitude(finding: _overflow_eval.Finding) -> tuple[float | None, str | None]:
    """The largest finite |result| of the op computed in float32, or of its inputs."""
    if finding.low_precision and not finding.opaque:
        try:
            outs = _in_float32(finding)
        except Exception:  # noqa: BLE001 - any failure falls back to the inputs
            outs = []
        top = _largest_finite([x for x in outs if is_float(x)])
        if top is not None:
            return top, "float32"
    top = _largest_finite([x for x in finding.invals if is_float(x)])
    return (top, "inputs") if top is not None else (None, None)


def _in_float32(finding: _overflow_eval.Finding) -> list[Any]:
    """The finding's equation again, its lower-precision inputs and dtype params in float32."""
    eqn, f32 = finding.eqn, np.dtype(jnp.float32)

    def up(x: Any) -> Any:
        if is_float(x) and np.dtype(jnp.result_type(x)).itemsize < 4:
            return jnp.asarray(x, f32)
        return x

    params = dict(eqn.params)
    for key in ("preferred_element_type", "new_dtype"):
        value = params.get(key)
        if value is not None and jnp.issubdtype(value, jnp.floating):
            params[key] = f32 if np.dtype(value).itemsize < 4 else value
    return finding.frame.bind(eqn, [up(x) for x in finding.invals], params)


def _largest_finite(xs: list[Any]) -> float | None:
    best = None
    for x in xs:
        a = np.abs(np.asarray(jnp.asarray(x, jnp.float32)))
        a = a[np.isfinite(a)]
        if a.size:
            best = max(best or 0.0, float(a.max()))
    return best
