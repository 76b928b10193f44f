"""FP8 matrix products through ``jaxamp.autocast(f, dtype=jnp.bfloat16, fp8=jaxamp.fp8())``
(issue 33, parts 1 to 3).

Every numerical check compares against a float64 reference of the same
bfloat16 inputs, within the error bound of the FP8 formats themselves: each
element of an operand rounds to e4m3 (relative 2**-4, half its epsilon 2**-3)
or, for the incoming gradient, e5m2 (2**-3), plus, below the format's smallest
normal, an absolute error of half its smallest subnormal times the
dequantization factor ``amax / fmax``; that bound is carried through the
contraction, the float32 accumulation and the final rounding to bfloat16
(``fp8_bound``). The products whose HLO is inspected are checked for the form
XLA's GPU GEMM rewriter turns into a cuBLASLt FP8 call (``gemm_rewriter.cc``,
``MatchFp8Param``: see ``fp8_dots``).
"""

from __future__ import annotations

import ast
import functools
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from tests.helpers import dot_input_dtypes, equations

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_ALL = jaxamp.fp8(first_last_bf16=False)  # a lone product is both first and last layer


# ---------------------------------------------------------------- the error bound


def _unit(dtype) -> float:
    # Round to nearest: half the epsilon; 2**-20 covers the float32 rounding of
    # the scale and of its inverse (relative 2**-24 each); 2**-9 the bfloat16
    # rounding of a tensorwise dequantized operand (``convert(q) * inv``).
    return float(jnp.finfo(dtype).eps) / 2 + 2.0**-20 + 2.0**-9


def _abs_floor(x: np.ndarray, dtype) -> float:
    """Below the smallest normal: half a subnormal step, in the operand's units."""
    fi = jnp.finfo(dtype)
    return float(np.max(np.abs(x))) / float(fi.max) * float(fi.smallest_subnormal) / 2


