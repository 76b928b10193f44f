"""The matrix's cells: the product of paths, modes, placements and model states.

``ALL`` is the whole product less the combinations left out below (each with its
reason). Two more axes run on a smaller product, where the others add nothing
but time: ``COMPOSED``, the composition axis (``compositions.py``: the guard inside
and around optax's structures) on the functional paths, and ``DTYPES``, the params'
dtype (a user-input axis: ``modes.DTYPES``) on every path; both on one device, an
Explicit mesh and ``shard_map``, with model states ``none`` and ``bn``. ``CI`` is the
fixed subset ``make test`` runs: every value of every axis at least once, and each
bug issue 30 names in a cell of its own. A cell is built once (:func:`build`: its
runner, twin and reference compiled on first use) and reused by every example
drawn for it.
"""

from __future__ import annotations

import gc
import itertools

import jax

from tests.matrix import compositions, paths_functional, paths_nnx
from tests.matrix.drive import Cell
from tests.matrix.models import KINDS, Kind
from tests.matrix.modes import DTYPES, Mode
from tests.matrix.modes import NAMES as MODES
from tests.matrix.placements import NAMES as PLACEMENTS
from tests.matrix.placements import Placement

FUNCTIONAL = ("update", "step", "train_state")
NNX = ("nnx", "nnx_flaxgrad", "flax_opt")
PATHS = FUNCTIONAL + NNX

# Left out, with the reason:
# - nnx paths under pmap and shard_map over a stacked state: an nnx Module holds one
#   model, not one per device; a per-replica program gets its arrays through
#   nnx.split, and what it then runs is the functional paths' program (their cells).
#   The nnx paths run under shard_map over the replicated state instead.
LEFT_OUT = {(p, pl) for p in NNX for pl in ("pmap", "shard_map_stacked")}

# Flax's own nnx.Optimizer cannot restore what a forward writes: with such a model
# it must refuse, at trace time, naming jaxamp.nnx.Optimizer.
FLAX_REFUSED = {("flax_opt", k) for k in ("bn", "dropout", "teacher", "bn2")}


def refusal(path: str, mode: str, kind: str) -> str | None:
    """The regex a refused cell's error must match; None for a cell that trains. A
    mode's refusal (at ``tx.init`` or the first reader) comes before Flax's."""
    if Mode(mode).refusal is not None:
        return Mode(mode).refusal
    return r"jaxamp\.nnx\.Optimizer" if (path, kind) in FLAX_REFUSED else None


def cell_id(path: str, mode: str, pl: str, kind: str) -> str:
    return f"{path}-{mode}-{pl}-{kind}"


def _all() -> list[tuple[str, str, str, str]]:
    # Placement-major, paths adjacent: consecutive cells share their reference.
    out = []
    for pl, kind, mode, path in itertools.product(PLACEMENTS, KINDS, MODES, PATHS):
        if (path, pl) not in LEFT_OUT:
            out.append((path, mode, pl, kind))
    return out


ALL = _all()

# Left out of the composition axis, with the reason: optax's flatten (one vector
# concatenated from every leaf) and contrib.mechanize (a vdot of two FSDP-sharded
# trees) do not trace on an Explicit mesh whose leaves are sharded differently,
# around plain optax either (JAX asks for an out_sharding there).
COMPOSED_LEFT_OUT = {(c, "explicit_shard") for c in ("flatten", "guard_mechanize")}

SMALL = tuple(itertools.product(("one", "explicit_shard", "shard_map"), ("none", "bn")))
COMPOSED = [
    (path, comp, pl, kind)
    for (pl, kind), comp, path in itertools.product(SMALL, compositions.NAMES, FUNCTIONAL)
    if (comp, pl) not in COMPOSED_LEFT_OUT
]
NEW_DTYPES = tuple(d for d in DTYPES if d not in MODES)  # float32 is the product's plain
DTYPED = [
    (path, dt, pl, kind) for (pl, kind), dt, path in itertools.product(SMALL, NEW_DTYPES, PATHS)
]

