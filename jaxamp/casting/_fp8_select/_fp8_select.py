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

With ``other_batches`` the budget is measured against the gradient's sampling
noise, which a step on a fresh batch carries anyway: with sigma the relative
distance of one batch's gradient from the mean (estimated from the calibration
batch and the others, ``||g_0 - g_k||**2 / 2`` averaged), FP8's error e and the
noise add in quadrature (rounding does not depend on which examples a batch
holds), so the gradient a step applies moves ``sqrt(sigma**2 + e**2) - sigma``
farther from the mean gradient; the budget bounds that, so a set is kept while
``e <= sqrt(budget**2 + 2 * budget * sigma)`` (``Fp8Selection.threshold``). With
no other batch, sigma is 0 and the threshold is the budget: a model trained on one
batch (or fitting its data) has no sampling noise to hide FP8's error in.
The quadrature holds for the part of FP8's error that changes from batch to batch;
the part common to every batch adds up over steps, as the noise does not, so the kept
set is measured on the other batches too and, where its common part (``_noise._bias``)
is over the budget of the mean gradient, the noise is not counted (docs/fp8.md).
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
from jaxamp.casting._fp8_select._noise import _bias, _noise
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
    if the set's error with it is within `budget`. It compiles the gradient
    once per candidate and once per one that could join (at most twice the
    candidates, plus the reference; with `other_batches`, twice more per other
    batch and once for the kept set): a calibration, not a train step.

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
        tuples like `args` (``[(params, batch_2)]``): the budget then bounds how
        much farther from the mean gradient FP8 moves a step's gradient, beside
        the sampling noise a step on a fresh batch has anyway (module
        docstring; ``Fp8Selection.noise``, ``.threshold``), unless the FP8 error
        common to the batches is over the budget of the mean gradient (then the
        selection is the one without them, its noise 0). For training on
        fresh batches, far from fitting the data; not for a model trained on
        one batch or fitting its data to a loss near 0.

    Returns:
      A function of `fun`'s arguments returning an [`Fp8Selection`][jaxamp.types.Fp8Selection]:
      layer -> bool, the reason of each, the errors measured.

    Raises:
      TypeError: `fun` is not callable, or arguments of `fun` are given to
        ``fp8_select`` itself; an array argument is given by keyword with
        `other_batches` (they are positional).
      ValueError: `budget` is not a number >= 0; `argnums` is out of range; `fun`
        returns no scalar; the bfloat16 gradient is zero or not finite (nothing to
        compare against); another batch is shaped otherwise, or is at other
        parameters (its `argnums` arrays differ).
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
) -> Callable[[Mapping[str, bool] | None], np.ndarray]:  # fmt: skip
    """``gradient(select)``: the flat float64 gradient of autocast `fun` at `args`, with the
    FP8 products of the `select` layers (None: bfloat16 autocast, no FP8)."""
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

    return gradient


def _select(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], budget: float,
    base: dict[str, Any], dtype: Any, argnums: Any, others: Sequence[tuple[Any, ...]],
) -> Fp8Selection:  # fmt: skip
    from jaxamp.casting._autocast._api import autocast

    def at(a: tuple[Any, ...]) -> Callable[..., np.ndarray]:
        return _gradients(fun, a, kwargs, base, dtype, argnums)

    arrays, _, call = _arrays(args, kwargs, argnums)
    gradient = at(args)
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

    noise, grads = _noise(ref, args, others, at, wrt)
    if not math.isfinite(noise):
        raise ValueError(
            "jaxamp.fp8_select: bfloat16 autocast's gradient on other_batches is not finite; "
            "give other batches of the training data at the same parameters"
        )
    errors: dict[frozenset[str], float] = {}  # a set's error does not depend on the limit

    def error(kept: set[str]) -> float:
        if frozenset(kept) not in errors:
            g = gradient({p: p in kept for p in paths})
            e = float(np.linalg.norm(g - ref) / norm)
            errors[frozenset(kept)] = e if np.isfinite(e) else float("inf")
        return errors[frozenset(kept)]

    limit = _threshold(budget, noise)
    named = f"{limit:.3g} (budget {budget:g} beside noise {noise:.3g})" if noise else f"{budget:g}"
    chosen = _choose(paths, error, limit, named)
    kept = {p for p, on in chosen[0].items() if on}
    if noise and kept:
        # The quadrature only holds for the part of FP8's error that changes from batch to
        # batch; the part common to every batch adds up over steps as the sampling noise
        # does not, so it must be within the budget of the mean gradient, as on one batch.
        select = {p: p in kept for p in paths}
        ds = [at(o)(select) - g for o, g in zip(others, grads, strict=True)]
        bias = _bias(gradient(select) - ref, ref, ds, grads)
        if bias > budget:
            common = (
                f"the FP8 error common to the batches was {bias:.3g} of the mean gradient"
                if math.isfinite(bias)
                else "the batches' gradients had no mean direction in common"
            )
            named = f"{budget:g} (noise {noise:.3g} not counted: {common} with {len(kept)} kept)"
            noise, chosen = 0.0, _choose(paths, error, budget, named)
    modules, reasons, alone, total = chosen
    return Fp8Selection(
        modules=modules,
        reasons=reasons,
        alone=alone,
        error=total,
        budget=budget,
        scaling=base["scaling"],
        noise=noise,
    )


def _choose(
    paths: list[str], error: Callable[[set[str]], float], limit: float, named: str
) -> tuple[dict[str, bool], dict[str, str], dict[str, float], float]:
    """``(modules, reasons, alone, error)``: every layer if their error is within `limit`,
    else each in order of least error alone while the set's error stays within it."""
    modules, reasons = {p: False for p in paths}, {}
    everything = error(set(paths)) if paths else 0.0
    if everything <= limit:
        for p in paths:
            modules[p] = True
            reasons[p] = f"all {len(paths)} modules in FP8: error {everything:.3g} <= {named}"
        return modules, reasons, {}, everything
    alone = {p: error({p}) for p in paths}
    kept: set[str] = set()
    total = 0.0
    for p in sorted(paths, key=lambda p: (alone[p], p)):
        if alone[p] > limit:
            reasons[p] = f"alone {alone[p]:.3g} > budget {named}"
            continue
        with_it = error(kept | {p})
        if with_it <= limit:
            kept.add(p)
            modules[p], total = True, with_it
            reasons[p] = (
                f"error {with_it:.3g} <= {named} with it and the {len(kept) - 1} kept "
                f"before it (alone {alone[p]:.3g})"
            )
        else:
            reasons[p] = (
                f"error {with_it:.3g} > budget {named} with the {len(kept)} kept "
                f"(alone {alone[p]:.3g})"
            )
    return modules, reasons, alone, total


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
