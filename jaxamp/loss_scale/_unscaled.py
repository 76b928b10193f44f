"""``Unscaled``: gradients already divided by the loss scale, told apart by their type.

PyTorch raises on a second ``unscale_()``, and its ``step`` knows not to unscale
again, because the scaler keeps a per-optimizer flag. A functional API has no such
flag, so the gradients carry it: [`unscale_and_check`][jaxamp.unscale_and_check]
returns them wrapped in this pytree node, which ``jax.tree.map`` (and so every optax
transformation, a clip included) keeps. Every guarded step reads it: the gradients
are checked but not unscaled again, and a second ``unscale_and_check`` raises.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["Unscaled"]


@jax.tree_util.register_pytree_with_keys_class
class Unscaled:
    """Gradients that [`unscale_and_check`][jaxamp.unscale_and_check] divided by the loss scale.

    A pytree node of one child, ``tree``: ``jax.tree.map``, ``optax.tree.norm`` and
    optax transformations (``optax.clip_by_global_norm(...).update``) see its leaves
    and keep the wrapper, so the gradients stay marked through any edit.
    [`jaxamp.step`][jaxamp.step], ``tx.update`` of a jaxamp transformation and
    [`jaxamp.TrainState`][jaxamp.TrainState] take it as it is (checked, never unscaled
    twice; with or without ``finite=``); ``unscale_and_check`` refuses it, as PyTorch's
    second ``unscale_()`` does. ``grads["w"]`` and ``grads.dtype`` read the tree;
    ``grads.tree`` is the plain tree, for code outside jaxamp (a plain optax optimizer).

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> ls = jaxamp.static_scale(4.0)
      >>> grads, finite = jaxamp.unscale_and_check(ls, {"w": jnp.array([4.0, 8.0])})
      >>> grads = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]
      >>> type(grads).__name__, grads["w"]
      ('Unscaled', Array([0.4472136, 0.8944272], dtype=float32))
    """

    __slots__ = ("tree",)

    def __init__(self, tree: Any) -> None:
        if isinstance(tree, Unscaled):
            tree = tree.tree
        self.tree = tree

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], None]:
        return ((jax.tree_util.GetAttrKey("tree"), self.tree),), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> Unscaled:
        del aux
        return cls(children[0])

    def __getitem__(self, key: Any) -> Any:
        return self.tree[key]

    # What a mapping of gradients answers (``"w" in grads``, Flax's apply_gradients
    # asks), without Python's fallback of probing __getitem__ with 0, 1, ...
    def __contains__(self, key: Any) -> bool:
        return key in self.tree

    def __iter__(self) -> Any:
        return iter(self.tree)

    def __len__(self) -> int:
        return len(self.tree)

    def __getattr__(self, name: str) -> Any:
        # What the tree has (a dict's keys(), an array's dtype): read through the mark.
        if name == "tree":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tree, name)

    def __repr__(self) -> str:
        return f"Unscaled({self.tree!r})"


def unwrap(grads: Any) -> tuple[Any, bool]:
    """``(tree, whether grads were Unscaled)``."""
    if isinstance(grads, Unscaled):
        return grads.tree, True
    return grads, False