CI = [
    # Issue 30's named bugs, one cell each.
    ("update", "plain", "explicit_shard", "none"),  # optax path under an Explicit mesh
    ("nnx", "plain", "one", "bn2"),  # two forwards before one update
    ("nnx", "plain", "one", "teacher"),  # another module passed first
    ("nnx_flaxgrad", "plain", "one", "bn"),  # Flax's nnx.value_and_grad
    ("nnx", "every_k", "one", "dropout"),  # step counter over a skipped window
    ("nnx", "plain", "one", "lora"),  # frozen base copied into the optimizer
    ("train_state", "plain", "one", "bn"),  # FrozenDict held, plain dict passed
    ("flax_opt", "plain", "one", "bn"),  # refused, naming jaxamp.nnx.Optimizer
    # Every other value of every axis at least once (in make test-slow:
    # tests/ci_budget.py).
    ("flax_opt", "sr", "auto_rep", "none"),
    ("step", "spikes", "auto_shard", "dropout"),
    ("update", "kahan", "shard_map_stacked", "bn"),
    ("train_state", "every_k", "pmap", "lora"),
    ("nnx", "multi", "shard_map", "bn"),
    ("nnx_flaxgrad", "spikes", "explicit_shard", "teacher"),
    ("flax_opt", "kahan", "explicit_rep", "lora"),
]
# The composition axis: each structure once, the paths, placements and model states
# spread over them (those that train mostly on the update path, the cheapest to
# compile: the others cost a twin or a TrainState); the dtype axis: each dtype on a
# path of each family.
CI_COMPOSED = [
    ("update", "chain_of_one", "one", "none"),
    ("update", "named_chain_of_one", "one", "bn"),
    ("train_state", "flatten", "shard_map", "none"),
    ("update", "inject_around", "explicit_shard", "bn"),
    ("step", "inject_inside", "shard_map", "none"),
    ("update", "guard_chain", "shard_map", "bn"),
    ("update", "guard_masked", "explicit_shard", "none"),
    ("update", "guard_multisteps", "one", "bn"),
    ("update", "guard_mechanize", "one", "none"),
    ("step", "chain_guard_last", "explicit_shard", "bn"),
    ("train_state", "chain_guard_first", "shard_map", "none"),
    ("step", "named_chain_guard_last", "shard_map", "bn"),
    ("train_state", "multisteps", "one", "none"),
    ("step", "apply_if_finite", "one", "bn"),
    ("train_state", "mechanize", "explicit_shard", "none"),
    ("step", "masked", "explicit_shard", "bn"),
    ("train_state", "partition", "shard_map", "none"),
    ("update", "lookahead", "shard_map", "bn"),
    ("update", "guard_stored_8bit", "one", "none"),
    ("update", "guard_stored_bf16", "one", "none"),
    ("train_state", "stored_around", "one", "none"),
]
CI_DTYPED = [
    ("update", "bf16", "explicit_shard", "bn"),
    ("nnx", "bf16", "one", "none"),
    ("train_state", "f16", "one", "none"),
    ("flax_opt", "f16", "one", "bn"),
]
assert all(c in ALL for c in CI), [c for c in CI if c not in ALL]
assert all(c in COMPOSED for c in CI_COMPOSED), [c for c in CI_COMPOSED if c not in COMPOSED]
assert all(c in DTYPED for c in CI_DTYPED), [c for c in CI_DTYPED if c not in DTYPED]
assert all(
    {c[i] for c in CI} == set(axis) for i, axis in enumerate((PATHS, MODES, PLACEMENTS, KINDS))
), "CI holds every value of every axis"
assert {c[1] for c in CI_COMPOSED} == set(compositions.NAMES), "CI holds every composition"
assert {c[1] for c in CI_DTYPED} == set(NEW_DTYPES), "CI holds every dtype"

_built: dict[tuple, Cell] = {}
_refs: dict[tuple, object] = {}


def build(path: str, mode: str, pl: str, kind: str) -> Cell:
    """The cell, compiled on first use; one cell (and two references) kept at a time,
    so that the whole product's executables do not pile up in memory."""
    key = (path, mode, pl, kind)
    if key not in _built:
        if _built:  # a jitted function's executables go with it
            was_pmap = any(c.pl.name == "pmap" for c in _built.values())
            _built.clear()
            gc.collect()
            # jax.pmap's do not: JAX keeps every pmap executable until clear_caches,
            # about 1,000 memory mappings a cell here, and a process that reaches the
            # kernel's vm.max_map_count (65,530) dies in XLA's next compile (SIGSEGV),
            # which 50-60 pmap cells in one worker reach.
            if was_pmap:
                jax.clear_caches()
        m = Mode(mode)
        k = Kind(kind, m.param_dtype)
        p = Placement(pl)
        module = paths_nnx if path in NNX else paths_functional
        # update and step share one reference (plain optax); the nnx paths share Flax's.
        family = "nnx" if path in NNX else ("ts" if path == "train_state" else "optax")
        ref_key = (family, mode, pl, kind)
        if ref_key not in _refs:
            if len(_refs) >= 2:
                _refs.pop(next(iter(_refs)))
            _refs[ref_key] = module.Reference(path, k, m, p)
        _built[key] = Cell(path, k, m, p, module.Runner(path, k, m, p), _refs[ref_key])
    return _built[key]
