"""Where a loss-scale guard may sit among optax transformations.

A guard (``jaxamp.skip_nonfinite``, ``jaxamp.multi_transform``) promises that a
skipped step writes nothing: that holds only where nothing outside it reads the
scaled gradients or writes on a step it skips. So the guard must be the outermost
transformation, or sit inside a structure known to be safe around it (``SAFE``).

The rule is read two ways, each giving the structures around the guard, innermost
first, judged by one function (``_judge``):

- off an optimizer state (``check_state``), by every function that reads one
  (``get_loss_scale`` and all that call it, ``jaxamp.step``, ``TrainState``): the
  guard's state is the NamedTuple whose field holds the ``LossScaleState``, and each
  node above it names a structure (an optax chain is a plain tuple, a named chain a
  dict, a wrapper its own NamedTuple);
- off the frames that call the guard's ``update`` (``check_callers``): an optax
  wrapper calling ``tx.update`` directly is refused even where nothing reads the state
  (a bfloat16 run with no scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import FrameType
from typing import Any, NamedTuple

import jax

from jaxamp._utils.errors import NamedValueError
from jaxamp.loss_scale._state import LossScaleState

__all__: list[str] = []


class Around(NamedTuple):
    """One structure enclosing the guard: ``kind`` (``"chain"``, ``"named_chain"``, or an
    optax wrapper's name), and in a chain the guard's position among ``size`` members."""

    kind: str
    position: int = 0
    size: int = 1


#: Structures that never read the gradients the guard checks, nor write on a step it
#: skips. ``inject_hyperparams`` around a factory that builds the guard: its step
#: count and the hyperparameters it derives from it advance on every call, skipped
#: ones too (as PyTorch's ``scheduler.step()`` does); inject inside the guard for a
#: schedule that counts taken steps only.
SAFE = frozenset({"flatten", "with_extra_args_support", "inject_hyperparams"})

#: Optax's wrapper states, by class name, and the wrapper that builds each.
_WRAPPER_OF_STATE = {
    "MultiStepsState": "MultiSteps",
    "MechanicState": "mechanize",
    "ApplyIfFiniteState": "apply_if_finite",
    "MaskedState": "masked",
    "PartitionState": "partition",
    "LookaheadState": "lookahead",
    "InjectHyperparamsState": "inject_hyperparams",
    "InjectStatefulHyperparamsState": "inject_hyperparams",
}

#: Why each known structure is unsafe around the guard, and what to write instead.
_FIX = {
    "MultiSteps": (
        "optax.MultiSteps",
        "it accumulates the scaled gradients itself, so one non-finite micro-batch stays "
        "in its accumulator and every later window is skipped (training stops)",
        "jaxamp.skip_nonfinite(inner, loss_scale, every_k=k)",
    ),
    "mechanize": (
        "optax.contrib.mechanize",
        "it reads the gradients before the guard checks them: a non-finite batch writes "
        "NaN into the params on a step reported as skipped",
        "jaxamp.skip_nonfinite(optax.contrib.mechanize(inner), loss_scale)",
    ),
    "apply_if_finite": (
        "optax.apply_if_finite",
        "it withholds non-finite steps from the guard, so the loss scale never backs off",
        "jaxamp.skip_nonfinite(inner, jaxamp.dynamic_scale(max_consecutive_nonfinite=N)) alone",
    ),
    "masked": (
        "optax.masked",
        "the leaves outside the mask get the scaled, unchecked gradients as updates, on "
        "skipped steps too",
        "jaxamp.multi_transform({'train': inner, 'frozen': optax.set_to_zero()}, labels, "
        "loss_scale) (optax.masked inside the guard would still pass the masked-out leaves' "
        "gradients through as their updates)",
    ),
    "partition": (
        "optax.partition / optax.multi_transform",
        "its other groups update on a step the guard skips",
        "jaxamp.multi_transform(transforms, param_labels, loss_scale), one guard for all "
        "the groups",
    ),
    "lookahead": (
        "optax.lookahead",
        "it moves the params towards its slow weights on steps the guard skips",
        "jaxamp.skip_nonfinite(optax.chain(...), loss_scale) without lookahead (jaxamp "
        "has no guarded lookahead)",
    ),
}

_CHAIN_FIX = {
    "after": (
        "the transformations before it see the scaled, unchecked gradients (a NaN reaches "
        "their state, a clip measures the scaled norm)",
        "jaxamp.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), "
        "optax.adam(1e-3)), loss_scale)",
    ),
    "before": (
        "the transformations after it would still run on a skipped step (weight decay, "
        "for one, would move the params)",
        "jaxamp.skip_nonfinite(optax.chain(optax.sgd(0.1), optax.add_decayed_weights(1e-4)), "
        "loss_scale)",
    ),
}


def _judge(arounds: list[Around], fn: str, container_hint: bool) -> None:
    """Raises for the innermost structure in ``arounds`` that is unsafe around the guard."""
    for i, a in enumerate(arounds):
        if a.kind == "masked" and arounds[i + 1 : i + 2] == [Around("partition")]:
            continue  # optax.partition masks each group: name the partition
        if a.kind in SAFE or (a.kind in ("chain", "named_chain") and a.size == 1):
            continue
        if a.kind in ("chain", "named_chain"):
            side = "before" if a.position == 0 else "after"
            why, fix = _CHAIN_FIX[side]
            where = f"optax.{a.kind} ({a.position + 1} of {a.size} members)"
            mine = (
                f" If that {'tuple' if a.kind == 'chain' else 'dict'} is your own container, "
                "not an optax state, pass the optimizer state itself."
                if container_hint
                else ""
            )
            raise NamedValueError(
                "the optimizer puts jaxamp.skip_nonfinite (or jaxamp.multi_transform) "
                f"{side} other transformations in an {where}: {why}. Put them inside: "
                f"{fix}.{mine}",
                fn,
            )
        maker = (
            f"the optax transformation whose state is {a.kind}"
            if a.kind.endswith("State")
            else f"optax's {a.kind}"
        )
        name, why, fix = _FIX.get(
            a.kind,
            (
                maker,
                "jaxamp does not know it to be safe around the guard (it may read the "
                "scaled gradients or write on a skipped step)",
                "the guard around it: jaxamp.skip_nonfinite(<that transformation>(inner), "
                "loss_scale)",
            ),
        )
        raise NamedValueError(
            f"jaxamp.skip_nonfinite (or jaxamp.multi_transform) is wrapped in {name}: "
            f"{why}. Write {fix} instead; the guard must be the outermost transformation.",
            fn,
        )


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _state_like(x: Any) -> bool:
    """Whether ``x`` looks like an optax state: a NamedTuple, or a tuple / dict of them
    (a chain's, a named chain's). A container of the user's holds arrays or params."""
    if _is_namedtuple(x):
        return True
    if type(x) in (tuple, list):
        return all(map(_state_like, x))
    if isinstance(x, Mapping):
        return all(map(_state_like, x.values()))
    return False


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``node``'s children, one level down, with their key-path entries."""
    leaves = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return [(path[0], child) for path, child in leaves if path]


def _trail(tree: Any) -> list[Any]:
    """The nodes from ``tree`` down to the one ``LossScaleState`` in it (excluded)."""
    is_ls = lambda x: isinstance(x, LossScaleState)  # noqa: E731
    found = [p for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_ls)[0] if is_ls(x)]
    if len(found) != 1:
        return []
    trail, node = [], tree
    for entry in found[0]:
        trail.append(node)
        node = next((c for k, c in _children(node) if k == entry), None)
        if node is None:  # a node that names its children otherwise: stop here
            break
    return trail


