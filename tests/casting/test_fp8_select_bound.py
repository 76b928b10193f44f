"""``jaxamp.fp8_select(other_batches=...)``'s bound on the common part against a
leave-one-out jackknife written here, the kept set's checks, and what a selection with
other batches reads and writes."""

import itertools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.casting._fp8_select._fp8_select import _choose
from jaxamp.casting._fp8_select._noise import common_bound, pair_means
from tests.casting.test_fp8_select import _args, _loss, _other_batch


def _jackknife(ds: list[np.ndarray], gs: list[np.ndarray]) -> tuple[float, float]:
    """``(sqrt(r), sqrt(r + se))``: r the mean of ``d_i . d_j`` over pairs i < j over the
    same mean for `gs`, se the jackknife standard error of r, each batch left out in
    turn: ``sqrt((n - 1) / n * sum (r_(k) - mean r_(.))**2)``."""

    def pairs(v: list[np.ndarray], keep: list[int]) -> float:
        return float(np.mean([v[i] @ v[j] for i, j in itertools.combinations(keep, 2)]))

    n = len(ds)
    every = list(range(n))
    r = pairs(ds, every) / pairs(gs, every)
    left = [[j for j in every if j != k] for k in every]
    loo = np.array([pairs(ds, keep) / pairs(gs, keep) for keep in left])
    se = math.sqrt((n - 1) / n * np.sum((loo - loo.mean()) ** 2))
    return math.sqrt(max(r, 0.0)), math.sqrt(max(r + se, 0.0))


@pytest.mark.parametrize("n", [3, 4, 6])
def test_the_common_bound_is_a_jackknife_over_batches_of_the_ratio(n):
    rng = np.random.default_rng(n)
    mu, b = rng.normal(size=(2, 40))
    for _ in range(20):
        gs = [mu + 0.5 * rng.normal(size=40) for _ in range(n)]
        ds = [0.2 * b + rng.uniform(0.01, 0.5) * rng.normal(size=40) for _ in range(n)]
        mean = pair_means(gs)
        if not (mean[0] > 0 and np.all(mean[1] > 0)):
            continue  # fp8_select reads these as no mean direction (blind)
        # float64 sums of 40 products, one path against another: rounding ~1e-15.
        assert common_bound(ds, mean) == pytest.approx(_jackknife(ds, gs), rel=1e-9, abs=1e-12)
        # Three batches leave one pair each out: three samples, a spread above 0.
        estimate, bound = common_bound(ds, mean)
        assert bound > estimate
    # The common error exactly a multiple of each batch's gradient: every pair's ratio
    # is that multiple squared, no spread, the bound the estimate.
    ds = [0.3 * g for g in gs]
    assert common_bound(ds, pair_means(gs)) == pytest.approx((0.3, 0.3), rel=1e-12)


def _judges(seed: int, paths: list[str]):
    """A judge of sets of `paths` (fits, error, why) drawn at random per set, the same
    for the same set: no order among sets, as a bound with a noisy spread has none."""
    rng = np.random.default_rng(seed)
    table = {
        frozenset(s): (bool(rng.random() < 0.6), float(rng.random()))
        for k in range(1, len(paths) + 1)
        for s in itertools.combinations(paths, k)
    }

    def judge(kept: set[str]) -> tuple[bool, float, str]:
        fits, e = table[frozenset(kept)]
        return fits, e, f"{'fits' if fits else 'over'} {sorted(kept)}"

    return judge


