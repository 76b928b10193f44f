"""A NumPy model of Adam's second moment stored with m mantissa bits (issue 45).

How much larger stochastic rounding of `nu` makes Adam's steps on average: it keeps
`nu`'s decay in expectation, but its rounding errors add up over `nu`'s memory
(``1 / (1 - b2)`` steps), and ``1 / sqrt(nu)`` is convex (Jensen). This model measures that step
multiplier, ``sqrt(nu_exact / nu_stored)`` averaged over elements and steps (b2 0.999,
and b2 0.95 as the GPT-2 runs use), for:

* ``nu``: `nu` itself stored, rounded stochastically (what ``_codes`` does);
* ``weyl``: the same, its uniform draws a golden-ratio sequence per element (a
  low-discrepancy dither, unbiased each step) instead of independent ones;
* ``sqrt``: ``sqrt(nu)`` stored instead, rounded stochastically. It halves a
  block's range in binades, so the range rule (``_codes``) would give it one more
  mantissa bit: compare ``sqrt`` at m + 1 with ``nu`` at m;
* ``sqrt_unbiased``: ``sqrt(nu)`` stored, rounded up with the probability that
  keeps `nu` itself unbiased (``E[s**2] = nu``), as ``nu`` is.

Elements have gradient scales spread over 2**(+-4.3); a grid with m mantissa bits
and no exponent limit (a block's code within its range). Run: ``python
benchmarks/nu_rounding_model.py`` (seconds).
"""

from __future__ import annotations

import numpy as np

N, STEPS, BURN_IN, BETA = 4096, 4000, 1000, 0.999
PHI = (np.sqrt(5.0) - 1.0) / 2.0


def _round(x: np.ndarray, u: np.ndarray, m: int) -> np.ndarray:
    """`x` > 0 rounded down or up to m mantissa bits, up where the fraction exceeds 1 - u."""
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(x, 1e-30))) - m)
    return np.floor(x / ulp + u) * ulp


def step_multiplier(m: int, kind: str, seed: int = 0, beta: float = BETA) -> tuple[float, float]:
    """Mean and std of ``sqrt(nu_exact / nu_stored)`` after the burn-in."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-3.0, 3.0, N))
    offset = rng.uniform(0.0, 1.0, N)
    exact, stored, ratios = np.zeros(N), np.zeros(N), []
    for t in range(1, STEPS + 1):
        g2 = (scale * rng.standard_normal(N)) ** 2
        exact = beta * exact + (1 - beta) * g2
        nu = stored if kind in ("nu", "weyl") else stored**2
        x = beta * nu + (1 - beta) * g2
        u = (offset + t * PHI) % 1.0 if kind == "weyl" else rng.uniform(0.0, 1.0, N)
        if kind == "sqrt_unbiased":
            lo = _round(np.sqrt(x), np.zeros(N), m)
            hi = _round(np.sqrt(x), np.ones(N), m)
            up = (x - lo**2) / np.maximum(hi**2 - lo**2, 1e-300)
            stored = np.where(u < up, hi, lo)
        elif kind == "sqrt":
            stored = _round(np.sqrt(x), u, m)
        else:
            stored = _round(x, u, m)
        if t > BURN_IN:
            ratios.append(np.sqrt(exact / (stored if kind in ("nu", "weyl") else stored**2)))
    r = np.asarray(ratios)
    return float(r.mean()), float(r.std())


if __name__ == "__main__":
    print("| mantissa bits | stored | step multiplier, mean | std |")
    print("|---|---|---|---|")
    for m in (4, 5, 6):
        for kind in ("nu", "weyl", "sqrt", "sqrt_unbiased"):
            mean, std = step_multiplier(m, kind)
            print(f"| {m} | {kind} | {mean:.4f} | {std:.4f} |")
    # bench_optimizer_state's GPT-2 task decays nu by b2 = 0.95: a memory of ~20
    # steps, over which fewer rounding errors add up.
    print("\n| mantissa bits | b2 | step multiplier, mean | std |")
    print("|---|---|---|---|")
    for m in (4, 5, 6):
        mean, std = step_multiplier(m, "nu", beta=0.95)
        print(f"| {m} | 0.95 | {mean:.4f} | {std:.4f} |")