def fp8_bound(spec: str, a, b, da, db, k: int) -> np.ndarray:
    """Per output element: |fp8 product - exact product| of ``einsum(spec, a, b)``,
    `a` rounded to `da` and `b` to `db` with current scaling, summed over `k` terms
    in float32 and rounded to bfloat16."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ea = _unit(da) * np.abs(a) + _abs_floor(a, da)
    eb = _unit(db) * np.abs(b) + _abs_floor(b, db)
    quant = (
        np.einsum(spec, ea, np.abs(b)) + np.einsum(spec, np.abs(a), eb) + np.einsum(spec, ea, eb)
    )
    size = np.einsum(spec, np.abs(a) + ea, np.abs(b) + eb)
    acc = (k + 4) * 2.0**-24 * size  # float32 sums, then two scale multiplies
    ref = np.abs(np.einsum(spec, a, b))
    return (quant + acc) * (1 + 2.0**-8) + 2.0**-8 * ref


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, F32), np.float64)


@functools.cache
def _matmul_and_vjp(scaling: str):
    f = jaxamp.autocast(
        lambda x, w: x @ w, dtype=BF16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
    )

    def run(x, w, g):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))

    return jax.jit(run)


def check_matmul(x, w, g, scaling: str) -> None:
    """y = x @ w and its vjp with cotangent g, FP8 through autocast, against float64."""
    y, dx, dw = _matmul_and_vjp(scaling)(x, w, g)
    assert y.dtype == dx.dtype == dw.dtype == BF16
    x64, w64, g64 = _f64(x), _f64(w), _f64(g)
    k, n = w.shape
    for got, spec, a, b, da, db, size in [
        (y, "mk,kn->mn", x64, w64, E4M3, E4M3, k),
        (dx, "mn,kn->mk", g64, w64, E5M2, E4M3, n),
        (dw, "mk,mn->kn", x64, g64, E4M3, E5M2, x.shape[0]),
    ]:
        err = np.abs(_f64(got) - np.einsum(spec, a, b))
        bound = fp8_bound(spec, a, b, da, db, size)
        assert np.all(err <= bound), (spec, float(np.max(err - bound)))


def _tensor(rng, shape, kind: str) -> jax.Array:
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)
    if kind == "zero":
        x = np.zeros(shape)
    elif kind == "outlier":
        idx = tuple(rng.integers(0, s) for s in shape)
        x[idx] = np.sign(rng.standard_normal()) * np.abs(x).max() * 10.0 ** rng.uniform(2, 5)
    return jnp.asarray(x, BF16)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    shape=st.sampled_from([(16, 32, 48), (48, 16, 32)]),
    kinds=st.tuples(*[st.sampled_from(["normal", "normal", "zero", "outlier"])] * 3),
    scaling=st.sampled_from(["tensorwise", "rowwise"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fp8_matmul_forward_and_backward_within_the_fp8_bound(shape, kinds, scaling, seed):
    rng = np.random.default_rng(seed)
    m, k, n = shape
    x, w, g = (
        _tensor(rng, s, kind) for s, kind in zip([(m, k), (k, n), (m, n)], kinds, strict=True)
    )
    check_matmul(x, w, g, scaling)


def _representable(rng, n: int, dtype, exp: int) -> np.ndarray:
    """An n x n matrix of random `dtype` values times 2**exp, with fmax * 2**exp on the
    diagonal: every row's and every column's amax is fmax * 2**exp, so every scale,
    tensorwise or rowwise, is exactly 2**-exp and the rounding to `dtype` exact."""
    bits = rng.integers(0, 256, (n, n), dtype=np.uint8).view(jnp.dtype(dtype))
    x = np.where(np.isfinite(bits.astype(np.float32)), bits.astype(np.float64), 0.0)
    np.fill_diagonal(x, float(jnp.finfo(dtype).max) * np.sign(rng.standard_normal(n)))
    return jnp.asarray(x * 2.0**exp, BF16)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_operands_fp8_holds_exactly_come_back_exactly(scaling):
    """No error but float32 summation and the final bfloat16 rounding: the scales
    and their inverses cancel exactly (a scale off by 1% fails here, while it
    could hide in the worst-case bound above)."""
    rng = np.random.default_rng(4)
    x, w = (_representable(rng, 32, E4M3, e) for e in (-7, 5))
    g = _representable(rng, 32, E5M2, -20)
    y, dx, dw = _matmul_and_vjp(scaling)(x, w, g)
    for got, a, b in [(y, x, w), (dx, g, w.T), (dw, x.T, g)]:
        a, b = _f64(a), _f64(b)
        ref = a @ b
        bound = 2.0**-8 * np.abs(ref) + 40 * 2.0**-24 * (np.abs(a) @ np.abs(b))
        assert np.all(np.abs(_f64(got) - ref) <= bound)


def test_all_zero_operands_give_exact_zeros():
    x, w, g = jnp.zeros((16, 32), BF16), jnp.ones((32, 16), BF16), jnp.ones((16, 16), BF16)
    f = jaxamp.autocast(lambda x, w: x @ w, dtype=BF16, fp8=FP8_ALL)
    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(g)
    assert np.all(np.asarray(y, F32) == 0) and np.all(np.asarray(dw, F32) == 0)
    np.testing.assert_array_equal(np.asarray(dx, F32), np.full((16, 32), 16.0))


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_operand_stays_visible(bad):
    x = np.ones((16, 32))
    x[3, 4] = bad
    f = jaxamp.autocast(lambda x, w: x @ w, dtype=BF16, fp8=FP8_ALL)
    assert not np.all(np.isfinite(np.asarray(f(jnp.asarray(x, BF16), jnp.ones((32, 16), BF16)))))


def test_rowwise_keeps_the_rows_without_the_outlier_precise():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 64))
    x[0, 0] = 1e6  # tensorwise, every other value falls to e4m3's subnormals
    x, w = jnp.asarray(x, BF16), jnp.asarray(rng.standard_normal((64, 32)), BF16)
    ref = _f64(x) @ _f64(w)
    # The bound with the rows' own amax (1 to 4), not the tensor's (1e6).
    x_rest = _f64(x)[1:]
    tight = fp8_bound("mk,kn->mn", x_rest, _f64(w), E4M3, E4M3, 64)
    errs = {}
    for scaling in ["tensorwise", "rowwise"]:
        f = jaxamp.autocast(
            lambda x, w: x @ w, dtype=BF16, fp8=jaxamp.fp8(scaling, first_last_bf16=False)
        )
        errs[scaling] = np.abs(_f64(f(x, w))[1:] - ref[1:])
    assert np.all(errs["rowwise"] <= tight)
    # Tensorwise, those rows lose most of their precision (the bound above is a
    # worst case; the typical errors differ by more than 5x).
    assert np.median(errs["tensorwise"]) > 5 * np.median(errs["rowwise"])


# ------------------------------------------------------------ HLO: what XLA fuses

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\((.*?)\)(?:,|$)")


def parse_hlo(text: str) -> dict[str, tuple[str, str, list[str]]]:
    """name -> (result type, opcode, operand names), for every instruction of `text`."""
    out = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        name, typ, op, args = m.groups()
        if op == "custom-call" and 'custom_call_target="Sharding"' in line:
            op = "Sharding"  # an Explicit mesh's annotation: the partitioner removes it
        names = re.findall(r"%([\w.\-]+)", args) if "%" in args else [
            a.strip() for a in args.split(",") if a.strip()
        ]  # fmt: skip
        out[name] = (typ.split("{")[0], op, names)
    return out


def _dtype(typ: str) -> str:
    return typ.split("[")[0]


# The ops XLA's GEMM rewriter lets stand between a dequantization and the dot
# (``MatchFp8Param`` in gemm_rewriter.cc), all of which commute with it. A
# select against zero commutes too; no product here needs one.
_COMMUTING = {"bitcast", "broadcast", "copy", "dynamic-slice", "pad", "reshape", "slice",
              "transpose"}  # fmt: skip


def _through(instrs, name: str) -> tuple[str, tuple[str, str, list[str]]]:
    """`name` and its instruction, past Explicit-mesh ``Sharding`` annotations."""
    while instrs[name][1] == "Sharding":
        name = instrs[name][2][0]
    return name, instrs[name]


def _one_element(instrs, name: str) -> bool:
    """Whether `name` is a broadcast of one value (a scalar scale): followed through
    the reshapes, broadcasts and converts JAX emits around a size-1 array."""
    typ, op, ops = _through(instrs, name)[1]
    if op != "broadcast":
        return False
    while True:
        typ, op, ops = _through(instrs, ops[0])[1]
        dims = typ.partition("[")[2].rstrip("]")
        if all(d.strip() in ("", "1") for d in dims.split(",")):
            return True
        if op not in ("reshape", "broadcast", "convert"):
            return False


def fp8_operand(instrs, name: str) -> tuple[str, str] | None:
    """``(f8 dtype, form)`` of a dot operand the rewriter takes as FP8: form "f8"
    when the operand is f8 itself, "dequantized" when it is ``convert(f8)``
    multiplied (or divided) by a broadcast scalar, each possibly followed by the
    commuting ops; None when the rewriter would not see an FP8 operand."""
    typ, op, ops = _through(instrs, name)[1]
    while op in _COMMUTING and not _dtype(typ).startswith("f8"):
        typ, op, ops = _through(instrs, ops[0])[1]
    if _dtype(typ).startswith("f8"):
        return _dtype(typ), "f8"
    if op not in ("multiply", "divide") or len(ops) != 2:
        return None
    for i, (conv, scale) in enumerate([ops, ops[::-1]]):
        c_typ, c_op, c_ops = _through(instrs, conv)[1]
        if op == "divide" and i == 1:
            break
        src = _dtype(_through(instrs, c_ops[0])[1][0]) if c_op == "convert" else ""
        if src.startswith("f8") and _one_element(instrs, scale):
            return src, "dequantized"
    return None


def _dims(typ: str) -> str:
    return "[" + typ.partition("[")[2]


def fp8_dots(text: str, rowwise: bool = False) -> list[tuple[str, str]]:
    """The FP8 dots of an HLO module, each checked for the form XLA's GPU GEMM
    rewriter folds into one cuBLASLt FP8 call. Tensorwise: both operands
    dequantized (``convert(f8) * broadcast(scalar)``, the scale becoming the
    call's scale operand), the result in the operands' dtype. Rowwise (per-row
    scales are not scalars; the rewriter folds none): both operands f8, a
    float32 result whose only use is a multiply by the broadcast factors.
    Either way one operand is e4m3fn. Returns each one's (result dimensions,
    "e4m3" or "e5m2": its gradient operand's)."""
    instrs = parse_hlo(text)
    users: dict[str, list[str]] = {}
    for name, (_, _, ops) in instrs.items():
        for o in ops:
            users.setdefault(o, []).append(name)
    found = []
    for name, (typ, op, ops) in instrs.items():
        if op != "dot":
            continue
        srcs = [fp8_operand(instrs, o) for o in ops]
        if not any(srcs):
            continue
        assert all(srcs), (name, srcs)
        kinds = sorted(dtype for dtype, _ in srcs)
        assert kinds in (["f8e4m3fn", "f8e4m3fn"], ["f8e4m3fn", "f8e5m2"]), (name, kinds)
        if not rowwise:
            assert {form for _, form in srcs} == {"dequantized"}, (name, srcs)
            assert {_dtype(instrs[o][0]) for o in ops} == {_dtype(typ)}, (name, typ)
        else:
            assert {form for _, form in srcs} == {"f8"}, (name, srcs)
            assert _dtype(typ) == "f32", (name, typ)
            (user,) = users[name]
            while instrs[user][1] == "Sharding":
                (user,) = users[user]
            u_typ, u_op, u_ops = instrs[user]
            assert u_op == "multiply" and u_typ == typ, (name, instrs[user])
        found.append((_dims(typ), "e5m2" if "f8e5m2" in kinds else "e4m3"))
    return found


def mlp(params, x):
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


SIZES = (32, 48, 64, 80, 16)  # first layer 32 -> 48 and last 80 -> 16 stay bfloat16


def mlp_params(seed=0, sizes=SIZES):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        jax.random.normal(k, (a, b)) / np.sqrt(a)
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(fwd):
    def loss(params, x, y):
        return jnp.mean((fwd(params, x).astype(F32) - y) ** 2)

    return loss


def _data(batch=32, seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, SIZES[0])), F32), jnp.asarray(
        rng.standard_normal((batch, SIZES[-1])), F32
    )


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_every_fp8_matmul_of_a_training_step_has_the_shape_xla_fuses(scaling):
    params, (x, y) = mlp_params(), _data()
    fwd = jaxamp.autocast(mlp, dtype=BF16, fp8=jaxamp.fp8(scaling))
    text = jax.jit(jax.grad(mlp_loss(fwd))).lower(params, x, y).as_text(dialect="hlo")
    dots = fp8_dots(text, rowwise=scaling == "rowwise")
    # Layers 2 and 3 forward ([32,64], [32,80]) in e4m3; backward, layer 3's
    # dgrad and wgrad ([32,64], [64,80]) and layer 2's ([32,48], [48,64]) with
    # the gradient in e5m2.
    assert sorted(dots) == sorted(
        [("[32,64]", "e4m3"), ("[32,80]", "e4m3")]
        + [(t, "e5m2") for t in ["[32,64]", "[64,80]", "[32,48]", "[48,64]"]]
    )
    instrs = parse_hlo(text)
    bf16_dots = [
        _norm(t)
        for t, op, ops in instrs.values()
        if op == "dot" and "bf16" in t and not any(fp8_operand(instrs, o) for o in ops)
    ]
    # Layer 1's forward and wgrad, layer 4's forward, dgrad and wgrad stay bfloat16.
    assert sorted(bf16_dots) == sorted(
        ["bf16[32,48]", "bf16[32,48]", "bf16[16,32]", "bf16[32,80]", "bf16[16,80]"]
    )


