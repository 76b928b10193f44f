"""``find_overflow``'s advice, each piece checked by running the loss again with it.

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

from jaxamp.casting._find_overflow import _overflow_eval
from jaxamp.casting._find_overflow._overflow_report import OverflowReport
from jaxamp.casting._rules._resolve import known_primitives

__all__ = ["advise"]

# How many smaller loss scales find_overflow tries before it gives up on one.
_MAX_RETRIES = 8

#: probe(loss_scale, **overrides) -> an OverflowReport without advice: the loss
#: run again with `overrides` (dtype=, rules=, modules=, autocast=) in place of
#: the caller's.
Probe = Callable[..., OverflowReport]


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
        known = known_primitives()
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
        f"The loss scale is too large: with a scale of {r.loss_scale:.9g} this gradient "
        f"op exceeds {r.dtype}'s range; run again at scale={s}, no gradient op "
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
