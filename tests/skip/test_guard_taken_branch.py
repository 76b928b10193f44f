"""A finite step copies nothing: the branches it takes in the compiled HLO hold no copy.

The guarded step skips a non-finite update with a ``lax.cond``; whatever one of its
branches returns as it got it (the per-leaf record, the finite check's flags) or
returns as one buffer shared by several outputs (zeros of one shape), XLA copies into
the cond's outputs, on every step that takes that branch. These tests compile small
donated steps on the CPU and count ``copy`` ops in the computations a finite step runs:
each conditional's last branch (the ``true`` branch of a ``lax.cond``), nested ones
included. Op counts, not timings or float comparisons: the same on any CPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

_COMPUTATION = re.compile(r"^(?:ENTRY )?(%[\w.-]+) .*\{$")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OPCODE = re.compile(r"= (?:\(.*?\)|\S+) ([\w-]+)\(")


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = "ENTRY" if line.startswith("ENTRY") else m.group(1)
            comps[name] = []
        elif name is not None and line.strip() not in ("", "}"):
            comps[name].append(line.strip())
    return comps


_CALLS = re.compile(r"\bcalls=(%[\w.-]+)")
_MOVES = {"parameter", "copy", "transpose", "bitcast", "reshape", "tuple", "get-tuple-element"}


def _taken(comps: dict[str, list[str]], name: str) -> list[str]:
    """Opcodes a finite step runs in ``name``'s taken branches (nested ones too); a
    fusion that only copies or transposes (a layout change) counts as a ``copy``."""
    ops = []
    for line in comps[name]:
        m = _OPCODE.search(line)
        if m is None:
            continue
        op = m.group(1)
        called = _CALLS.search(line)
        if op == "fusion" and called:
            body = {o.group(1) for o in map(_OPCODE.search, comps[called.group(1)]) if o}
            op = "copy" if body <= _MOVES and body & {"copy", "transpose"} else op
        ops.append(op)
        branches = _BRANCHES.search(line)
        if m.group(1) == "conditional" and branches:
            ops.extend(_taken(comps, branches.group(1).split(", ")[-1]))
    return ops


def _finite_path(compiled) -> tuple[int, int]:
    """(conditionals, copy ops) in the branches a finite step takes."""
    comps = _computations(compiled.as_text())
    conds = 0
    copies = 0
    for line in comps["ENTRY"]:
        branches = _BRANCHES.search(line)
        if " conditional(" in line and branches:
            conds += 1
            ops = _taken(comps, branches.group(1).split(", ")[-1])
            copies += sum(op in ("copy", "copy-start") for op in ops)
    return conds, copies


def _model():
    # Leaves of one shape (the zeros XLA would share), small and large ones. Products
    # `x @ w` give row-major gradients: an einsum whose gradient XLA lays out transposed
    # (attention's (d, heads, head_dim) kernels) still gets a layout-changing copy at
    # the top of the taken branch on XLA:CPU (benchmarks/RESULTS.md, issue 34).
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "a": {"w": jax.random.normal(k[0], (16, 16)), "b": jnp.zeros(16)},
        "b": {"w": jax.random.normal(k[1], (16, 16)), "b": jnp.zeros(16)},
        "big": jax.random.normal(k[2], (200, 100)) * 0.01,
        "scale": jnp.ones(16),
    }
    x = jax.random.normal(k[3], (4, 16))

    def loss(p):
        h = jnp.tanh(x @ p["a"]["w"] + p["a"]["b"])
        h = jnp.tanh(h @ p["b"]["w"] + p["b"]["b"]) * p["scale"]
        return jnp.mean(h**2) + jnp.mean(p["big"] ** 2)

    return params, loss


def _tx(every_k: int = 1):
    return jaxamp.skip_nonfinite(optax.adamw(1e-3), jaxamp.dynamic_scale(), every_k=every_k)


def _compile(step, params, state):
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, state).compile()


@pytest.mark.parametrize("how", ["step", "every_k=3", "finite="])
def test_jaxamp_step_copies_nothing_on_a_finite_step(how) -> None:
    params, loss = _model()
    tx = _tx(3 if how == "every_k=3" else 1)

    def step(p, s):
        _, g = jaxamp.value_and_grad(lambda p: loss(p))(s, p)
        if how != "finite=":
            return jaxamp.step(tx, g, s, p)
        g, finite = jaxamp.unscale_and_check(s.loss_scale, g)  # PyTorch's unscale_
        return jaxamp.step(tx, g, s, p, finite=finite)

    conds, copies = _finite_path(_compile(step, params, tx.init(params)))
    assert conds >= 1  # the guarded update (and the scale-below-1 re-check)
    assert copies == 0


def test_the_optax_path_copies_nothing_on_a_finite_step() -> None:
    params, loss = _model()
    tx = _tx()

    def step(p, s):
        _, g = jaxamp.value_and_grad(lambda p: loss(p))(s, p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    conds, copies = _finite_path(_compile(step, params, tx.init(params)))
    assert conds >= 1
    assert copies == 0


def test_multi_transform_copies_nothing_on_a_finite_step() -> None:
    params, loss = _model()
    labels = {"a": "x", "b": "y", "big": "x", "scale": "y"}
    tx = jaxamp.multi_transform(
        {"x": optax.sgd(0.1), "y": optax.adam(0.1)}, labels, jaxamp.dynamic_scale()
    )

    def step(p, s):
        _, g = jaxamp.value_and_grad(lambda p: loss(p))(s, p)
        return jaxamp.step(tx, g, s, p)

    conds, copies = _finite_path(_compile(step, params, tx.init(params)))
    assert conds >= 2  # one update cond per part
    assert copies == 0


def test_a_finite_verdict_skip_still_names_the_non_finite_leaves() -> None:
    # With finite=, nothing is checked here: the skip branch reads the leaves for the
    # record, and the taken branch hands no record through.
    params, _ = _model()
    tx = _tx()
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    grads["b"]["b"] = grads["b"]["b"].at[3].set(jnp.nan)
    step = jax.jit(lambda g, s, p, f: jaxamp.step(tx, g, s, p, finite=f))
    new_params, state = step(grads, state, params, jnp.array(False))
    why = jaxamp.explain(state, params)
    assert why.last == ("b.b",) and why.counts == {"b.b": 1}
    jax.tree.map(np.testing.assert_array_equal, new_params, params)
    # A taken finite= step leaves the record as it was.
    finite_grads = jax.tree.map(jnp.ones_like, params)
    _, state = step(finite_grads, state, params, jnp.array(True))
    assert jaxamp.explain(state, params).counts == {"b.b": 1}