def _cosine(a, b) -> float:
    a = np.concatenate([np.ravel(np.asarray(t, np.float64)) for t in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(np.asarray(t, np.float64)) for t in jax.tree.leaves(b)])
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _close_to_float32(loss_fn, ref_fn, *args):
    (v, g) = jax.jit(jax.value_and_grad(loss_fn))(*args)
    (rv, rg) = jax.jit(jax.value_and_grad(ref_fn))(*args)
    assert abs(float(v) - float(rv)) <= 0.05 * abs(float(rv))
    assert _cosine(g, rg) > 0.99


# ------------------------------------------------------------------ composition


def test_jit_and_grad_of_an_mlp_match_float32():
    params, (x, y) = mlp_params(), _data()
    fwd = jaxamp.autocast(mlp, dtype=BF16, fp8=jaxamp.fp8())
    _close_to_float32(mlp_loss(fwd), mlp_loss(mlp), params, x, y)


def test_vmap_scales_each_instance_by_its_own_amax():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 16, 32))
    x[1] *= 1e-5  # one global scale would leave instance 1 in e4m3's subnormals
    x, w = jnp.asarray(x, BF16), jnp.asarray(rng.standard_normal((32, 16)), BF16)
    f = jaxamp.autocast(lambda x, w: x @ w, dtype=BF16, fp8=FP8_ALL)
    got = jax.vmap(f, in_axes=(0, None))(x, w)
    for i in range(2):
        a = _f64(x[i])
        err = np.abs(_f64(got[i]) - a @ _f64(w))
        assert np.all(err <= fp8_bound("mk,kn->mn", a, _f64(w), E4M3, E4M3, 32))


