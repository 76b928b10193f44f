"""``jaxamp.fp8_select``: which layers' products run in FP8, measured on a calibration batch.

The signal is the loss gradient: FP8's rounding reaches training through it, and
the gradient is what a step applies. For a set S of modules, the error is

    ||g_S - g_bf16|| / ||g_bf16||

where g_bf16 is bfloat16 autocast's gradient of the loss on the calibration
arguments and g_S the gradient with the FP8 products of S only (every other
product in bfloat16): the FP8 error on top of bfloat16's, the comparison the
1 % goal makes. The forward loss alone would miss a layer whose FP8 wgrad is
wrong (its loss is bfloat16's until the next step), and a per-layer output
error does not say how much of the gradient a layer moves.

The errors of single modules do not add up to the error of a set (a layer's
FP8 error reaches every layer before it through dgrad, and errors of
different layers may cancel or compound), so the procedure measures the set it
keeps: every candidate alone, then, in the order of least error alone (ties by
path), each one joins the set if the set's error with it stays within the
budget. Layers (``_fp8_layers``: module paths, or the weight a product reads
where module paths do not tell layers apart), not program order, name the
candidates: a model called twice is one set of layers, and the result is the
same for the same program and arguments (no randomness; XLA's CPU and GPU
products are deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.dtypes import is_inexact
from jaxamp.casting._fp8._fp8_config import fp8

__all__ = ["Fp8Selection", "fp8_select"]

#: What ``Fp8Selection.signal`` names: the measure its errors are in.
SIGNAL = "relative gradient error vs bfloat16 autocast: ||g_fp8 - g_bf16|| / ||g_bf16||"
_FP8 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Fp8Selection(Mapping[str, bool]):
    """What ``jaxamp.fp8_select`` measured and chose; as a mapping, layer -> bool.

    Pass it back as ``jaxamp.fp8(select=selection)`` (``audit`` then gives each
    decision's measured reason), or ``dict(selection)`` edited, or read back
    from JSON / a checkpoint (``to_dict`` / ``from_dict``).

    Attributes:
      modules: layer -> True (its products run FP8) or False (kept in the
        autocast dtype). A layer is its module path as ``jaxamp.audit`` prints
        it (``Block_0/Dense_1``), or, where the products of one module path read
        different weights (equinox scopes its layers by class) or there is no
        path (an nnx module merged inside the function, a plain function), the
        path of the weight its product reads in the function's arguments
        (``mlp/0/layers/1/weight``, ``attn/query/kernel``); audit's per-op
        rows give each product's layer (``OpRow.layer``).
      reasons: layer -> the measured reason of its decision.
      alone: layer -> the error with only its products in FP8.
      error: the error with every kept module in FP8 (0.0 when none is kept).
      budget: the budget the selection kept `error` within.
      scaling: the FP8 scaling it was measured with.
      signal: what the errors measure (``SIGNAL``).
    """

    modules: dict[str, bool]
    reasons: dict[str, str]
    alone: dict[str, float]
    error: float
    budget: float
    scaling: str
    signal: str = SIGNAL

    def __getitem__(self, path: str) -> bool:
        return self.modules[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def kept(self) -> float:
        """The share of candidate layers kept in FP8 (1.0 when there is none)."""
        return sum(self.modules.values()) / len(self.modules) if self.modules else 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, bool, float): ``json.dumps`` it, or save it in a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fp8Selection:
        """The selection ``to_dict`` wrote (e.g. ``json.loads`` of it)."""
        try:
            return cls(
                modules={str(k): bool(v) for k, v in data["modules"].items()},
                reasons={str(k): str(v) for k, v in data["reasons"].items()},
                alone={str(k): float(v) for k, v in data["alone"].items()},
                error=float(data["error"]),
                budget=float(data["budget"]),
                scaling=str(data["scaling"]),
                signal=str(data.get("signal", SIGNAL)),
            )
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(
                "Fp8Selection.from_dict: expected what Fp8Selection.to_dict returns (keys "
                f"'modules', 'reasons', 'alone', 'error', 'budget', 'scaling'); {e!r}"
            ) from e

    def __str__(self) -> str:
        n = sum(self.modules.values())
        lines = [
            f"jaxamp.fp8_select ({self.scaling}, budget {self.budget:g}): {n} of "
            f"{len(self.modules)} layers in FP8, error {self.error:.4g} ({self.signal})"
        ]
        for path in self.modules:
            on = "FP8 " if self.modules[path] else "bf16"
            lines.append(f"  {on}  {path or '(no module, no weight)'}: {self.reasons[path]}")
        return "\n".join(lines)


def _check_budget(budget: Any) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise ValueError(
            f"jaxamp.fp8_select: budget={budget!r}; write a relative gradient error >= 0, "
            "e.g. budget=0.05 (the FP8 gradient within 5 % of bfloat16 autocast's, in norm)"
        )
    return float(budget)


def fp8_select(
    fun: Callable[..., Any],
    *,
    budget: float = 0.05,
    scaling: str = "tensorwise",
    dtype: Any = jnp.bfloat16,
    argnums: int | tuple[int, ...] = 0,
    modules: Mapping[str, bool] | None = None,
    first_last_bf16: bool = True,
    batched: bool = False,
) -> Callable[..., Fp8Selection]:
    """``jaxamp.fp8_select(loss_fun)(*args)``: the layers whose FP8 products keep the
    loss gradient within `budget` of bfloat16 autocast's, measured on `args`.

    `loss_fun` returns a scalar loss; `args` are a calibration batch and the
    parameters (the floating arrays of the `argnums` arguments are
    differentiated; other leaves, an equinox model's activation functions and
    flags, are passed as they are, as ``eqx.filter_grad`` does). Every layer
    with a product that ``jaxamp.fp8(scaling, modules=..., first_last_bf16=...,
    batched=...)`` runs in FP8 is a candidate: its module path, or the path of
    the weight it reads where module paths do not tell layers apart (equinox's
    class scopes; an nnx module merged inside `fun`; a plain function of
    weights; ``Fp8Selection.modules``). The error of a set of layers is
    ``||g - g_bf16|| / ||g_bf16||``, the gradient with only their products in
    FP8 against bfloat16 autocast's. Each candidate is measured alone; then, in
    order of least error alone (ties by module path), each joins the kept set
    if the set's error with it is within `budget`. It compiles the gradient
    once per candidate and once per one that could join (at most twice the
    candidates, plus the reference): a calibration, not a train step.

    FP8 costs the gradient least at init: calibrate at parameters like the ones
    it will train (a checkpoint part way through; after a few hundred bfloat16
    steps where there is none), on a batch of the training data.

    Use it once before training in FP8::

        selection = jaxamp.fp8_select(loss_fun)(params, batch)
        print(selection)  # each layer: FP8 or bf16, and the measured reason
        cfg = jaxamp.fp8(select=selection)
        step = jaxamp.autocast(loss_fun, dtype=jnp.bfloat16, fp8=cfg)

    Args:
      fun: the loss function, returning a scalar.
      budget: the largest relative gradient error of the kept set (default
        0.05: on the conformance linen LM it kept 3 of 11 modules in FP8 and
        its final loss within 0.4 % of bfloat16 autocast's, where 0.1 kept 8
        and missed by 2.6 %). Lower it for a model that fits its data to a
        loss near 0: there each FP8 layer costs more of the final loss (the
        conformance equinox transformer, rowwise, met the 1 % goal at 0.02,
        not at 0.05; docs/fp8.md).
      scaling: as ``jaxamp.fp8``. This and the next three decide the candidates,
        and the selection is measured with them: pass the same to ``jaxamp.fp8``
        with ``select=``.
      modules: as ``jaxamp.fp8``.
      first_last_bf16: as ``jaxamp.fp8``.
      batched: as ``jaxamp.fp8``.
      dtype: the autocast dtype (default bfloat16).
      argnums: which arguments the gradient is of (default 0).

    Returns:
      A function of `fun`'s arguments returning an [`Fp8Selection`][jaxamp.types.Fp8Selection]:
      layer -> bool, the reason of each, the errors measured.

    Raises:
      TypeError: `fun` is not callable, or arguments of `fun` are given to
        ``fp8_select`` itself.
      ValueError: `budget` is not a number >= 0; `fun` returns no scalar; the
        bfloat16 gradient is zero or not finite (nothing to compare against).
    """
    if not callable(fun):
        raise TypeError(
            f"jaxamp.fp8_select: fun must be the loss function, got {type(fun).__name__}; "
            "write jaxamp.fp8_select(loss_fun)(*args)"
        )
    budget = _check_budget(budget)
    base = dict(scaling=scaling, modules=modules, first_last_bf16=first_last_bf16, batched=batched)
    fp8(**base)  # its errors, here, in the caller's words

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> Fp8Selection:
        return _select(fun, args, kwargs, budget, base, dtype, argnums)

    return run


def _select(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], budget: float,
    base: dict[str, Any], dtype: Any, argnums: Any,
) -> Fp8Selection:  # fmt: skip
    from jaxamp.casting._autocast._api import autocast

    arrays, diff, call = _arrays(args, kwargs, argnums)
    fixed = [x for j, x in enumerate(arrays) if j not in diff]

    def gradient(select: Mapping[str, bool] | None) -> np.ndarray:
        cfg = None if select is None else fp8(**base, select=select)
        f = autocast(fun, dtype=dtype, fp8=cfg)

        def of(wrt: list[Any], rest: list[Any]) -> Any:
            it, other = iter(wrt), iter(rest)
            return call(f, [next(it) if j in diff else next(other) for j in range(len(arrays))])

        g = jax.jit(jax.grad(of))([arrays[j] for j in diff], fixed)
        return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in g] or [np.zeros(0)])

    out = jax.eval_shape(functools.partial(call, fun), arrays)
    if not (hasattr(out, "shape") and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(
            f"jaxamp.fp8_select: fun must return a scalar floating loss, got {out}; "
            "return the loss alone (the gradient of it is what the selection measures)"
        )
    measured = autocast(fun, dtype=dtype, fp8=fp8(**base))
    paths = _candidates(functools.partial(call, measured), arrays)
    ref = gradient(None)
    norm = float(np.linalg.norm(ref))
    if not (np.isfinite(norm) and norm > 0):
        raise ValueError(
            f"jaxamp.fp8_select: bfloat16 autocast's gradient on these arguments has norm {norm}; "
            "calibrate on a batch and parameters where the loss has a finite, nonzero gradient"
        )

    def error(kept: set[str]) -> float:
        g = gradient({p: p in kept for p in paths})
        e = float(np.linalg.norm(g - ref) / norm)
        return e if np.isfinite(e) else float("inf")

    modules, reasons, alone = {p: False for p in paths}, {}, {}
    everything = error(set(paths)) if paths else 0.0
    if everything <= budget:
        for p in paths:
            modules[p] = True
            reasons[p] = f"all {len(paths)} modules in FP8: error {everything:.3g} <= {budget:g}"
        return Fp8Selection(
            modules=modules,
            reasons=reasons,
            alone={},
            error=everything,
            budget=budget,
            scaling=base["scaling"],
        )
    alone = {p: error({p}) for p in paths}
    kept: set[str] = set()
    total = 0.0
    for p in sorted(paths, key=lambda p: (alone[p], p)):
        if alone[p] > budget:
            reasons[p] = f"alone {alone[p]:.3g} > budget {budget:g}"
            continue
        with_it = error(kept | {p})
        if with_it <= budget:
            kept.add(p)
            modules[p], total = True, with_it
            reasons[p] = (
                f"error {with_it:.3g} <= {budget:g} with it and the {len(kept) - 1} kept "
                f"before it (alone {alone[p]:.3g})"
            )
        else:
            reasons[p] = (
                f"error {with_it:.3g} > budget {budget:g} with the {len(kept)} kept "
                f"(alone {alone[p]:.3g})"
            )
    return Fp8Selection(
        modules=modules,
        reasons=reasons,
        alone=alone,
        error=total,
        budget=budget,
        scaling=base["scaling"],
    )


def _arrays(
    args: tuple[Any, ...], kwargs: dict[str, Any], argnums: int | Sequence[int]
) -> tuple[list[Any], set[int], Callable[..., Any]]:
    """``(arrays, diff, call)``: the array leaves of `fun`'s arguments, which of them the
    gradient is of (the floating ones of the `argnums` arguments), and ``call(f,
    arrays)``, `f` on the arguments with those arrays. The other leaves stay as they
    are, never traced: an equinox model's activation functions and flags, as
    ``eqx.filter_grad`` does."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    nums = {n % len(args) for n in nums if -len(args) <= n < len(args)}
    at = [i for i, (_, x) in enumerate(flat) if isinstance(x, jax.Array | np.ndarray | np.generic)]
    diff = set()
    for j, i in enumerate(at):
        path, x = flat[i]
        if path[0] == jax.tree_util.SequenceKey(0) and path[1].idx in nums and is_inexact(x):
            diff.add(j)

    def call(f: Callable[..., Any], arrays: list[Any]) -> Any:
        leaves = [x for _, x in flat]
        for i, x in zip(at, arrays, strict=True):
            leaves[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, leaves)
        return f(*a, **k)

    return [flat[i][1] for i in at], diff, call


def _candidates(f: Callable[..., Any], arrays: list[Any]) -> list[str]:
    """The layers of the products `f` (autocast with the FP8 config, of the argument
    arrays) runs in FP8 (``audit``'s per-op view), sorted."""
    from jaxamp.casting._interpreter._decisions import fresh_trace, recording

    with recording() as ops, fresh_trace():
        jax.make_jaxpr(f)(arrays)
    return sorted({r.layer for r in ops if r.primitive == "dot_general" and r.dtype == _FP8})
