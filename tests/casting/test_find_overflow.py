"""jaxamp.find_overflow: the first op whose float16 result overflowed, where and why.

Each test plants one overflow and checks what the report says about it: the
primitive, forward or backward, the exact source line (found with a ``# HERE``
marker in the function's source), the module path, the loop iteration, the
magnitude, and that the advice, followed, makes the overflow go away
(``assert_advice_works``: every setting the advice names, run again).
The ``shard_map`` cases are in ``tests/multidevice/test_find_overflow_shard_map.py``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from tests.conformance import harness

F16_MAX = 65504.0


def marker_line(fn, marker: str = "# HERE") -> int:
    """The line number of the (only) line of `fn`'s source holding `marker`."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, hits
    return hits[0]


def assert_here(report: jaxamp.types.OverflowReport, fn, marker: str = "# HERE") -> None:
    assert report.file == __file__
    assert report.line == marker_line(fn, marker)
    assert report.function == fn.__qualname__


def same_overflow(a: jaxamp.types.OverflowReport, b: jaxamp.types.OverflowReport) -> bool:
    """The same place overflows again (in that op, or in a cast next to it)."""
    where = ("pass_", "file", "line", "module_path", "scan_iterations", "low_precision")
    return b.found and all(getattr(a, k) == getattr(b, k) for k in where)


def advised_settings(report: jaxamp.types.OverflowReport) -> list[dict]:
    """The find_overflow settings the advice tells the user to use, read from its words."""
    text = report.advice
    if "no single autocast setting" in text:
        return []  # it names only what it tried
    settings = []
    for m in re.finditer(r"(rules|modules)=(\{[^}]*\})", text):  # in the advice's order
        settings.append({m.group(1): json.loads(m.group(2))})
    m = re.search(r"init_scale=([0-9.e+]+)", text)
    if m:
        settings.append({"scale": float(m.group(1))})
    if "dtype=jnp.bfloat16" in text:
        settings.append({"dtype": jnp.bfloat16})
    return settings


def assert_advice_works(report, loss_fn, *args, **kwargs) -> list[jaxamp.types.OverflowReport]:
    """Every setting the advice names removes the reported overflow when followed
    (``kwargs``: the caller's own find_overflow options)."""
    settings = advised_settings(report)
    assert settings, report.advice
    again = []
    for setting in settings:
        # The advice's rules / modules include the caller's own.
        options = {"scale": report.loss_scale, **kwargs, **setting}
        after = jaxamp.find_overflow(loss_fn, **options)(*args)
        assert not same_overflow(report, after), (setting, str(after))
        again.append(after)
    return again


# ---------------------------------------------------------------- plain functions


def matmul_loss(w, x):
    h = x @ w  # HERE
    return jnp.mean(h)


W_BIG, X_BIG = jnp.full((4, 4), 300.0), jnp.full((2, 4), 100.0)  # x @ w = 120000 > 65504


def test_plain_matmul_forward_overflow():
    report = jaxamp.find_overflow(matmul_loss, scale=1.0)(W_BIG, X_BIG)
    assert report.found and report.low_precision
    assert report.primitive == "dot_general"
    assert report.pass_ == "forward"
    assert report.dtype == "float16" and report.nonfinite == "inf"
    assert_here(report, matmul_loss)
    assert report.magnitude_source == "float32"
    assert report.magnitude == pytest.approx(120000.0)
    assert report.dtype_max == F16_MAX
    assert report.ratio == pytest.approx(120000.0 / F16_MAX)
    assert report.scan_iterations == () and report.scan_iteration is None
    assert report.module_path is None
    assert 'rules={"dot_general": "float32"}' in report.advice
    assert report.suggested_rules == {"dot_general": "float32"}
    assert_advice_works(report, matmul_loss, W_BIG, X_BIG)
    text = str(report)
    assert "dot_general" in text and "forward" in text and f":{report.line}" in text
    # The advice works: matmuls in float32, or bfloat16's range.
    assert not jaxamp.find_overflow(matmul_loss, scale=1.0, rules={"dot_general": "float32"})(
        W_BIG, X_BIG
    ).found
    assert not jaxamp.find_overflow(matmul_loss, scale=1.0, dtype=jnp.bfloat16)(W_BIG, X_BIG).found


def test_nothing_overflows():
    report = jaxamp.find_overflow(matmul_loss, scale=2.0**10)(W_BIG / 100, X_BIG / 100)
    assert report.found is False
    assert report.primitive is None and report.advice == ""
    assert "nothing overflowed" in str(report)


def jit_loss(w, x):
    @jax.jit
    def inner(a):
        return a @ w  # HERE

    return jnp.mean(inner(x))


def test_inside_jit_reports_the_inner_op():
    report = jaxamp.find_overflow(jit_loss, scale=1.0)(W_BIG, X_BIG)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.file == __file__ and report.line == marker_line(jit_loss)
    assert report.function == "jit_loss.<locals>.inner"


def checkpoint_loss(w, x):
    h = jax.checkpoint(lambda a: jnp.sin(a) @ w)(x)  # HERE
    return jnp.mean(h)


def test_inside_checkpoint():
    x = jnp.full((2, 4), math.pi / 2)  # sin = 1: 4 * 30000 > 65504
    report = jaxamp.find_overflow(checkpoint_loss, scale=1.0)(jnp.full((4, 4), 30000.0), x)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.file == __file__ and report.line == marker_line(checkpoint_loss)


def scan_loss(w, xs):
    def body(carry, x):
        h = x @ w  # HERE
        return carry + jnp.sum(h), None

    total, _ = jax.lax.scan(body, 0.0, xs)
    return total


def test_inside_scan_reports_the_iteration():
    # Iteration i computes 4 * 1000 * 10**i: 4000, 40000, 400000 (> 65504), ...
    xs = jnp.stack([jnp.full((2, 4), 10.0**i) for i in range(4)])
    w = jnp.full((4, 4), 1000.0)
    report = jaxamp.find_overflow(scan_loss, scale=1.0)(w, xs)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.scan_iterations == (2,) and report.scan_iteration == 2
    assert report.file == __file__ and report.line == marker_line(scan_loss)
    assert "iteration 2" in str(report)
    # Iteration 2 made harmless: the first overflow is iteration 3.
    again = jaxamp.find_overflow(scan_loss, scale=1.0)(w, xs.at[2].set(1.0))
    assert again.scan_iterations == (3,)


def while_loss(w, x, m, n):
    def body(i, h):
        return h @ m  # HERE

    # The loop runs on arguments that are not differentiated (reverse mode
    # cannot go through a while loop of unknown length).
    return jnp.mean(jax.lax.fori_loop(0, n, body, x)) * jnp.sum(w)


def test_inside_while_loop():
    # h grows 8x per iteration from 1: 8, 64, ..., 8**5 = 32768, 8**6 overflows.
    args = (jnp.ones((2, 2)), jnp.ones((2, 4)), jnp.full((4, 4), 2.0), jnp.asarray(10))
    report = jaxamp.find_overflow(while_loss, scale=1.0)(*args)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.scan_iterations == (5,)
    assert report.line == marker_line(while_loss)


@jax.custom_vjp
def amplify(x):
    return x


def _amplify_fwd(x):
    return x, None


def _amplify_bwd(_, g):
    g16 = g.astype(jnp.float16)
    return (g16 * 300.0 * 300.0,)  # 90000: inf in float16


amplify.defvjp(_amplify_fwd, _amplify_bwd)


def custom_vjp_loss(w, x):
    h = amplify(x @ w)  # HERE
    return jnp.sum(h)


def test_custom_vjp_bwd_overflow_is_backward():
    report = jaxamp.find_overflow(custom_vjp_loss, scale=1)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert report.found and report.low_precision
    assert report.pass_ == "backward"
    assert report.primitive == "mul" and report.dtype == "float16"
    # JAX records the custom rule's ops at the call of the custom_vjp function.
    assert report.file == __file__ and report.line == marker_line(custom_vjp_loss)
    # Not the loss scale (it is 1): the advice is about precision, not the scale.
    assert report.suggested_loss_scale is None
    assert "float32" in report.advice  # test_no_single_setting_fixes_it_and_it_says_so


def test_loss_scale_too_large():
    # Finite forward; with loss scale 2**24 the gradient of the mean (2**24 / 8)
    # and then of the matmul overflow float16.
    w, x = jnp.ones((4, 4)), jnp.full((2, 4), 10.0)
    assert not jaxamp.find_overflow(matmul_loss, scale=1.0)(w, x).found
    report = jaxamp.find_overflow(matmul_loss, scale=2.0**24)(w, x)
    assert report.found and report.pass_ == "backward" and report.dtype == "float16"
    assert report.magnitude > F16_MAX
    suggested = report.suggested_loss_scale
    assert suggested is not None and 1 <= suggested < 2.0**24
    assert f"init_scale={suggested:g}" in report.advice
    assert "loss scale is too large" in report.advice
    assert_advice_works(report, matmul_loss, w, x)
    assert not jaxamp.find_overflow(matmul_loss, scale=suggested)(w, x).found
    # ... and it is not needlessly small: 4x larger overflows again.
    assert jaxamp.find_overflow(matmul_loss, scale=4 * suggested)(w, x).found


def test_float32_overflow_is_reported_when_no_float16_op_overflows():
    def loss(w, x):
        e = jnp.exp(x @ w)  # HERE
        return jnp.sum(e / jnp.sum(e))

    report = jaxamp.find_overflow(loss, scale=1)(jnp.full((4, 4), 0.5), jnp.full((2, 4), 100.0))
    # autocast runs exp in float32 (and 200 fits float16): exp(200) overflows float32.
    assert report.found and not report.low_precision
    assert report.primitive == "exp" and report.dtype == "float32" and report.pass_ == "forward"
    assert report.line == marker_line(loss)
    assert "No float16 op overflowed" in report.advice
    # Checked: the program without autocast overflows there too.
    assert "the float32 program (run again without autocast) does so too" in report.advice


def rounding_loss(w, x):
    d = x @ (w + 1e-5) - x @ w  # 4e-5 in float32; 0 where w + 1e-5 rounds to w in float16
    return -jnp.sum(jnp.log(d))  # HERE


def test_float32_overflow_only_under_mixed_precision_is_not_blamed_on_the_program():
    w, x = jnp.full((4, 4), 0.25), jnp.ones((1, 4))
    assert np.isfinite(rounding_loss(w, x))
    report = jaxamp.find_overflow(rounding_loss, scale=1.0)(w, x)
    assert report.found and not report.low_precision
    assert report.primitive == "log" and report.line == marker_line(rounding_loss)
    # 0.3 said the program "does this without mixed precision too".
    assert "without mixed precision too" not in report.advice
    assert "does so too" not in report.advice
    assert "only under mixed precision (the float32 program is finite here)" in report.advice


# ---------------------------------------------------------------- advice, checked


def square_loss(w, x):
    return jnp.sum((x @ w) ** 2)  # HERE


def test_advice_is_checked_before_it_is_given():
    # x @ w = 4e4 fits float16; 2 * x @ w = 8e4, the square's gradient cast to
    # float16 for the backward matmul, does not. 0.3 advised
    # rules={"convert_element_type": "float32"}, which, followed, gives the same report.
    w, x = jnp.full((4, 4), 100.0), jnp.full((2, 4), 100.0)
    report = jaxamp.find_overflow(square_loss, scale=1.0)(w, x)
    assert report.found and report.low_precision and report.line == marker_line(square_loss)
    assert report.magnitude == pytest.approx(8e4)
    (after,) = assert_advice_works(report, square_loss, w, x)
    assert not after.found
    assert report.suggested_rules == {"dot_general": "float32"}
    assert '"convert_element_type": "float32"' not in report.advice
    # The caller's own rules are kept in what it suggests.
    mine = jaxamp.find_overflow(square_loss, scale=1.0, rules={"exp": "float32"})(w, x)
    assert mine.suggested_rules == {"exp": "float32", "dot_general": "float32"}
    assert_advice_works(mine, square_loss, w, x, rules={"exp": "float32"})


def test_no_single_setting_fixes_it_and_it_says_so():
    # The custom_vjp backward rule casts to float16 itself: no autocast rule, module
    # or bfloat16 changes that multiplication.
    report = jaxamp.find_overflow(custom_vjp_loss, scale=1)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert report.found and report.primitive == "mul" and report.dtype == "float16"
    assert report.suggested_rules is None and report.suggested_modules is None
    assert report.suggested_dtype is None and report.suggested_loss_scale is None
    assert "no single autocast setting removes it" in report.advice
    assert 'tried rules={"mul": "float32"}' in report.advice
    assert "9e+04 in float32 (1.37x float16's max 65504)" in report.advice
    assert advised_settings(report) == []
    # What it tried does not help, as it says.
    again = jaxamp.find_overflow(custom_vjp_loss, scale=1, rules={"mul": "float32"})(
        jnp.ones((4, 4)), jnp.ones((2, 4))
    )
    assert same_overflow(report, again)


# ---------------------------------------------------------------- higher-order primitives


@jax.custom_jvp
def project(x, w):
    return x @ w  # HERE


project.defjvp(lambda p, t: (project(*p), t[0] @ p[1] + p[0] @ t[1]))


def custom_jvp_loss(w, x, m):
    # Not differentiated, the custom_jvp function stays one call in the program
    # (differentiated, JAX records its rule's ops at the call, as for custom_vjp).
    return jnp.mean(project(x, m)) * jnp.sum(w)


def test_inside_custom_jvp():
    args = (jnp.ones((2, 2)), X_BIG, W_BIG)
    report = jaxamp.find_overflow(custom_jvp_loss, scale=1.0)(*args)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.line == marker_line(project) and report.function == "project"
    assert_advice_works(report, custom_jvp_loss, *args)


def cond_loss(w, x):
    def big(a):
        return a @ w  # HERE

    def small(a):
        return a

    return jnp.mean(jax.lax.cond(jnp.sum(x) > 0, big, small, x))


def test_inside_cond_the_branch_taken():
    report = jaxamp.find_overflow(cond_loss, scale=1.0)(W_BIG, X_BIG)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.line == marker_line(cond_loss)
    assert not jaxamp.find_overflow(cond_loss, scale=1.0)(W_BIG, -X_BIG).found


def test_a_call_it_cannot_enter_is_named_not_blamed(monkeypatch):
    # Without the jit handler (as for a higher-order primitive find_overflow does not
    # know), the float16 overflow inside comes out as a float32 inf of the call:
    # 0.3 then blamed the float32 program (issue 31: shard_map).
    from jaxamp.casting._find_overflow import _overflow_eval
    from jaxamp.casting._rules._primitives import Kind

    monkeypatch.delitem(_overflow_eval.HANDLERS, Kind.JIT)

    def loss(w, x):
        return jax.jit(lambda a, b: jnp.sum((a @ b).astype(jnp.float32)))(x, w)  # HERE

    report = jaxamp.find_overflow(loss, scale=1.0)(W_BIG, X_BIG)
    assert report.found and report.opaque and report.primitive in ("pjit", "jit")
    assert report.line == marker_line(loss)
    assert "cannot enter" in report.advice and "No float16 op overflowed" not in report.advice
    assert "no float16 / bfloat16 op overflowed" not in str(report)


# ---------------------------------------------------------------- Flax


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)  # HERE


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Mlp()(nn.Dense(4)(x))


def test_linen_module_path():
    model = Block()
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    # Inner Dense's output ~1e5 (100 * 4000 * O(1)); every gradient stays below 1e4.
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p * (4000.0 if "Mlp_0" in jax.tree_util.keystr(path) else 100.0), params
    )

    def loss(p, x):
        return jnp.mean(model.apply(p, x))

    report = jaxamp.find_overflow(loss, scale=1.0)(params, x)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.module_path == "Block/Mlp_0/Dense_0"
    assert report.file == __file__ and report.line == marker_line(Mlp.__call__)
    assert 'modules={"Block/Mlp_0/Dense_0": "float32"}' in report.advice
    # The advice works: that module in float32 overflows nothing.
    fixed = jaxamp.find_overflow(loss, scale=1.0, modules={"Block/Mlp_0/Dense_0": "float32"})(
        params, x
    )
    assert not fixed.found


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.up(x)  # HERE


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.mlp = NnxMlp(rngs)

    def __call__(self, x):
        return self.mlp(x)


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs), NnxBlock(rngs)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_nnx_module_path():
    model = NnxLM(nnx.Rngs(0))
    kernel = model.blocks[1].mlp.up.kernel
    # Its entries fit float16 (a larger kernel would overflow in its own cast), its
    # products do not.
    kernel[...] = kernel[...] * 1e4
    assert float(jnp.abs(kernel[...]).max()) < F16_MAX

    def loss(model, x):
        return jnp.mean(model(x))

    x = jnp.full((2, 4), 30.0)
    report = jaxamp.find_overflow(loss)(model, x)
    assert report.primitive == "dot_general" and report.pass_ == "forward"
    assert report.module_path == "blocks/1/mlp/up"
    assert report.module_class == "Linear"
    assert report.line == marker_line(NnxMlp.__call__)
    assert 'modules={"blocks/1/mlp/up": "float32"}' in report.advice
    assert_advice_works(report, loss, model, x)


# ---------------------------------------------------------------- third-party models


def lm_loss(built):
    def loss(params, batch):
        logits, _ = built.apply(params, built.state, batch)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return jnp.sum(losses * batch["weights"]) / jnp.sum(batch["weights"])

    return loss


