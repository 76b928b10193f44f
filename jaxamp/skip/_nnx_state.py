"""The nnx model state a forward writes, and the one optimizer that cannot keep it.

A skipped step must leave everything the step wrote as it was. In
NNX the forward writes model state in place (``BatchStat``, RNG counters); only an
optimizer that sees the model can put it back, and Flax's own ``nnx.Optimizer``
hands a jaxamp ``tx`` the params alone.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxamp._utils.tree import render_path


def pure(tree: Any) -> Any:
    """An nnx State as plain arrays (``nnx.as_pure``; ``to_pure_dict`` before Flax 0.12)."""
    return nnx.as_pure(tree) if hasattr(nnx, "as_pure") else nnx.to_pure_dict(tree)


#: The nnx filter of what a forward can write: every Variable but Params and
#: Intermediates. ``nnx.Intermediate`` (values ``sow``n by the forward) is an output,
#: not state the next step reads; Params (a frozen base under LoRA too) are read, not
#: written, so no optimizer needs a copy of them. A non-Param Variable in ``wrt``
#: (``wrt=nnx.Any(nnx.Param, nnx.BatchStat)``) is both written by the forward and
#: updated by the optimizer: it is recorded too, so that a skip puts it back.
FORWARD_WRITTEN = nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.Intermediate))


def refuse_written_state(model: nnx.Module) -> None:
    """Raises if ``model`` holds state a forward can write: Flax's ``nnx.Optimizer``
    updating it would keep a skipped step's writes."""
    written = pure(nnx.state(model, FORWARD_WRITTEN))
    paths = [render_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(written)[0]]
    if not paths:
        return
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    raise TypeError(
        f"Flax's nnx.Optimizer cannot keep this model's state on a step jaxamp skips: the "
        f"model holds state a forward can write ({shown}), and Flax's optimizer hands the "
        "jaxamp tx the params alone, so a non-finite batch's statistics would stay. Build "
        "it with jaxamp.nnx.Optimizer(model, tx, wrt=...) instead: the same arguments and "
        "update(model, grads), and a skipped step puts that state back (and does not count "
        "in optimizer.step)."
    )
