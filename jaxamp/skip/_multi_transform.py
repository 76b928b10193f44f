"""``multi_transform``: several optimizers sharing one loss scale, each skipped on its own.

The same guarded core as ``skip_nonfinite`` (``_guard.guarded``), with one part
per label; [`jaxamp.step`][jaxamp.step] runs it with the parameter update fused in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._utils.deprecation import deprecated_parameter
from jaxamp._utils.tree import check_axis_name
from jaxamp.loss_scale import LossScaleState
from jaxamp.skip import _record, _spikes
from jaxamp.skip._guard import Call, Part, Spikes, guarded
from jaxamp.skip._transformation import (
    MOVED_LIMIT,
    GuardedUpdate,
    check_grads,
    check_inner,
    check_inner_state,
    check_spike_state,
    check_state_type,
    loss_scale_arg,
    record_of,
    refuse_narrow,
    refuse_nested,
    restore_fields,
    with_outcome,
)

__all__ = ["MultiTransformState", "multi_transform"]


class MultiTransformState(NamedTuple):
    """State of [`multi_transform`][jaxamp.multi_transform]: one inner state per label, one shared
    loss scale.

    Attributes:
      inner_states: label -> that label's optimizer state.
      loss_scale: the shared [`jaxamp.LossScaleState`][jaxamp.LossScaleState].
      nonfinite_leaves: a [`jaxamp.types.NonfiniteLeaves`][jaxamp.types.NonfiniteLeaves] over all
        the params.
      spikes: with ``spikes=``, the [`jaxamp.types.SpikeState`][jaxamp.types.SpikeState] (``None``
        otherwise).

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> opts = {"a": optax.sgd(0.1), "b": optax.adam(0.1)}
      >>> tx = jaxamp.multi_transform(opts, {"x": "a", "y": "b"})
      >>> sorted(tx.init({"x": jnp.ones(2), "y": jnp.ones(2)}).inner_states)
      ['a', 'b']
    """

    inner_states: dict[Any, optax.OptState]
    loss_scale: LossScaleState
    nonfinite_leaves: Any = None
    spikes: Any = None


def _full_labels(labels: Any, tree: Any, transforms: Mapping[Any, Any], fn: str) -> Any:
    """``labels`` (a tree, a prefix of one, or a callable) spread over every leaf of ``tree``."""
    if callable(labels):
        labels = labels(tree)
    try:
        full = jax.tree.map(lambda lab, sub: jax.tree.map(lambda _: lab, sub), labels, tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{fn}: param_labels must have the params' tree structure (or a prefix of it), "
            f"with one label per leaf: {e}"
        ) from None
    missing = []
    for label in jax.tree.leaves(full):
        try:
            known = label in transforms
        except TypeError:  # unhashable: no mapping key can equal it
            known = False
        if not known and label not in missing:
            missing.append(label)
    if missing:
        # Compared as keys, not as text: the label 1 is not the key "1".
        raise ValueError(
            f"{fn}: param_labels name label(s) {missing} that are not keys of `transforms`; "
            f"its keys are {list(transforms)}."
        )
    return full


def _positions(labels: Sequence[Any], transforms: Mapping[Any, Any]) -> list[list[int]]:
    """Per transform (in order), the indices of its leaves among all the leaves."""
    return [[i for i, lab in enumerate(labels) if lab == key] for key in transforms]


def _mask(tree: Any, full_labels: Any, label: Any) -> Any:
    if tree is None:
        return None
    return jax.tree.map(lambda x, lab: x if lab == label else optax.MaskedNode(), tree, full_labels)


def _merge(trees: Mapping[Any, Any], full_labels: Any, like_tree: Any) -> Any:
    """One tree from the per-label trees, each leaf taken from its label's tree."""
    treedef = jax.tree.structure(like_tree)
    labels = treedef.flatten_up_to(full_labels)
    flat = {label: treedef.flatten_up_to(t) for label, t in trees.items()}
    return treedef.unflatten([flat[label][i] for i, label in enumerate(labels)])


