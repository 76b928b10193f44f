"""The Getting started pages (docs/start/) run as shown.

docs/start/linen.md and docs/start/nnx.md each show one script as a diff: the lines
with a space or a ``-`` in front are the script before (float32 Flax), those with a
space or a ``+`` the script after (jaxamp, float16 compute, dynamic loss scale).
Both run; the after script equals the page's "to copy" block, skips an overflowing
batch with its BatchNorm statistics kept (its own asserts), and trains as far as the
float32 script does. docs/start/pytorch.md's jaxamp column runs on eight batches
(PyTorch's column, fenced ``py``, is not run: no torch here).
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import textwrap

import jax
import jax.numpy as jnp
import pytest

START = pathlib.Path(__file__).resolve().parents[2] / "docs" / "start"
FENCE = re.compile(r"^( *)```(\w+)[^\n]*\n(.*?)^\1```", re.S | re.M)


def blocks(page: str, lang: str) -> list[str]:
    text = (START / page).read_text(encoding="utf-8")
    return [textwrap.dedent(m[2]) for m in FENCE.findall(text) if m[1] == lang]


def side(diff: str, keep: str) -> str:
    """One side of a diff block: ``keep`` is "-" (before) or "+" (after)."""
    lines = []
    for line in diff.splitlines():
        if line == "":  # an editor strips a blank context line's space
            lines.append("")
        elif line[0] in (" ", keep):
            lines.append(line[1:])
        else:
            assert line[0] in "+-", f"not a diff line: {line!r}"
    return "\n".join(lines) + "\n"


def run(code: str, name: str, namespace: dict | None = None) -> tuple[dict, str]:
    namespace = {} if namespace is None else namespace
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), namespace)
    return namespace, out.getvalue()


@pytest.mark.parametrize("page", ["linen.md", "nnx.md"])
def test_diff_before_and_after_run(page):
    (diff,) = blocks(page, "diff")
    (to_copy,) = blocks(page, "python")
    before, after = side(diff, "-"), side(diff, "+")
    assert after == to_copy, f"{page}: the 'to copy' block is not the diff's after side"
    changed = sum(line[:1] in "+-" for line in diff.splitlines() if line)
    assert 6 <= changed <= 30, f"{page}: {changed} changed lines"

    ref, _ = run(before, f"docs/start/{page}[before]")
    amp, printed = run(after, f"docs/start/{page}[after]")
    # Same data, same initialisation, 100 steps: the float16-compute run ends where the
    # float32 one does. Each step's gradients differ by float16 rounding (2**-11
    # relative) and Adam's updates amplify that along the way; 0.02 on a loss that
    # falls from about 1.4 to below 0.05 is far below what a broken scale or a lost
    # step would give, and well above the gap measured (under 1e-3).
    loss32, loss16 = float(ref["loss"]), float(amp["loss"])
    assert loss32 < 0.05, loss32
    assert abs(loss16 - loss32) < 0.02, (loss16, loss32)
    assert "skipped 0" in printed, printed  # 100 finite steps: none skipped


def _pytorch_page_data() -> list:
    """Eight batches of 32 (input, target) pairs: a linear rule the MLP learns."""
    kx, kw = jax.random.split(jax.random.key(0))
    inputs = jax.random.normal(kx, (8, 32, 20))
    targets = jnp.argmax(inputs[..., :10] @ jax.random.normal(kw, (10, 10)), axis=-1)
    return list(zip(inputs, targets, strict=True))


def test_pytorch_page_jaxamp_column_runs():
    code, _ = blocks("pytorch.md", "python")
    assert len(blocks("pytorch.md", "py")) == 2  # the PyTorch columns
    ns, printed = run(code, "docs/start/pytorch.md[jaxamp]", {"data": _pytorch_page_data()})
    epochs = [line.split() for line in printed.strip().splitlines()]
    assert len(epochs) == 3, printed
    losses = [float(loss) for loss, _ in epochs]
    assert losses[2] < losses[0] * 0.9, losses
    # GradScaler's initial scale, 2**16, not yet grown (2000 steps) nor backed off
    assert {float(scale) for _, scale in epochs} == {2.0**16}, printed
    assert int(ns["m"]["skipped_steps"]) == 0


def test_pytorch_page_batchnorm_dropout_and_eval_column_runs():
    """The second jaxamp column: BatchNorm statistics move with the steps, dropout draws
    a new mask each step, evaluation runs the products in float16 and returns float32
    logits that classify better than chance."""
    _, code = blocks("pytorch.md", "python")
    data = _pytorch_page_data()
    ns, printed = run(code, "docs/start/pytorch.md[jaxamp, BatchNorm]", {"data": data})
    losses = [float(line.split()[0]) for line in printed.strip().splitlines()]
    assert len(losses) == 3 and losses[2] < losses[0] * 0.9, losses
    assert int(ns["jaxamp"].metrics(ns["state"])["skipped_steps"]) == 0
    init = ns["variables"]["batch_stats"]["BatchNorm_0"]["mean"]
    assert float(jnp.abs(ns["state"].batch_stats["BatchNorm_0"]["mean"] - init).max()) > 1e-3
    assert ns["output"].dtype == jnp.float32
    assert ns["accuracy"] > 0.3  # ten classes: chance is 0.1
    # eval is deterministic (dropout off); the train step is not, given two keys
    state, x, y = ns["state"], data[0][0], data[0][1]
    assert (ns["eval_step"](state, x) == ns["output"]).all()
    _, a = ns["train_step"](state, x, y, jax.random.key(5))
    _, b = ns["train_step"](state, x, y, jax.random.key(6))
    assert float(a) != float(b)
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    evaluate = lambda v, x: state.apply_fn(v, x, train=False)  # noqa: E731
    dots = [
        str(e.invars[0].aval.dtype)
        for e in jax.make_jaxpr(evaluate)(variables, x).jaxpr.eqns
        for e in _all_eqns(e)
        if e.primitive.name == "dot_general"
    ]
    assert dots and set(dots) == {"float16"}, dots


def _all_eqns(eqn):
    """``eqn`` and the equations of the jaxprs nested in it."""
    yield eqn
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", None)
        if inner is not None:
            for sub in getattr(inner, "jaxpr", inner).eqns:
                yield from _all_eqns(sub)
