"""``jaxamp.fp8_health``: per FP8 product, the amax and the fractions of each cast that
saturate and flush to zero (issue 46, item 3).

The fractions are checked against a float64 computation of the same casts from
their definitions: an element saturates when it is inf or NaN, and flushes when
it is finite, nonzero, and its magnitude times the scale ``fmax / amax`` is at most
half the FP8 type's smallest subnormal (round to nearest even: it rounds to 0).
The planted values sit far from that threshold (1e-12 of the amax against e5m2's
1.3e-10), so float32 and float64 agree on every element and the counts must
match exactly.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from jaxamp.casting._fp8 import _fp8, _fp8_gemm

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_ALL = jaxamp.fp8(first_last_bf16=False)
B, D = 32, 64


def reference(x, dtype, axes) -> tuple[float, float, float]:
    """``(amax, saturated, flushed)`` of `x` cast to `dtype`, the amax over `axes`
    (None: the whole tensor), in float64."""
    x = np.asarray(x, np.float64)
    fi = jnp.finfo(dtype)
    mag = np.abs(x)
    with np.errstate(invalid="ignore"):
        amax = np.max(mag, axis=axes, keepdims=axes is not None)
        scaled = mag * (float(fi.max) / np.maximum(amax, float(fi.max) * 2.0**-126))
    finite = np.isfinite(x)
    flushed = finite & (x != 0) & (scaled <= float(fi.smallest_subnormal) / 2)
    return float(np.max(mag)), float(np.mean(~finite)), float(np.mean(flushed))


class Planted(nn.Module):
    """``sat`` reads an input with infs (its output masked back to finite, as a
    sentinel is); ``under``'s output gradient spans 12 decades."""

    @nn.compact
    def __call__(self, x, x_inf):
        h = nn.Dense(D, name="first")(x)
        s = nn.Dense(D, name="sat")(x_inf)
        s = jnp.where(jnp.isfinite(s), s, 0.0)
        h = nn.Dense(D, name="mid")(jax.nn.relu(h + s))
        return nn.Dense(D, name="under")(h)


def _planted(scaling: str):
    kx, ki, kc, kp, kw = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(kx, (B, D))
    x_inf = jax.random.normal(ki, (B, D))
    x_inf = x_inf.at[3, 5].set(jnp.inf).at[17, 40].set(-jnp.inf)
    # A gradient of ones with a fifth of its entries 1e-12: every row and column
    # keeps an amax of 1, so the small entries flush rowwise too.
    small = jax.random.bernoulli(kc, 0.2, (B, D))
    c = jnp.where(small, 1e-12, 1.0)
    model = Planted()
    params = model.init(kp, x, x)
    fwd = jaxamp.autocast(
        model.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
    )

    def loss(params, x, x_inf):
        return jnp.sum(fwd(params, x, x_inf) * c)

    return loss, params, x, x_inf, c


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_planted_layers_are_named_with_their_fractions(scaling):
    loss, params, x, x_inf, c = _planted(scaling)
    (_, health), _ = jax.jit(jaxamp.fp8_health(loss))(params, x, x_inf)
    health = jax.tree.map(float, health)
    names = {"Planted/first", "Planted/sat", "Planted/mid", "Planted/under"}
    assert set(health) == names
    grads = ("grad_dgrad", "grad_wgrad") if scaling == "rowwise" else ("grad",)
    again = ("lhs_wgrad", "rhs_dgrad") if scaling == "rowwise" else ()
    for name in names:
        assert set(health[name]) == {"lhs", "rhs", *grads, *again}

    def having(cast, stat):
        return {n for n, casts in health.items() if casts[cast][stat] > 0}

    assert having("lhs", "saturated") == {"Planted/sat"}
    assert having("lhs", "flushed") == {"Planted/sat"}
    assert having("rhs", "saturated") == having("rhs", "flushed") == set()
    for g in grads:
        assert having(g, "flushed") == {"Planted/under"}
        assert having(g, "saturated") == set()

    # Tensorwise the inf is the amax of the whole operand: every finite element
    # flushes; rowwise only the two rows holding an inf do.
    row = 1 if scaling == "rowwise" else None
    amax, sat, flush = reference(x_inf, E4M3, row)
    got = health["Planted/sat"]["lhs"]
    assert got["amax"] == amax == np.inf
    assert got["saturated"] == pytest.approx(sat, abs=0.5 / x_inf.size) and sat == 2 / x_inf.size
    assert got["flushed"] == pytest.approx(flush, abs=0.5 / x_inf.size) and flush > 0
    if scaling == "rowwise":
        # The wgrad casts the input again per column: only the two columns holding
        # an inf flush, the infs themselves saturating again.
        amax, sat, flush = reference(x_inf, E4M3, 0)
        got = health["Planted/sat"]["lhs_wgrad"]
        assert got["amax"] == amax and got["saturated"] == pytest.approx(sat, abs=0.5 / x.size)
        assert got["flushed"] == pytest.approx(flush, abs=0.5 / x_inf.size)
        assert 0 < flush < health["Planted/sat"]["lhs"]["flushed"]
    # autocast rounds the input to bfloat16 before the product quantizes it.
    x16 = x.astype(jnp.bfloat16)
    assert health["Planted/first"]["lhs"]["amax"] == reference(x16, E4M3, None)[0]

    # The gradient reaching `under` is `c`, rounded to bfloat16 (far from any threshold).
    c16 = np.asarray(c.astype(jnp.bfloat16), np.float64)
    casts = {"grad": None} if scaling == "tensorwise" else {"grad_dgrad": 1, "grad_wgrad": 0}
    for cast, axes in casts.items():
        amax, sat, flush = reference(c16, E5M2, axes)
        got = health["Planted/under"][cast]
        assert got["amax"] == amax == 1.0
        assert got["saturated"] == sat == 0.0
        assert got["flushed"] == pytest.approx(flush, abs=0.5 / c.size)
        assert flush == pytest.approx(float(np.mean(c16 < 1)))


def test_rowwise_backward_casts_the_weight_again_per_row():
    """Rowwise, the dgrad contracts the weight's other axis: it casts the weight
    again, one scale per row, and flushes what the forward's per-column scales
    keep (and the reverse). Two huge entries in one row: the forward flushes
    the rest of their two columns, the dgrad the rest of their row."""
    w = jax.random.normal(jax.random.key(10), (D, D)).at[0, :2].set(1e8)
    x = jax.random.normal(jax.random.key(11), (B, D))
    f = jaxamp.autocast(
        lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=jaxamp.fp8("rowwise", first_last_bf16=False)
    )
    (_, health), _ = jax.jit(jaxamp.fp8_health(lambda w: jnp.sum(f(w, x))))(w)
    health = jax.tree.map(float, health["w"])
    w16 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    x16 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    for cast, operand, axes, flushed in (
        ("rhs", w16, 0, 2 * (D - 1)), ("rhs_dgrad", w16, 1, D - 2),
        ("lhs", x16, 1, None), ("lhs_wgrad", x16, 0, None),
    ):  # fmt: skip
        amax, sat, flush = reference(operand, E4M3, axes)
        assert health[cast]["amax"] == amax and health[cast]["saturated"] == sat == 0.0
        assert health[cast]["flushed"] == pytest.approx(flush, abs=0.5 / operand.size)
        if flushed is not None:
            assert flush * operand.size == flushed


def test_rowwise_rescues_a_row_that_tensorwise_flushes():
    """A row of tiny gradients flushes under one tensorwise scale and keeps its
    own scale rowwise in the dgrad cast (not in the wgrad cast, whose amax runs
    down the columns)."""
    w = jax.random.normal(jax.random.key(1), (D, D)) / 8
    x = jax.random.normal(jax.random.key(2), (B, D))
    c = jnp.ones((B, D)).at[4].set(1e-12)

    def flushed(scaling):
        f = jaxamp.autocast(
            lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
        )
        (_, health), _ = jaxamp.fp8_health(lambda w: jnp.sum(f(w, x) * c))(w)
        return {k: float(v["flushed"]) for k, v in health["w"].items()}

    tensorwise, rowwise = flushed("tensorwise"), flushed("rowwise")
    assert tensorwise["grad"] == pytest.approx(1 / B)
    assert rowwise["grad_dgrad"] == 0.0
    assert rowwise["grad_wgrad"] == pytest.approx(1 / B)


def test_value_and_grads_are_jax_value_and_grads_and_no_host_transfer():
    loss, params, x, x_inf, _ = _planted("tensorwise")
    x = jax.device_put(x)
    plain = jax.jit(jax.value_and_grad(lambda p: loss(p, x, x)))(params)
    step = jax.jit(jaxamp.fp8_health(lambda p, x: (loss(p, x, x), 2.0), has_aux=True))
    with jax.transfer_guard("disallow"):
        ((value, aux), health), grads = step(params, x)
        step(params, x)  # and again, from the cache
    assert float(value) == float(plain[0]) and float(aux) == 2.0
    jax.tree.map(np.testing.assert_array_equal, grads, plain[1])
    assert health["Planted/first"]["rhs"]["amax"].dtype == jnp.float32


