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


def test_pytorch_page_jaxamp_column_runs():
    (code,) = blocks("pytorch.md", "python")
    assert len(blocks("pytorch.md", "py")) == 1  # the PyTorch column
    kx, kw = jax.random.split(jax.random.key(0))
    inputs = jax.random.normal(kx, (8, 32, 20))
    targets = jnp.argmax(inputs[..., :10] @ jax.random.normal(kw, (10, 10)), axis=-1)
    ns, printed = run(
        code, "docs/start/pytorch.md[jaxamp]", {"data": list(zip(inputs, targets, strict=True))}
    )
    epochs = [line.split() for line in printed.strip().splitlines()]
    assert len(epochs) == 3, printed
    losses = [float(loss) for loss, _ in epochs]
    assert losses[2] < losses[0] * 0.9, losses
    # GradScaler's initial scale, 2**16, not yet grown (2000 steps) nor backed off
    assert {float(scale) for _, scale in epochs} == {2.0**16}, printed
    assert int(ns["m"]["skipped_steps"]) == 0
