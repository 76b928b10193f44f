"""The functional paths: ``tx.update`` + ``optax.apply_updates``, ``jaxamp.step``, ``TrainState``.

The model is split into plain dicts (``models.Functional``): ``params`` (what is
trained), ``rest`` (frozen params, BatchStat, RNG state) and the teacher's state.
Each path writes ``rest`` the way its users do:

- ``update``: gradients by JAX's own ``jax.value_and_grad`` of the loss scaled by
  hand (``jaxamp.scale``), ``tx.update`` + ``optax.apply_updates``, and
  ``jaxamp.where_stepped`` for the model state;
- ``step``: gradients by ``jaxamp.value_and_grad``, ``jaxamp.step`` and
  ``where_stepped``; its twin is the same program with ``tx.update`` +
  ``optax.apply_updates``, which must give the same bits;
- ``train_state``: a ``jaxamp.TrainState`` holding the model state as a
  ``FrozenDict`` (as ``linen.Module.init`` used to return it) and given the new one
  as a plain dict (what ``apply(..., mutable=...)`` returns):
  ``apply_gradients(grads=..., rest=..., extra_args=...)``.

The reference is the same program with the plain optax optimizer (Flax's own
``TrainState`` for ``train_state``) on the unscaled loss, whose update is kept
only where the harness says the call is taken (``take``, one flag per label).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import freeze
from flax.training import train_state as flax_train_state

import jaxamp
from tests.matrix import harness as h
from tests.matrix.models import Functional, Kind
from tests.matrix.modes import BASE, OTHER, LossScaleConfig, Mode
from tests.matrix.placements import Placement


class MatrixTrainState(jaxamp.TrainState):
    rest: Any = None


class RefTrainState(flax_train_state.TrainState):
    rest: Any = None


def _add(a: Any, b: Any) -> Any:
    return b if a is None else jax.tree.map(jnp.add, a, b)


def _forwards(kind: Kind, pl: Placement, grad_of, params, rest, teacher, x, gp, amp, axis):
    """Every forward of one call: the summed gradients and losses, and the model state
    the last forward left. ``grad_of(args)`` returns ``((loss, rest), grads)``."""
    grads, loss = None, jnp.float32(0.0)
    for f in range(kind.forwards):
        args = (params, rest, x[f], gp[f], amp)
        if kind.argnums == 1:
            args = (teacher, *args)
        (value, rest), g = grad_of(args)
        if axis is not None and pl.replicated:  # per replica: the global batch's mean
            g, value = jax.lax.pmean((g, value), axis)
        grads, loss = _add(grads, g), loss + value
    return grads, loss, rest


def _loss_fn(fn: Functional, kind: Kind, pl: Placement):
    """``fn.loss`` in the argument order of the kind; under ``shard_map`` (replicated
    state) averaged over the mesh inside, so that its gradients are invariant."""
    loss = fn.loss
    if pl.name == "shard_map":

        def loss(*args):
            value, rest = fn.loss(*args)
            return jax.lax.pmean(value, pl.axis_name), rest

    if kind.argnums == 1:
        return loss
    return lambda params, rest, x, gp, amp: loss(None, params, rest, x, gp, amp)


class Runner:
    """A functional path of one cell, compiled once for its placement."""

    def __init__(self, path: str, kind: Kind, mode: Mode, pl: Placement, fused: bool = True):
        self.path, self.kind, self.mode, self.pl = path, kind, mode, pl
        self.fused = fused and path == "step"
        with pl.context():
            self.fn = Functional.of(kind, kind.build(pl.bn_axis_name), kind.teacher())
            # The loss scale's numbers come from the state; the step uses only tx's parts.
            self.tx = mode.tx(BASE, pl.axis_name, pl.name)
        self.call = pl.compile(self._body)
        self.twin = Runner(path, kind, mode, pl, fused=False) if self.fused else None

    def new(self, ls: LossScaleConfig) -> Any:
        with self.pl.context():
            tx = self.mode.tx(ls, self.pl.axis_name, self.pl.name)
            fn = Functional.of(
                self.kind, self.kind.build(self.pl.bn_axis_name), self.kind.teacher()
            )
            if self.path == "train_state":
                ts = MatrixTrainState.create(
                    apply_fn=None, params=fn.params, tx=tx, rest=freeze(fn.rest)
                )
                carry = {"ts": ts, "teacher": fn.teacher}
            else:
                carry = {"params": fn.params, "opt": tx.init(fn.params), "rest": fn.rest}
                carry["teacher"] = fn.teacher
            return self.pl.put_state(carry)

    def _body(self, carry, x, gp, amp, *, axis):
        kind, mode = self.kind, self.mode
        tx = self.tx
        loss_fn = _loss_fn(self.fn, kind, self.pl)
        if self.path == "train_state":
            ts = carry["ts"]
            params, rest, opt = ts.params, dict(ts.rest), ts.opt_state
        else:
            params, rest, opt = carry["params"], carry["rest"], carry["opt"]
        if self.path == "update":  # JAX's own grad of the loss scaled by hand

            def grad_of(args):
                ls = jaxamp.get_loss_scale(opt)

                def scaled(*a):
                    value, new_rest = loss_fn(*a)
                    return jaxamp.scale(ls, value), (value, new_rest)

                (_, aux), g = jax.value_and_grad(scaled, kind.argnums, has_aux=True)(*args)
                return aux, g
        else:
            grad_of = lambda args: jaxamp.value_and_grad(loss_fn, kind.argnums, has_aux=True)(
                opt, *args
            )
        grads, loss, new_rest = _forwards(
            kind, self.pl, grad_of, params, rest, carry["teacher"], x, gp, amp, axis
        )
        extra = {"value": loss} if mode.name == "spikes" else {}
        if self.path == "train_state":
            ts = ts.apply_gradients(grads=grads, rest=new_rest, extra_args=extra)
            return {"ts": ts, "teacher": carry["teacher"]}
        if self.fused:
            params, opt = jaxamp.step(tx, grads, opt, params, **extra)
        else:
            updates, opt = tx.update(grads, opt, params, **extra)
            params = optax.apply_updates(params, updates)
        rest = jaxamp.where_stepped(opt, new_rest, rest)
        return {"params": params, "opt": opt, "rest": rest, "teacher": carry["teacher"]}

    def snap(self, carry: Any) -> h.Snap:
        on_host = h.to_host(carry)
        if self.path == "train_state":
            ts = on_host["ts"]
            params, opt, rest, step = ts.params, ts.opt_state, dict(ts.rest), ts.step
            step = int(np.ravel(step)[0])
        else:
            params, opt, rest = on_host["params"], on_host["opt"], on_host["rest"]
            step = None
        return h.Snap(
            params=h.flat(params),
            inner=h.inner_of(opt, self.mode, reference=False),
            counters=h.counters_of(opt, self.mode),
            mstate=h.flat(rest),
            metrics=h.metrics_of(jax.tree.map(lambda a: a[0], opt) if self.pl.replicated else opt),
            teacher=None if on_host["teacher"] is None else h.flat(on_host["teacher"]),
            step=step,
            everything=jax.tree.leaves(on_host),
            shardings=h.shardings(carry),
            opt_shapes=[x.shape for x in jax.tree.leaves(opt)],
        )

    def restore(self, carry: Any) -> Any:
        """``carry`` through an orbax checkpoint into state built with another configuration."""
        fresh = self.new(OTHER)
        with self.pl.context():
            return h.save_and_restore(carry, fresh)


# ---------------------------------------------------------------------------
# The reference.


class Reference:
    """Plain optax (or Flax's ``TrainState``) on the same model, placement and calls."""

    def __init__(self, path: str, kind: Kind, mode: Mode, pl: Placement):
        self.path, self.kind, self.mode, self.pl = path, kind, mode, pl
        with pl.context():
            self.fn = Functional.of(kind, kind.build(pl.bn_axis_name), kind.teacher())
        self.call = pl.compile(self._body)

    def new(self) -> Any:
        with self.pl.context():
            fn = Functional.of(
                self.kind, self.kind.build(self.pl.bn_axis_name), self.kind.teacher()
            )
            tx = self.mode.reference(self.pl.name)
            if self.path == "train_state":
                ts = RefTrainState.create(apply_fn=None, params=fn.params, tx=tx, rest=fn.rest)
                carry = {"ts": ts, "teacher": fn.teacher}
            else:
                carry = {"params": fn.params, "opt": tx.init(fn.params), "rest": fn.rest}
                carry["teacher"] = fn.teacher
            return self.pl.put_state(carry)

    def _body(self, carry, take, x, gp, amp, *, axis):
        kind, labels = self.kind, self.mode.labels
        loss_fn = _loss_fn(self.fn, kind, self.pl)
        if self.path == "train_state":
            ts = carry["ts"]
            params, rest, opt = ts.params, ts.rest, ts.opt_state
        else:
            params, rest, opt = carry["params"], carry["rest"], carry["opt"]
        grad_of = lambda args: jax.value_and_grad(loss_fn, kind.argnums, has_aux=True)(*args)
        grads, loss, new_rest = _forwards(
            kind, self.pl, grad_of, params, rest, carry["teacher"], x, gp, amp, axis
        )
        info = {"finite": h.finite(grads, labels), "loss": loss, "norm": h.norm(grads)}
        tx = self.mode.reference(self.pl.name)
        if self.path == "train_state":
            new = ts.apply_gradients(grads=grads, rest=new_rest)
            new_params, new_opt, new_rest = new.params, new.opt_state, new.rest
        else:
            updates, new_opt = tx.update(grads, opt, params)
            new_params = optax.apply_updates(params, updates)
        out = {
            "params": h.select(take, labels, new_params, params, "params"),
            "opt": h.select(take, labels, new_opt, opt, "opt", self.mode.always),
            "rest": h.select(take, labels, new_rest, rest, "rest"),
        }
        if self.path == "train_state":
            step = jnp.where(jnp.all(take), ts.step + 1, ts.step)
            ts = ts.replace(params=out["params"], opt_state=out["opt"], rest=out["rest"], step=step)
            return {"ts": ts, "teacher": carry["teacher"]}, info
        return {**out, "teacher": carry["teacher"]}, info

    def opt(self, carry: Any) -> Any:
        return carry["ts"].opt_state if self.path == "train_state" else carry["opt"]

    def with_opt(self, carry: Any, opt: Any) -> Any:
        if self.path == "train_state":
            return {**carry, "ts": carry["ts"].replace(opt_state=opt)}
        return {**carry, "opt": opt}

    def snap(self, carry: Any) -> h.Snap:
        on_host = h.to_host(carry)
        if self.path == "train_state":
            ts = on_host["ts"]
            params, opt, rest = ts.params, ts.opt_state, ts.rest
        else:
            params, opt, rest = on_host["params"], on_host["opt"], on_host["rest"]
        return h.Snap(
            params=h.flat(params),
            inner=h.inner_of(opt, self.mode, reference=True),
            counters=h.counters_of(opt, self.mode),
            mstate=h.flat(rest),
        )
