"""The matrix's optimizer modes and the oracles the checks compare against.

A mode is the jaxamp transformation (``tx``) and the plain optax optimizer it must
equal on finite steps (``reference``):

- ``plain``: ``skip_nonfinite(adam)``;
- ``every_k``: ``skip_nonfinite(adam, every_k=2)``; reference ``optax.MultiSteps(adam, 2)``
  on windows that are finite as a whole;
- ``multi``: ``jaxamp.multi_transform`` (first layer: adam, the rest: sgd with
  momentum); reference ``optax.multi_transform``, each label stepped on its own;
- ``spikes``: ``skip_nonfinite(adam, spikes=spike_rule(...))``; whether a step is
  a spike comes from ``tests/skip/test_spikes.py``'s plain-Python rule;
- ``sr`` / ``kahan``: bfloat16 params, ``chain(adam, jaxamp.apply_with_stochastic_rounding(key))``
  or ``chain(adam, jaxamp.apply_with_kahan_summation())``; the reference is the same chain
  without the skip (the rounding transformations are jaxamp's, the skip is what
  is under test).

Two more axes are modes too, run on a smaller product (``cells.COMPOSED``, ``cells.DTYPED``):

- the composition axis (``compositions.py``): the guard inside and around optax's
  structures, each against the same structure around plain optax or refused by name;
- the params' dtype (user input): ``plain`` is float32; ``bf16``: ``skip_nonfinite(adam)``
  on bfloat16 params against adam on them; ``f16``: float16 params, which the guard
  refuses (``FLOAT16``).

Loss scales are powers of two, so unscaling is exact and a finite step computes
what the reference computes; see :meth:`Mode.tolerance` for why the comparison is
to a few ulps rather than bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from tests.matrix import compositions
from tests.matrix.models import label_of
from tests.skip.test_spikes import Reference as SpikeReference

NAMES = ("plain", "every_k", "multi", "spikes", "sr", "kahan")
DTYPES = {"plain": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
FLOAT16 = r"jaxamp\.skip_nonfinite: the params hold leaves of float16's range or narrower"
LABELS = ("a", "b")
K = 2  # every_k's window
SPIKE_RULE = dict(window=4, sigmas=2.0, warmup=2)
SPIKE_AMP = 64.0  # a spike multiplies the loss (and so its gradients) by this


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """A dynamic loss scale; the oracle below follows docs/semantics.md#update-rule step by step."""

    init_scale: float = 2.0**4
    growth_interval: int = 3
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**7

    def state(self) -> jaxamp.LossScaleState:
        return jaxamp.dynamic_scale(
            init_scale=self.init_scale,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
        )


BASE = LossScaleConfig()
# A restore target built with another configuration: every number must come from
# the checkpoint (jaxamp.checkpoint's contract), so the run goes on as BASE's.
OTHER = LossScaleConfig(init_scale=2.0**10, growth_interval=5, hysteresis=1, max_scale=2.0**12)


def _labels(tree: Any) -> Any:
    """multi_transform's labels for a params tree (plain dicts or an nnx State)."""

    def one(path: Any, _: Any) -> str:
        key = path[0]
        return label_of(str(getattr(key, "key", getattr(key, "name", key))))

    return jax.tree_util.tree_map_with_path(one, tree)


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str

    @property
    def param_dtype(self) -> Any:
        if self.name in ("sr", "kahan"):
            return jnp.bfloat16
        return DTYPES.get(self.name, jnp.float32)

    @property
    def low_precision(self) -> bool:
        return self.param_dtype != jnp.float32

    @property
    def refusal(self) -> str | None:
        """The regex a refused mode's error must match (None: accepted)."""
        if self.name == "f16":
            return FLOAT16
        return compositions.REFUSED[self.name][1] if self.name in compositions.REFUSED else None

    @property
    def always(self) -> tuple[str, ...]:
        """The reference's top-level state fields that advance on every call."""
        acc = compositions.ACCEPTED.get(self.name)
        return acc.always if acc is not None else ()

    @property
    def every_k(self) -> int:
        return K if self.name == "every_k" else 1

    @property
    def labels(self) -> tuple[str, ...]:
        return LABELS if self.name == "multi" else ("all",)

    def _inner(self) -> Any:
        adam = optax.adam(1e-2)
        if self.name == "sr":
            return optax.chain(adam, jaxamp.apply_with_stochastic_rounding(jax.random.key(3)))
        if self.name == "kahan":
            return optax.chain(adam, jaxamp.apply_with_kahan_summation())
        return adam

    def _transforms(self) -> dict[str, Any]:
        return {"a": optax.adam(1e-2), "b": optax.sgd(0.05, momentum=0.9)}

    @functools.cache  # noqa: B019 (nnx and TrainState hold it as static: built once)
    def tx(self, ls: LossScaleConfig, axis_name: str | None, placement: str) -> Any:
        """The jaxamp transformation; ``placement`` only keys the cache: its initial
        state's arrays live where they were built (on a mesh, under ``jax.set_mesh``)."""
        state = ls.state()
        if self.name == "multi":
            return jaxamp.multi_transform(self._transforms(), _labels, state, axis_name=axis_name)
        if self.name in compositions.NAMES:
            guard = lambda inner: jaxamp.skip_nonfinite(inner, state, axis_name=axis_name)  # noqa: E731
            return compositions.tx(self.name, guard)
        spikes = jaxamp.spike_rule(**SPIKE_RULE) if self.name == "spikes" else None
        return jaxamp.skip_nonfinite(
            self._inner(), state, every_k=self.every_k, axis_name=axis_name, spikes=spikes
        )

    @functools.cache  # noqa: B019
    def reference(self, placement: str) -> Any:
        if self.name == "multi":
            return optax.multi_transform(self._transforms(), _labels)
        if self.name == "every_k":
            return optax.MultiSteps(self._inner(), K)
        if self.name in compositions.ACCEPTED:
            return compositions.ACCEPTED[self.name].reference()
        return self._inner()

    def tolerance(self, calls: int) -> float:
        """Relative tolerance against the reference (relative to an array's largest
        magnitude): 8 ulps of the params' dtype per call.

        The reference is another program, and XLA:CPU contracts a multiply and an
        add into one fused multiply-add wherever its fusions let it (which differs
        from program to program), so the last bit of a finite step differs now and
        then even with power-of-two loss scales; within one program (a step against
        its twin, a skipped step against the state before it, a restored state)
        comparisons are bit for bit.
        """
        eps = 2.0**-8 if self.low_precision else 2.0**-23
        return 8 * calls * eps


