"""Flax NNX: an ``nnx.Optimizer`` that skips a non-finite step as a whole.

``jaxamp.nnx.Optimizer`` is ``flax.nnx.Optimizer`` with [`jaxamp.step`][jaxamp.step] inside
``update``: one ``lax.cond`` around the inner update and the parameter write, so
a skipped step leaves the ``wrt`` Variables and the optimizer state as they were,
and ``optimizer.step`` counts only the steps taken. The model state the forward
pass wrote (``BatchStat`` and every other Variable outside ``wrt``) is put back
on a skipped step too: [`value_and_grad`][jaxamp.nnx.value_and_grad] records it before the forward,
and ``update`` restores it where the step was skipped. The loss scale is
``jaxamp.get_loss_scale(optimizer).scale``.

Requires the Flax NNX optimizer interface of flax >= 0.11
(``Optimizer(model, tx, wrt=...)``, ``update(model, grads)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxamp._utils.deprecation import renamed_parameter
from jaxamp._utils.errors import named
from jaxamp._utils.tree import render_path
from jaxamp.loss_scale import (
    LossScaleNotFound,
    LossScaleState,
    Unscaled,
    get_loss_scale,
    select_tree,
    unwrap,
)
from jaxamp.skip._nnx_state import FORWARD_WRITTEN
from jaxamp.skip._nnx_state import pure as _pure
from jaxamp.skip._stepped import applied_calls, stepped
from jaxamp.skip._transformation import GuardedUpdate, step
from jaxamp.skip._value_and_grad import scaled_loss

__all__ = ["Optimizer", "value_and_grad"]


def _flax_version() -> tuple[int, ...]:
    import flax

    return tuple(int(p) for p in flax.__version__.split(".")[:2] if p.isdigit())


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose ``update`` skips a non-finite step as a whole.

    Build it as Flax's, with a [`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite] (or
    [`jaxamp.multi_transform`][jaxamp.multi_transform]) transformation; take the gradients of the
    scaled loss with [`jaxamp.nnx.value_and_grad`][jaxamp.nnx.value_and_grad] (or Flax's own
    ``nnx.value_and_grad`` of ``loss * jaxamp.get_loss_scale(optimizer).scale``); then
    ``optimizer.update(model, grads)``.

    On a skipped step the ``wrt`` Variables, the optimizer state (but for its
    loss-scale counters), ``optimizer.step`` and the model state the forwards of
    this step wrote keep their values. That model state is every Variable outside
    ``wrt`` that is neither an ``nnx.Param`` nor an ``nnx.Intermediate``
    (``BatchStat``, RNG counters and keys, caches). The optimizer keeps a copy of
    it as it was before the step's first forward: [`value_and_grad`][jaxamp.nnx.value_and_grad]
    records it there (once per step, from the module it differentiates, so neither a second forward
    nor a teacher passed first changes what is recorded). Without that record (gradients from Flax's
    own ``nnx.grad``) the copy is the model state as the last update left it; if something else
    writes that state between updates (a load, an EMA written after the update, another optimizer's
    step on the same model), call [`keep`][jaxamp.nnx.Optimizer.keep] after it. Params outside
    ``wrt`` (a frozen base under LoRA) are not copied: a forward does not write them.
    Only this model's state is put back: another module the loss runs in train mode (a
    teacher, a GAN's generator) keeps what its forward wrote: run it in eval mode, or put
    its state back with [`jaxamp.where_stepped`][jaxamp.where_stepped]; and a forward of
    this model before [`value_and_grad`][jaxamp.nnx.value_and_grad] (metrics in train
    mode) is not undone, so run those after the update or in eval mode.
    ``optimizer.step`` counts the calls applied: with ``every_k=k`` it moves by k when a window is
    applied, not at all for a skipped window.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
      >>> optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
      >>> loss, grads = jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, jnp.ones((4, 2)))
      >>> _ = optimizer.update(model, grads)
      >>> int(optimizer.step), float(jaxamp.get_loss_scale(optimizer).scale)
      (1, 32768.0)
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        graph: bool | None = None,
    ) -> None:
        if _flax_version() < (0, 11):
            import flax

            raise RuntimeError(
                "jaxamp.nnx.Optimizer needs flax >= 0.11 (nnx.Optimizer(model, tx, wrt=...) "
                f"and update(model, grads)); this is flax {flax.__version__}. The rest of "
                "jaxamp works with it: use jaxamp.step on nnx.split states."
            )
        if not nnx.graph.is_graph_node(model):
            behind = getattr(model, "__self__", None)
            if behind is not None and nnx.graph.is_graph_node(behind):
                raise TypeError(
                    "jaxamp.nnx.Optimizer: `model` must be the nnx module, got a function "
                    "bound to it (jaxamp.autocast(model) or model.method): autocast wraps "
                    "the forward, the optimizer holds the module's parameters. Write "
                    "jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param) and "
                    "optimizer.update(model, grads), and call jaxamp.autocast(model)(x) "
                    "inside the loss."
                )
            raise TypeError(
                f"jaxamp.nnx.Optimizer: `model` must be an nnx module, got {type(model).__name__}"
            )
        if not isinstance(getattr(tx, "update", None), GuardedUpdate):
            raise TypeError(
                "jaxamp.nnx.Optimizer: `tx` must come from jaxamp.skip_nonfinite(...) or "
                f"jaxamp.multi_transform(...), got {type(tx).__name__}. For a plain optax "
                "optimizer wrap it: jaxamp.skip_nonfinite(optax.adamw(1e-3), "
                "jaxamp.dynamic_scale())."
            )
        kwargs = {} if graph is None else {"graph": graph}
        super().__init__(model, tx, wrt=wrt, **kwargs)
        # The model state a skipped update puts back, and whether it was recorded
        # since the last update (then a later forward's state does not replace it).
        self.kept = nnx.data(_as_kept(self._written(model)))
        self.armed = nnx.OptState(jnp.array(False))

    def _written(self, model: nnx.Module) -> Any:
        """The model state a forward can write, as plain arrays."""
        graph = getattr(self, "graph", None)
        kw = {} if graph is None else {"graph": graph}
        return _pure(nnx.state(model, FORWARD_WRITTEN, **kw))

    @property
    def loss_scale(self) -> LossScaleState:
        """The loss-scale state inside the optimizer state (plain arrays):
        ``jaxamp.get_loss_scale(optimizer)``."""
        return get_loss_scale(_pure(self.opt_state))

    def keep(self, model: nnx.Module) -> None:
        """Records ``model``'s state now as what a skipped step puts back.

        Only the first record since the last update counts: it is the state before
        the step's first forward. [`value_and_grad`][jaxamp.nnx.value_and_grad] calls it; call it
        yourself when the gradients come from Flax's own ``nnx.grad`` and something besides the
        forward wrote the model state since the last update (loaded statistics, an EMA, another
        optimizer's step), before the forward.
        """
        now = self._checked(model, "keep")
        armed = self.armed[...]
        nnx.update(self.kept, nnx.state(_as_kept(select_tree(armed, _pure(self.kept), now))))
        self.armed[...] = jnp.array(True)

    def _checked(self, model: nnx.Module, fn: str) -> Any:
        """``model``'s forward-written state, checked against the optimizer's record."""
        written, kept = self._written(model), _pure(self.kept)
        if jax.tree.structure(written) != jax.tree.structure(kept):
            have = {render_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(written)}
            had = {render_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(kept)}
            new, gone = sorted(have - had), sorted(had - have)
            raise ValueError(
                f"jaxamp.nnx.Optimizer.{fn}: the model's forward-written state (every Variable "
                "but Params) is not the one "
                "the optimizer was built with"
                + (f"; new: {', '.join(new[:4])}" if new else "")
                + (f"; missing: {', '.join(gone[:4])}" if gone else "")
                + ". Pass the trained model, and create state such as caches before "
                "building the optimizer (or build a new optimizer after creating it)."
            )
        return written

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
        """One fused, guarded step ([`jaxamp.step`][jaxamp.step]); a skip changes nothing but
        counters.

        Args:
          model: the model; its ``wrt`` Variables are updated in place.
          grads: gradients of the *scaled* loss, e.g. from
            [`value_and_grad`][jaxamp.nnx.value_and_grad].
          **kwargs: extra arguments for the inner optimizer (``value=``, ...).

        Returns:
          The change applied to the ``wrt`` Variables (new minus old; zeros on a
          skipped step). Unused under ``jit``, it costs nothing.
        """
        graph = getattr(self, "graph", None)
        kw = {} if graph is None else {"graph": graph}
        self._checked(model, "update")
        kept = _pure(self.kept)
        params = _pure(nnx.state(model, self.wrt, **kw))
        grads, marked = unwrap(grads)  # unscale_and_check's: keep the mark past nnx.state
        grads = _pure(nnx.state(grads, self.wrt, **kw))
        grads = Unscaled(grads) if marked else grads
        opt_state = _pure(self.opt_state)
        new_params, new_opt_state = step(self.tx, grads, opt_state, params, **_pure(kwargs))
        nnx.update(model, new_params)
        _write(self.opt_state, new_opt_state)
        self.step[...] += applied_calls(opt_state, new_opt_state).astype(self.step.dtype)
        # What the forwards of this step wrote (and, for a non-Param Variable in
        # `wrt`, the update then made of it) stays only if the step was taken.
        state = select_tree(stepped(new_opt_state), self._written(model), kept)
        nnx.update(model, state)
        nnx.update(self.kept, nnx.state(_as_kept(state)))
        self.armed[...] = jnp.array(False)
        return jax.tree.map(lambda n, o: n - o, new_params, params)


def _write(variables: Any, new: Any) -> None:
    """``new`` into the optimizer state's Variables, each its whole value, so that the
    state keeps the structure ``tx.init`` gave it. A Variable's value can be a pytree
    node (``jaxamp.low_precision_state`` stores a moment where optax put an array, in
    the params' Variables ``tx.init`` was given), which ``nnx.update`` would replace
    with a State of its fields that the next ``tx.update`` does not recognise."""
    cells, treedef = jax.tree.flatten(variables, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for cell, value in zip(cells, treedef.flatten_up_to(new), strict=True):
        if hasattr(cell, "set_value"):
            cell.set_value(value)
        else:  # Flax before 0.12
            cell.value = value


def _trained_module(optimizer: Optimizer, argnums: Any, args: tuple[Any, ...]) -> Any:
    """The differentiated argument that is the optimizer's model, or None.

    A loss may take other modules first (a distillation teacher): only a module in
    ``argnums`` whose state outside ``wrt`` has the optimizer's layout is recorded. When
    several have it (two peers of one architecture, each with its own optimizer), which
    one is this optimizer's cannot be told from the arguments: nothing is recorded, and
    a skip puts back the state as the last update left it.
    """
    nums = argnums if isinstance(argnums, tuple | list) else (argnums,)
    kept = jax.tree.structure(_pure(optimizer.kept))
    found: list[Any] = []
    for n in nums:
        n = getattr(n, "argnum", n)  # nnx.DiffState(argnum, filter)
        module = args[n] if isinstance(n, int) and -len(args) <= n < len(args) else None
        if isinstance(module, nnx.Module) and all(module is not m for m in found):
            if jax.tree.structure(optimizer._written(module)) == kept:
                found.append(module)
    return found[0] if len(found) == 1 else None


def _as_kept(tree: Any) -> Any:
    """A copy of plain arrays as optimizer-state Variables (not the model's own arrays)."""
    return jax.tree.map(lambda x: nnx.OptArray(jnp.array(x, copy=True)), tree)


def _loss_scale_of(state: Any, args: tuple[Any, ...]) -> LossScaleState:
    """The loss scale in an optimizer state or ``LossScaleState`` given in place of the
    optimizer; the usual slips (the optimizer forgotten, or after the model) named."""
    try:
        with named("nnx.value_and_grad"):
            return get_loss_scale(_pure(state))
    except LossScaleNotFound as e:
        got = type(state).__name__
        got = f"the nnx.Module {got}" if isinstance(state, nnx.Module) else f"a {got}"
        later = [i + 2 for i, a in enumerate(args) if isinstance(a, Optimizer)]
        raise LossScaleNotFound(
            "the first argument must be the optimizer "
            "(a jaxamp.nnx.Optimizer built with jaxamp.skip_nonfinite), then the loss's "
            "own arguments: jaxamp.nnx.value_and_grad(loss_fn)(optimizer, model, x, y). "
            f"Got {got} first, with no LossScaleState in it"
            + (f"; the optimizer is argument {later[0]}: put it first." if later else "."),
            e.fn,
            got=state,
        ) from None


@renamed_parameter("f", "fun", removed_in="0.5", module="jaxamp.nnx")
def value_and_grad(
    fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of the *scaled* loss, returning the loss as ``fun`` computed it.

    The returned function takes the [`Optimizer`][jaxamp.nnx.Optimizer] (or an optimizer state /
    ``LossScaleState``) first, then ``fun``'s arguments; ``argnums`` (ints or
    ``nnx.DiffState``) and ``has_aux`` mean what they mean to ``nnx.value_and_grad``.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      argnums: which of ``fun``'s arguments to differentiate: an int, a sequence of
        ints or an ``nnx.DiffState`` (as in ``nnx.value_and_grad``).
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      ``(optimizer, *args, **kwargs) -> (loss, grads)`` (``((loss, aux), grads)``
      with ``has_aux``), the gradients of the scaled loss, for ``optimizer.update``.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.static_scale(4.0))
      >>> optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> loss, grads = jaxamp.nnx.value_and_grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(
      ...     optimizer, model)
      >>> float(grads["bias"][...][0])  # the gradient of 4 * loss
      4.0
    """
    if not callable(fun):
        raise TypeError(f"jaxamp.nnx.value_and_grad: `fun` must be callable, got {type(fun)}.")

    def wrapped(optimizer: Any, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, Optimizer):
            ls = optimizer.loss_scale
            trained = _trained_module(optimizer, argnums, args)
            if trained is not None:
                optimizer.keep(trained)
        else:
            ls = _loss_scale_of(optimizer, args)
        scaled = functools.wraps(fun)(scaled_loss(fun, has_aux, ls, "jaxamp.nnx.value_and_grad"))
        grad_fn = nnx.value_and_grad(scaled, argnums=argnums, has_aux=True)
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped
