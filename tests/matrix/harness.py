"""The matrix's parts: the calls (what hypothesis draws), snapshots, comparisons, restore.

A call is one update's worth of data: per forward, a batch that is finite or holds
an +inf, -inf or NaN (which also poisons what the forward writes, BatchStat), or a
finite batch whose loss term poisons one gradient element (+inf, -inf, NaN); on
the device or batch slice of one replica; and, with ``spikes=``, possibly a spike.
``drive.py`` runs calls through a cell and checks each against the reference.

The references' own parts are here too: their finiteness per label, gradient
norm (the spike rule's input) and the select that keeps a reference's update
only where the harness says the call is taken.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from hypothesis import strategies as st

import jaxamp
from tests.matrix import compositions
from tests.matrix import modes as modes_lib
from tests.matrix.models import BATCH, IN, label_of

POISONS = ("x+inf", "x-inf", "xnan", "g+inf", "g-inf", "gnan")
_VALUE = {"+inf": np.inf, "-inf": -np.inf, "nan": np.nan}


@dataclasses.dataclass(frozen=True)
class Call:
    """One call: a poison per forward, the replica (or batch slice) it lands on, a spike."""

    poison: tuple[str, ...]
    replica: int = 0
    spike: bool = False

    def poisoned_labels(self) -> set[str]:
        """Labels whose gradients the poison makes non-finite: all for a poisoned
        batch, the first layer's ("a") for a poisoned loss term."""
        out: set[str] = set()
        for p in self.poison:
            if p.startswith("x"):
                out |= {"a", "b"}
            elif p.startswith("g"):
                out.add("a")
        return out


def calls(forwards: int, spikes: bool, max_calls: int) -> st.SearchStrategy[list[Call]]:
    """Call sequences: each forward finite 60% of the time (shrinking towards finite)."""
    poison = st.sampled_from(("ok",) * 9 + POISONS)
    one = st.builds(
        Call,
        st.tuples(*[poison] * forwards),
        st.integers(0, 7),
        st.booleans() if spikes else st.just(False),
    )
    return st.lists(one, min_size=1, max_size=max_calls)


_DATA = [np.random.default_rng(i).normal(size=(2, BATCH, IN)).astype(np.float32) for i in range(8)]


def arrays(call: Call, i: int, forwards: int, replicas: int) -> tuple[np.ndarray, ...]:
    """The call's batch ``x`` (forwards, BATCH, IN), poison ``gp`` (replicas, forwards), ``amp``."""
    x = _DATA[i % len(_DATA)][:forwards].copy()
    gp = np.zeros((replicas, forwards), np.float32)
    row = call.replica * (BATCH // 8)  # the replica's (under a mesh: the device's) first row
    for f, p in enumerate(call.poison):
        if p.startswith("x"):
            x[f, row, 1] = _VALUE[p[1:]]
        elif p.startswith("g"):
            gp[call.replica % replicas, f] = _VALUE[p[1:]]
    amp = modes_lib.SPIKE_AMP if call.spike else 1.0
    return x, gp, amp


# ---------------------------------------------------------------------------
# Snapshots: every array on the host, keyed by path.


def host(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def to_host(tree: Any) -> Any:
    """``tree`` on the host in one transfer (PRNG keys as their data), its structure kept."""
    is_key = lambda x: hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.device_get(jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree))


def flat(tree: Any) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key(k) for k in path): host(v) for path, v in leaves}


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


@dataclasses.dataclass
class Snap:
    """What a runner or reference holds after a call, on the host: params, the inner
    optimizer state per label, the model state (everything outside ``wrt``), the
    optimizer's counters that move on every call (``modes.Mode.always``), and for
    runners the metrics, step counter, teacher, every leaf and its sharding."""

    params: dict[str, np.ndarray]
    inner: dict[str, list[np.ndarray]]
    mstate: dict[str, np.ndarray]
    counters: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    teacher: dict[str, np.ndarray] | None = None
    step: int | None = None
    everything: list[np.ndarray] = dataclasses.field(default_factory=list)
    shardings: list[Any] = dataclasses.field(default_factory=list)
    opt_shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)


def inner_of(opt_state: Any, mode: modes_lib.Mode, *, reference: bool) -> dict[str, list]:
    return {
        lab: [host(x) for x in modes_lib.inner_leaves(opt_state, mode, lab, reference=reference)]
        for lab in mode.labels
    }


def counters_of(opt_state: Any, mode: modes_lib.Mode) -> dict[str, np.ndarray]:
    return {k: host(v) for k, v in compositions.counters(opt_state, mode.always).items()}


def metrics_of(opt_state: Any) -> dict[str, Any]:
    return {k: host(v) for k, v in jaxamp.metrics(opt_state).items()}


def shardings(tree: Any) -> list[Any]:
    return [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]


# ---------------------------------------------------------------------------
# Comparisons.


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same(what: str, got: Any, want: Any, rtol: float | None) -> None:
    """``got == want``: dicts by key, lists in order; bit for bit, or within ``rtol``
    (relative to the array's largest magnitude) when ``rtol`` is given."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(f"{what}[{k}]", got[k], want[k], rtol)
        return
    if isinstance(want, list):
        assert len(got) == len(want), f"{what}: {len(got)} leaves != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(f"{what}[{i}]", g, w, rtol)
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    )
    if rtol is None or not np.issubdtype(want.dtype, np.floating) and want.dtype.kind != "V":
        if not bits_equal(got, want):
            raise AssertionError(f"{what}: not bit for bit equal: {_diff(got, want)}")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.array_equal(np.isfinite(g), np.isfinite(w)), f"{what}: finiteness differs"
    scale = max(float(np.max(np.abs(w), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(np.nan_to_num(g - w)), initial=0.0))
    assert err <= rtol * scale, f"{what}: off by {err:.3g} (> {rtol:.3g} x {scale:.3g})"


def _diff(got: np.ndarray, want: np.ndarray) -> str:
    g, w = got.reshape(-1), want.reshape(-1)
    if g.dtype.kind == "V" or not np.issubdtype(g.dtype, np.number):
        g, w = g.view(np.uint8), w.view(np.uint8)
    bad = (
        np.flatnonzero(g.tobytes() != w.tobytes())
        if g.size == 0
        else np.flatnonzero((g != w) & ~(np.isnan(g.astype(float)) & np.isnan(w.astype(float))))
    )
    if bad.size == 0:
        return "same values, other bits (-0.0 or NaN payload)"
    i = bad[0]
    return f"{bad.size} of {g.size} elements differ, first at {i}: {g[i]!r} != {w[i]!r}"


def _by_label(tree: dict[str, np.ndarray], label: str) -> dict[str, np.ndarray]:
    return {k: v for k, v in tree.items() if label == "all" or label_of(k) == label}


# ---------------------------------------------------------------------------
# The references' parts: their own finiteness, their gradient norm, their select.


def select(
    take: jax.Array, labels: tuple[str, ...], new: Any, old: Any, part: str, always: tuple = ()
) -> Any:
    """``new`` where the reference takes the call, ``old`` where it does not: params
    by their label, multi_transform's inner states by theirs, the rest by all; the
    optimizer state's top-level fields in ``always`` advance on every call."""
    everything = jnp.all(take)

    def pick(path, n, o):
        keys = [_key(k) for k in path]
        if part == "opt" and keys[0] in always:
            return n
        if len(labels) > 1 and part == "params":
            on = take[labels.index(label_of(keys[0]))]
        elif len(labels) > 1 and part == "opt" and "inner_states" in keys:
            on = take[labels.index(keys[keys.index("inner_states") + 1])]
        else:
            on = everything
        return jnp.where(on, n, o)

    return jax.tree_util.tree_map_with_path(pick, new, old)


def finite(grads: Any, labels: tuple[str, ...]) -> jax.Array:
    flags = {lab: jnp.bool_(True) for lab in labels}
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        lab = label_of(_key(path[0])) if len(labels) > 1 else "all"
        flags[lab] = flags[lab] & jnp.all(jnp.isfinite(g))
    return jnp.stack([flags[lab] for lab in labels])


def norm(grads: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))


# ---------------------------------------------------------------------------
# Checkpoint and restore (orbax, jaxamp.checkpoint.restore).


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def save_and_restore(tree: Any, target: Any) -> Any:
    """Saves ``tree`` with orbax and restores it into ``target`` (concrete arrays of
    another configuration, placed where the run's are) with jaxamp.checkpoint.restore.
    PRNG keys travel as their data (orbax stores arrays of numbers)."""
    as_data = lambda t: jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, t)
    with tempfile.TemporaryDirectory() as d, ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(d) / "c", as_data(tree))
        ckptr.wait_until_finished()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), as_data(target)
        )
        restored = jaxamp.checkpoint.restore(ckptr, abstract, directory=Path(d) / "c")
    return jax.tree.map(
        lambda t, x: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t)) if _is_key(t) else x,
        target,
        restored,
    )
