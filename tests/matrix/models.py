"""The matrix's model states: one tiny nnx network, built six ways, and its loss.

Every cell trains the same small MLP (``IN -> H -> OUT``); the model-state axis
says what else the forward reads or writes:

- ``none``: nothing but params;
- ``bn``: a BatchNorm (``BatchStat`` written by every training forward);
- ``dropout``: a Dropout whose RNG stream counter moves on every forward;
- ``lora``: a frozen base (``nnx.Param``) with ``nnx.LoRAParam`` adapters, ``wrt=nnx.LoRAParam``;
- ``teacher``: the ``bn`` student, with a teacher of the same class (eval mode)
  passed to the loss first (``loss(teacher, student, x)``, ``argnums=1``);
- ``bn2``: the ``bn`` model with two forwards (two gradient calls, summed) before
  one update.

Non-finite steps are planted two ways (``Step`` in ``harness.py``): in the data
(``x``: the forward's BatchStat is poisoned too) or in the loss, through
``gp * w[0, 0]`` of the first trainable kernel (its gradient alone is +inf, -inf or
NaN; under FSDP that element lives on one device). ``amp`` multiplies the loss
(a spike).

The same module is trained through nnx (``jaxamp.nnx.Optimizer``, Flax's
``nnx.Optimizer``) and functionally (``nnx.split`` into plain dicts: params and
the rest, merged back inside the step) by the optax and ``TrainState`` paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

IN, H, OUT = 8, 16, 4  # kernels' first dimensions divide over 8 devices (FSDP)
# 8 rows per device under pmap / shard_map: a BatchNorm over 2 rows passes almost no
# gradient to the layer before it, and Adam turns that rounding noise into full steps.
BATCH = 64
RANK = 2
KINDS = ("none", "bn", "dropout", "lora", "teacher", "bn2")


def _full(w: jax.Array) -> jax.Array:
    """Under an Explicit mesh a sharded kernel is all-gathered by hand before its matmul."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return w
    return jax.sharding.reshard(w, P())


class Dense(nnx.Module):
    def __init__(
        self, din: int, dout: int, *, rngs: nnx.Rngs, dtype: Any, lora: bool, bias: bool = True
    ) -> None:
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (din, dout), dtype))
        self.bias = nnx.Param(jnp.full((dout,), 0.1, dtype)) if bias else None
        self.lora = lora
        if lora:
            self.lora_a = nnx.LoRAParam(0.3 * jax.random.normal(rngs.params(), (din, RANK), dtype))
            self.lora_b = nnx.LoRAParam(0.3 * jax.random.normal(rngs.params(), (RANK, dout), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ _full(self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora:
            y = y + (x @ _full(self.lora_a[...])) @ _full(self.lora_b[...])
        return y

    def first(self) -> jax.Array:
        """The first trainable kernel, where a gradient is poisoned."""
        return self.lora_a[...] if self.lora else self.kernel[...]


class Net(nnx.Module):
    def __init__(
        self, kind: str, rngs: nnx.Rngs, dtype: Any = jnp.float32, bn_axis: str | None = None
    ) -> None:
        lora = kind == "lora"
        # No bias before a BatchNorm: its gradient is rounding noise, which Adam
        # would blow up to full steps of either sign.
        self.l1 = Dense(IN, H, rngs=rngs, dtype=dtype, lora=lora, bias=not has_bn(kind))
        bn = has_bn(kind)
        self.bn = nnx.BatchNorm(H, rngs=rngs, param_dtype=dtype, axis_name=bn_axis) if bn else None
        self.drop = nnx.Dropout(0.25, rngs=rngs) if kind == "dropout" else None
        self.l2 = Dense(H, OUT, rngs=rngs, dtype=dtype, lora=lora)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = nnx.relu(h)
        if self.drop is not None:
            h = self.drop(h)
        return self.l2(h).astype(jnp.float32)


def has_bn(kind: str) -> bool:
    return kind in ("bn", "teacher", "bn2")


@dataclasses.dataclass(frozen=True)
class Kind:
    """A model-state kind: how to build it, what is trained, how many forwards a step takes."""

    name: str
    dtype: Any = jnp.float32

    @property
    def wrt(self) -> Any:
        return nnx.LoRAParam if self.name == "lora" else nnx.Param

    @property
    def forwards(self) -> int:
        return 2 if self.name == "bn2" else 1

    @property
    def argnums(self) -> int:
        return 1 if self.name == "teacher" else 0

    def build(self, bn_axis: str | None = None) -> Net:
        return Net(self.name, nnx.Rngs(0), self.dtype, bn_axis)

    def teacher(self) -> Net | None:
        if self.name != "teacher":
            return None
        t = Net("bn", nnx.Rngs(7), self.dtype)
        t.eval()  # a teacher's forward writes nothing
        return t


def label_of(path: str) -> str:
    """multi_transform's two labels: the first layer ("a", where gradients are
    poisoned) and everything else ("b")."""
    return "a" if path.startswith("l1") else "b"


def loss_of(model: Net, teacher: Net | None, x: jax.Array, gp: jax.Array, amp: jax.Array):
    """The loss of one forward: a regression (on the teacher's output, if any), times
    ``amp``, plus ``gp * w[0, 0]`` of the first trainable kernel."""
    target = jnp.sin(x[:, :OUT]) if teacher is None else teacher(x)
    loss = amp * jnp.mean((model(x) - target) ** 2)
    w = model.l1.first()
    plant = jnp.zeros(w.shape, jnp.float32).at[0, 0].set(gp)  # gp where w[0, 0] is, 0 elsewhere
    return loss + jnp.sum(w.astype(jnp.float32) * plant)


# ---------------------------------------------------------------------------
# The functional form: plain dicts of arrays, merged into the module inside a step.


@dataclasses.dataclass
class Functional:
    """``model`` split into ``params`` (``wrt``) and ``rest`` (frozen params, BatchStat,
    RNG state), as plain nested dicts; ``apply`` merges them and runs the forward."""

    wrt: Any
    graphdef: Any
    params_state: Any
    rest_state: Any
    params: dict
    rest: dict
    teacher_graphdef: Any = None
    teacher_state: Any = None
    teacher: dict | None = None

    @classmethod
    def of(cls, kind: Kind, model: Net, teacher: Net | None) -> Functional:
        graphdef, p, rest = nnx.split(model, kind.wrt, ...)
        out = cls(kind.wrt, graphdef, p, rest, nnx.to_pure_dict(p), nnx.to_pure_dict(rest))
        if teacher is not None:
            tg, ts = nnx.split(teacher)
            out.teacher_graphdef, out.teacher_state, out.teacher = tg, ts, nnx.to_pure_dict(ts)
        return out

    def merge(self, params: dict, rest: dict) -> Net:
        p = jax.tree.map(lambda v: v, self.params_state)
        r = jax.tree.map(lambda v: v, self.rest_state)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(r, rest)
        return nnx.merge(self.graphdef, p, r)

    def teacher_module(self, teacher: dict | None) -> Net | None:
        if teacher is None:
            return None
        t = jax.tree.map(lambda v: v, self.teacher_state)
        nnx.replace_by_pure_dict(t, teacher)
        return nnx.merge(self.teacher_graphdef, t)

    def loss(self, teacher, params, rest, x, gp, amp):
        """``(loss, new_rest)``: one forward of the merged module."""
        m = self.merge(params, rest)
        loss = loss_of(m, self.teacher_module(teacher), x, gp, amp)
        _, _, new_rest = nnx.split(m, self.wrt, ...)
        return loss, nnx.to_pure_dict(new_rest)