# eq=False: hashed by identity, as a plain function is, so that `jax.jit(tx.update)`
# works (a field such as multi_transform's dict of transforms is unhashable).
@dataclasses.dataclass(frozen=True, eq=False)
class _MultiTransformUpdate(GuardedUpdate):
    """``multi_transform``'s update function; its parts are its fields."""

    transforms: dict[Any, optax.GradientTransformationExtraArgs]
    param_labels: Any
    axis_name: Any
    spikes: _spikes.SpikeRule | None = None

    def run(
        self, grads: Any, state: MultiTransformState, params: Any, call: Call
    ) -> tuple[Any, MultiTransformState]:
        fn = "jaxamp.step" if call.to_params else "multi_transform.update"
        check_state_type(state, MultiTransformState, fn)
        check_spike_state(self.spikes, state, fn)
        # An equinox model passed whole: its non-array fields set aside, put back at the end.
        given, params = params, check_grads(grads, params, fn)
        refuse_narrow(params, state.inner_states, fn)
        labels = _full_labels(self.param_labels, grads, self.transforms, fn)
        parts = []
        for label, tx in self.transforms.items():
            masked = _mask(grads, labels, label)
            masked_params = _mask(params, labels, label)
            check_inner_state(
                tx,
                state.inner_states[label],
                masked if params is None else masked_params,
                fn,
                f"opt_state.inner_states[{label!r}]",
            )
            parts.append(Part(tx, state.inner_states[label], masked, masked_params))
        spikes = None
        if self.spikes is not None:
            loss = _spikes.loss_value(self.spikes, call.extra_args, fn)
            spikes = Spikes(self.spikes, state.spikes, loss)
        flat_labels = jax.tree.structure(grads).flatten_up_to(labels)
        record = record_of(state, _positions(flat_labels, self.transforms))
        got = guarded(state.loss_scale, parts, call, self.axis_name, spikes, record)
        out = _merge(dict(zip(self.transforms, got.outs, strict=True)), labels, grads)
        if call.to_params and params is not given:
            out = restore_fields(out, given)
        new = with_outcome(state, got)
        return out, new._replace(
            inner_states=dict(zip(self.transforms, got.inner_states, strict=True))
        )


@deprecated_parameter("max_consecutive_nonfinite", MOVED_LIMIT, removed_in="0.5")
def multi_transform(
    transforms: Mapping[Any, optax.GradientTransformation],
    param_labels: Any,
    loss_scale: LossScaleState | None = None,
    *,
    max_consecutive_nonfinite: int | None = None,
    axis_name: Any = None,
    spikes: _spikes.SpikeRule | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Several optimizers sharing one loss scale, each skipped on its own.

    PyTorch's "multiple optimizers, one scaler". Like ``optax.multi_transform``,
    each label's transformation sees only its own parameters' gradients, all
    unscaled with the one shared scale. A non-finite gradient in one partition
    skips that partition's update (its params and inner state unchanged bit for
    bit) while the others step; the shared scale updates once per step with
    "every partition finite" (PyTorch's combined ``found_inf``), so
    ``metrics(...)["skipped"]`` is True when any partition was skipped.

    Args:
      transforms: a mapping from label to optax transformation.
      param_labels: a tree of labels with the params' structure (or a prefix of
        it), or a function of the params returning one.
      loss_scale: the shared [`LossScaleState`][jaxamp.LossScaleState], as in
        [`skip_nonfinite`][jaxamp.skip_nonfinite]; ``None`` is ``jaxamp.check_only()``.
      axis_name: as in [`skip_nonfinite`][jaxamp.skip_nonfinite].
      spikes: as in [`skip_nonfinite`][jaxamp.skip_nonfinite]: a spike skips every partition.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      [`MultiTransformState`][jaxamp.types.MultiTransformState]; extra arguments are forwarded to
      every transformation.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.multi_transform(
      ...     {"body": optax.sgd(1.0), "head": optax.sgd(1.0)},
      ...     {"w": "body", "b": "head"}, jaxamp.static_scale(2.0))
      >>> params = {"w": jnp.ones(2), "b": jnp.ones(2)}
      >>> grads = {"w": jnp.array([2.0, 2.0]), "b": jnp.array([jnp.inf, 2.0])}
      >>> params, state = jaxamp.step(tx, grads, tx.init(params), params)
      >>> params["w"], params["b"]
      (Array([0., 0.], dtype=float32), Array([1., 1.], dtype=float32))
    """
    fn = "multi_transform"
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"{fn}: `transforms` must be a non-empty mapping from label to optax "
            f"transformation, got {transforms!r}."
        )
    checked = {k: check_inner(v, fn, f"transforms[{k!r}]") for k, v in transforms.items()}
    loss_scale = loss_scale_arg(loss_scale, max_consecutive_nonfinite, fn)
    axis_name = check_axis_name(axis_name, fn)
    spikes = _spikes.check_rule(spikes, fn)

    def init_fn(params: optax.Params) -> MultiTransformState:
        labels = _full_labels(param_labels, params, checked, fn)
        states = {k: tx.init(_mask(params, labels, k)) for k, tx in checked.items()}
        refuse_narrow(params, states, f"jaxamp.{fn}")
        refuse_nested(states, f"jaxamp.{fn}")
        ls = jax.tree.map(lambda x: jnp.array(x, copy=True), loss_scale)
        spike_state = None if spikes is None else _spikes.init(spikes)
        return MultiTransformState(states, ls, _record.init(params), spike_state)

    return optax.GradientTransformationExtraArgs(
        init_fn, _MultiTransformUpdate(checked, param_labels, axis_name, spikes)
    )
