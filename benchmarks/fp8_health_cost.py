"""What ``jaxamp.fp8_health`` costs a train step, by XLA's own count (compiled, not run).

A linen MLP (4 Dense layers of width 1024, batch 1024 rows; all four products in
FP8) trained by one SGD step under ``jax.jit``: the step with
``jax.value_and_grad`` and with ``jaxamp.fp8_health`` (returning the health
dict), tensorwise and rowwise. For each, XLA's ``cost_analysis()`` of the
optimized program (flops, bytes accessed) and the instruction count of its
optimized HLO. No timing: the figures are the compiler's, on whatever backend
runs this. Run: ``python benchmarks/fp8_health_cost.py``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxamp

WIDTH, ROWS, LAYERS = 1024, 1024, 4


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = nn.Dense(WIDTH, name=f"fc{i}")(x)
            x = jax.nn.gelu(x) if i < LAYERS - 1 else x
        return x


def _cost(step, *args) -> tuple[float, float, int]:
    compiled = jax.jit(step).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    instrs = sum(
        1 for line in text.splitlines() if " = " in line and not line.startswith("HloModule")
    )
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), instrs


def main() -> None:
    x = jax.random.normal(jax.random.key(0), (ROWS, WIDTH))
    y = jax.random.normal(jax.random.key(1), (ROWS, WIDTH))
    model = MLP()
    params = model.init(jax.random.key(2), x)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; MLP {LAYERS} x {WIDTH}, "
          f"{ROWS} rows")  # fmt: skip
    print("| scaling | step | flops | bytes accessed | HLO instructions |")
    print("|---|---|---|---|---|")
    for scaling in ("tensorwise", "rowwise"):
        fwd = jaxamp.autocast(
            model.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
        )

        def loss(p, x, y, fwd=fwd):
            return jnp.mean((fwd(p, x) - y) ** 2)

        def plain(p, x, y):
            value, g = jax.value_and_grad(loss)(p, x, y)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), value

        def measured(p, x, y):
            (value, health), g = jaxamp.fp8_health(loss)(p, x, y)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), value, health

        base = _cost(plain, params, x, y)
        with_health = _cost(measured, params, x, y)
        for name, c in (("value_and_grad", base), ("fp8_health", with_health)):
            print(f"| {scaling} | {name} | {c[0]:.4g} | {c[1]:.4g} | {c[2]} |")
        print(f"| {scaling} | ratio | {with_health[0] / base[0]:.4f} | "
              f"{with_health[1] / base[1]:.4f} | {with_health[2] / base[2]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
