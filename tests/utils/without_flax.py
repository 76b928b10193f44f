"""An equinox / plain-optax program's use of jaxamp, run where Flax cannot be imported.

``python tests/utils/without_flax.py --block`` first installs an import hook that refuses
``flax`` and ``flax.*`` (as if it were not installed) and records each attempt;
without ``--block`` it runs as it is (the wheel smoke test runs it after uninstalling
Flax). It then imports jaxamp and trains: a loss scale, ``tx.update`` and
``jaxamp.step`` under ``jit``, a skipped non-finite step, ``unscale_and_check`` and
``autocast`` of a plain function (and an equinox model where equinox is installed),
and exits non-zero if Flax was imported, or any of it tried to.
"""

from __future__ import annotations

import importlib.abc
import sys

ATTEMPTS: list[str] = []


class _NoFlax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flax" or name.startswith("flax."):
            ATTEMPTS.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
        return None


def main() -> None:
    import jax
    import jax.numpy as jnp
    import optax

    import jaxamp

    x = jax.random.normal(jax.random.key(0), (32, 4))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    params = {"w": jnp.full((4, 1), 0.1), "b": jnp.zeros(1)}
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(init_scale=2.0**10))

    def train(loss_fn):
        @jax.jit
        def optax_step(params, opt_state, x, y):  # tx.update, as optax users write it
            loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        @jax.jit
        def fused_step(params, opt_state, x, y):  # jaxamp.step
            loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, x, y)
            params, opt_state = jaxamp.step(tx, grads, opt_state, params)
            return params, opt_state, loss

        for step in (optax_step, fused_step):
            p, opt_state, first = params, tx.init(params), None
            for i in range(20):
                bad = x.at[0, 0].set(jnp.inf) if i == 5 else x  # one non-finite step, skipped
                p, opt_state, loss = step(p, opt_state, bad, y)
                first = loss if first is None else first
            m = jaxamp.metrics(opt_state)
            assert int(m["skipped_steps"]) == 1 and float(m["loss_scale"]) == 2.0**9, m
            assert float(loss) < float(first), (step.__name__, float(first), float(loss))
            jaxamp.check_health(opt_state)

    train(lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2))
    ls = jaxamp.dynamic_scale()
    grads, finite = jaxamp.unscale_and_check(ls, {"w": jnp.array([jnp.inf, 1.0])})
    assert not bool(finite) and not bool(jaxamp.stepped(jaxamp.update(ls, finite)))

    # autocast of a plain function: a Flax module can be among its arguments only
    # once the program imported Flax, so autocast looks for one without importing it.
    forward = jaxamp.autocast(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]), dtype=jnp.float16)
    assert "f16" in str(jax.make_jaxpr(forward)(params, x))
    train(lambda p, x, y: jnp.mean((forward(p, x) - y) ** 2))

    try:
        import equinox as eqx
    except ImportError:
        eqx = None
    if eqx is not None:  # an equinox model: its fields are not params
        model = eqx.nn.MLP(4, 1, 8, 1, key=jax.random.key(2))
        tx = jaxamp.skip_nonfinite(optax.sgd(1e-2), jaxamp.dynamic_scale())
        opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def eqx_step(model, opt_state):
            loss_fn = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)
            grad_fn = jaxamp.value_and_grad(loss_fn, inexact_only=True)
            loss, grads = grad_fn(opt_state, model)
            model, opt_state = jaxamp.step(tx, grads, opt_state, model)
            return model, opt_state, loss

        model, opt_state, loss = eqx_step(model, opt_state)
        assert bool(jaxamp.stepped(opt_state)) and bool(jnp.isfinite(loss))

    flax = sorted(m for m in sys.modules if m == "flax" or m.startswith("flax."))
    assert not flax, f"Flax imported: {flax}"
    assert not ATTEMPTS, f"import jaxamp, the optax path or autocast tried to import {ATTEMPTS}"
    print("without flax: ok")


if __name__ == "__main__":
    if "--block" in sys.argv[1:]:
        sys.meta_path.insert(0, _NoFlax())
    main()