def _scaled(params, path: tuple[str, ...], factor: float):
    def visit(tree, rest):
        if not rest:
            return tree * factor
        return {**tree, rest[0]: visit(tree[rest[0]], rest[1:])}

    return visit(params, path)


@pytest.mark.slow  # CI's budget: CI names an HF model's layer in the BERT test below
def test_hf_gpt2_activation_overflow():
    built = harness.build("hf-gpt2")
    loss = lm_loss(built)
    # Kernel entries up to ~2e4 (they fit float16); that layer's outputs do not.
    params = _scaled(built.params, ("transformer", "h", "1", "mlp", "c_fc", "kernel"), 3e5)
    # loss_scale=1: the planted factor also makes that layer's gradient large.
    report = jaxamp.find_overflow(loss, scale=1.0)(params, built.batch)
    assert report.found and report.low_precision
    assert report.pass_ == "forward" and report.primitive == "dot_general"
    assert report.module_path.endswith("transformer/h/1/mlp/c_fc"), report.module_path
    assert os.path.basename(report.file) == "modeling_flax_gpt2.py"
    assert os.sep + "transformers" + os.sep in report.file
    assert report.function == "FlaxConv1D.__call__"
    assert report.line == _package_line("gpt2", "FlaxConv1D", "lax.dot_general(")
    assert report.magnitude > F16_MAX
    # The advice works: that layer in float32 (its float32 output then overflows
    # where the next layer casts it to float16, which the advice says), or every
    # matmul in float32.
    assert f'modules={{"{report.module_path}": "float32"}}' in report.advice
    layer, matmuls = assert_advice_works(report, loss, params, built.batch)
    assert layer.module_path.endswith("transformer/h/1/mlp/c_proj"), str(layer)
    assert f"in {layer.module_path} in the forward pass" in report.advice
    assert not matmuls.found


def _package_line(model: str, cls: str, text: str) -> int:
    """The line of `text` in transformers' Flax `model` module, class `cls`'s __call__."""
    module = importlib.import_module(f"transformers.models.{model}.modeling_flax_{model}")
    source, start = inspect.getsourcelines(getattr(module, cls).__call__)
    return start + next(i for i, line in enumerate(source) if text in line)


def test_hf_bert_activation_overflow():
    built = harness.build("hf-bert-mlm")
    path = ("bert", "encoder", "layer", "1", "intermediate", "dense", "kernel")
    params = _scaled(built.params, path, 3e5)  # as in the GPT-2 test
    report = jaxamp.find_overflow(lm_loss(built), scale=1.0)(params, built.batch)
    assert report.found and report.low_precision
    assert report.pass_ == "forward" and report.primitive == "dot_general"
    # The Dense matmul runs in flax; the model's own frame is the call of that Dense.
    assert report.module_path.endswith("encoder/layer/1/intermediate/dense"), report.module_path
    assert os.path.basename(report.file) == "modeling_flax_bert.py"
    assert report.function == "FlaxBertIntermediate.__call__"
    assert report.line == _package_line("bert", "FlaxBertIntermediate", "self.dense(")


def test_hf_bert_loss_scale_too_large():
    built = harness.build("hf-bert-mlm")
    loss = lm_loss(built)
    report = jaxamp.find_overflow(loss, scale=2.0**40)(built.params, built.batch)
    assert report.found and report.low_precision and report.pass_ == "backward"
    suggested = report.suggested_loss_scale
    assert suggested is not None and suggested < 2.0**40
    assert f"dynamic_scale(init_scale={suggested:g})" in report.advice
    assert not jaxamp.find_overflow(loss, scale=suggested)(built.params, built.batch).found


@pytest.mark.slow  # CI's budget: CI names a transformers model's layer with BERT
def test_hf_vit_softmax_without_max_subtraction():
    built = harness.build("hf-vit")

    def naive_softmax_loss(params, batch):
        logits, _ = built.apply(params, built.state, batch)
        e = jnp.exp(logits * 1e5)  # HERE
        probs = e / jnp.sum(e, axis=-1, keepdims=True)
        picked = jnp.take_along_axis(probs, batch["labels"][:, None], axis=-1)
        return -jnp.mean(jnp.log(picked))

    # loss_scale=1: at 2**15 the 1e5 factor alone would overflow the float16 gradient.
    report = jaxamp.find_overflow(naive_softmax_loss, scale=1.0)(built.params, built.batch)
    # autocast keeps exp in float32, so no float16 op overflows: exp does, in float32.
    assert report.found and not report.low_precision
    assert report.primitive == "exp" and report.dtype == "float32"
    assert report.pass_ == "forward"
    assert report.file == __file__ and report.line == marker_line(naive_softmax_loss)