def test_the_kept_set_is_one_the_judge_passes_and_each_reason_is_its_verdict():
    paths = ["a", "b", "c", "d", "e"]
    for seed in range(300):
        judge = _judges(seed, paths)
        modules, reasons, alone, kept = _choose(paths, judge)
        assert kept == {p for p, on in modules.items() if on}
        if kept:
            assert judge(kept)[0], seed
        for p in paths:
            assert ("fits" if modules[p] else "over") in reasons[p]
        # Every layer where their set fits, whatever each alone; else one pass: in order
        # of least error alone, each joins the set kept before it when that set with it
        # fits; a layer refused is not tried again.
        if judge(set(paths))[0]:
            assert kept == set(paths)
        else:
            so_far: set[str] = set()
            for p in sorted(paths, key=lambda p: (alone[p], p)):
                if judge({p})[0] and judge(so_far | {p})[0]:
                    so_far.add(p)
            assert kept == so_far


def _grad(cfg, p, x) -> np.ndarray:
    f = jaxamp.autocast(_loss, dtype=jnp.bfloat16, fp8=cfg)
    g = jax.jit(jax.grad(f))(p, x)  # jitted, as fp8_select's: eager rounds otherwise
    return np.concatenate([np.ravel(np.asarray(w, np.float64)) for w in g])


def test_with_other_batches_the_kept_set_holds_its_bound_and_round_trips():
    params, x = _args()
    others = [_other_batch(s) for s in (11, 12)]
    kw = dict(budget=0.15, first_last_bf16=False, other_batches=others)
    chosen = jaxamp.fp8_select(_loss, **kw)(params, x)
    # Every layer is kept here (test_fp8_select's budget 0.15): the bound of their set,
    # from the gradients on the three batches, against the jackknife written above.
    assert all(chosen.values())
    batches = [x] + [o[1] for o in others]
    g = [_grad(None, params, b) for b in batches]
    fp8 = jaxamp.fp8(first_last_bf16=False)
    d = [_grad(fp8, params, b) - gk for b, gk in zip(batches, g, strict=True)]
    estimate, bound = _jackknife(d, g)
    why = chosen.reasons["l0"]
    got = re.findall(r"(?:batches|most) ([0-9.e-]+)", why)
    assert got == [f"{estimate:.3g}", f"{bound:.3g}"]  # printed to 3 digits
    assert bound <= chosen.budget and chosen.common == pytest.approx(estimate, rel=1e-9)
    back = jaxamp.types.Fp8Selection.from_dict(json.loads(json.dumps(chosen.to_dict())))
    assert back.to_dict() == chosen.to_dict() and str(back) == str(chosen)


def test_a_varying_part_over_its_threshold_names_the_threshold_and_repeats():
    params, x = _args()
    others = [_other_batch(s) for s in (11, 12)]
    kw = dict(budget=0.01, first_last_bf16=False, other_batches=others)
    chosen = jaxamp.fp8_select(_loss, **kw)(params, x)
    varying = chosen.reasons["l1"].split("varying")[1]
    t = f"{chosen.threshold:.3g}"
    assert f"> threshold {t} (budget 0.01 beside noise {chosen.noise:.3g})" in varying
    # The header names the same threshold.
    assert f"varying within {t}" in str(chosen).splitlines()[0]
    # The same selection again (another draw of nothing: no randomness).
    assert jaxamp.fp8_select(_loss, **kw)(params, x).to_dict() == chosen.to_dict()


def test_the_calibration_batch_in_another_order_is_refused_as_no_other_batch():
    # The same examples reshuffled (a loader's next epoch) pass the check on equal
    # arrays, but a mean loss's gradient is the calibration's: no noise was measured
    # (it read 0.0, every error common), the rule without other batches in disguise.
    params, x = _args()
    turned = (params, x[np.r_[1 : len(x), 0]])
    again = r"other_batches\[1\] is {} again.*another order"
    with pytest.raises(ValueError, match=again.format("the calibration batch")):
        jaxamp.fp8_select(_loss, other_batches=[_other_batch(11), turned])(params, x)
    with pytest.raises(ValueError, match=again.format(r"other_batches\[0\]")):
        fresh = _other_batch(11)[1]
        jaxamp.fp8_select(_loss, other_batches=[(params, fresh), (params, fresh[::-1])])(params, x)
