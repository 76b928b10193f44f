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

The errors of single modules do not add up to the error of a set (a layer's FP8
error reaches every layer before it through dgrad, and errors of different layers
may cancel or compound), so the procedure measures the set it keeps: every
candidate alone, then, in the order of least error alone (ties by path), each one
joins the set if the set's error with it stays within the budget, in one pass (a
refused layer may fit with later ones: each reason is the verdict on one set).
Layers (``_fp8_layers``: module paths, or the weight a product reads where module
paths do not tell layers apart), not program order, name the candidates: a model
called twice is one set of layers, and the result is the same for the same program
and arguments (no randomness; XLA's CPU and GPU products are deterministic).

With ``other_batches`` the budget is measured beside the gradient's sampling noise,
which a step on a fresh batch carries anyway. FP8's error d on a batch is split into
the part common to every batch, c (``E[d_i . d_j] = ||c||**2`` for independent
batches i != j), and the part that changes from batch to batch, v (``||d||**2 -
||c||**2`` on average; ``_noise.split``). The changing part and the noise (sigma,
one batch's gradient's distance from the mean, ``||g_0 - g_k||**2 / 2`` averaged)
add in quadrature and average out over steps together: the step moves
``sqrt(sigma**2 + ||v||**2) - sigma`` farther from the mean gradient, within the
budget while ``||v|| <= sqrt(budget**2 + 2 * budget * sigma)``
(``Fp8Selection.threshold``). The common part adds up over steps as the noise does
not: it is held to the budget against the gradient it adds up beside, the mean
gradient mu (``E[g_i . g_j] = ||mu||**2``): ``||c|| <= budget * ||mu||``, by a bound
one jackknife standard error above the estimate (``_noise.common_bound``). Without
other batches a set is kept while ``||d|| <= budget`` (relative to the calibration
gradient's norm, as the changing part is): a model trained on one batch (or fitting
its data) has no sampling noise to hide FP8's error in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.dtypes import is_inexact
from jaxamp.casting._fp8._fp8_config import fp8
from jaxamp.casting._fp8_select._noise import common_bound, noise_of, pair_means, split
from jaxamp.casting._fp8_select._selection import Fp8Selection, _threshold

_FP8 = "float8_e4m3fn"

__all__ = ["Fp8Selection", "fp8_select"]


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
    other_batches: Sequence[tuple[Any, ...]] = (),
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
    if the set's error with it is within `budget` (one pass; all where all fit).
    It compiles the gradient once per candidate and once per one that could join
    (at most twice the candidates, plus the reference; with `other_batches`, each
    runs on every batch): a calibration, not a train step.

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
      other_batches: `fun`'s arguments on other training batches, a list of
        tuples like `args` (``[(params, batch_2), (params, batch_3)]``; two or
        more, each once), at the same parameters: each set's error is then split
        into the part common to the batches, held to `budget` times the mean
        gradient (it adds up over steps; by a bound one standard error above its
        estimate), the part that changes from batch to batch held to `budget`
        beside the sampling noise a step on a fresh batch has anyway (module
        docstring; ``Fp8Selection.common``, ``.noise``, ``.threshold``).
        No mean direction in their gradients: as without them. For training on
        fresh batches; not for a model fitting its data to a loss near 0.

    Returns:
      A function of `fun`'s arguments returning an [`Fp8Selection`][jaxamp.types.Fp8Selection]:
      layer -> bool, the reason of each, the errors measured.

    Raises:
      TypeError: `fun` is not callable, or arguments of `fun` are given to
        ``fp8_select`` itself; an array argument is given by keyword with
        `other_batches` (they are positional).
      ValueError: `budget` is not a number >= 0; `argnums` is out of range; `fun`
        returns no scalar; the bfloat16 gradient is zero or not finite (nothing to
        compare against); another batch is shaped otherwise, at other parameters
        (its `argnums` arrays differ), given twice or reordered; one other batch.
    """
    if not callable(fun):
        raise TypeError(
            f"jaxamp.fp8_select: fun must be the loss function, got {type(fun).__name__}; "
            "write jaxamp.fp8_select(loss_fun)(*args)"
        )
    budget = _check_budget(budget)
    if not isinstance(other_batches, Sequence) or not all(type(b) is tuple for b in other_batches):
        raise TypeError(
            f"jaxamp.fp8_select: other_batches={_short(other_batches)}; write a list of "
            "argument tuples of fun, one per other batch: other_batches=[(params, batch_2)]"
        )
    if len(other_batches) == 1:
        # One pair of batches gives no measure of the common part's noise (common_bound):
        # on the tests' student it let in a layer 2.5 times over budget in 26 % of draws.
        raise ValueError(
            "jaxamp.fp8_select: other_batches has 1 batch; give at least two other "
            "batches (the FP8 error common to the batches is estimated from pairs of them, "
            "with its uncertainty): other_batches=[(params, batch_2), (params, batch_3)]"
        )
    base = dict(scaling=scaling, modules=modules, first_last_bf16=first_last_bf16, batched=batched)
    fp8(**base)  # its errors, here, in the caller's words

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> Fp8Selection:
        named = [k for k, v in kwargs.items() if any(map(_is_array, jax.tree.leaves(v)))]
        if other_batches and named:
            # The other batches are positional tuples: an array by keyword would be the
            # calibration's on every one of them, a noise never measured.
            raise TypeError(
                f"jaxamp.fp8_select: {', '.join(named)} given by keyword with other_batches; "
                "pass fun's arguments positionally, as the other batches are: "
                "fp8_select(fun, other_batches=[(params, batch_2)])(params, batch)"
            )
        return _select(fun, args, kwargs, budget, base, dtype, argnums, other_batches)

    return run


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _gradients(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], base: dict[str, Any],
    dtype: Any, argnums: Any,
) -> Callable[..., np.ndarray]:  # fmt: skip
    """``gradient(select, at=args)``: the flat float64 gradient of autocast `fun` with the
    FP8 products of the `select` layers (None: bfloat16 autocast, no FP8), at `args` or
    at other arguments of their structure (another batch): compiled once per `select`."""
    from jaxamp.casting._autocast._api import autocast

    _, diff, call = _arrays(args, kwargs, argnums)
    compiled: dict[Any, Any] = {}

    def gradient(select: Mapping[str, bool] | None, at: tuple[Any, ...] = args) -> np.ndarray:
        key = None if select is None else tuple(sorted(select.items()))
        if key not in compiled:
            cfg = None if select is None else fp8(**base, select=select)
            f = autocast(fun, dtype=dtype, fp8=cfg)

            def of(wrt: list[Any], rest: list[Any], n: int) -> Any:
                it, other = iter(wrt), iter(rest)
                return call(f, [next(it) if j in diff else next(other) for j in range(n)])

            compiled[key] = jax.jit(jax.grad(of), static_argnums=2)
        arrays = _arrays(at, kwargs, argnums)[0]
        wrt = [arrays[j] for j in range(len(arrays)) if j in diff]
        rest = [arrays[j] for j in range(len(arrays)) if j not in diff]
        g = compiled[key](wrt, rest, len(arrays))
        return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in g] or [np.zeros(0)])

    return gradient


def _select(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], budget: float,
    base: dict[str, Any], dtype: Any, argnums: Any, others: Sequence[tuple[Any, ...]],
) -> Fp8Selection:  # fmt: skip
    from jaxamp.casting._autocast._api import autocast

    arrays, _, call = _arrays(args, kwargs, argnums)
    gradient = _gradients(fun, args, kwargs, base, dtype, argnums)
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

    def wrt(a: tuple[Any, ...]) -> list[Any]:
        arrays, diff, _ = _arrays(a, kwargs, argnums)
        return [arrays[j] for j in sorted(diff)]

    noise, grads = noise_of(ref, args, others, lambda o: gradient(None, o), wrt)
    if not math.isfinite(noise):
        raise ValueError(
            "jaxamp.fp8_select: bfloat16 autocast's gradient on other_batches is not finite; "
            "give other batches of the training data at the same parameters"
        )
    mean = pair_means([ref, *grads]) if others else (0.0, np.zeros(0))
    blind = bool(others) and not (mean[0] > 0 and np.all(mean[1] > 0))
    if blind:
        # No mean direction shows through the noise (at a minimum; small batches, too
        # few): nothing to hold the common part against; the rule without other batches.
        others, noise, grads = (), 0.0, []
    limit = _threshold(budget, noise)
    cache: dict[frozenset[str], tuple[float, float, float, float]] = {}

    def measure(kept: set[str]) -> tuple[float, float, float, float]:
        """``(error, common, bound, varying)`` of `kept` in FP8: its error on the
        calibration batch; with other batches, its part common to them against the mean
        gradient (estimate, bound) and the part that changes, against ``norm``."""
        if frozenset(kept) not in cache:
            select = {p: p in kept for p in paths}
            ds = [gradient(select) - ref]
            ds += [gradient(select, o) - g for o, g in zip(others, grads, strict=True)]
            e = float(np.linalg.norm(ds[0]) / norm)
            common, bound, varying = (
                (*common_bound(ds, mean), split(ds)[1] / norm) if others else (e, e, e)
            )
            got = e, common, bound, varying
            cache[frozenset(kept)] = tuple(x if np.isfinite(x) else math.inf for x in got)
        return cache[frozenset(kept)]

    def judge(kept: set[str]) -> tuple[bool, float, str]:
        e, common, bound, varying = measure(kept)
        if not others:
            why = f"error {e:.3g} {'<=' if e <= budget else '> budget'} {budget:g}"
            return e <= budget, e, why + _BLIND * blind
        fits = bound <= budget and varying <= limit
        return fits, e, (
            f"error {e:.3g}: common to the batches {common:.3g} of the mean gradient "
            f"(at most {bound:.3g}) {'<=' if bound <= budget else '> budget'} {budget:g}, "
            f"varying {varying:.3g} {'<=' if varying <= limit else '> threshold'} "
            f"{limit:.3g} (budget {budget:g} beside noise {noise:.3g})"
        )  # fmt: skip

    modules, reasons, alone, kept = _choose(paths, judge)
    total, common, _, _ = measure(kept) if kept else (0.0, 0.0, 0.0, 0.0)
    return Fp8Selection(
        modules=modules,
        reasons=reasons,
        alone=alone,
        error=total,
        budget=budget,
        scaling=base["scaling"],
        noise=noise,
        common=common if others else 0.0,
    )


_BLIND = (
    " (other_batches: no mean direction in their gradients, the mean of g_i . g_j <= 0 "
    "with one left out: held to the budget as without them; more batches may show one)"
)


def _choose(
    paths: list[str], judge: Callable[[set[str]], tuple[bool, float, str]]
) -> tuple[dict[str, bool], dict[str, str], dict[str, float], set[str]]:
    """``(modules, reasons, alone, kept)``: every layer if their set fits (``judge``: fits,
    its error, why), else each in order of least error alone while the set still fits."""
    modules, reasons = {p: False for p in paths}, {}
    fits, _, why = judge(set(paths)) if paths else (True, 0.0, "")
    if fits:
        for p in paths:
            modules[p] = True
            reasons[p] = f"all {len(paths)} modules in FP8: {why}"
        return modules, reasons, {}, set(paths)
    verdicts = {p: judge({p}) for p in paths}
    alone = {p: v[1] for p, v in verdicts.items()}
    kept: set[str] = set()
    for p in sorted(paths, key=lambda p: (alone[p], p)):
        if not verdicts[p][0]:
            reasons[p] = f"alone: {verdicts[p][2]}"
            continue
        fits, _, why = judge(kept | {p})
        if fits:
            kept.add(p)
            modules[p] = True
            reasons[p] = (
                f"with it and the {len(kept) - 1} kept before it: {why} (alone {alone[p]:.3g})"
            )
        else:
            reasons[p] = f"with the {len(kept)} kept: {why} (alone {alone[p]:.3g})"
    return modules, reasons, alone, kept


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
    if not all(isinstance(n, int) and -len(args) <= n < len(args) for n in nums):
        raise ValueError(
            f"jaxamp.fp8_select: argnums={argnums!r} for fun called with {len(args)} "
            f"arguments; write the positions of the parameters among them, e.g. argnums=0"
        )
    nums = {n % len(args) for n in nums}
    at = [i for i, (_, x) in enumerate(flat) if _is_array(x)]
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