def test_off_by_default_the_program_is_unchanged(monkeypatch):
    """Without fp8_health the traced step is exactly the one that calls the FP8
    product directly, before and after a measured trace of the same function."""
    loss, params, x, x_inf, _ = _planted("tensorwise")
    step = jax.grad(loss)
    before = str(jax.make_jaxpr(step)(params, x, x_inf))
    measured = str(jax.make_jaxpr(jaxamp.fp8_health(loss))(params, x, x_inf))
    after = str(jax.make_jaxpr(step)(params, x, x_inf))
    monkeypatch.setattr(
        _fp8._fp8_health,
        "dot",
        lambda lhs, rhs, gemm, name: _fp8_gemm.fp8_dot_general(lhs, rhs, gemm),
    )
    direct = str(jax.make_jaxpr(step)(params, x, x_inf))
    assert before == after == direct
    # The model's own mask reads is_finite once; each measured cast once more.
    assert measured.count("is_finite") > before.count("is_finite")


def test_nnx_names_are_module_paths_as_audit_names_them():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(D, D, rngs=rngs)
            self.fc2 = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.block = Block(rngs)
            self.head = nnx.Linear(D, 32, rngs=rngs)

        def __call__(self, x):
            return self.head(self.block(x))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))
    x = jnp.ones((B, D))

    def loss(state, x):
        model = nnx.merge(graphdef, state)
        return jnp.mean(jaxamp.autocast(model, dtype=jnp.bfloat16, fp8=FP8_ALL)(x) ** 2)

    (_, health), grads = jax.jit(jaxamp.fp8_health(loss))(state, x)
    assert sorted(health) == ["block/fc1", "block/fc2", "head"]
    report = jaxamp.audit(jaxamp.fp8_health(loss))(state, x)
    assert {r.module for r in report.matmuls} == set(health)
    assert isinstance(grads, nnx.State)


def test_a_product_called_twice_is_two_entries():
    w = jax.random.normal(jax.random.key(3), (D, D))
    f = jaxamp.autocast(lambda w, x: (x @ w) @ w, dtype=jnp.bfloat16, fp8=FP8_ALL)
    (_, health), _ = jaxamp.fp8_health(lambda w: jnp.sum(f(w, jnp.ones((B, D)))))(w)
    assert sorted(health) == ["w", "w#2"]
    assert float(health["w"]["lhs"]["amax"]) == 1.0
    assert float(health["w#2"]["lhs"]["amax"]) > 1.0