def test_scan_and_checkpoint_bodies_run_fp8():
    ws = jnp.stack(mlp_params(sizes=(64,) * 4))  # three 64 x 64 layers, scanned
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 64)), F32)

    def net(ws, x):
        def body(h, w):
            return jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w), None

        return jax.lax.scan(body, x, ws)[0]

    fwd = jaxamp.autocast(net, dtype=BF16, fp8=jaxamp.fp8())

    def loss(f):
        return lambda ws, x: jnp.sum(f(ws, x).astype(F32) ** 2)

    text = jax.jit(jax.grad(loss(fwd))).lower(ws, x).as_text(dialect="hlo")
    # Inside a loop body nothing is a first / last layer: forward, its
    # recomputation under checkpoint, dgrad and wgrad are all FP8.
    assert len(fp8_dots(text)) == 4
    _close_to_float32(loss(fwd), loss(net), ws, x)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, size in enumerate(SIZES[1:]):
            x = nn.Dense(size, name=f"layer{i}")(x)
            x = nn.relu(x) if i < len(SIZES) - 2 else x
        return x


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)]
        )

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = jax.nn.relu(x) if i < len(self.layers) - 1 else x
        return x


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, len(SIZES) - 1)
        self.layers = [
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(SIZES[:-1], SIZES[1:], keys, strict=True)
        ]

    def __call__(self, x):  # one example, as equinox models are written
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = jax.nn.relu(x) if i < len(self.layers) - 1 else x
        return x


