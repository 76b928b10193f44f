"""The matrix's user-input axis, beyond the params' dtype (``modes.DTYPES``): what the
forward is made of, seen by the training path.

- ``object``: a model as a plain Python class holding its weights as attributes,
  called through ``jaxamp.autocast``: in the loss (an object built from the params
  being differentiated) and, once per call, as the object the user keeps, whose
  weights are assigned after each step (``model.w1 = new``): its autocast, made once
  before training, must answer with the new weights;
- ``const-<spelling>-<magnitude>``: one constant vector built by each jnp constructor
  (``tests/casting/test_constants.py``'s spellings) that float16 flushes to 0 (tiny),
  cannot hold (huge) or holds (normal), times its inverse, inside an
  ``autocast(float16)`` forward.

Each cell trains a small MLP with ``jaxamp.value_and_grad`` and ``jaxamp.step`` on
``skip_nonfinite(sgd)`` under a dynamic loss scale through the matrix's call
sequences (``harness.Call``: finite, +inf, -inf and NaN batches and gradients). On
each call the reference is float32 at the same params: a finite call must step
by ``-lr`` times the float32 gradient, to a tolerance derived from float16's unit
roundoff and the per-example gradients' magnitudes; a poisoned one must be skipped
with the params bit for bit as before; the metrics follow the loss-scale oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from tests.casting.test_constants import _SPELLINGS as SPELLINGS
from tests.matrix import harness as h
from tests.matrix import modes as modes_lib
from tests.matrix.models import BATCH, IN, OUT

F16, F32 = jnp.float16, jnp.float32
U16 = 2.0**-11  # float16's unit roundoff
H = 16  # the spellings build (16,) vectors: the hidden width
LR = 0.1
# A per-example term goes through at most eight roundings to float16 (the inputs and
# weights of both matmuls, forward and backward), each within U16 relative: twice that.
K = 16
# float16 flushes the tiny one to 0, turns the huge one into inf, holds the normal one.
MAGNITUDES = {"tiny": 3.0e-9, "huge": 3.0e5, "normal": 3.0}
NAMES = ("object", *(f"const-{s}-{m}" for s in sorted(SPELLINGS) for m in MAGNITUDES))


class PlainMlp:
    """A model as a plain class: its weights are attributes."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.w1, self.b1, self.w2 = params["w1"], params["b1"], params["w2"]

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ self.w1 + self.b1) @ self.w2


def _params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(11))
    return {
        "w1": jax.random.normal(k1, (IN, H)) / np.sqrt(IN),
        "b1": jnp.full((H,), 0.1),
        "w2": jax.random.normal(k2, (H, OUT)) / np.sqrt(H),
    }


