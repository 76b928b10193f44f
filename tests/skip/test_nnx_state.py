"""What a skipped nnx step keeps, however the step was called (issue 30, items 2-6).

Each test is a call order a user writes that 0.3 got wrong: two forwards before one
update, another module passed to the loss first, Flax's own ``nnx.value_and_grad``,
``every_k``'s step counter, a LoRA optimizer's copy of the frozen base, and Flax's own
``nnx.Optimizer`` given a jaxamp ``tx``. The model has BatchNorm and Dropout: its
forward writes ``BatchStat`` and RNG counters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 16) -> None:
        self.lin = nnx.Linear(4, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))


X = jax.random.normal(jax.random.key(1), (32, 4))
BAD = X.at[5, 2].set(jnp.inf)


def _loss(model: Net, x: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - 1.0) ** 2)


def _host(node, *filters):
    def host(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(host, nnx.state(node, *filters) if filters else nnx.state(node))


def _assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _setup(every_k: int = 1):
    model = Net(nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8), every_k=every_k)
    return model, jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def _step(model, optimizer, x) -> None:
    _, grads = jaxamp.nnx.value_and_grad(_loss)(optimizer, model, x)
    optimizer.update(model, grads)


def _finite_step(model, optimizer) -> None:
    _step(model, optimizer, X)


def test_two_forwards_before_one_update_keep_the_state_before_both() -> None:
    model, optimizer = _setup()
    _finite_step(model, optimizer)
    before = _host(model)

    @nnx.jit
    def two_forwards(model, optimizer):
        vg = jaxamp.nnx.value_and_grad(_loss)
        _, g1 = vg(optimizer, model, BAD)  # overflows: BatchStat becomes inf / NaN
        _, g2 = vg(optimizer, model, X)  # a finite batch after it, read the poisoned stats
        optimizer.update(model, jax.tree.map(jnp.add, g1, g2))

    two_forwards(model, optimizer)
    assert bool(jaxamp.metrics(optimizer.opt_state)["skipped"])
    _assert_same(_host(model), before)  # params, BatchStat and RNG counters
    assert int(optimizer.step) == 1


@pytest.mark.parametrize("teacher_width", [16, 8], ids=["same-architecture", "other-architecture"])
def test_a_teacher_passed_first_is_not_what_the_student_gets_back(teacher_width: int) -> None:
    model, optimizer = _setup()
    teacher = Net(nnx.Rngs(7), width=teacher_width)
    teacher(X * 3.0 + 1.0)  # statistics unlike the student's
    _finite_step(model, optimizer)
    before, teacher_before = _host(model), _host(teacher, nnx.BatchStat)

    def distill(teacher: Net, student: Net, x: jax.Array) -> jax.Array:
        return jnp.mean((student(x) - jax.lax.stop_gradient(teacher(x))) ** 2)

    @nnx.jit
    def step(teacher, model, optimizer, x):
        _, grads = jaxamp.nnx.value_and_grad(distill, argnums=1)(optimizer, teacher, model, x)
        optimizer.update(model, grads)

    step(teacher, model, optimizer, BAD)
    assert bool(jaxamp.metrics(optimizer.opt_state)["skipped"])
    _assert_same(_host(model), before)
    # The teacher's forward wrote its own statistics; the optimizer does not touch them.
    assert not np.array_equal(
        jax.tree.leaves(_host(teacher, nnx.BatchStat))[0], jax.tree.leaves(teacher_before)[0]
    )


def test_two_peers_of_one_architecture_each_get_their_own_state_back() -> None:
    # Deep mutual learning: both peers differentiated by one call, the scale from the
    # second's optimizer. Which peer is that optimizer's cannot be told from the
    # arguments: the skip puts back each peer's state as its last update left it.
    a, opt_a = _setup()
    b = Net(nnx.Rngs(1))
    opt_b = jaxamp.nnx.Optimizer(b, opt_a.tx, wrt=nnx.Param)
    mutual = lambda a, b, x: jnp.mean((a(x) - b(x)) ** 2)

    @nnx.jit
    def step(a, b, opt_a, opt_b, x):
        _, (ga, gb) = jaxamp.nnx.value_and_grad(mutual, argnums=(0, 1))(opt_b, a, b, x)
        opt_a.update(a, ga)
        opt_b.update(b, gb)

    step(a, b, opt_a, opt_b, X)
    a_before, b_before = _host(a), _host(b)
    assert not np.array_equal(
        jax.tree.leaves(_host(a, nnx.BatchStat))[0], jax.tree.leaves(_host(b, nnx.BatchStat))[0]
    )
    step(a, b, opt_a, opt_b, BAD)
    assert bool(jaxamp.metrics(opt_a.opt_state)["skipped"])
    assert bool(jaxamp.metrics(opt_b.opt_state)["skipped"])
    _assert_same(_host(a), a_before)
    _assert_same(_host(b), b_before)


def test_flax_own_value_and_grad_with_the_loss_scaled_by_hand() -> None:
    model, optimizer = _setup()
    _finite_step(model, optimizer)
    before = _host(model)

    @nnx.jit
    def step(model, optimizer, x):
        scale = optimizer.loss_scale.scale
        grads = nnx.grad(lambda m: _loss(m, x) * scale)(model)
        optimizer.update(model, grads)

    step(model, optimizer, BAD)
    assert bool(jaxamp.metrics(optimizer.opt_state)["skipped"])
    _assert_same(_host(model), before)
    step(model, optimizer, X)  # and a finite step after it is taken
    assert int(optimizer.step) == 2


def test_every_k_step_counts_only_applied_windows_as_multisteps_would() -> None:
    model, optimizer = _setup(every_k=4)
    ref_model = Net(nnx.Rngs(0))
    ref = nnx.Optimizer(ref_model, optax.MultiSteps(optax.adam(1e-2), 4), wrt=nnx.Param)
    ref_step = nnx.jit(lambda m, o, x: o.update(m, nnx.grad(_loss)(m, x)))
    for x in [X, BAD, X, X]:  # one skipped window
        _step(model, optimizer, x)
    assert int(optimizer.step) == 0
    for _ in range(4):  # one applied window
        _step(model, optimizer, X)
        ref_step(ref_model, ref, X)
    assert int(optimizer.step) == int(ref.step) == 4


def test_lora_optimizer_does_not_copy_the_frozen_base() -> None:
    class Lora(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.LoRA(64, 4, 64, base_module=nnx.Linear(64, 64, rngs=rngs), rngs=rngs)
            self.bn = nnx.BatchNorm(64, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    model = Lora(nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.sgd(1e-2), jaxamp.dynamic_scale(2.0**8))
    optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    flax_opt = nnx.Optimizer(Lora(nnx.Rngs(0)), optax.sgd(1e-2), wrt=nnx.LoRAParam)
    nbytes = lambda node: sum(x.nbytes for x in jax.tree.leaves(nnx.state(node)))
    # Only the BatchStat (2 x 64 float32) besides what Flax's own optimizer holds.
    kept = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))
    base = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.lin.base_module)))
    assert kept < base
    assert nbytes(optimizer) - nbytes(flax_opt) < kept + 4096  # + loss scale, record
    x = jax.random.normal(jax.random.key(2), (8, 64))
    before = _host(model)
    loss = lambda m, x: jnp.mean(m(x) ** 2)

    @nnx.jit
    def step(model, optimizer, x):
        vg = jaxamp.nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
        _, grads = vg(optimizer, model, x)
        optimizer.update(model, grads)

    step(model, optimizer, x.at[0, 0].set(jnp.nan))
    _assert_same(_host(model), before)


def test_flax_own_optimizer_with_a_jaxamp_tx() -> None:
    # Without model state, Flax's optimizer works: params and opt state kept on a skip.
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss = lambda m, x: (
        jnp.mean(m(x) ** 2) * jaxamp.get_loss_scale(nnx.as_pure(optimizer.opt_state)).scale
    )
    optimizer.update(model, nnx.grad(loss)(model, X))
    before = _host(model)
    optimizer.update(model, nnx.grad(loss)(model, BAD))
    assert bool(jaxamp.metrics(nnx.as_pure(optimizer.opt_state))["skipped"])
    _assert_same(_host(model), before)
    # With model state a forward writes, it refuses at once, naming what to use.
    bn_model = Net(nnx.Rngs(0))
    flax_opt = nnx.Optimizer(bn_model, tx, wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"jaxamp\.nnx\.Optimizer\(model, tx, wrt=\.\.\.\)"):
        flax_opt.update(bn_model, nnx.grad(_loss)(bn_model, X))


def test_state_loaded_after_the_optimizer_is_built_survives_a_skipped_first_step() -> None:
    model, optimizer = _setup()
    nnx.update(
        model, jax.tree.map(lambda x: jnp.full_like(x, 7.0), nnx.state(model, nnx.BatchStat))
    )
    loaded = _host(model)
    _step(model, optimizer, BAD)  # the first step overflows: skipped
    assert bool(jaxamp.metrics(optimizer.opt_state)["skipped"])
    _assert_same(_host(model), loaded)


def test_state_written_after_an_update_survives_the_next_skipped_step() -> None:
    # An EMA of the weights kept in the model, written after each update (as EMA
    # recipes do): a later skipped step must not roll it back.
    class Ema(nnx.Variable):
        pass

    model, optimizer = _setup()
    model.ema = Ema(jnp.zeros((4, 16)))
    optimizer = jaxamp.nnx.Optimizer(model, optimizer.tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        _, grads = jaxamp.nnx.value_and_grad(_loss)(optimizer, model, x)
        optimizer.update(model, grads)
        model.ema[...] = 0.9 * model.ema[...] + 0.1 * model.lin.kernel[...]

    step(model, optimizer, X)
    after = _host(model)
    step(model, optimizer, BAD)  # skipped; the EMA line runs again, on unchanged weights
    np.testing.assert_allclose(
        np.asarray(model.ema[...]),
        0.9 * after["ema"] + 0.1 * after["lin"]["kernel"],
        rtol=1e-6,
    )


def test_two_optimizers_on_one_model_do_not_undo_each_others_steps() -> None:
    # A GAN-style pair: each optimizer trains one half; a skipped step of one must not
    # put back what the other's applied step wrote.
    class Pair(nnx.Module):
        def __init__(self) -> None:
            self.g, self.d = Net(nnx.Rngs(0)), Net(nnx.Rngs(1))

    pair = Pair()
    tx = lambda: jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8))
    opt_g = jaxamp.nnx.Optimizer(pair, tx(), wrt=nnx.All(nnx.Param, nnx.PathContains("g")))
    opt_d = jaxamp.nnx.Optimizer(pair, tx(), wrt=nnx.All(nnx.Param, nnx.PathContains("d")))
    loss = lambda p, x: _loss(p.g, x) + _loss(p.d, x)

    @nnx.jit
    def step(pair, opt, x):
        _, grads = jaxamp.nnx.value_and_grad(loss)(opt, pair, x)
        opt.update(pair, grads)

    step(pair, opt_d, X)
    step(pair, opt_g, X * 2.0)  # applied: writes g's (and d's) statistics
    after_g = _host(pair)
    step(pair, opt_d, BAD)  # skipped
    assert bool(jaxamp.metrics(opt_d.opt_state)["skipped"])
    _assert_same(_host(pair), after_g)


def test_flax_optimizer_is_refused_through_a_chain_too() -> None:
    model = Net(nnx.Rngs(0))
    inner = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8))
    # Structures safe around the guard (an unsafe one is refused before this: its own test).
    for tx in (optax.chain(inner), optax.flatten(inner)):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        with pytest.raises(TypeError, match=r"jaxamp\.nnx\.Optimizer\(model, tx, wrt=\.\.\.\)"):
            optimizer.update(model, nnx.grad(_loss)(model, X))


def test_a_subclass_of_flax_optimizer_is_refused_too() -> None:
    # A user's own nnx.Optimizer subclass whose update names the model otherwise.
    class MyOptimizer(nnx.Optimizer):
        def update(self, net, grads, **kwargs):
            params = nnx.as_pure(nnx.state(net, self.wrt))
            grads = nnx.as_pure(nnx.state(grads, self.wrt))
            updates, new = self.tx.update(grads, nnx.as_pure(self.opt_state), params)
            nnx.update(net, optax.apply_updates(params, updates))
            nnx.update(self.opt_state, nnx.state(new))

    model = Net(nnx.Rngs(0))
    inner = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**8))
    optimizer = MyOptimizer(model, inner, wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"jaxamp\.nnx\.Optimizer\(model, tx, wrt=\.\.\.\)"):
        optimizer.update(model, nnx.grad(_loss)(model, X))


def test_state_created_after_the_optimizer_is_named() -> None:
    model, optimizer = _setup()
    model.extra = nnx.BatchStat(jnp.zeros(3))
    with pytest.raises(ValueError, match="new: extra"):
        _step(model, optimizer, X)


def test_a_wrt_holding_batch_stats_is_put_back_on_a_skip_and_updated_on_a_step() -> None:
    # `wrt` covers a Variable the forward writes: a skip puts back its value from
    # before the forward; a finite step gives what Flax's own optimizer gives.
    wrt = nnx.Any(nnx.Param, nnx.BatchStat)
    diff = nnx.DiffState(0, wrt)

    def build(tx):
        model = Net(nnx.Rngs(0))
        return model, tx(model)

    model, optimizer = build(
        lambda m: jaxamp.nnx.Optimizer(m, jaxamp.skip_nonfinite(optax.sgd(0.1)), wrt=wrt)
    )
    ref, ref_opt = build(lambda m: nnx.Optimizer(m, optax.sgd(0.1), wrt=wrt))

    @nnx.jit
    def step(model, optimizer, x):
        _, grads = jaxamp.nnx.value_and_grad(_loss, argnums=diff)(optimizer, model, x)
        optimizer.update(model, grads)

    @nnx.jit
    def ref_step(model, optimizer, x):
        optimizer.update(model, nnx.grad(_loss, argnums=diff)(model, x))

    step(model, optimizer, X)
    ref_step(ref, ref_opt, X)
    # The same arithmetic, fused differently by XLA: float32 within a few ulps.
    for a, b in zip(jax.tree.leaves(_host(model)), jax.tree.leaves(_host(ref)), strict=True):
        eps = np.finfo(np.float32).eps
        np.testing.assert_allclose(a, b, rtol=8 * eps, atol=8 * eps * np.abs(b).max())
    before = _host(model)
    step(model, optimizer, BAD)
    assert not bool(jaxamp.stepped(optimizer))
    _assert_same(_host(model), before)  # BatchStat too, not the bad batch's inf / NaN