def _norm(typ: str) -> str:
    """An HLO type with its dimensions sorted: JAX computes some products transposed
    (a vmapped equinox layer W @ x.T, a linen one x @ W; a wgrad g.T @ x)."""
    dtype, _, dims = typ.partition("[")
    return "{}[{}]".format(dtype, ",".join(sorted(dims.rstrip("]").split(","), key=int)))


def _forward_fp8_shapes(text: str) -> set[str]:
    """The (sorted) result dimensions of the forward FP8 dots: both operands e4m3."""
    instrs = parse_hlo(text)
    return {
        _norm(_dims(t))
        for t, op, ops in instrs.values()
        if op == "dot" and all((fp8_operand(instrs, o) or ("",))[0] == "f8e4m3fn" for o in ops)
    }


@pytest.mark.parametrize("framework", ["linen", "nnx", "equinox"])
def test_models_train_in_fp8_with_first_and_last_layers_in_bfloat16(framework):
    x, y = _data()
    if framework == "linen":
        model = LinenMLP()
        params = model.init(jax.random.key(0), x)
        fp8_apply = jaxamp.autocast(model.apply, dtype=BF16, fp8=jaxamp.fp8())
        loss, ref = mlp_loss(fp8_apply), mlp_loss(model.apply)
    elif framework == "nnx":
        model = NnxMLP(nnx.Rngs(0))
        graphdef, params = nnx.split(model)

        def loss(params, x, y):
            m = nnx.merge(graphdef, params)
            return jnp.mean((jaxamp.autocast(m, dtype=BF16, fp8=jaxamp.fp8())(x) - y) ** 2)

        def ref(params, x, y):
            return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)
    else:
        params = EqxMLP(jax.random.key(0))

        def batched(model, x):
            return jax.vmap(model)(x)

        fp8_batched = jaxamp.autocast(batched, dtype=BF16, fp8=jaxamp.fp8())
        loss, ref = mlp_loss(fp8_batched), mlp_loss(batched)

    text = jax.jit(jax.grad(loss)).lower(params, x, y).as_text(dialect="hlo")
    assert _forward_fp8_shapes(text) == {"[32,64]", "[32,80]"}, framework
    _close_to_float32(loss, ref, params, x, y)


def _layer_dtypes(fn, *args, batch: int) -> list[tuple[int, str]]:
    """Each ``dot_general`` of `fn`'s forward program, in order: the layer it
    belongs to (by its output width in ``SIZES``) and its operands' dtype."""
    found = []
    jaxpr = jax.make_jaxpr(fn)(*args)
    for eqn, ins in zip(equations(jaxpr), dot_input_dtypes(jaxpr), strict=True):
        (width,) = set(eqn.outvars[0].aval.shape) - {batch}
        lhs, rhs = (str(d) for d in ins)
        found.append((SIZES[1:].index(width), lhs if lhs == rhs else "mixed"))
    return found