def _around_of(node: Any, inner: Any, parent: Any) -> Around | None:
    """The structure ``node`` stands for around its child ``inner`` (None: a container).
    A dict that is a field of an optax wrapper's state (``partition``'s states by label)
    is part of that wrapper, not a named chain."""
    if _is_namedtuple(parent) and type(parent).__module__.split(".")[0] == "optax":
        if isinstance(node, Mapping):
            return None
    if node and (type(node) is tuple or isinstance(node, Mapping)) and _state_like(node):
        members = list(node.values()) if isinstance(node, Mapping) else list(node)
        at = next(i for i, m in enumerate(members) if m is inner)
        return Around("chain" if type(node) is tuple else "named_chain", at, len(members))
    if _is_namedtuple(node) and type(node).__module__.split(".")[0] == "optax":
        name = type(node).__name__
        return Around(_WRAPPER_OF_STATE.get(name, name))
    return None


def check_state(tree: Any, fn: str) -> bool:
    """Raises if the guard in ``tree`` (an optimizer state, or what holds one) sits in a
    structure that is unsafe around it; returns whether a guard owns the
    ``LossScaleState`` in ``tree``. One that no guard owns (kept beside a plain
    optimizer, or passed alone) is not judged."""
    trail = _trail(tree)
    if not trail or not _is_namedtuple(trail[-1]):
        return False  # no guard state: a loss-scale state on its own
    arounds = []
    parents = [None, *trail][: len(trail) - 1]
    for parent, node, inner in zip(parents, trail[:-1], trail[1:], strict=True):
        a = _around_of(node, inner, parent)
        if a is not None:
            arounds.append(a)
    _judge(arounds[::-1], fn, container_hint=True)
    return True


def _holds(tree: Any, node: Any) -> bool:
    """Whether ``node`` (by identity) is ``tree`` or inside it."""
    return any(x is node for x in jax.tree.leaves(tree, is_leaf=lambda x: x is node))


#: Packages whose frames sit between an optax wrapper and the guard it calls.
_PASS_THROUGH = ("jax", "jaxlib", "functools", "contextlib")
_FRAMES_UP = 40


def check_callers(frame: FrameType | None, state: Any, fn: str) -> None:
    """Raises if the guard's ``update`` (whose state is ``state``) is called by an optax
    wrapper unsafe around it; ``frame`` is the caller's. Stops at the first frame that
    is neither optax nor JAX (the user's, Flax's, jaxamp's)."""
    arounds: list[Around] = []
    inner = state
    for _ in range(_FRAMES_UP):
        if frame is None:
            break
        package = frame.f_globals.get("__name__", "").split(".")[0]
        if package in _PASS_THROUGH:
            frame = frame.f_back
            continue
        if package != "optax":
            break
        kind = frame.f_code.co_qualname.split(".")[0]
        if kind in ("chain", "named_chain"):
            members = frame.f_locals.get("state")
            if isinstance(members, Mapping):
                members = tuple(members.values())
            if isinstance(members, tuple):
                found = [i for i, m in enumerate(members) if _holds(m, inner)]
                arounds.append(Around(kind, found[0] if found else 1, len(members)))
                inner = frame.f_locals.get("state")
        elif not arounds or arounds[-1].kind != kind:
            arounds.append(Around(kind))
        frame = frame.f_back
    _judge(arounds, fn, container_hint=False)
