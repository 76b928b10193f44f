"""The nnx paths: ``jaxamp.nnx.Optimizer`` and Flax's own ``nnx.Optimizer`` with a jaxamp ``tx``.

- ``nnx``: ``jaxamp.nnx.Optimizer``, gradients by ``jaxamp.nnx.value_and_grad``;
- ``nnx_flaxgrad``: ``jaxamp.nnx.Optimizer``, gradients by Flax's own
  ``nnx.value_and_grad`` of the loss scaled by hand by ``optimizer.loss_scale.scale``;
- ``flax_opt``: Flax's ``nnx.Optimizer(model, jaxamp tx)``, gradients by
  ``jaxamp.nnx.value_and_grad(loss)(optimizer.opt_state, ...)``. A model whose
  forward writes state (BatchStat, RNG counters) must be refused with an error
  naming ``jaxamp.nnx.Optimizer`` (its cells expect that error, see ``test_matrix``).

Each is the code a user writes under ``nnx.jit``, with the model and optimizer
objects mutated in place. Gradients are taken with respect to ``nnx.DiffState(argnum,
wrt)``. With a teacher (``kind.argnums == 1``) the loss is ``loss(teacher, student, ...)``.

The reference is Flax's ``nnx.Optimizer`` with the plain inner optimizer and
Flax's ``nnx.value_and_grad``, on a model built alike, run functionally
(``nnx.split`` / ``nnx.merge`` inside ``jax.jit``) so that the harness can keep
or drop its update per label.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxamp
from tests.matrix import harness as h
from tests.matrix.models import Kind, loss_of
from tests.matrix.modes import OTHER, LossScaleConfig, Mode
from tests.matrix.placements import Placement


def _loss_fn(kind: Kind, pl: Placement):
    """The loss in the kind's argument order; under ``shard_map`` averaged over the mesh
    inside, so that the gradients of the replicated state are the global batch's."""
    mean = (lambda v: jax.lax.pmean(v, pl.axis_name)) if pl.name == "shard_map" else (lambda v: v)
    if kind.argnums == 1:
        return lambda t, m, x, gp, amp: mean(loss_of(m, t, x, gp, amp))
    return lambda m, x, gp, amp: mean(loss_of(m, None, x, gp, amp))


def _scaled(loss_fn, scale: jax.Array):
    """The loss scaled by hand, and the loss as computed (aux)."""

    def scaled(*args):
        value = loss_fn(*args)
        return value * scale, value

    return scaled


def _pure(state: Any) -> Any:
    return nnx.to_pure_dict(state)


class Runner:
    """An nnx path of one cell, compiled once: ``nnx.jit`` on a global placement; under
    ``shard_map``, ``nnx.merge`` of the replicated state inside the per-device program
    (once per graph: an optimizer restored into another configuration is another)."""

    twin = None

    def __init__(self, path: str, kind: Kind, mode: Mode, pl: Placement):
        assert not pl.replicated
        self.path, self.kind, self.mode, self.pl = path, kind, mode, pl
        self._jit = nnx.jit(self._body)
        self._per_graph: dict[Any, Any] = {}

    def new(self, ls: LossScaleConfig) -> Any:
        kind, pl = self.kind, self.pl
        with pl.context():
            model, teacher = kind.build(self.pl.bn_axis_name), kind.teacher()
            nnx.update(model, pl.put_state(nnx.state(model)))
            if teacher is not None:
                nnx.update(teacher, pl.put_state(nnx.state(teacher)))
            tx = self.mode.tx(ls, pl.axis_name, pl.name)
            cls = nnx.Optimizer if self.path == "flax_opt" else jaxamp.nnx.Optimizer
            opt = cls(model, tx, wrt=kind.wrt)
            nnx.update(opt, pl.put_state(nnx.state(opt)))
            return model, opt, teacher

    def call(self, carry: Any, x: Any, gp: Any, amp: Any) -> Any:
        if self.pl.name != "shard_map":
            self._jit(*carry, x, gp, amp)
            return carry
        graphdef, state = nnx.split(carry)
        if graphdef not in self._per_graph:

            def per_device(state, x, gp, amp, *, axis, graphdef=graphdef):
                objects = nnx.merge(graphdef, state)
                self._body(*objects, x, gp, amp)
                return nnx.state(objects)

            self._per_graph[graphdef] = self.pl.compile(per_device)
        nnx.update(carry, self._per_graph[graphdef](state, x, gp, amp))
        return carry

    def _body(self, model, opt, teacher, x, gp, amp) -> None:
        kind, path = self.kind, self.path
        loss_fn = _loss_fn(kind, self.pl)
        diff = nnx.DiffState(kind.argnums, kind.wrt)
        grads, loss = None, jnp.float32(0.0)
        for f in range(kind.forwards):
            args = (model, x[f], gp[f], amp)
            if teacher is not None:
                args = (teacher, *args)
            if path == "nnx_flaxgrad":  # Flax's own grad of the loss scaled by hand
                scaled = _scaled(loss_fn, opt.loss_scale.scale)

                (_, value), g = nnx.value_and_grad(scaled, argnums=diff, has_aux=True)(*args)
            else:
                first = opt if path == "nnx" else opt.opt_state
                value, g = jaxamp.nnx.value_and_grad(loss_fn, argnums=diff)(first, *args)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            loss = loss + value
        extra = {"value": loss} if self.mode.name == "spikes" else {}
        opt.update(model, grads, **extra)

    def snap(self, carry: Any) -> h.Snap:
        model, opt, teacher = carry
        wrt = self.kind.wrt
        everything = nnx.state((model, opt, teacher))
        on_host = h.to_host(everything)
        m, o = on_host[0], on_host[1]
        return h.Snap(
            params=h.flat(_pure(nnx.filter_state(m, wrt))),
            inner=h.inner_of(_pure(o)["opt_state"], self.mode, reference=False),
            mstate=h.flat(_pure(nnx.filter_state(m, nnx.Not(wrt)))),
            metrics=h.metrics_of(opt.opt_state),
            teacher=None if teacher is None else h.flat(_pure(on_host[2])),
            step=int(o["step"].get_value()),
            everything=jax.tree.leaves(on_host),
            shardings=h.shardings(everything),
            opt_shapes=[x.shape for x in jax.tree.leaves(o)],
        )

    def restore(self, carry: Any) -> Any:
        """The model and optimizer through an orbax checkpoint into ones built with
        another loss-scale configuration."""
        model, opt, teacher = carry
        fresh_model, fresh_opt, _ = self.new(OTHER)
        with self.pl.context():
            restored = h.save_and_restore(
                nnx.state((model, opt)), nnx.state((fresh_model, fresh_opt))
            )
            nnx.update((fresh_model, fresh_opt), restored)
        return fresh_model, fresh_opt, teacher


class Reference:
    """Flax's ``nnx.Optimizer`` with the plain inner optimizer, split into plain state."""

    def __init__(self, path: str, kind: Kind, mode: Mode, pl: Placement):
        self.kind, self.mode, self.pl = kind, mode, pl
        self.graphdefs = None
        self.new()
        self.call = pl.compile(self._body)

    def new(self) -> Any:
        kind = self.kind
        with self.pl.context():
            model, teacher = kind.build(self.pl.bn_axis_name), kind.teacher()
            opt = nnx.Optimizer(model, self.mode.reference(self.pl.name), wrt=kind.wrt)
            (gm, ms), (go, os_) = nnx.split(model), nnx.split(opt)
            gt, ts = nnx.split(teacher) if teacher is not None else (None, None)
            if self.graphdefs is None:
                self.graphdefs = (gm, go, gt)
            return self.pl.put_state({"model": ms, "opt": os_, "teacher": ts})

    def _body(self, carry, take, x, gp, amp, *, axis):
        kind, labels = self.kind, self.mode.labels
        gm, go, gt = self.graphdefs
        old = jax.tree.map(lambda v: v, carry)  # merge shares the Variables; update writes them
        model, opt = nnx.merge(gm, carry["model"]), nnx.merge(go, carry["opt"])
        teacher = None if gt is None else nnx.merge(gt, carry["teacher"])
        loss_fn = _loss_fn(kind, self.pl)
        diff = nnx.DiffState(kind.argnums, kind.wrt)
        grads, loss = None, jnp.float32(0.0)
        for f in range(kind.forwards):
            args = (model, x[f], gp[f], amp)
            if teacher is not None:
                args = (teacher, *args)
            value, g = nnx.value_and_grad(loss_fn, argnums=diff)(*args)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            loss = loss + value
        info = {"finite": h.finite(grads, labels), "loss": loss, "norm": h.norm(grads)}
        opt.update(model, grads)
        wrt, rest = kind.wrt, nnx.Not(kind.wrt)
        new_model = nnx.merge_state(
            h.select(
                take, labels, nnx.state(model, wrt), nnx.filter_state(old["model"], wrt), "params"
            ),
            h.select(
                take, labels, nnx.state(model, rest), nnx.filter_state(old["model"], rest), "rest"
            ),
        )
        new_opt = h.select(take, labels, nnx.state(opt), old["opt"], "opt")
        return {"model": new_model, "opt": new_opt, "teacher": carry["teacher"]}, info

    def opt(self, carry: Any) -> Any:
        return carry["opt"]

    def with_opt(self, carry: Any, opt: Any) -> Any:
        return {**carry, "opt": opt}

    def snap(self, carry: Any) -> h.Snap:
        wrt, on_host = self.kind.wrt, h.to_host(carry)
        return h.Snap(
            params=h.flat(_pure(nnx.filter_state(on_host["model"], wrt))),
            inner=h.inner_of(_pure(on_host["opt"])["opt_state"], self.mode, reference=True),
            mstate=h.flat(_pure(nnx.filter_state(on_host["model"], nnx.Not(wrt)))),
        )