def test_flax_linen_transformer_healthy():
    built = harness.build("flax-linen-transformer")
    report = jaxamp.find_overflow(lm_loss(built))(built.params, built.batch)
    assert report.found is False


# ---------------------------------------------------------------- bad input


def test_bad_input():
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    with pytest.raises(TypeError, match="fun must be callable"):
        jaxamp.find_overflow("loss")(w, x)
    with pytest.raises(ValueError, match="dtype must be jnp.float16 or jnp.bfloat16, got float32"):
        jaxamp.find_overflow(matmul_loss, dtype=jnp.float32)(w, x)
    with pytest.raises(TypeError, match=r"scalar floating loss, got float32\[2, 4\]"):
        jaxamp.find_overflow(lambda w, x: x @ w)(w, x)
    with pytest.raises(ValueError, match="argnums=2 is out of range for 2 positional"):
        jaxamp.find_overflow(matmul_loss, argnums=2)(w, x)
    with pytest.raises(TypeError, match="argnums must be an int"):
        jaxamp.find_overflow(matmul_loss, argnums="w")(w, x)
    with pytest.raises(ValueError, match="scale must be positive"):
        jaxamp.find_overflow(matmul_loss, scale=-1.0)(w, x)
    with pytest.raises(ValueError, match="unknown primitive"):
        jaxamp.find_overflow(matmul_loss, rules={"dot_genral": "float32"})(w, x)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda w: jaxamp.find_overflow(matmul_loss)(w, x))(w)


def test_report_is_frozen_and_exported():
    report = jaxamp.find_overflow(matmul_loss, scale=1.0)(W_BIG, X_BIG)
    with pytest.raises(AttributeError):
        report.found = False
    assert "find_overflow" in jaxamp.__all__ and "OverflowReport" in jaxamp.types.__all__
    assert np.isfinite(report.magnitude)


def test_a_loss_that_casts_itself_is_checked_as_written():
    # float16 by hand, no autocast: exp(12) overflows float16. Under autocast exp
    # runs in float32 and nothing is found.
    def loss_fn(w, x):
        h = x.astype(jnp.float16) @ w.astype(jnp.float16)
        return jnp.sum(jnp.log(jnp.exp(h)).astype(jnp.float32))  # HERE

    w, x = jnp.full((4, 4), 1.0), jnp.full((2, 4), 3.0)
    assert not bool(jnp.isfinite(loss_fn(w, x)))
    as_written = jaxamp.find_overflow(loss_fn, scale=1.0, autocast=False)(w, x)
    assert as_written.found and as_written.pass_ == "forward", as_written
    assert (as_written.primitive, as_written.dtype) == ("exp", "float16")
    assert as_written.line == marker_line(loss_fn)
    assert as_written.magnitude == pytest.approx(math.exp(12.0), rel=1e-6), as_written
    # No autocast setting applies to a program run as written; the advice says so.
    assert "the code itself casts to float16 (autocast=False)" in as_written.advice
    assert advised_settings(as_written) == []
    assert not jaxamp.find_overflow(loss_fn, scale=1.0)(w, x).found
    with pytest.raises(TypeError, match="autocast must be a bool"):
        jaxamp.find_overflow(loss_fn, autocast="no")(w, x)


def test_loss_scale_from_an_optimizer_state():
    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale(init_scale=2.0**20))
    state = tx.init(W_BIG)
    report = jaxamp.find_overflow(matmul_loss, scale=state)(W_BIG / 1000, jnp.ones((2, 4)))
    assert report.loss_scale == 2.0**20
    replicated = jax.tree.map(lambda x: jnp.stack([x, x]), state)  # as pmap keeps it
    assert (
        jaxamp.find_overflow(matmul_loss, scale=replicated)(
            W_BIG / 1000, jnp.ones((2, 4))
        ).loss_scale
        == 2.0**20
    )
    with pytest.raises(ValueError, match="one number"):
        jaxamp.find_overflow(matmul_loss, scale=jnp.ones(2))(W_BIG, X_BIG)
    with pytest.raises(TypeError, match=r"got a dict with no LossScaleState in it$"):
        jaxamp.find_overflow(matmul_loss, scale={"a": jnp.ones(3)})(W_BIG, X_BIG)
