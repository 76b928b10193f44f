"""``jaxamp.autocast`` on forwards wrapped by Flax transforms and helpers.

nnx: ``nnx.capture`` (sown intermediates), ``nnx.view``, ``nnx.jit`` and
``nnx.value_and_grad`` both inside and outside autocast, ``sow`` and
``BatchNorm`` state written back. linen: ``nn.jit``, ``nn.scan`` and
``nn.remat`` inside a model called through ``autocast(model.apply)``.

Each test checks the output against float32, that a matmul really ran in
float16 (a ``dot_general`` on float16 inputs in the autocast program), and,
where the forward changes module state, that the state written back matches
float32's.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from tests.helpers import dot_input_dtypes

F16 = jnp.float16
TOL = 1e-2


def _assert_f16_dot(fn, *args):
    dots = dot_input_dtypes(jax.make_jaxpr(fn)(*args))
    assert dots, "no dot_general traced"
    assert any(all(d == np.dtype(F16) for d in ins) for ins in dots), dots


def _close(out, ref, tol=TOL):
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key):  # RNG state: exact
            np.testing.assert_array_equal(jax.random.key_data(o), jax.random.key_data(r))
            continue
        on, rn = np.asarray(o, np.float32), np.asarray(r, np.float32)
        assert np.isfinite(on).all()
        scale = max(1.0, float(np.abs(rn).max()))
        np.testing.assert_allclose(on, rn, rtol=tol, atol=tol * scale)


class _Sowing(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.l1(x))
        self.sow(nnx.Intermediate, "hidden", h)
        return self.l2(h)


class _Plain(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.gelu(self.l1(x)))


class _WithBN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        h = self.drop(nnx.relu(self.bn(self.l1(x))))
        return self.l2(h)


def _x(n=16):
    return jax.random.normal(jax.random.key(7), (n, 8))


# --------------------------------------------------------------------------
# nnx.capture / sow
# --------------------------------------------------------------------------


def test_nnx_capture_inside_autocast():
    assert hasattr(nnx, "capture")
    m, x = _Sowing(nnx.Rngs(0)), _x()

    def fwd(m, x):
        return nnx.capture(m, nnx.Intermediate)(x)

    ref_y, ref_i = fwd(m, x)
    fast = jaxamp.autocast(fwd, dtype=F16)
    y, inter = fast(m, x)
    _close(y, ref_y)
    _close(nnx.to_pure_dict(inter), nnx.to_pure_dict(ref_i))
    _assert_f16_dot(fast, m, x)


def test_nnx_capture_of_autocast_module():
    """nnx.capture(autocast(model)): the sow happens inside autocast's trace."""
    m, x = _Sowing(nnx.Rngs(0)), _x()
    ref_y, ref_i = nnx.capture(m, nnx.Intermediate)(x)
    y, inter = nnx.capture(jaxamp.autocast(m, dtype=F16), nnx.Intermediate)(x)
    _close(y, ref_y)
    _close(nnx.to_pure_dict(inter), nnx.to_pure_dict(ref_i))


def test_nnx_capture_of_autocast_function():
    m, x = _Sowing(nnx.Rngs(0)), _x()
    ref_y, ref_i = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(m, x)
    fast = jaxamp.autocast(lambda m, x: m(x), dtype=F16)
    y, inter = nnx.capture(fast, nnx.Intermediate)(m, x)
    _close(y, ref_y)
    _close(nnx.to_pure_dict(inter), nnx.to_pure_dict(ref_i))


def test_nnx_sow_written_back():
    """A sow inside autocast adds a Variable to the module, as a plain call does."""
    ref_m, m, x = _Sowing(nnx.Rngs(0)), _Sowing(nnx.Rngs(0)), _x()
    ref_y = ref_m(x)
    y = jaxamp.autocast(m, dtype=F16)(x)
    _close(y, ref_y)
    assert hasattr(m, "hidden"), "the sown intermediate was not written back"
    _close(nnx.to_pure_dict(nnx.state(m, nnx.Intermediate)),
           nnx.to_pure_dict(nnx.state(ref_m, nnx.Intermediate)))  # fmt: skip