def inner_leaves(opt_state: Any, mode: Mode, label: str, *, reference: bool) -> list[Any]:
    """The inner optimizer's state (one label's, under multi_transform) as a leaf list.

    jaxamp: ``SkipNonfiniteState.inner_state`` / ``MultiTransformState.inner_states``;
    the reference: optax's own state (``MultiSteps``' ``inner_opt_state``,
    ``multi_transform``'s ``inner_states[label].inner_state``); a composition's, the
    structure around the guard too (``compositions.inner_leaves``). Works on plain
    optax states and on an nnx optimizer's pure state dict.
    """
    if mode.name in compositions.ACCEPTED:
        return compositions.inner_leaves(opt_state, mode.always, reference=reference)
    get = lambda s, k: s[k] if isinstance(s, dict) else getattr(s, k)
    if label != "all":
        s = get(get(opt_state, "inner_states"), label)
        return jax.tree.leaves(get(s, "inner_state") if reference else s)
    if reference:
        s = opt_state
        if isinstance(s, optax.MultiStepsState) or (isinstance(s, dict) and "inner_opt_state" in s):
            s = get(s, "inner_opt_state")
        return jax.tree.leaves(s)
    return jax.tree.leaves(get(opt_state, "inner_state"))


# ---------------------------------------------------------------------------
# Oracles: the loss scale (docs/semantics.md#update-rule), spikes (tests/skip/test_spikes.py),
# windows.


@dataclasses.dataclass
class ScaleOracle:
    cfg: LossScaleConfig
    scale: float = 0.0
    growth_tracker: int = 0
    hysteresis_tracker: int = 0
    nonfinite_streak: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        self.scale = self.cfg.init_scale
        self.hysteresis_tracker = self.cfg.hysteresis

    def update(self, finite: bool) -> None:
        if finite:
            self.growth_tracker += 1
            self.nonfinite_streak = 0
            self.hysteresis_tracker = self.cfg.hysteresis
            if self.growth_tracker == self.cfg.growth_interval:
                self.scale = min(self.scale * 2.0, self.cfg.max_scale)
                self.growth_tracker = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_streak += 1
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker == 0:
                self.scale = max(self.scale * 0.5, self.cfg.min_scale)
                self.hysteresis_tracker = self.cfg.hysteresis

    def metrics(self) -> dict[str, Any]:
        return {
            "loss_scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "nonfinite_streak": self.nonfinite_streak,
            "skipped_steps": self.skipped_steps,
            "skipped": self.nonfinite_streak > 0,
        }


class SpikeOracle:
    def __init__(self) -> None:
        self.rule = SpikeReference(**SPIKE_RULE)
        self.skips = 0
        self.last = False

    def step(self, loss: float, norm: float, finite: bool) -> bool:
        self.last = self.rule.step(loss, norm if finite else math.inf, finite)
        self.skips += self.last
        return self.last


def as_bool(x: Any) -> bool:
    return bool(jnp.all(jnp.asarray(x)))
