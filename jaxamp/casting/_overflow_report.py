"""What [`jaxamp.find_overflow`][jaxamp.find_overflow] says: the report, and advice checked before
it is given.

Every piece of advice is a setting ``find_overflow`` can run again (a smaller
loss scale, a per-module or per-primitive autocast rule, bfloat16): it is given
only if the loss, run again with it, no longer overflows at that op. When no
single setting does, the report says so, with the op and its magnitude.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp.casting import _overflow_eval, _overflow_where
from jaxamp.casting._rules import _known_primitives

__all__ = ["OverflowReport", "advise", "build"]

# How many smaller loss scales find_overflow tries before it gives up on one.
_MAX_RETRIES = 8

#: probe(loss_scale, **overrides) -> an OverflowReport without advice: the loss
#: run again with `overrides` (dtype=, rules=, modules=, autocast=) in place of
#: the caller's.
Probe = Callable[..., "OverflowReport"]


@dataclasses.dataclass(frozen=True)
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
        top = _largest_finite([x for x in outs if _overflow_eval.is_float(x)])
        if top is not None:
            return top, "float32"
    top = _largest_finite([x for x in finding.invals if _overflow_eval.is_float(x)])
    return (top, "inputs") if top is not None else (None, None)


def _in_float32(finding: _overflow_eval.Finding) -> list[Any]:
    """The finding's equation again, its lower-precision inputs and dtype params in float32."""
    eqn, f32 = finding.eqn, np.dtype(jnp.float32)

    def up(x: Any) -> Any:
        if _overflow_eval.is_float(x) and np.dtype(jnp.result_type(x)).itemsize < 4:
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


# --------------------------------------------------------------------------
# Advice, each piece checked by running the loss again with it.
# --------------------------------------------------------------------------


def advise(
    r: OverflowReport,
    finding: _overflow_eval.Finding | None,
    probe: Probe,
    rules: Mapping[Any, str] | None,
    modules: Mapping[str, Any] | None,
    autocast: bool,
) -> OverflowReport:
    """`r` with the advice that, tried by `probe`, removes its overflow."""
    if not r.found:
        return r
    if r.opaque:
        return dataclasses.replace(r, advice=_opaque_advice(r))
    smallest = None
    if _scale_bound(r):
        scale, smallest = _checked_scale(r, probe)
        if scale is not None:
            return dataclasses.replace(
                r, suggested_loss_scale=scale, advice=_scale_advice(r, scale)
            )
    tries: list[tuple[str, dict[str, Any]]] = []
    if autocast and r.module_path is not None:
        tries.append(("modules", {"modules": {**(modules or {}), r.module_path: "float32"}}))
    if autocast and r.low_precision:
        known = _known_primitives()
        # A cast takes its dtype from the op it feeds: that op's rule is the fix.
        names = [r.primitive, *(finding.consumers if finding is not None else ())]
        for name in dict.fromkeys(n for n in names if n in known):
            tries.append(("rules", {"rules": {**(rules or {}), name: "float32"}}))
    if autocast and r.compute_dtype == "float16":
        tries.append(("dtype", {"dtype": jnp.bfloat16}))
    if not r.low_precision:
        # A float32 op: it is the program's own overflow if float32 does it too.
        same = autocast and _same_site(r, probe(r.loss_scale, autocast=False))
        if same or not autocast:
            return dataclasses.replace(r, advice=_float32_advice(r, as_written=not autocast))
        tries = [t for t in tries if t[0] != "rules"]
    found: dict[str, tuple[Any, OverflowReport]] = {}
    for kind, override in tries:
        if kind in found or (kind == "dtype" and any(not f[1].found for f in found.values())):
            continue
        try:
            again = probe(r.loss_scale, **override)
        except (TypeError, ValueError):  # a rule autocast refuses for this program
            continue
        if not _same_site(r, again):
            found[kind] = (next(iter(override.values())), again)
            if not again.found:
                break
    return dataclasses.replace(
        r,
        suggested_modules=found["modules"][0] if "modules" in found else None,
        suggested_rules=found["rules"][0] if "rules" in found else None,
        suggested_dtype="bfloat16" if "dtype" in found else None,
        advice=_precision_advice(r, found, tries, autocast, finding, smallest),
    )


def _scale_bound(r: OverflowReport) -> bool:
    """Whether `r` is a lower-precision gradient overflow that the loss scale may cause."""
    return r.found and r.low_precision and r.pass_ == "backward" and r.loss_scale > 1


def _same_site(r: OverflowReport, again: OverflowReport) -> bool:
    """Whether `again` reports the overflow `r` reports (the same place, kind and pass)."""
    where = ("pass_", "file", "line", "module_path", "scan_iterations", "low_precision")
    return again.found and all(getattr(r, k) == getattr(again, k) for k in where)


def _next_scale(r: OverflowReport) -> float | None:
    """A loss scale under which this backward op's result would fit its dtype."""
    if r.ratio is None:
        return r.loss_scale / 2 if r.loss_scale >= 2 else None
    scale = r.loss_scale / 2.0 ** max(1, math.ceil(math.log2(r.ratio)))
    return scale if scale >= 1 else None