def _apply_twice(framework):
    """``(params, apply)`` of one MLP in `framework`: ``apply(params, x)`` runs it on a
    batch (of any size: 96 here, no width of ``SIZES``)."""
    if framework == "plain":
        return mlp_params(), mlp
    if framework == "linen":
        model = LinenMLP()
        return model.init(jax.random.key(0), _data()[0]), model.apply
    if framework == "nnx":
        graphdef, state = nnx.split(NnxMLP(nnx.Rngs(0)))
        return state, lambda state, x: nnx.merge(graphdef, state)(x)
    return EqxMLP(jax.random.key(0)), lambda model, x: jax.vmap(model)(x)


@pytest.mark.parametrize("framework", ["plain", "linen", "nnx", "equinox"])
def test_a_model_called_twice_keeps_its_own_first_and_last_layers_in_bfloat16(framework):
    # The first and last layers are the model's, not the program's: with the
    # model applied to two batches, both calls' first and last layers stay
    # bfloat16, and each call computes what the model alone computes on its
    # batch (the same products on the same operands: bit for bit).
    params, apply = _apply_twice(framework)
    rng = np.random.default_rng(4)
    x1, x2 = (jnp.asarray(rng.standard_normal((96, SIZES[0])), F32) for _ in range(2))
    cfg = jaxamp.fp8()
    twice = jaxamp.autocast(lambda p, a, b: (apply(p, a), apply(p, b)), dtype=BF16, fp8=cfg)
    once = jaxamp.autocast(apply, dtype=BF16, fp8=cfg)
    per_call = [(0, "bfloat16"), (1, "float8_e4m3fn"), (2, "float8_e4m3fn"), (3, "bfloat16")]
    assert _layer_dtypes(once, params, x1, batch=96) == per_call
    assert _layer_dtypes(twice, params, x1, x2, batch=96) == per_call * 2
    y1, y2 = jax.jit(twice)(params, x1, x2)
    np.testing.assert_array_equal(y1, jax.jit(once)(params, x1))
    np.testing.assert_array_equal(y2, jax.jit(once)(params, x2))


def _dot_dtypes(fn, *args) -> list[str]:
    """Each ``dot_general`` of `fn`'s forward program, in order, nested jaxprs
    included (a loop body once): its operands' dtype."""
    return [str(a) if a == b else "mixed" for a, b in dot_input_dtypes(jax.make_jaxpr(fn)(*args))]


BF, F8 = "bfloat16", "float8_e4m3fn"


def test_a_tied_embedding_and_a_loop_calling_the_model_keep_its_layers_in_bfloat16():
    # The embedding is read by the first product and, transposed, by the head:
    # both stay bfloat16, and so do they in a loop that runs the model again
    # (their weights reach its body as constants); the layers between run FP8.
    rng = np.random.default_rng(5)
    p = {
        "embed": jnp.asarray(rng.standard_normal((64, 32)) / 8, F32),
        "layers": [jnp.asarray(rng.standard_normal((32, 32)) / 6, F32) for _ in range(2)],
    }

    def lm(p, h):
        h = h @ p["embed"]
        for w in p["layers"]:
            h = jnp.tanh(h @ w)
        return h @ p["embed"].T

    def generate(p, x):
        def step(h, _):
            return jax.nn.softmax(lm(p, h)), None

        return jax.lax.scan(step, lm(p, x), None, length=2)[0]

    x = jax.nn.one_hot(jnp.arange(16) % 64, 64)
    f = jaxamp.autocast(generate, dtype=BF16, fp8=jaxamp.fp8())
    assert _dot_dtypes(f, p, x) == [BF, F8, F8, BF] * 2


def test_scanned_layers_run_fp8_between_the_first_and_last_of_a_model_called_twice():
    # Scan over layers: the one product of the body is every middle layer
    # (FP8); the first and last layers around it stay bfloat16 in both calls.
    rng = np.random.default_rng(6)
    p = {
        "first": jnp.asarray(rng.standard_normal((32, 64)) / 6, F32),
        "stack": jnp.asarray(rng.standard_normal((3, 64, 64)) / 8, F32),
        "last": jnp.asarray(rng.standard_normal((64, 16)) / 8, F32),
    }

    def net(p, x):
        h = x @ p["first"]
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"])[0]
        return h @ p["last"]

    x1, x2 = (jnp.asarray(rng.standard_normal((32, 32)), F32) for _ in range(2))
    f = jaxamp.autocast(lambda p, a, b: (net(p, a), net(p, b)), dtype=BF16, fp8=jaxamp.fp8())
    assert _dot_dtypes(f, p, x1, x2) == [BF, F8, BF] * 2