def test_products_in_a_while_body_are_named_unmeasured():
    """A while loop is not reverse-differentiable (here it reads no differentiated
    value): its products cannot hand out backward figures. A scan's are measured
    (test_fp8_health_loops.py)."""
    w, v = jax.random.normal(jax.random.key(4), (2, D, D)) / 8

    def body(c):
        return c[0] + 1, jnp.tanh(c[1] @ v)

    f = jaxamp.autocast(
        lambda w, x: x @ w + jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1],
        dtype=jnp.bfloat16, fp8=FP8_ALL,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"not measured: \['dot_general'\]"):
        (_, health), _ = jaxamp.fp8_health(lambda w: jnp.sum(f(w, jnp.ones((B, D)))))(w)
    assert sorted(health) == ["w"]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="fun must be callable"):
        jaxamp.fp8_health(3)
    with pytest.raises(TypeError, match="argnums"):
        jaxamp.fp8_health(lambda x: x, argnums="0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (_, health), g = jaxamp.fp8_health(lambda x: jnp.sum(x**2))(jnp.ones(3))
    assert health == {} and g.tolist() == [2.0, 2.0, 2.0]


def test_an_autocast_call_on_no_differentiated_argument_is_named_unmeasured():
    """It runs as its own jit (autocast's eager call), traced apart from the loss."""
    w, v = jax.random.normal(jax.random.key(5), (2, D, D))
    f = jaxamp.autocast(lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=FP8_ALL)
    x = jnp.ones((B, D))
    with pytest.warns(UserWarning, match=r"not measured: \['w#2'\]"):
        (_, health), grad = jaxamp.fp8_health(lambda w, v: jnp.sum(f(w, x)) + jnp.sum(f(v, x)))(
            w, v
        )
    assert sorted(health) == ["w"] and grad.shape == (D, D)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_flushed_is_the_products_own_rounding_under_its_rounded_scale(out_dtype, seed):
    """Random operands crowding the flush threshold: ``flushed`` must count the
    elements the product itself rounds to 0. A tensorwise product's scale is
    rounded to its dequantization dtype (bfloat16 for a bfloat16 product), which
    moves the threshold by up to 2**-8 of it; the float64 reference applies the
    same rounded scale, so each element's verdict is exact (no element within a
    float32 ulp of the threshold but on it: float32 and float64 agree on every one;
    one exactly on it rounds to even, 0)."""
    rng = np.random.default_rng(seed)
    amax = float(rng.uniform(1.0, 2.0)) * 2.0 ** int(rng.integers(-8, 8))
    fmax, tiny = float(jnp.finfo(E4M3).max), float(jnp.finfo(E4M3).smallest_subnormal)
    # Magnitudes within 2 % of the threshold, both signs, and the amax itself.
    near = amax * tiny / 2 / fmax * rng.uniform(0.98, 1.02, (B, D))
    x = (near * rng.choice([-1.0, 1.0], (B, D))).astype(np.float32)
    x[0, 0] = amax
    x = np.asarray(jnp.asarray(x, out_dtype), np.float64)  # the operand the product sees
    amax = float(np.max(np.abs(x)))
    w = jax.random.normal(jax.random.key(seed), (D, D), out_dtype)
    f = jaxamp.autocast(lambda w, x: x @ w, dtype=out_dtype, fp8=FP8_ALL)
    (_, health), _ = jaxamp.fp8_health(lambda w, x: jnp.sum(f(w, x).astype(jnp.float32)))(
        w, jnp.asarray(x, out_dtype)
    )
    dequantized = _fp8_gemm._dequantized_dtype(np.dtype(out_dtype))
    inv = float(np.asarray(np.float32(amax / fmax)).astype(dequantized))
    scaled = np.abs(x) / inv
    off = np.abs(scaled - tiny / 2)
    assert not np.any((off > 0) & (off <= tiny / 2 * 2.0**-23))  # exact ties round to 0
    expected = np.count_nonzero((x != 0) & (scaled <= tiny / 2)) / x.size
    assert 0 < expected < 1
    assert float(health["w"]["lhs"]["flushed"]) == pytest.approx(expected, abs=0.1 / x.size)


@pytest.mark.parametrize("wrap", [jax.checkpoint, lambda f: lambda w: jax.jit(f)(w)])
def test_products_in_a_cached_nested_trace_are_named_unmeasured(wrap):
    """``jax.checkpoint`` and ``jax.jit`` trace their function once and reuse the
    jaxpr: the counting pass traced it, so the measured pass never meets the
    product. It is still not measured, and the warning must still say so."""
    w = jax.random.normal(jax.random.key(6), (D, D))
    f = jaxamp.autocast(lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=FP8_ALL)
    loss = wrap(lambda w: jnp.sum(f(w, jnp.ones((B, D)))))
    with pytest.warns(UserWarning, match=r"not measured: \['w'\]"):
        (_, health), _ = jaxamp.fp8_health(loss)(w)
    assert health == {}


def test_argnums_are_read_as_jax_reads_them_and_out_of_range_is_named():
    w = jax.random.normal(jax.random.key(7), (D, D))
    f = jaxamp.autocast(lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=FP8_ALL)
    loss = lambda w, x: jnp.sum(f(w, x))  # noqa: E731
    x = jnp.ones((B, D))
    (_, health), g = jaxamp.fp8_health(loss, argnums=np.int64(0))(w, x)
    np.testing.assert_array_equal(g, jax.grad(loss, argnums=np.int64(0))(w, x))
    # The probes fp8_health appends are its own: the error counts the caller's arguments.
    with pytest.raises(TypeError, match=r"argnums=\(0, 2\).*2 positional arguments"):
        jaxamp.fp8_health(loss, argnums=(0, 2))(w, x)


def _onehot_loss():
    w = jax.random.normal(jax.random.key(8), (D, 16))
    f = jaxamp.autocast(lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=FP8_ALL)

    def loss(w, x, labels, step):
        onehot = np.eye(16, dtype=np.float32)[np.asarray(labels)]
        if step > 0:
            x = x * 2
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(f(w, x).astype(jnp.float32)) * onehot, -1))

    return loss, w, np.ones((B, D), np.float32), np.arange(B) % 16


def test_a_numpy_argument_not_differentiated_stays_numpy_as_in_jax_value_and_grad():
    """A host batch read with numpy works under jax.value_and_grad (only the
    differentiated arguments are traced): the counting pass must not trace it."""
    loss, w, x, labels = _onehot_loss()
    (value, health), grad = jaxamp.fp8_health(loss)(w, x, labels, 1)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x, labels, 1)
    assert float(value) == float(ref_value) and sorted(health) == ["w"]
    np.testing.assert_array_equal(grad, ref_grad)
    assert float(health["w"]["lhs"]["amax"]) == 2.0


def test_an_array_flag_not_differentiated_in_python_control_flow():
    """Fine under eager jax.value_and_grad (only w is traced); the counting pass's
    eval_shape stages every op, so it must count as value_and_grad traces."""
    loss, w, x, labels = _onehot_loss()
    for step in (0, 1):  # both branches of the `if`
        (value, health), grad = jaxamp.fp8_health(loss)(w, x, labels, jnp.int32(step))
        ref_value, ref_grad = jax.value_and_grad(loss)(w, x, labels, jnp.int32(step))
        assert float(value) == float(ref_value) and sorted(health) == ["w"]
        np.testing.assert_array_equal(grad, ref_grad)
        assert float(health["w"]["lhs"]["amax"]) == 2.0**step