# --------------------------------------------------------------------------
# nnx.view
# --------------------------------------------------------------------------


def test_nnx_view_eval_mode():
    assert hasattr(nnx, "view")
    ref_m, m, x = _WithBN(nnx.Rngs(0)), _WithBN(nnx.Rngs(0)), _x()

    def fwd(m, x):
        return nnx.view(m, deterministic=True, use_running_average=True)(x)

    ref = fwd(ref_m, x)
    fast = jaxamp.autocast(fwd, dtype=F16)
    _close(fast(m, x), ref)
    # Eval mode: nothing changed in the module's state.
    _close(nnx.to_pure_dict(nnx.state(m)), nnx.to_pure_dict(nnx.state(ref_m)), tol=0)
    _assert_f16_dot(fast, m, x)


def test_nnx_view_train_mode_writes_back_batch_stats():
    ref_m, m, x = _WithBN(nnx.Rngs(0)), _WithBN(nnx.Rngs(0)), _x()

    def fwd(m, x):
        return nnx.view(m, deterministic=True, use_running_average=False)(x)

    ref = fwd(ref_m, x)
    out = jaxamp.autocast(fwd, dtype=F16)(m, x)
    _close(out, ref)
    stats, ref_stats = nnx.state(m, nnx.BatchStat), nnx.state(ref_m, nnx.BatchStat)
    _close(nnx.to_pure_dict(stats), nnx.to_pure_dict(ref_stats))
    assert not np.allclose(np.asarray(stats["bn"]["mean"][...]), 0.0), "stats not written back"


# --------------------------------------------------------------------------
# nnx.jit / nnx.value_and_grad inside and outside autocast
# --------------------------------------------------------------------------


@pytest.mark.parametrize("model_cls", [_Plain, _WithBN], ids=["plain", "batchnorm"])
def test_nnx_jit_inside_autocast(model_cls):
    ref_m, m, x = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0)), _x()

    def fwd(m, x):
        return nnx.jit(lambda m, x: m(x))(m, x)

    ref = fwd(ref_m, x)
    fast = jaxamp.autocast(fwd, dtype=F16)
    _close(fast(m, x), ref)
    _close(nnx.to_pure_dict(nnx.state(m)), nnx.to_pure_dict(nnx.state(ref_m)))
    _assert_f16_dot(fast, model_cls(nnx.Rngs(0)), x)


@pytest.mark.parametrize("model_cls", [_Plain, _WithBN], ids=["plain", "batchnorm"])
def test_nnx_jit_outside_autocast(model_cls):
    ref_m, m, x = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0)), _x()
    ref = nnx.jit(lambda m, x: m(x))(ref_m, x)
    step = nnx.jit(lambda m, x: jaxamp.autocast(m, dtype=F16)(x))
    _close(step(m, x), ref)
    _close(nnx.to_pure_dict(nnx.state(m)), nnx.to_pure_dict(nnx.state(ref_m)))
    _assert_f16_dot(lambda m, x: jaxamp.autocast(m, dtype=F16)(x), model_cls(nnx.Rngs(0)), x)


def _loss(m, x):
    return jnp.mean(m(x) ** 2)


@pytest.mark.parametrize("model_cls", [_Plain, _WithBN], ids=["plain", "batchnorm"])
def test_nnx_value_and_grad_inside_autocast(model_cls):
    ref_m, m, x = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0)), _x()

    def vg(m, x):
        return nnx.value_and_grad(_loss)(m, x)

    ref_l, ref_g = vg(ref_m, x)
    fast = jaxamp.autocast(vg, dtype=F16)
    loss, grads = fast(m, x)
    _close(loss, ref_l)
    _close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_g), tol=3e-2)
    _close(nnx.to_pure_dict(nnx.state(m)), nnx.to_pure_dict(nnx.state(ref_m)))
    _assert_f16_dot(fast, model_cls(nnx.Rngs(0)), x)


