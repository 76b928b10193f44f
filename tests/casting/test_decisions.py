"""``jaxamp.audit``'s view before XLA: the dtype autocast chose for each equation,
and why (issue 33, part 3). The reasons come from the decision code itself
(``_rules.choose``, ``Context.rules_at``, the FP8 plan), so each test plants a
rule or an exclusion and reads it back, with the dtype the equation really got
in the program (checked against the jaxpr, not the log alone).
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import dot_input_dtypes

BF16 = jnp.bfloat16


class MLP(nn.Module):
    sizes: tuple[int, ...] = (48, 64, 80, 16)

    @nn.compact
    def __call__(self, x):
        for i, size in enumerate(self.sizes):
            x = nn.Dense(size, name=f"layer{i}")(x)  # DENSE
            x = jnp.tanh(x) if i < len(self.sizes) - 1 else x  # TANH
        return x


def _setup(sizes=(48, 64, 80, 16)):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)), jnp.float32)
    model = MLP(sizes)
    return model, model.init(jax.random.key(0), x), x


def _line(marker: str) -> int:
    src, start = inspect.getsourcelines(MLP.__call__)
    return start + next(i for i, line in enumerate(src) if marker in line)


def _rows(report, primitive, module=None):
    return [
        r
        for r in report.ops
        if r.primitive == primitive and (module is None or r.module.endswith(module))
    ]


def _jaxpr_dtypes(fn, *args, primitive):
    """The input dtypes of every `primitive` equation of `fn`'s program, nested
    jaxprs included: what really ran, to hold the log to."""
    found = dot_input_dtypes(jax.make_jaxpr(fn)(*args), primitive)
    return [tuple(str(d) for d in ins) for ins in found]


def test_a_user_rule_shows_its_class_and_where_it_comes_from():
    model, params, x = _setup()
    plain = jaxamp.audit(jaxamp.autocast(model.apply, dtype=BF16))(params, x)
    tanh = _rows(plain, "tanh")
    assert len(tanh) == 3
    # The table's class: tanh follows its bfloat16 activation.
    assert {(r.dtype, r.op_class, r.rule) for r in tanh} == {
        ("bfloat16", "elementwise", "DEFAULT_RULES")
    }
    ruled = jaxamp.autocast(model.apply, dtype=BF16, rules={"tanh": "float32"})
    report = jaxamp.audit(ruled)(params, x)
    tanh = _rows(report, "tanh")
    assert {(r.dtype, r.op_class, r.rule) for r in tanh} == {("float32", "float32", "rules=")}
    assert all(r.reason == "a float32-list op" for r in tanh)
    assert {r.source for r in tanh} == {f"test_decisions.py:{_line('# TANH')} (MLP.__call__)"}
    # The log says what the program does: tanh's operands are float32 there.
    assert set(_jaxpr_dtypes(ruled, params, x, primitive="tanh")) == {("float32",)}
    assert "tanh" in str(report) and "float32 (rules=)" in str(report)


def test_a_modules_rule_names_its_pattern():
    model, params, x = _setup()
    fwd = jaxamp.autocast(model.apply, dtype=BF16, modules={"layer2": "float32"})
    (dot,) = _rows(jaxamp.audit(fwd)(params, x), "dot_general", "layer2")
    assert (dot.dtype, dot.op_class, dot.rule) == (
        "float32",
        "as_written",
        "modules['layer2']='float32'",
    )
    assert dot.module == "MLP/layer2"
    assert dot.source == f"test_decisions.py:{_line('# DENSE')} (MLP.__call__)"
    fwd = jaxamp.autocast(model.apply, dtype=BF16, modules={"layer1": {"tanh": "float32"}})
    # The Dense's own ops are under layer1; tanh is the MLP's, so the rule does not reach it.
    assert {r.rule for r in _rows(jaxamp.audit(fwd)(params, x), "tanh")} == {"DEFAULT_RULES"}


def test_full_precision_regions_say_so():
    def f(x, w):
        h = x @ w
        return jaxamp.full_precision(lambda h: jnp.sin(h) @ w)(h)

    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
    report = jaxamp.audit(jaxamp.autocast(f, dtype=BF16))(x, w)
    first, second = _rows(report, "dot_general")
    assert (first.dtype, first.op_class) == ("bfloat16", "lower")
    assert (second.dtype, second.op_class, second.rule) == (
        "float32",
        "as_written",
        "full_precision",
    )


def test_fp8_first_and_last_layers_say_why_they_stay_bfloat16():
    model, params, x = _setup()
    fwd = jaxamp.autocast(model.apply, dtype=BF16, fp8=jaxamp.fp8())

    def loss(params, x):
        return jnp.mean(fwd(params, x).astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss))
    report = jaxamp.audit(step)(params, x)
    dots = {r.module: r for r in _rows(report, "dot_general")}
    assert sorted(dots) == [f"MLP/layer{i}" for i in range(4)]
    assert dots["MLP/layer0"].dtype == "bfloat16"
    assert "first matrix-product layer (first_last_bf16)" in dots["MLP/layer0"].reason
    assert dots["MLP/layer3"].dtype == "bfloat16"
    assert "last matrix-product layer (first_last_bf16)" in dots["MLP/layer3"].reason
    for name in ("MLP/layer1", "MLP/layer2"):
        assert dots[name].dtype == "float8_e4m3fn"
        assert dots[name].reason.startswith("FP8 tensorwise")
    # What the program does: two FP8 forward products, two bfloat16 ones.
    fwd_dots = _jaxpr_dtypes(fwd, params, x, primitive="dot_general")
    assert sorted(fwd_dots).count(("float8_e4m3fn", "float8_e4m3fn")) == 2
    assert fwd_dots.count(("bfloat16", "bfloat16")) == 2


def test_fp8_module_overrides_show_their_pattern():
    model, params, x = _setup()
    cfg = jaxamp.fp8("rowwise", modules={"layer0": True, "layer1": False})
    report = jaxamp.audit(jaxamp.autocast(model.apply, dtype=BF16, fp8=cfg))(params, x)
    dots = {r.module: r for r in _rows(report, "dot_general")}
    assert dots["MLP/layer0"].dtype == "float8_e4m3fn"
    assert dots["MLP/layer0"].reason.endswith("(jaxamp.fp8(modules={'layer0': True}))")
    assert dots["MLP/layer0"].reason.startswith("FP8 rowwise")
    assert dots["MLP/layer1"].dtype == "bfloat16"
    assert "not FP8: jaxamp.fp8(modules={'layer1': False})" in dots["MLP/layer1"].reason


def test_a_gemm_whose_dims_are_not_multiples_of_16_says_why():
    model, params, x = _setup((48, 40, 80, 16))
    cfg = jaxamp.fp8(first_last_bf16=False)
    report = jaxamp.audit(jaxamp.autocast(model.apply, dtype=BF16, fp8=cfg))(params, x)
    dots = {r.module: r for r in _rows(report, "dot_general")}
    # layer1: (32 x 48) @ (48 x 40); layer2: (32 x 40) @ (40 x 80).
    for name, mnk in (("MLP/layer1", "32, 40, 48"), ("MLP/layer2", "32, 80, 40")):
        assert dots[name].dtype == "bfloat16"
        assert f"not FP8: M, N, K = {mnk}, not all multiples of 16" in dots[name].reason
    assert dots["MLP/layer0"].dtype == dots["MLP/layer3"].dtype == "float8_e4m3fn"


def test_float32_list_ops_show_their_class():
    def f(x, w):
        logits = x @ w
        return jax.nn.softmax(logits), jnp.exp(logits), jax.nn.log_softmax(logits)

    x, w = jnp.ones((16, 32)), jnp.ones((32, 16)) * 0.01
    report = jaxamp.audit(jaxamp.autocast(f, dtype=jnp.float16))(x, w)
    exps = _rows(report, "exp")
    assert len(exps) == 3 and {(r.dtype, r.op_class) for r in exps} == {("float32", "float32")}
    assert {r.rule for r in exps} == {"DEFAULT_RULES"}
    # jnp.exp of the float16 activation: one float32 region with its neighbours.
    assert any(r.reason.startswith("float32 region: exp (a float32-list op)") for r in exps)
    (ls,) = [r for r in report.ops if r.rule == "log_softmax (FLOAT32_FUNCTIONS)"]
    assert (ls.primitive, ls.dtype, ls.op_class) == ("jit", "float32", "float32")
    # The reductions of softmax: the float32 list, from the table.
    assert {(r.dtype, r.op_class) for r in _rows(report, "reduce_max")} == {("float32", "float32")}


def test_an_activation_meeting_a_float32_input_is_promoted():
    def f(x, w, target):
        return ((x @ w) - target) @ w  # not the output: else it is float32 anyway

    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
    report = jaxamp.audit(jaxamp.autocast(f, dtype=BF16))(x, w, jnp.ones((16, 16)))
    (sub,) = _rows(report, "sub")
    assert sub.dtype == "float32" and sub.reason.startswith("promoted")


def test_a_step_jax_traced_before_is_traced_again_for_the_log():
    model, params, x = _setup()
    fwd = jaxamp.autocast(model.apply, dtype=BF16)
    step = jax.jit(jax.grad(lambda p, x: jnp.sum(fwd(p, x).astype(jnp.float32))))
    step(params, x)  # traced, compiled and cached by JAX
    first = jaxamp.audit(step)(params, x)
    again = jaxamp.audit(step)(params, x)
    assert len(first.ops) == len(again.ops) > 0
    assert [r.primitive for r in first.ops] == [r.primitive for r in again.ops]


def test_without_autocast_there_is_nothing_to_explain():
    model, params, x = _setup()
    report = jaxamp.audit(model.apply)(params, x)
    assert report.ops == () and "autocast's choices" not in str(report)


@pytest.mark.parametrize("dtype", [jnp.float16, BF16])
def test_the_log_matches_the_program_for_every_equation(dtype):
    """Every logged dtype of a ``dot_general`` and a ``tanh`` is the dtype its
    operands have in the autocast program, in order."""
    model, params, x = _setup()
    fwd = jaxamp.autocast(model.apply, dtype=dtype)
    report = jaxamp.audit(fwd)(params, x)
    for prim in ("dot_general", "tanh"):
        logged = [r.dtype for r in _rows(report, prim)]
        ran = [d[0] for d in _jaxpr_dtypes(fwd, params, x, primitive=prim)]
        assert logged == ran, prim


@pytest.mark.parametrize("loop", ["cond", "scan", "while"])
def test_audit_lists_a_product_inside_a_loop_or_branch_once(loop):
    x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
    fn = {
        "cond": lambda x, w: jax.lax.cond(x[0, 0] > 0, lambda h: jnp.tanh(h @ w), lambda h: h, x),
        "scan": lambda x, w: jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[
            0
        ],
        "while": lambda x, w: jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0)
        )[0],
    }[loop]
    ops = jaxamp.audit(jaxamp.autocast(fn, dtype=BF16))(x, w).ops
    assert [o.primitive for o in ops if o.primitive in ("dot_general", "tanh")] == [
        "dot_general",
        "tanh",
    ]
