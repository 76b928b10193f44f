"""Issue 30's differential matrix: every training path of jaxamp against plain optax / Flax.

Each cell (``cells.py``: path x mode x placement x model state) runs a fixed
sequence that holds every kind of call (a poisoned batch, a poisoned gradient, a
spike, finite calls, a restore through orbax mid-window), then hypothesis-drawn
sequences of finite, +inf, -inf and NaN calls (and spikes, and one orbax restore
into another configuration), with every check of ``harness.py`` after every call.
A refused cell must raise, at construction or trace time, an error naming the fix.

Issue 43 adds two axes with their own tests: the composition axis
(``test_composition``: the guard inside and around optax's structures) and the
user input (``test_dtype``: float32, bfloat16 and float16 params; ``inputs.py``: a
Python-object model, constants built by every jnp constructor).

CI runs ``cells.CI``, ``cells.CI_COMPOSED`` and ``cells.CI_DTYPED`` (fixed subsets,
``make test``, less the cells tests/ci_budget.py leaves to ``make test-slow``);
``make matrix`` runs the whole products (``MATRIX_FULL=1``). Both
need 8 devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (cells on one device run
without).
"""

from __future__ import annotations

import os

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.matrix import cells, drive, harness, inputs
from tests.matrix.modes import BASE
from tests.matrix.placements import N_DEV

FULL = os.environ.get("MATRIX_FULL") == "1"
SELECTED = cells.ALL if FULL else cells.CI
COMPOSED = cells.COMPOSED if FULL else cells.CI_COMPOSED
DTYPED = cells.DTYPED if FULL else cells.CI_DTYPED
# CI: the object model, and issue 43's spelling (jnp.full) at the magnitudes float16
# flushes and overflows, and a run-time argument; tests/casting/test_constants.py
# holds every spelling at every magnitude in CI.
CI_INPUTS = ["object", "const-jnp.full-tiny", "const-jnp.full-huge", "const-argument-normal"]
assert set(CI_INPUTS) <= set(inputs.NAMES)
INPUTS = inputs.NAMES if FULL else CI_INPUTS
EXAMPLES = 10 if FULL else 4
MAX_CALLS = 8 if FULL else 6


def _fixed(forwards: int) -> list[harness.Call]:
    """Every kind of call, in an order that also hits every_k's windows (2) both ways."""
    C = harness.Call
    ok, rest = ("ok",) * forwards, ("ok",) * (forwards - 1)
    return [
        C(ok),
        C(("x+inf", *rest), replica=3),  # a poisoned batch: the forward's state is NaN too
        C(ok),
        C((*rest, "g-inf"), replica=5),  # a poisoned gradient (its last forward's)
        C(ok, spike=True),  # a spike (a loss 64x the history's; only spikes= skips it)
        C(ok),
        C(("xnan", *rest), replica=7),
        C(ok),
        C((*rest, "gnan")),
        C(ok),
    ]


@pytest.mark.parametrize(
    "path,mode,placement,kind", SELECTED, ids=[cells.cell_id(*c) for c in SELECTED]
)
def test_cell(path: str, mode: str, placement: str, kind: str) -> None:
    _run(path, mode, placement, kind)


@pytest.mark.parametrize(
    "path,mode,placement,kind", COMPOSED, ids=[cells.cell_id(*c) for c in COMPOSED]
)
def test_composition(path: str, mode: str, placement: str, kind: str) -> None:
    _run(path, mode, placement, kind)


@pytest.mark.parametrize(
    "path,mode,placement,kind", DTYPED, ids=[cells.cell_id(*c) for c in DTYPED]
)
def test_dtype(path: str, mode: str, placement: str, kind: str) -> None:
    _run(path, mode, placement, kind)


@pytest.mark.parametrize("name", INPUTS)
def test_input(name: str) -> None:
    cell = inputs.Cell(name)
    inputs.drive(cell, _fixed(1))
    _drawn(lambda seq, at: inputs.drive(cell, seq), spikes=False, forwards=1)


def _drawn(run, spikes: bool, forwards: int) -> None:
    """``run(seq, restore_at)`` on hypothesis-drawn call sequences."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not FULL,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def drawn(data: st.DataObject) -> None:
        seq = data.draw(harness.calls(forwards, spikes, MAX_CALLS), label="calls")
        at = data.draw(st.one_of(st.none(), st.integers(0, len(seq) - 1)), label="restore at")
        run(seq, at)

    drawn()


def _run(path: str, mode: str, placement: str, kind: str) -> None:
    pattern = cells.refusal(path, mode, kind)
    if pattern is not None:
        _refused(path, mode, placement, kind, pattern)
        return
    cell = cells.build(path, mode, placement, kind)
    drive.drive(cell, _fixed(cell.kind.forwards), restore_at=4)
    _drawn(
        lambda seq, at: drive.drive(cell, seq, restore_at=at, reject=hypothesis.reject),
        spikes=mode == "spikes",
        forwards=cell.kind.forwards,
    )


def _refused(path: str, mode: str, placement: str, kind: str, pattern: str) -> None:
    """A structure or input jaxamp cannot train right (Flax's own nnx.Optimizer on a
    model whose forward writes state, the guard inside an unsafe optax structure,
    float16 params): a clear error, raised when the state is built or the first step
    is traced, naming what to write instead."""
    cell = cells.build(path, mode, placement, kind)
    forwards, replicas = cell.kind.forwards, N_DEV if cell.pl.per_device else 1
    inp = harness.arrays(harness.Call(("ok",) * forwards), 0, forwards, replicas)
    with cell.pl.context(), pytest.raises((TypeError, ValueError), match=pattern):
        carry = cell.run.new(BASE)
        cell.run.call(carry, *cell.pl.put_input(*inp))
