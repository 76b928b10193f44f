"""``find_overflow`` inside a ``shard_map`` body: values as per-device blocks.

A ``shard_map`` body runs on each device's block of its inputs, with
collectives between devices, so it cannot be evaluated on the global arrays.
While ``_overflow_eval`` evaluates a body, each value is held as its
per-device blocks stacked along a new leading axis sharded over the mesh axes
the value varies over, and each equation runs in its own ``jax.shard_map``
over the same mesh and manual axes: the collectives see the same devices and
blocks as in the program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from jax.sharding import PartitionSpec

from jaxamp._utils import jax_compat

__all__ = ["Shard"]


class Shard:
    """A ``shard_map`` body's layout: each value as its per-device blocks stacked.

    A value that varies over mesh axes ``A`` (its type says so under
    ``check_vma``; without it, every value is taken to vary over every manual
    axis) is held as an array of shape ``(prod(A's sizes), *block)`` sharded
    over ``A`` along its first axis: device ``d`` holds its own block. An
    invariant value is held as the block itself (the same on every device).
    """

    def __init__(self, params: dict[str, Any], axes: tuple[str, ...], cache: dict) -> None:
        self.params = params
        self.axes = axes
        self.typed = bool(params.get("check_vma", False))
        self.cache = cache

    @classmethod
    def of(cls, params: dict[str, Any], cache: dict) -> Shard | None:
        """The layout for a ``shard_map`` equation's body, or None where JAX's
        ``shard_map`` cannot be called again with its params (JAX < 0.7)."""
        if not jax_compat.HAS_SHARD_MAP or "in_specs" not in params:
            return None
        mesh = params["mesh"]
        manual = params.get("newly_manual_axes") or frozenset(mesh.axis_names)
        return cls(params, tuple(a for a in mesh.axis_names if a in manual), cache)

    def axes_of(self, aval: Any) -> tuple[str, ...]:
        if not self.typed:
            return self.axes
        # The varying axes: ``aval.manual_axis_type.varying`` (JAX 0.10),
        # ``aval.vma`` (JAX 0.7 to 0.9).
        mat = getattr(aval, "manual_axis_type", None)
        varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", ())
        return tuple(a for a in self.axes if a in (varying or ()))

    def literal(self, v: Literal) -> Any:
        """A literal as held here: stacked where untyped values all vary."""
        if self.typed:
            return v.val
        n = int(np.prod([self.params["mesh"].shape[a] for a in self.axes]))
        return jnp.broadcast_to(jnp.asarray(v.val, v.aval.dtype), (n, *np.shape(v.val)))

    def _map(self, fn: Callable, vals: Sequence, in_specs: Sequence, out_specs: Sequence, key):
        """``fn`` under ``jax.shard_map`` with the body's mesh and manual axes.

        Compiled once per `key` (an equation is bound once per loop iteration
        and once per loss scale tried); `key` holds the objects it names, so
        their ids stay theirs while the cache lives.
        """
        in_specs, out_specs = tuple(in_specs), tuple(out_specs)
        full = (key, in_specs, out_specs) if key is not None else None
        mapped = self.cache.get(full) if full is not None else None
        if mapped is None:
            mapped = jax.jit(
                jax.shard_map(
                    lambda *xs: tuple(fn(*xs)),
                    mesh=self.params["mesh"],
                    in_specs=in_specs,
                    out_specs=out_specs,
                    axis_names=frozenset(self.axes),
                    check_vma=self.typed,
                )
            )
            if full is not None:
                self.cache[full] = mapped
        return list(mapped(*vals))

    def _spec(self, axes: tuple[str, ...]) -> PartitionSpec:
        return PartitionSpec(axes) if axes else PartitionSpec()

    def call(self, fn: Callable, vals: Sequence, in_avals: Sequence, out_avals: Sequence, key):
        """``fn`` on each device's blocks of `vals`, its outputs stacked back."""
        ins = [self.axes_of(a) for a in in_avals]
        outs = [self.axes_of(a) for a in out_avals]

        def per_device(*xs: Any) -> list[Any]:
            ys = fn(*(x[0] if a else x for x, a in zip(xs, ins, strict=True)))
            return [y[None] if a else y for y, a in zip(ys, outs, strict=True)]

        return self._map(per_device, vals, map(self._spec, ins), map(self._spec, outs), key)

    def enter(self, vals: Sequence[Any], in_specs: Sequence, avals: Sequence) -> list[Any]:
        """The body's inputs from the ``shard_map``'s global arguments."""
        outs = [self.axes_of(a) for a in avals]

        def stack(*xs: Any) -> list[Any]:
            return [x[None] if a else x for x, a in zip(xs, outs, strict=True)]

        return self._map(stack, vals, in_specs, map(self._spec, outs), None)

    def leave(self, vals: Sequence[Any], avals: Sequence, out_specs: Sequence) -> list[Any]:
        """The ``shard_map``'s global results from the body's outputs."""
        ins = [self.axes_of(a) for a in avals]

        def unstack(*xs: Any) -> list[Any]:
            return [x[0] if a else x for x, a in zip(xs, ins, strict=True)]

        return self._map(unstack, vals, map(self._spec, ins), out_specs, None)
