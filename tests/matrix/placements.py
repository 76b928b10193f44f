"""The matrix's placements: where the state lives and how a step is compiled.

- ``one``: one device, ``jax.jit``.
- ``pmap`` / ``shard_map_stacked``: 8 replicas, data parallel, the state stacked
  (a leading axis of 8, one slice per device, ``in_specs=P("data")``: how pmap code
  moves to shard_map); the step runs per replica, averages the gradients (and the
  loss) over ``"data"`` and gives the jaxamp transformation ``axis_name="data"``.
  Each replica's BatchNorm keeps its own statistics (no ``axis_name`` on it), as
  in Flax's pmap examples.
- ``shard_map``: the state replicated (``in_specs=P()``, invariant across the
  mesh), the batch split; the loss is averaged over ``"data"`` inside the
  differentiated function (so the gradients are the global batch's, invariant),
  the BatchNorm averages its statistics over ``"data"``, and the jaxamp
  transformation gets ``axis_name="data"``.
- ``auto_rep`` / ``auto_shard``: ``jax.jit`` over global arrays on an 8-device
  mesh with Auto axes, params replicated or FSDP-sharded (a kernel's first
  dimension over ``"data"``), the batch split over ``"data"``.
- ``explicit_rep`` / ``explicit_shard``: the same on ``jax.make_mesh``'s default
  (Explicit) axes, under ``jax.set_mesh``.

Sharding rule for ``*_shard``: every array of two or more dimensions whose first
dimension divides over the mesh is split on it (kernels, their Adam moments,
LoRA's ``a``); everything else (biases, BatchNorm, scalars, jaxamp's counters) is
replicated: "shard what divides, replicate the rest".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.helpers import N_DEV

AXIS = "data"
NAMES = (
    "one",
    "pmap",
    "shard_map",
    "shard_map_stacked",
    "auto_rep",
    "auto_shard",
    "explicit_rep",
    "explicit_shard",
)


@functools.cache
def _mesh(explicit: bool) -> jax.sharding.Mesh:
    if explicit:
        return jax.make_mesh((N_DEV,), (AXIS,))  # the defaults: Explicit axes
    return jax.make_mesh((N_DEV,), (AXIS,), axis_types=(AxisType.Auto,))


@functools.cache
def _pmap_sharding() -> jax.sharding.Sharding:
    """Where pmap puts (and wants) a stacked array: placed there, an input is not moved."""
    return jax.pmap(lambda t: t)(np.zeros(N_DEV)).sharding


def _pmap_put(tree: Any) -> Any:
    return jax.device_put(tree, _pmap_sharding())


def _stack(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.stack([a] * N_DEV), tree)


@dataclasses.dataclass(frozen=True)
class Placement:
    name: str

    @property
    def replicated(self) -> bool:
        """Per-replica programs over a stacked state (pmap, shard_map_stacked)."""
        return self.name in ("pmap", "shard_map_stacked")

    @property
    def per_device(self) -> bool:
        """Per-device programs (pmap, either shard_map): the gradients are averaged by hand."""
        return self.replicated or self.name == "shard_map"

    @property
    def devices(self) -> int:
        return 1 if self.name == "one" else N_DEV

    @property
    def axis_name(self) -> str | None:
        return AXIS if self.per_device else None

    @property
    def bn_axis_name(self) -> str | None:
        """The BatchNorm's: statistics over the global batch under ``shard_map`` (they
        must be invariant to leave it replicated), per replica otherwise."""
        return AXIS if self.name == "shard_map" else None

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        if self.name.startswith(("auto", "explicit", "shard_map")):
            return _mesh(self.name.startswith("explicit"))
        return None

    def context(self) -> Any:
        """Where the cell's state is built and its steps run: ``jax.set_mesh`` for
        an Explicit mesh (sharding in types), nothing otherwise."""
        if self.name.startswith("explicit"):
            return jax.set_mesh(self.mesh)
        return contextlib.nullcontext()

    # -- placing state and inputs ---------------------------------------------

    def _spec(self, a: Any) -> P:
        if self.name == "shard_map":
            return P()
        shape = np.shape(a)
        shard = self.name.endswith("_shard") and len(shape) >= 2 and shape[0] % N_DEV == 0
        return P(AXIS) if shard else P()

    def put_state(self, tree: Any) -> Any:
        """The state on this placement (stacked per replica for pmap / shard_map)."""
        if self.name == "one":
            return jax.device_put(tree, jax.devices()[0])
        if self.name == "pmap":
            return _pmap_put(_stack(tree))
        if self.name == "shard_map_stacked":
            return jax.device_put(_stack(tree), NamedSharding(self.mesh, P(AXIS)))
        return jax.tree.map(
            lambda a: jax.device_put(a, NamedSharding(self.mesh, self._spec(a))), tree
        )

    def put_input(self, x: np.ndarray, gp: np.ndarray, amp: float) -> tuple[Any, ...]:
        """One call's inputs: ``x`` (forwards, batch, IN); ``gp`` (replicas, forwards),
        the planted gradient poison of each replica (one row when not replicated);
        ``amp``, the loss factor."""
        amp = np.float32(amp)
        if self.replicated:
            f, b, n = x.shape
            x = np.ascontiguousarray(x.reshape(f, N_DEV, b // N_DEV, n).transpose(1, 0, 2, 3))
            tree = (x, gp, np.full((N_DEV,), amp))
            if self.name == "pmap":
                return _pmap_put(tree)
            return jax.device_put(tree, NamedSharding(self.mesh, P(AXIS)))
        if self.name == "one":
            return jax.device_put((x, gp[0], amp), jax.devices()[0])
        batch = NamedSharding(self.mesh, P(None, AXIS))
        rep = NamedSharding(self.mesh, P())
        if self.name == "shard_map":  # each device's poison, on that device
            return (
                jax.device_put(x, batch),
                jax.device_put(gp, NamedSharding(self.mesh, P(AXIS))),
                jax.device_put(amp, rep),
            )
        return jax.device_put(x, batch), jax.device_put(gp[0], rep), jax.device_put(amp, rep)

    # -- compiling a step -------------------------------------------------------

    def compile(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body(*args)`` on global arrays (``axis`` None) or per replica (``axis="data"``),
        compiled for this placement. ``body`` takes ``axis`` as a keyword."""
        if self.name == "pmap":
            return jax.pmap(functools.partial(body, axis=AXIS), axis_name=AXIS)
        if self.name == "shard_map_stacked":

            def per_device(*args: Any) -> Any:
                one = jax.tree.map(lambda a: a[0], args)  # this device's replica
                return jax.tree.map(lambda a: a[None], body(*one, axis=AXIS))

            spec = P(AXIS)
            return jax.jit(jax.shard_map(per_device, mesh=self.mesh, in_specs=spec, out_specs=spec))
        if self.name == "shard_map":
            # (state, [take,] x, gp, amp): state and flags replicated, the batch split,
            # gp one row per device; outputs replicated.

            def per_device(*args: Any) -> Any:
                *head, x, gp, amp = args
                return body(*head, x, gp[0], amp, axis=AXIS)

            def compiled(*args: Any) -> Any:
                specs = (*[P()] * (len(args) - 3), P(None, AXIS), P(AXIS), P())
                f = jax.shard_map(per_device, mesh=self.mesh, in_specs=specs, out_specs=P())
                return f(*args)

            return jax.jit(compiled)
        return jax.jit(functools.partial(body, axis=None))