@pytest.mark.parametrize("model_cls", [_Plain, _WithBN], ids=["plain", "batchnorm"])
def test_nnx_value_and_grad_outside_autocast(model_cls):
    ref_m, m, x = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0)), _x()
    ref_l, ref_g = nnx.value_and_grad(_loss)(ref_m, x)
    loss, grads = nnx.value_and_grad(jaxamp.autocast(_loss, dtype=F16))(m, x)
    _close(loss, ref_l)
    _close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_g), tol=3e-2)
    _close(nnx.to_pure_dict(nnx.state(m)), nnx.to_pure_dict(nnx.state(ref_m)))


@pytest.mark.parametrize("model_cls", [_Plain, _WithBN], ids=["plain", "batchnorm"])
def test_nnx_jit_value_and_grad_of_autocast(model_cls):
    """A train step: nnx.jit(nnx.value_and_grad(autocast(loss)))."""
    ref_m, m, x = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0)), _x()
    ref_l, ref_g = nnx.jit(nnx.value_and_grad(_loss))(ref_m, x)
    loss, grads = nnx.jit(nnx.value_and_grad(jaxamp.autocast(_loss, dtype=F16)))(m, x)
    _close(loss, ref_l)
    _close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_g), tol=3e-2)
    _close(nnx.to_pure_dict(nnx.state(m)), nnx.to_pure_dict(nnx.state(ref_m)))


# --------------------------------------------------------------------------
# linen lifted transforms inside a model, called through autocast(model.apply)
# --------------------------------------------------------------------------


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(x)))


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return _Block()(x), None


class _LinenModel(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        if self.kind == "jit":
            x = nn.jit(_Block)()(x)
        elif self.kind == "remat":
            x = nn.remat(_Block)()(x)
        elif self.kind == "scan":
            stack = nn.scan(
                _ScanBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=3,
            )
            x, _ = stack()(x, None)
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


@pytest.mark.parametrize("kind", ["jit", "remat", "scan"])
def test_linen_lifted_transform_inside_apply(kind):
    model = _LinenModel(kind)
    x = _x()
    params = model.init(jax.random.key(0), x)
    ref = model.apply(params, x)
    fast = jaxamp.autocast(model.apply, dtype=F16)
    _close(fast(params, x), ref)
    _assert_f16_dot(fast, params, x)
    # Differentiable, with float32 gradients close to float32's.
    g_ref = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
    g = jax.grad(lambda p: jnp.mean(fast(p, x) ** 2))(params)
    _close(g, g_ref, tol=3e-2)


class _BnNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.bn(self.lin(x))


def test_autocast_of_an_nnx_module_reads_the_modules_attributes():
    # Issue 43, item 9: autocast(model) is a method bound to the model, and reads
    # of it go to the model (they raised AttributeError).
    model = _BnNet(nnx.Rngs(0))
    amp = jaxamp.autocast(model, dtype=F16)
    assert amp.lin is model.lin and amp.bn.num_features == 8
    amp.eval()
    assert model.bn.use_running_average
    with pytest.raises(AttributeError):
        amp.no_such_attribute  # noqa: B018


def test_an_optimizer_of_autocast_of_a_module_says_to_pass_the_module():
    import optax

    model = _BnNet(nnx.Rngs(0))
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    with pytest.raises(TypeError, match=r"jaxamp\.nnx\.Optimizer\(model, tx, wrt=nnx\.Param\)"):
        jaxamp.nnx.Optimizer(jaxamp.autocast(model, dtype=F16), tx, wrt=nnx.Param)


def test_audit_of_autocast_of_a_module_that_writes_state_compiles_it_purely():
    # A train-mode BatchNorm writes its statistics: audit traces the forward as a
    # function of the module's state (it raised Flax's TraceContextError), and
    # the module outside is not written.
    model = _BnNet(nnx.Rngs(0))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
    report = jaxamp.audit(jaxamp.autocast(model, dtype=F16))(x)
    assert [r.requested for r in report.matmuls] == ["f16 x f16 -> f16"]
    after = nnx.state(model, nnx.BatchStat)
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
