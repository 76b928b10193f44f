"""One example of one cell: a call sequence through the runner, its twin and the reference.

A cell is a runner (the jaxamp path under test, compiled once) and a reference
(plain optax, Flax's ``TrainState`` or Flax's ``nnx.Optimizer`` with the plain
inner optimizer, compiled once) on one placement. :func:`drive` feeds both the
same calls. The reference first reports what its own (unscaled) gradients say
(finite per label, loss, gradient norm); the harness decides from that alone what
is taken (not a non-finite label, not a spike, not a window holding either) and
the reference keeps its update only there: on a skipped call the reference does
nothing. After every call:

- what was not taken is bit for bit as before the call: the params and inner
  optimizer state of each skipped label, and, when the call did not step, all the
  model state outside ``wrt`` (BatchStat, RNG counters); a teacher never changes;
- params, inner optimizer state and model state equal the reference's, to a few
  ulps per call (``modes.Mode.tolerance`` says why not bit for bit); the counters
  that move on every call, skipped ones too (``modes.Mode.always``), bit for bit;
- ``jaxamp.metrics`` equals the loss-scale oracle (docs/semantics.md#update-rule) and, with spikes,
  the spike oracle; the step counter, where the path has one, moves as documented;
- every leaf keeps the sharding it started with;
- the ``jaxamp.step`` cells' twin (the same program with ``tx.update`` +
  ``optax.apply_updates``) holds the same bits;
- under LoRA the optimizer holds no array of a frozen kernel's shape.

At the restore point the state goes through orbax into state built with another
loss-scale configuration (``modes.OTHER``) by ``jaxamp.checkpoint.restore``; it
must come back bit for bit and with its shardings, and the run (and every check,
against the uninterrupted reference and oracles) goes on from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from tests.matrix import harness as h
from tests.matrix import modes as modes_lib
from tests.matrix.models import Kind
from tests.matrix.modes import BASE, Mode
from tests.matrix.placements import N_DEV, Placement

# Paths whose step counter counts calls (Flax's own counters: TrainState.step, Flax's
# nnx.Optimizer.step); jaxamp.nnx.Optimizer's counts the updates taken; the optax
# paths have none.
COUNTS_CALLS = ("train_state", "flax_opt")
COUNTS_TAKEN = ("nnx", "nnx_flaxgrad")


@dataclasses.dataclass
class Cell:
    path: str
    kind: Kind
    mode: Mode
    pl: Placement
    run: Any
    ref: Any


def _take(pl: Placement, flags: list[bool]) -> Any:
    return pl.put_state(jax.numpy.asarray(flags, bool))


def _first(x: Any, pl: Placement) -> np.ndarray:
    x = h.host(x)
    return x[0] if pl.replicated else x


def _equivalent(a: Any, b: Any, ndim: int) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or a.is_equivalent_to(b, ndim)


def check_shardings(what: str, got: h.Snap, want: h.Snap) -> None:
    assert len(got.shardings) == len(want.shardings), what
    for i, (a, b, x) in enumerate(zip(got.shardings, want.shardings, want.everything, strict=True)):
        assert _equivalent(a, b, np.ndim(x)), f"{what}: leaf {i} moved from {b} to {a}"


def _ambiguous() -> None:
    raise AssertionError("a spike verdict within 1e-4 of its threshold in a fixed sequence")


def drive(cell: Cell, seq: list[h.Call], restore_at: int | None, reject: Any = _ambiguous) -> None:
    run, ref, mode, pl, kind = cell.run, cell.ref, cell.mode, cell.pl, cell.kind
    labels = mode.labels
    with pl.context():
        carry, rcarry = run.new(BASE), ref.new()
        twin = run.twin.new(BASE) if run.twin is not None else None
        start = prev = run.snap(carry)
        want = ref.snap(rcarry)
        for part in ("params", "inner", "mstate"):
            h.assert_same(f"initial {part}", getattr(start, part), getattr(want, part), None)
        scale = modes_lib.ScaleOracle(BASE)
        spikes = modes_lib.SpikeOracle() if mode.name == "spikes" else None
        window_ok, window_opt = True, ref.opt(rcarry)
        step = 0
        for i, call in enumerate(seq):
            where = f"call {i} of {[(c.poison, c.replica, c.spike) for c in seq]}"
            inp = pl.put_input(*h.arrays(call, i, kind.forwards, N_DEV if pl.per_device else 1))
            probe, info = ref.call(rcarry, _take(pl, [False] * len(labels)), *inp)
            finite = [bool(f) for f in _first(info["finite"], pl)]
            bad = call.poisoned_labels()
            # The planted poison is what the reference's own gradients show.
            assert finite == [lab not in bad and (lab != "all" or not bad) for lab in labels], (
                f"{where}: the reference saw finite={finite}"
            )
            spike = False
            if spikes is not None:
                loss, norm = float(_first(info["loss"], pl)), float(_first(info["norm"], pl))
                spike = spikes.step(loss, norm, all(finite))
                # float32 sums against float64: no verdict decided by the last bits
                # (a drawn sequence that comes this close is rejected, as in test_spikes).
                if spikes.rule.margin <= 1e-4:
                    reject()
            if mode.every_k > 1:
                window_ok = window_ok and all(finite)
                end = i % mode.every_k == mode.every_k - 1
                take = [window_ok] * len(labels)
                updated = dict.fromkeys(labels, end and window_ok)
                stepped = window_ok
            else:
                end = True
                take = [f and not spike for f in finite]
                updated = dict(zip(labels, take, strict=True))
                stepped = all(take)
            if any(take):
                rcarry, _ = ref.call(rcarry, _take(pl, take), *inp)
            elif mode.always:  # what moves on every call moved in the probe
                rcarry = probe
            if end:
                scale.update(all(finite) if mode.every_k == 1 else window_ok)
                if mode.every_k > 1:
                    if not window_ok:  # the reference drops the window's accumulation
                        rcarry = ref.with_opt(rcarry, window_opt)
                    window_ok, window_opt = True, ref.opt(rcarry)
            if cell.path in COUNTS_CALLS:
                step += 1
            elif cell.path in COUNTS_TAKEN:  # every_k: k at the end of an applied window
                step += mode.every_k if end and all(updated.values()) else 0

            carry = run.call(carry, *inp)
            got = run.snap(carry)
            _check(cell, where, got, prev, start, ref.snap(rcarry), updated, stepped, i)
            want_metrics = scale.metrics()
            if spikes is not None:
                want_metrics["spike_skipped_steps"] = spikes.skips
                want_metrics["spike_skipped"] = spikes.last
                want_metrics["skipped"] = want_metrics["skipped"] or spikes.last
            have = {k: got.metrics[k].item() for k in want_metrics}
            assert have == want_metrics, f"{where}: metrics {have}, want {want_metrics}"
            if got.step is not None:
                assert got.step == step, f"{where}: step counter {got.step}, want {step}"
            if twin is not None:
                twin = run.twin.call(twin, *inp)
                h.assert_same(f"{where}: jaxamp.step vs tx.update", got.everything,
                              run.twin.snap(twin).everything, None)  # fmt: skip
            prev = got
            if restore_at == i:
                carry = run.restore(carry)
                back = run.snap(carry)
                h.assert_same(f"{where}: restored", back.everything, got.everything, None)
                check_shardings(f"{where}: restored", back, start)


def _check(cell, where, got, prev, start, want, updated, stepped, i) -> None:
    mode, labels = cell.mode, cell.mode.labels
    # What was not taken is bit for bit as before the call.
    for lab in labels:
        if not updated[lab]:
            h.assert_same(f"{where}: params[{lab}] of a skipped step", h._by_label(got.params, lab),
                          h._by_label(prev.params, lab), None)  # fmt: skip
            h.assert_same(f"{where}: inner state [{lab}] of a skipped step", got.inner[lab],
                          prev.inner[lab], None)  # fmt: skip
    if not stepped:
        h.assert_same(f"{where}: model state of a skipped step", got.mstate, prev.mstate, None)
    if start.teacher is not None:
        h.assert_same(f"{where}: the teacher", got.teacher, start.teacher, None)
    # Equal to the reference.
    rtol = mode.tolerance(i + 1)
    h.assert_same(f"{where}: params", got.params, want.params, rtol)
    h.assert_same(f"{where}: inner optimizer state", got.inner, want.inner, rtol)
    h.assert_same(f"{where}: model state", got.mstate, want.mstate, rtol)
    h.assert_same(f"{where}: counters that move on every call", got.counters, want.counters, None)
    check_shardings(where, got, start)
    if cell.kind.name == "lora":  # no copy of the frozen base in the optimizer
        frozen = {v.shape for k, v in got.mstate.items() if k.endswith("kernel")}
        copies = [s for s in got.opt_shapes if s in frozen]
        assert not copies, (
            f"{where}: the optimizer holds arrays of the frozen base's shapes {copies}"
        )