def _forwards(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The forward ``(params, x, arg) -> y`` in float32 and under autocast(float16)."""
    if name == "object":
        return (
            lambda p, x, arg: PlainMlp(p)(x),
            lambda p, x, arg: jaxamp.autocast(PlainMlp(p), dtype=F16)(x),
        )
    _, spelling, magnitude = name.split("-")
    c = MAGNITUDES[magnitude]
    k = 1.0 / c  # a Python scalar: brings the product back to about 1

    def f(p, x, arg):
        pre = x @ p["w1"] + p["b1"]
        return jnp.tanh(pre * SPELLINGS[spelling](c, pre[0], arg) * k) @ p["w2"]

    return f, jaxamp.autocast(f, dtype=F16)


def constant_arg(name: str) -> jax.Array:
    """The ``argument`` spelling's constant (a (16,) vector every cell passes)."""
    c = MAGNITUDES[name.split("-")[2]] if name.startswith("const") else 1.0
    return jnp.full((H,), c, F32)


def _loss(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The matrix's loss on one forward: a regression, times ``amp``, plus ``gp * w1[0, 0]``."""

    def loss(p, x, gp, amp, arg):
        err = forward(p, x, arg).astype(F32) - jnp.sin(x[:, :OUT])
        return amp * jnp.mean(err**2) + gp * p["w1"][0, 0]

    return loss


class Cell:
    """One user-input cell: its jitted training step and its float32 reference."""

    def __init__(self, name: str) -> None:
        self.name = name
        f32, f16 = _forwards(name)
        self.forward32 = jax.jit(f32)
        self.tx = jaxamp.skip_nonfinite(optax.sgd(LR), modes_lib.BASE.state())
        loss16, loss32 = _loss(f16), _loss(f32)

        @jax.jit
        def step(params, opt, x, gp, amp, arg):
            _, grads = jaxamp.value_and_grad(loss16)(opt, params, x, gp, amp, arg)
            return jaxamp.step(self.tx, grads, opt, params)

        @jax.jit
        def reference(params, x, gp, amp, arg):
            """The float32 gradient and the sum of its per-example terms' magnitudes."""
            per_example = jax.vmap(
                jax.grad(lambda p, xi: loss32(p, xi[None], gp, amp, arg) / BATCH), (None, 0)
            )(params, x)
            grads = jax.tree.map(lambda t: jnp.sum(t, axis=0), per_example)
            size = jax.tree.map(lambda t: jnp.sum(jnp.abs(t), axis=0), per_example)
            return grads, size

        self.step, self.reference = step, reference

    def new(self) -> tuple[dict[str, jax.Array], Any]:
        params = _params()
        return params, self.tx.init(params)


def drive(cell: Cell, seq: list[h.Call]) -> None:
    params, opt = cell.new()
    arg = constant_arg(cell.name)
    scale = modes_lib.ScaleOracle(modes_lib.BASE)
    # The model the user keeps, and its autocast, made once before training.
    model = PlainMlp(params)
    kept = jaxamp.autocast(model, dtype=F16)
    x_eval = jnp.asarray(h.arrays(h.Call(("ok",)), 5, 1, 1)[0][0])
    start = h.to_host(cell.forward32(params, x_eval, arg)) if cell.name == "object" else None
    taken = 0
    for i, call in enumerate(seq):
        where = f"{cell.name}: call {i} of {[(c.poison, c.replica, c.spike) for c in seq]}"
        x, gp, amp = h.arrays(call, i, 1, 1)
        x, gp, amp = jnp.asarray(x[0]), jnp.asarray(gp[0, 0]), jnp.float32(amp)
        grads, size = cell.reference(params, x, gp, amp, arg)
        finite = all(np.isfinite(h.host(g)).all() for g in jax.tree.leaves(grads))
        assert finite == (not call.poisoned_labels()), f"{where}: the reference saw {finite}"
        new, opt = cell.step(params, opt, x, gp, amp, arg)
        scale.update(finite)
        have = {k: v.item() for k, v in h.metrics_of(opt).items() if k in scale.metrics()}
        assert have == scale.metrics(), f"{where}: metrics {have}, want {scale.metrics()}"
        for key in params:
            got, old = h.host(new[key]), h.host(params[key])
            if not finite:
                assert h.bits_equal(got, old), f"{where}: {key} moved on a skipped step"
                continue
            want = old.astype(np.float64) - LR * h.host(grads[key]).astype(np.float64)
            ulp = np.spacing(np.abs(old).astype(np.float32)).astype(np.float64)
            tol = LR * K * U16 * h.host(size[key]).astype(np.float64) + 2 * ulp
            err = np.abs(got.astype(np.float64) - want)
            assert (err <= tol).all(), (
                f"{where}: {key} off the float32 step by {err.max():.3g} "
                f"(tolerance {tol.flat[np.argmax(err - tol)]:.3g})"
            )
        taken += finite
        params = new
        if cell.name == "object":
            model.w1, model.b1, model.w2 = params["w1"], params["b1"], params["w2"]
            _check_kept(where, kept(x_eval), params, x_eval)
    if cell.name == "object" and taken:
        # The check above tells the new weights from the first ones.
        moved = np.abs(h.to_host(cell.forward32(params, x_eval, arg)) - start).max()
        assert moved > 2 * _tolerance(params, x_eval).max(), f"{cell.name}: weights barely moved"


def _tolerance(p: dict[str, jax.Array], x: jax.Array) -> np.ndarray:
    """float16 forward's error bound: the inputs, weights and activations of both
    layers each rounded to float16 (within U16 relative), tanh contracting."""
    a = lambda t: np.abs(h.host(t)).astype(np.float64)  # noqa: E731
    pre = a(x) @ a(p["w1"]) + a(p["b1"])
    return 4 * U16 * (pre + np.abs(_hidden(p, x))) @ a(p["w2"])


def _hidden(p: dict[str, jax.Array], x: jax.Array) -> np.ndarray:
    f64 = lambda t: h.host(t).astype(np.float64)  # noqa: E731
    return np.tanh(f64(x) @ f64(p["w1"]) + f64(p["b1"]))


def _check_kept(where: str, out: jax.Array, p: dict[str, jax.Array], x: jax.Array) -> None:
    """The kept model's autocast against float64 at the weights just assigned."""
    want = _hidden(p, x) @ h.host(p["w2"]).astype(np.float64)
    err = np.abs(h.host(out).astype(np.float64) - want)
    assert (err <= _tolerance(p, x)).all(), (
        f"{where}: the kept model's autocast is off by {err.max():.3g}: not its new weights?"
    )