def test_module_rules_override_the_first_last_default():
    x = _data()[0]
    model = LinenMLP()
    params = model.init(jax.random.key(0), x)

    def shapes(cfg):
        f = jaxamp.autocast(model.apply, dtype=BF16, fp8=cfg)
        return _forward_fp8_shapes(jax.jit(f).lower(params, x).as_text(dialect="hlo"))

    # Sorted dims: the last layer's [32,16] reads [16,32].
    assert shapes(jaxamp.fp8(modules={"layer3": True, "layer1": False})) == {
        "[32,80]", "[16,32]"
    }  # fmt: skip
    assert shapes(jaxamp.fp8(first_last_bf16=False)) == {
        "[32,48]", "[32,64]", "[32,80]", "[16,32]"
    }  # fmt: skip
    assert shapes(jaxamp.fp8(modules={"Dense": False})) == set()


def test_dimensions_not_multiples_of_16_stay_bfloat16():
    f = jaxamp.autocast(lambda x, w: x @ w, dtype=BF16, fp8=FP8_ALL)
    for m, k, n in [(24, 32, 32), (32, 40, 32), (32, 32, 8)]:
        text = jax.jit(f).lower(jnp.ones((m, k), BF16), jnp.ones((k, n), BF16)).as_text()
        assert "f8E4M3FN" not in text, (m, k, n)
    text = jax.jit(f).lower(jnp.ones((32, 32), BF16), jnp.ones((32, 32), BF16)).as_text()
    assert "f8E4M3FN" in text


def test_step_with_a_loss_scale_trains_and_the_scale_changes_nothing():
    model = LinenMLP()
    x, y = _data()
    params = model.init(jax.random.key(0), x)
    loss = mlp_loss(jaxamp.autocast(model.apply, dtype=BF16, fp8=jaxamp.fp8()))
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(2.0**15))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        value, grads = jaxamp.value_and_grad(loss)(opt_state, params, x, y)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        return params, opt_state, value, grads

    first = float(loss(params, x, y))
    _, _, _, scaled = train_step(params, opt_state)
    # Current scaling divides a power-of-two loss scale out of every FP8 operand
    # exactly, and bfloat16 has float32's range: unscaled, the gradients are
    # those of the unscaled loss, bit for bit.
    plain = jax.jit(jax.grad(loss))(params, x, y)
    unscaled = jax.tree.map(lambda g: g / 2.0**15, scaled)
    jax.tree.map(np.testing.assert_array_equal, unscaled, plain)
    for _ in range(5):
        params, opt_state, value, _ = train_step(params, opt_state)
        assert not bool(jaxamp.metrics(opt_state)["skipped"])
    assert float(loss(params, x, y)) < 0.9 * first


def test_bad_arguments_say_what_to_write():
    with pytest.raises(ValueError, match="scaling='tensorwise'"):
        jaxamp.fp8("blockwise")
    with pytest.raises(TypeError, match="write True"):
        jaxamp.fp8(modules={"head": "bf16"})
    with pytest.raises(TypeError, match=r"fp8=jaxamp.fp8\(\)"):
        jaxamp.autocast(mlp, dtype=BF16, fp8="e4m3")
    with pytest.raises(ValueError, match=r"fp8=jaxamp.fp8\(\)"):
        jaxamp.autocast(mlp, dtype=E4M3)


def test_a_module_pattern_matching_nothing_lists_the_nnx_module_paths():
    from tests.casting.test_audit import _nnx_model

    model = _nnx_model()
    f = jaxamp.autocast(model, dtype=BF16, fp8=jaxamp.fp8(modules={"decoder/mpl": False}))
    with pytest.warns(UserWarning, match="matches no module") as caught:
        jax.make_jaxpr(f)(jnp.ones((16, 32)))
    paths = ast.literal_eval(str(caught[0].message).split("paths: ")[1].split(")")[0])
    assert "decoder/blocks/0/mlp/linear1" in paths and not any("[" in p for p in paths), paths