def _checked_scale(r: OverflowReport, probe: Probe) -> tuple[float | None, float]:
    """The largest scale tried (each step down as far as the op needs) under which
    no gradient op overflows because of the scale, or None; and the smallest tried."""
    scale, smallest = _next_scale(r), r.loss_scale
    for _ in range(_MAX_RETRIES):
        if scale is None:
            break
        again, smallest = probe(scale), scale
        if not _scale_bound(again):
            return scale, smallest
        scale = _next_scale(again)
    return None, smallest


def _scale_advice(r: OverflowReport, scale: float) -> str:
    s = f"{scale:g}"
    return (
        f"The loss scale is too large: with loss_scale={r.loss_scale:.9g} this gradient "
        f"op exceeds {r.dtype}'s range; run again at loss_scale={s}, no gradient op "
        f"overflows because of the scale. Start from it: jaxamp.dynamic_scale(init_scale={s}) "
        "(a dynamic scale also gets there by halving, skipping one step each time)."
    )


def _precision_advice(
    r: OverflowReport,
    found: dict[str, tuple[Any, OverflowReport]],
    tries: list[tuple[str, dict[str, Any]]],
    autocast: bool,
    finding: _overflow_eval.Finding | None,
    smallest_scale: float | None,
) -> str:
    pass_ = "" if r.pass_ == "forward" else " (its gradient)"
    what = f"Module {r.module_path}" if r.module_path is not None else f"This {r.primitive}"
    feeds = [c for c in (finding.consumers if finding is not None else ()) if c != r.primitive]
    if r.primitive == "convert_element_type" and feeds:
        what = f"A value cast to {r.dtype} for the {feeds[0]} it feeds"
        what += f" in module {r.module_path}" if r.module_path is not None else ""
    if r.low_precision:
        head = f"{what} produces values beyond {r.dtype}'s range{pass_}"
    else:
        head = (
            f"No {r.compute_dtype} op overflowed, but this float32 {r.primitive} makes "
            f"{r.nonfinite} only under mixed precision (the float32 program is finite here)"
        )
    if found:
        ways = []
        for kind, (value, again) in found.items():
            text = _describe(kind, value)
            text = f"jaxamp.autocast(f, {text})" if kind == "modules" else text
            if again.found:
                module = f" in {again.module_path}" if again.module_path is not None else ""
                text += (
                    f" (then {again.primitive}{module} in the {again.pass_} pass at "
                    f"{again.file}:{again.line} overflows next)"
                )
            ways.append(text)
        return (
            f"{head}. Checked by running the loss again, each of these removes this "
            "overflow: " + "; or ".join(ways) + "."
        )
    size = ""
    if r.magnitude is not None and r.ratio is not None:
        size = f", {r.magnitude:.4g} in float32 ({r.ratio:.3g}x {r.dtype}'s max {r.dtype_max:g})"
    elif r.magnitude is not None:
        size = f" (largest input {r.magnitude:.4g})"
    where = f" at {r.file}:{r.line}" if r.file is not None else ""
    if not autocast:
        why = f"the code itself casts to {r.dtype} (autocast=False), so no autocast setting applies"
    else:
        tried = "; ".join(_describe(k, next(iter(o.values()))) for k, o in tries) or "nothing"
        why = f"no single autocast setting removes it (find_overflow tried {tried})"
    if smallest_scale is not None and smallest_scale < r.loss_scale:
        why += f", nor does a smaller loss scale (tried down to {smallest_scale:g})"
    elif smallest_scale is not None:
        why += ", and a loss scale small enough for it would be below 1"
    return (
        f"{head}: {r.nonfinite}{where}{size}; {why}. The value must get smaller there, "
        "or stay in float32 in the code that produces and uses it."
    )


def _float32_advice(r: OverflowReport, as_written: bool) -> str:
    scale = ""
    if r.pass_ == "backward" and r.loss_scale > 1:
        scale = (
            f" In the backward pass the loss scale ({r.loss_scale:g}) multiplies every "
            "gradient: try a smaller one as well."
        )
    how = (
        "in the program as written (autocast=False)"
        if as_written
        else "and the float32 program (run again without autocast) does so too"
    )
    return (
        f"No {r.compute_dtype} op overflowed; a {r.dtype} {r.primitive} made {r.nonfinite} "
        f"from finite inputs {how} (exp of a large value, log of 0, 0/0, a value past "
        "float32's range): fix the computation there (subtract the max before exp, add an "
        "epsilon, clip)." + scale
    )


def _opaque_advice(r: OverflowReport) -> str:
    return (
        f"The overflow is inside a {r.primitive}, which find_overflow cannot enter: run "
        "find_overflow on the function inside it to find the op."
    )


def _describe(kind: str, value: Any) -> str:
    """A setting as the caller writes it: ``rules={"dot_general": "float32"}``."""
    if kind == "dtype":
        return f"dtype=jnp.{np.dtype(value).name} (float32's range)"

    def name(x: Any) -> str:
        if isinstance(x, str):
            return x
        try:
            return np.dtype(x).name
        except TypeError:
            return str(getattr(x, "name", x))

    items = ", ".join(f'"{name(k)}": "{name(v)}"' for k, v in value.items())
    return f"{kind}={{{items}}}"
