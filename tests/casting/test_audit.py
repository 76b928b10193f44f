"""``jaxamp.audit``: every matrix product as XLA will run it (issue 33, part 3).

On the CPU (where these run) XLA computes FP8 and bfloat16 products in float32:
the audit must say so for each of them, with the module path and the user's
line, and must flag a float32 product planted inside autocast.
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.casting._audit import _hlo_text, _match

BF16 = jnp.bfloat16


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, size in enumerate((48, 64, 80, 16)):
            x = nn.Dense(size, name=f"layer{i}")(x)  # DENSE
            x = nn.relu(x) if i < 3 else x
        return x


def _setup():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)), jnp.float32)
    model = MLP()
    return model, model.init(jax.random.key(0), x), x


def _dense_line() -> int:
    src, start = inspect.getsourcelines(MLP.__call__)
    return start + next(i for i, line in enumerate(src) if "# DENSE" in line)


def test_an_fp8_training_step_lists_each_fp8_product_and_where_it_runs():
    model, params, x = _setup()
    fwd = jaxamp.autocast(model.apply, dtype=BF16, fp8=jaxamp.fp8())

    def loss(params, x):
        return jnp.mean(fwd(params, x).astype(jnp.float32) ** 2)

    report = jaxamp.audit(jax.grad(loss))(params, x)
    fp8 = [r for r in report.matmuls if r.requested.startswith("f8")]
    # layer1 and layer2: forward, dgrad and wgrad each.
    assert len(fp8) == 6
    assert sorted((r.module, r.pass_) for r in fp8) == sorted(
        [(f"MLP/layer{i}", p) for i in (1, 2) for p in ("forward", "backward", "backward")]
    )
    grads = [r for r in fp8 if r.pass_ == "backward"]
    assert all("f8e5m2" in r.requested for r in grads)
    for r in fp8:
        assert r.source == f"test_audit.py:{_dense_line()} (MLP.__call__)", r
        # XLA:CPU has no FP8 GEMM: the audit says what really runs.
        assert r.executed == "f32 x f32 -> f32" and "FP8 requested" in " ".join(r.flags)
    bf16 = [r for r in report.matmuls if r.requested.startswith("bf16")]
    assert len(bf16) == 5  # layer0's forward and wgrad, layer3's forward, dgrad, wgrad
    assert all("XLA runs it in float32" in " ".join(r.flags) for r in bf16)
    assert "MLP/layer1" in str(report)


def test_a_planted_float32_product_inside_autocast_is_flagged():
    model, params, x = _setup()
    fwd = jaxamp.autocast(model.apply, dtype=BF16, modules={"layer2": "float32"})
    report = jaxamp.audit(fwd)(params, x)
    flagged = [r for r in report.matmuls if any("float32 product inside" in f for f in r.flags)]
    assert [r.requested for r in flagged] == ["f32 x f32 -> f32"]
    assert [r.shape for r in flagged] == ["f32[32,80]"]  # layer2's output
    plain = jaxamp.audit(model.apply)(params, x)  # no autocast: nothing to say
    assert not plain.flagged and len(plain.matmuls) == 4


def test_a_large_standalone_convert_is_listed():
    report = jaxamp.audit(lambda x: x.astype(BF16))(jnp.ones((64, 64)))
    assert "bf16[64,64]" in report.converts_of_at_least(1024)[0]
    assert not report.large_converts  # 4096 elements < 2**20
    big = jaxamp.audit(lambda x: x.astype(BF16))(jnp.ones((1024, 1024)))
    assert "bf16[1024,1024]" in big.large_converts[0]
    small = jaxamp.audit(lambda x: x.astype(BF16))(jnp.ones((8, 8)))
    assert not small.converts_of_at_least(1024)


def test_every_keyword_goes_to_fn():
    # audit has no keyword of its own: a `large=` of fn reaches fn.
    seen = []

    def h(x, w, large=False):
        seen.append(large)
        return (x @ w) * (2.0 if large else 1.0)

    jaxamp.audit(jax.jit(h, static_argnames="large"))(
        jnp.ones((16, 32)), jnp.ones((32, 16)), large=True
    )
    assert seen == [True]


def test_stack_frames_are_read_innermost_first():
    def h(x):
        return x @ x

    def g(x):
        return h(x) + 1

    text = jax.jit(g).lower(jnp.ones((4, 4))).compile().as_text()
    mod = _hlo_text.parse(text)
    (dot,) = [i for i in mod.instrs.values() if i.opcode == "dot"]
    frames = mod.frames_of(dot)
    assert [f[2].rsplit(".", 1)[-1] for f in frames[:2]] == ["h", "g"]


def _layer(x, w):
    return jnp.tanh(x @ w)  # LAYER


def test_products_in_a_scan_body_and_a_nested_jit_are_matched_to_their_request():
    # JAX names a called computation's instructions relative to their call
    # (`dot_general` under `jit(f)/jit(_layer)`); XLA inlines them under the
    # full name. Each product XLA runs is matched to the one autocast asked for,
    # also where XLA makes two of one (a nested jit called twice).
    inner = jax.jit(_layer)

    def f(x, ws, w2):
        y, _ = jax.lax.scan(lambda c, w: (_layer(c, w), None), x, ws)
        y = inner(y, w2)
        y = inner(y, w2)
        return jnp.sum(y.astype(jnp.float32))

    fwd = jaxamp.autocast(f, dtype=BF16)
    x, ws, w2 = jnp.ones((32, 64)), jnp.ones((3, 64, 64)) * 0.01, jnp.ones((64, 64)) * 0.01
    report = jaxamp.audit(jax.grad(fwd, argnums=(1, 2)))(x, ws, w2)
    src, start = inspect.getsourcelines(_layer)
    line = start + next(i for i, s in enumerate(src) if "# LAYER" in s)
    assert len(report.matmuls) >= 9  # forward, dgrad, wgrad of three call sites
    for r in report.matmuls:
        assert r.requested == "bf16 x bf16 -> bf16", r
        assert r.source == f"test_audit.py:{line} (_layer)", r


def test_each_product_names_its_own_line():
    # Two products of one shape and parameters: each row names the line it is
    # written on, not the first one's (autocast binds them through one cached op).
    def f(x, w):
        a = x @ w  # FIRST
        b = jnp.tanh(a) @ w  # SECOND
        return b

    src, start = inspect.getsourcelines(f)
    lines = [start + i for i, s in enumerate(src) if "# FIRST" in s or "# SECOND" in s]
    report = jaxamp.audit(jaxamp.autocast(f, dtype=BF16))(jnp.ones((16, 16)), jnp.ones((16, 16)))
    got = sorted(r.source for r in report.matmuls)
    assert got == [f"test_audit.py:{n} ({f.__qualname__})" for n in lines], got
    assert sorted(o.source for o in report.ops if o.primitive == "dot_general") == got


def test_an_equinox_filter_jit_function_is_audited_as_its_jax_jit_twin():
    """eqx.filter_jit's ``lower`` returns equinox's own Lowered (its ``as_text`` takes no
    dialect): audit reads the JAX lowering inside, and sees what jax.jit shows."""
    import equinox as eqx

    def f(x, w, scale):  # `scale` a Python float: filter_jit keeps it static
        return jaxamp.autocast(lambda x, w: (x @ w) * scale, dtype=BF16)(x, w)

    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    report = jaxamp.audit(eqx.filter_jit(f))(x, w, 2.0)
    twin = jaxamp.audit(jax.jit(f, static_argnums=2))(x, w, 2.0)
    assert [m.requested for m in report.matmuls] == ["bf16 x bf16 -> bf16"]
    assert [(m.requested, m.executed, m.shape) for m in report.matmuls] == [
        (m.requested, m.executed, m.shape) for m in twin.matmuls
    ]


def test_a_compiled_shape_is_read_as_a_shard_of_the_requested_one():
    # The partitioner divides dimensions by mesh axes (padding where they do not
    # divide), XLA merges adjacent ones; the factors spend at most num_partitions.
    assert _match._shard_of((32, 48), (16, 48), 8)
    assert _match._shard_of((4, 8, 16), (32, 4), 4)  # merged, features over 4
    assert _match._shard_of((10, 4), (3, 4), 4)  # 10 rows over 4 devices, padded
    assert _match._shard_of((8, 48), (48,), 8)  # rows split down to one
    assert not _match._shard_of((48, 64), (16, 48), 8)  # 48 is not 64 over a factor
    assert not _match._shard_of((32, 48), (16, 48), 1)  # off a mesh: the shape itself
    assert not _match._shard_of((32, 64), (16, 16), 4)  # 2 x 4 partitions > 4
    assert not _match._shard_of((48, 32), (32, 48), 8)  # transposed: not a shard


def test_a_product_whose_shape_xla_changed_keeps_its_request_where_its_line_agrees():
    # cuBLASLt pads FP8 operands to multiples of 16: a (24, 40) product runs as
    # (32, 48). Its op_name and line still name it; if their requests agree, that
    # is its request; if they do not, the audit cannot tell and says so.
    same = [_match._Request((24, 40), "f8e4m3fn x f8e4m3fn -> f32") for _ in range(2)]
    assert _match._fitting(same, (32, 48), 1) == same
    both = [same[0], _match._Request((40, 24), "bf16 x bf16 -> bf16")]
    assert _match._fitting(both, (32, 48), 1) == []
    assert _match._fitting(both, (24, 40), 1) == [same[0]]
    assert _match._fitting(both, (40, 24), 1) == [both[1]]
    other = [same[0], _match._Request((16, 16), "bf16 x bf16 -> bf16")]
    assert _match._fitting(other, (40, 24), 1) == [same[0]]  # transposed: by its size


def _modules(model):
    from flax import nnx

    return [n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Module)]


def _nnx_model():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(32, 64, rngs=rngs)
            self.linear2 = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.linear2(jax.nn.relu(self.linear1(x)))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.mlp = Mlp(rngs)

        def __call__(self, x):
            return x + self.mlp(x)

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs), Block(rngs)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.decoder = Decoder(rngs)
            self.head = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.head(self.decoder(x))

    return Model(nnx.Rngs(0))


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_nnx_modules_are_named_by_their_paths_under_every_jit(fp8):
    # autocast names each nnx module call relative to its caller's, so the name
    # stack, and every report read from it, is the model's path
    # (decoder/blocks/0/mlp/linear1), not the callers' absolute paths run together;
    # and it names them under audit even where nothing else needs the names
    # (no fp8=, modules= or debug=).
    import equinox as eqx
    from flax import nnx

    model, x = _nnx_model(), jnp.ones((16, 32))
    before = [(type(n), dict(vars(n))) for n in _modules(model)]
    want = "f8e4m3fn x f8e4m3fn -> bf16" if fp8 else "bf16 x bf16 -> bf16"
    fp8 = jaxamp.fp8(first_last_bf16=False) if fp8 else None
    graphdef, state = nnx.split(model)
    forms = {
        "autocast(model)": (jaxamp.autocast(model, dtype=BF16, fp8=fp8), (x,)),
        "nnx.jit": (nnx.jit(lambda m, x: jaxamp.autocast(m, dtype=BF16, fp8=fp8)(x)), (model, x)),
        "jax.jit": (
            jax.jit(lambda s, x: jaxamp.autocast(nnx.merge(graphdef, s), dtype=BF16, fp8=fp8)(x)),
            (state, x),
        ),
        "eqx.filter_jit": (
            eqx.filter_jit(lambda m, x: jaxamp.autocast(m, dtype=BF16, fp8=fp8)(x)),
            (model, x),
        ),
    }
    paths = {f"decoder/blocks/{i}/mlp/linear{j}" for i in (0, 1) for j in (1, 2)} | {"head"}
    for form, (fn, args) in forms.items():
        report = jaxamp.audit(fn)(*args)
        assert sorted(r.module for r in report.matmuls) == sorted(paths), form
        assert all(r.requested == want for r in report.matmuls), form
        ops = {r.module for r in report.ops}
        assert {r.module for r in report.ops if r.primitive == "dot_general"} == paths, form
        assert ops <= paths | {"", "decoder/blocks/0", "decoder/blocks/1"} | {
            f"decoder/blocks/{i}/mlp" for i in (0, 1)
        }, form
    # The names live on autocast's own copies: the user's modules are as they were.
    after = [(type(n), dict(vars(n))) for n in _modules(model)]
    assert [t for t, _ in after] == [t for t, _ in before]
    assert [sorted(v) for _, v in after] == [sorted(v) for _, v in before]


def test_a_product_is_named_by_its_scopes_not_by_what_the_lowering_adds():
    # JAX's lowering names a nested jit's products jit(<lambda>)/..., a scan body's
    # while/body/closed_call/..., a cond branch's cond/branch_1_fun/...: none of
    # them a module. Each row's module is the one report.ops gives its equation.
    def f(x, w):
        with jax.named_scope("outer"):
            y = jax.jit(lambda x: x @ w)(x)
            y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), y, None, length=2)
            y = jax.lax.cond(y.sum() > 0, lambda y: y @ w, lambda y: y @ w.T, y)
        return jnp.sum(y.astype(jnp.float32))

    x, w = jnp.ones((16, 16)), jnp.ones((16, 16)) * 0.1
    report = jaxamp.audit(jax.grad(jaxamp.autocast(f, dtype=BF16), argnums=1))(x, w)
    assert {r.module for r in report.ops if r.primitive == "dot_general"} == {"outer"}
    assert len(report.matmuls) >= 8  # forward and two gradients, each site
    assert {r.module for r in report.matmuls} == {"outer"}, report


class _Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.remat(_Block)(name=f"block{i}")(x)
        return nn.Dense(8, name="head")(x)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32, name="up")(x)


def test_a_rematerialised_layer_s_gradients_are_named_by_its_module_once():
    # The transpose of a remat region re-enters its scopes
    # (transpose(jvp(jaxamp_autocast))/Net/jvp(jaxamp_autocast)/Net/checkpoint/...):
    # the rows are named as report.ops names the forward ops, not Net/Net/checkpoint.
    x = jnp.ones((16, 32))
    net = _Remat()
    params = net.init(jax.random.key(0), x)
    fwd = jaxamp.autocast(net.apply, dtype=BF16)
    report = jaxamp.audit(jax.grad(lambda p, x: jnp.sum(fwd(p, x).astype(jnp.float32) ** 2)))(
        params, x
    )
    names = {"_Remat/block0/up", "_Remat/block1/up", "_Remat/head"}
    assert {r.module for r in report.ops if r.primitive == "dot_general"} == names
    assert {(r.module, r.pass_) for r in report.matmuls} == {
        (n, p) for n in names for p in ("forward", "backward")
    }, report


def test_nnx_blocks_rebuilt_by_nnx_remat_keep_their_paths():
    # nnx.remat rebuilds each block inside its trace; autocast's copies carry
    # their paths into it.
    from flax import nnx

    from tests.casting.test_rules import _NnxTwoBlocks

    step = nnx.jit(lambda m, x: jaxamp.autocast(m, dtype=BF16)(x))
    report = jaxamp.audit(step)(_NnxTwoBlocks(nnx.Rngs(0)), jnp.ones((4, 8)))
    assert sorted(r.module for r in report.matmuls) == ["blocks/0/lin", "blocks/1/lin"]
