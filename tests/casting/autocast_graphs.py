"""Random small graphs for autocast's property tests (issue 31).

A graph is a list of ops over a pool of values: an activation ``x @ w``, a
float32 input of the activation's shape (``t``, a target ``2**-12`` away from
it in places), the float32 input ``x``, a parameter vector ``p`` (a bias, a
per-channel scale or offset), a boolean mask ``m`` and Python scalar constants. Each op appends its
result to the pool; the graph's output is the last value.

One graph is evaluated four ways:

* ``run_jnp``: with ``jax.numpy``, for ``jaxamp.autocast`` and float32;
* ``reference``: exactly (float64, matmul inputs rounded to the low dtype as
  torch.autocast and jaxamp.autocast both round them), with a bound on the
  error of a program that rounds each op's result to the dtype that
  torch.autocast gives it (``TorchModel`` for CUDA float16, or the dtypes
  torch reports, ``run_torch``);
* ``emulate``: numpy, each op rounded to that dtype (the bound's own check);
* ``run_torch``: under ``torch.autocast`` when torch is installed.

The data are dyadic (``x`` in halves, ``w`` in quarters or eighths) so the
first matmul is exact in float16 and bfloat16 and the bound is tight where torch
keeps a value in float32: ``h - t`` must come out as ``2**-12``, not 0. ``p``
is not: eighths times ``1 + 2**-12`` (which neither low dtype holds), for some
seeds times ``2**-28`` (0 in float16), so a parameter cast down where torch
promotes is outside the bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

B, F = 4, 8
UNARY = ("exp", "log1p_abs", "tanh", "sigmoid", "square", "neg", "abs", "sum", "mean")
BINARY = ("add", "sub", "mul", "max", "min", "where")
WITH_PARAM = ("bias", "scale", "where_const", "add_const", "mul_const", "matmul")
OPS = UNARY + BINARY + WITH_PARAM
#: torch.autocast's float32 list (CUDA) among these ops; "sum" is torch.sum.
TORCH_FLOAT32 = frozenset({"exp", "log1p_abs", "square", "sum"})
LOW, WIDE = "low", "float32"


@dataclasses.dataclass(frozen=True)
class Graph:
    ops: tuple[tuple[str, int, int], ...]  # (op, operand a, operand b): see _ops_of
    const: float  # the Python scalar of *_const ops


def make_data(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (B, F)) / 2.0
    w = rng.integers(-16, 17, (F, F)) / rng.choice([4.0, 8.0])
    h = x @ w  # exact: multiples of 1/8 or 1/16, at most 32 or 16 in magnitude
    delta = rng.choice([0.0, 2.0**-12, -(2.0**-12), 0.75], (B, F))
    return {
        "x": x.astype(np.float32),
        "w": w.astype(np.float32),
        "t": (h + delta).astype(np.float32),
        "p": (
            rng.integers(-12, 13, (F,)) / 8.0 * (1 + 2.0**-12) * rng.choice([1.0, 2.0**-28])
        ).astype(np.float32),
        "m": rng.random((B, F)) < 0.5,
    }


def _ops_of(graph: Graph) -> list[tuple[str, int, int, int]]:
    """(op, a, b, index) with operand indices resolved against the pool so far:
    0 is the newest value, so small numbers (what hypothesis tries first) chain."""
    out = []
    n = 3  # the pool starts with h, t, x
    for op, a, b in graph.ops:
        out.append((op, n - 1 - a % n, n - 1 - b % n, n))
        n += 1
    return out


def _evaluate(graph: Graph, data: dict[str, Any], impl: dict[str, Callable[..., Any]]) -> Any:
    pool = [impl["matmul"](data["x"], None), data["t"], data["x"]]
    for op, a, b, _ in _ops_of(graph):
        va, vb = pool[a], pool[b]
        if op == "matmul" and va.shape[-1] != F:
            op = "neg"
        pool.append(impl[op](va, vb))
    return pool[-1]


def jnp_impl(jnp: Any, data: dict[str, Any], const: float) -> dict[str, Callable[..., Any]]:
    p, m, w = data["p"], data["m"], data["w"]
    return {
        "exp": lambda a, b: jnp.exp(a),
        "log1p_abs": lambda a, b: jnp.log(jnp.abs(a) + 1.0),
        "tanh": lambda a, b: jnp.tanh(a),
        "sigmoid": lambda a, b: 1.0 / (1.0 + jnp.exp(-a)) if jnp.__name__ == "numpy" else _sig(a),
        "square": lambda a, b: a * a if jnp.__name__ == "numpy" else jnp.square(a),
        "neg": lambda a, b: -a,
        "abs": lambda a, b: jnp.abs(a),
        "sum": lambda a, b: jnp.sum(a, axis=-1, keepdims=True),
        "mean": lambda a, b: jnp.mean(a, axis=-1, keepdims=True),
        "add": lambda a, b: a + b,
        "sub": lambda a, b: a - b,
        "mul": lambda a, b: a * b,
        "max": lambda a, b: jnp.maximum(a, b),
        "min": lambda a, b: jnp.minimum(a, b),
        "where": lambda a, b: jnp.where(m, a, b),
        "bias": lambda a, b: a + p,
        "scale": lambda a, b: a * p,
        "where_const": lambda a, b: jnp.where(m, a, const),
        "add_const": lambda a, b: a + const,
        "mul_const": lambda a, b: a * const,
        "matmul": lambda a, b: a @ w,
    }


def _sig(a: Any) -> Any:
    import jax

    return jax.nn.sigmoid(a)


def run_jnp(graph: Graph) -> Callable[..., Any]:
    """``f(x, w, t, p, m)``: the graph in jax.numpy (arguments are traced)."""
    import jax.numpy as jnp

    def f(x: Any, w: Any, t: Any, p: Any, m: Any) -> Any:
        data = {"x": x, "w": w, "t": t, "p": p, "m": m}
        return _evaluate(graph, data, jnp_impl(jnp, data, graph.const))

    return f


# ----------------------------------------------------------- dtypes and bounds


def matmul_results(graph: Graph) -> frozenset[int]:
    """Pool indices of matmul results: ``h`` and each ``matmul`` op of a value of
    width ``F`` (of a sum's or mean's width-1 value it is ``neg``). A ``bias``
    added to one is a ``Linear`` layer's."""
    full, out = [True, True, True], {0}  # last axis F, not a reduction's 1
    for op, a, b, n in _ops_of(graph):
        if op in ("sum", "mean"):
            full.append(False)
        elif op in ("where", "bias", "scale", "where_const"):  # m and p have width F
            full.append(True)
        elif op in BINARY:
            full.append(full[a] or full[b])
        else:
            if op == "matmul" and full[a]:
                out.add(n)
            full.append(full[a])
    return frozenset(out)


def torch_model_dtypes(graph: Graph, data: dict[str, np.ndarray]) -> list[str]:
    """The dtype (LOW / WIDE) torch.autocast (CUDA, float16) gives each op's result.

    torch's type promotion: a float32 tensor with dimensions promotes a float16
    one (the parameter ``p`` in ``scale``, or in a ``bias`` of anything but a
    matmul); a Python scalar does not. torch's ``Linear`` casts its bias to
    the matmul's dtype: a ``bias`` of a matmul result follows it.
    """
    kinds, linear = [LOW, WIDE, WIDE], matmul_results(graph)
    for op, a, b, _ in _ops_of(graph):
        ka, kb = kinds[a], kinds[b]
        if op == "matmul":
            kinds.append(LOW)
        elif op in TORCH_FLOAT32 or op == "scale" or (op == "bias" and a not in linear):
            kinds.append(WIDE)
        elif op in BINARY:
            kinds.append(WIDE if WIDE in (ka, kb) else LOW)
        else:  # unary ops, scalars and a Linear's bias follow the activation
            kinds.append(ka)
    return kinds[3:]


@dataclasses.dataclass(frozen=True)
class Low:
    """The low dtype's rounding: unit roundoff, smallest subnormal step, max."""

    dtype: Any
    u: float
    tiny: float
    max: float


FLOAT16 = Low(np.float16, 2.0**-11, 2.0**-25, 65504.0)
BFLOAT16 = Low(
    ml_dtypes.bfloat16, 2.0**-8, 2.0**-134, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
)
F32_U, F32_TINY = 2.0**-24, 2.0**-150


def _exact_dot(a: np.ndarray, w: np.ndarray, bits: int) -> bool:
    """Whether every order of summing ``a @ w`` is exact with `bits` significant bits."""
    prods = a[:, :, None] * w[None, :, :]
    for e in range(0, 60):
        scaled = prods * 2.0**e
        if np.all(scaled == np.round(scaled)):
            return bool(np.all(np.abs(prods).sum(axis=1) * 2.0**e <= 2.0**bits))
    return False


def reference(
    graph: Graph, data: dict[str, np.ndarray], kinds: Sequence[str], low: Low
) -> tuple[np.ndarray, np.ndarray]:
    """(exact value, error bound) of the graph's output; `kinds` per op (LOW / WIDE).

    The bound is first-order forward error analysis, each op rounding its
    result once in its dtype (``u * |result|`` plus the subnormal step), a
    float32 operand of a LOW op rounded on entry, and every op's own
    sensitivity to its operands' errors (Lipschitz bounds: exp's is exp(a)).
    A matmul's inputs are rounded to the low dtype in the exact value too,
    since both torch.autocast and jaxamp.autocast round them; its accumulation
    costs ``F * u * (|a| @ |w|)`` unless every sum of its products is exact.
    """
    x, w, t, p = (data[k].astype(np.float64) for k in "xwtp")
    m, c = data["m"], float(graph.const)

    def rnd(v: np.ndarray) -> np.ndarray:
        return np.asarray(v, low.dtype).astype(np.float64)

    def out_err(v: np.ndarray, kind: str) -> np.ndarray:
        return (low.u * np.abs(v) + low.tiny) if kind == LOW else (F32_U * np.abs(v) + F32_TINY)

    def matmul(a: np.ndarray, ea: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ra, rw = rnd(a), rnd(w)
        v = ra @ rw
        bits = int(round(-np.log2(low.u)))  # significant bits: u = 2**-bits
        if not np.any(ea) and np.array_equal(ra, a) and _exact_dot(ra, rw, bits):
            return v, np.zeros_like(v)  # exact inputs, every partial sum exact
        acc = F * low.u * (np.abs(ra) @ np.abs(rw))
        # The program rounds its own (inexact) `a`: |rnd(a') - rnd(a)| <= ...
        ea_in = ea * (1 + low.u) + 2 * (low.u * np.abs(a) + low.tiny)
        return v, ea_in @ np.abs(rw) + acc + out_err(v, LOW)

    h, eh = matmul(x, np.zeros_like(x))
    vals, errs, kinds_all = [h, t, x], [eh, np.zeros_like(t), np.zeros_like(x)], [LOW, WIDE, WIDE]
    for (op, ia, ib, _), kind in zip(_ops_of(graph), kinds, strict=True):
        a, b, ea, eb = vals[ia], vals[ib], errs[ia], errs[ib]
        if op == "matmul" and a.shape[-1] != F:
            op = "neg"
        if kind == LOW:  # a float32 operand entering a low-precision op is rounded
            if kinds_all[ia] == WIDE:
                ea = ea + low.u * np.abs(a) + low.tiny
            if kinds_all[ib] == WIDE and op in BINARY:
                eb = eb + low.u * np.abs(b) + low.tiny
        v, e = _exact_op(op, a, b, ea, eb, p, m, c, low, matmul, kind)
        if op == "log1p_abs":  # torch rounds |a| + 1 in a's dtype before the log
            e = e + (low.u if kinds_all[ia] == LOW else F32_U)
        if op != "matmul":
            e = e + out_err(v, kind)
        vals.append(v)
        errs.append(e)
        kinds_all.append(kind)
    return vals[-1], errs[-1]


def _exact_op(op, a, b, ea, eb, p, m, c, low, matmul, kind):  # noqa: ANN001, ANN202
    """The exact result of one op and the bound its operands' errors give it."""
    if op == "exp":
        v = np.exp(a)
        return v, v * np.expm1(ea)
    if op == "log1p_abs":
        return np.log1p(np.abs(a)), ea  # Lipschitz 1
    if op == "tanh":
        return np.tanh(a), ea
    if op == "sigmoid":
        return 1.0 / (1.0 + np.exp(-a)), ea / 4.0
    if op == "square":
        return a * a, 2.0 * np.abs(a) * ea + ea * ea
    if op in ("neg", "abs"):
        return (-a if op == "neg" else np.abs(a)), ea
    if op in ("sum", "mean"):
        n = a.shape[-1]
        v = np.sum(a, axis=-1, keepdims=True)
        e = np.sum(ea, axis=-1, keepdims=True) + n * F32_U * np.sum(np.abs(a), -1, keepdims=True)
        return (v, e) if op == "sum" else (v / n, e / n)
    if op in ("add", "sub"):
        return (a + b if op == "add" else a - b), ea + eb
    if op == "mul":
        return a * b, np.abs(a) * eb + np.abs(b) * ea + ea * eb
    if op in ("max", "min"):
        return (np.maximum(a, b) if op == "max" else np.minimum(a, b)), np.maximum(ea, eb)
    if op == "where":
        return np.where(m, a, b), np.where(m, ea, eb)
    if op in ("bias", "scale"):
        # the parameter rounded to the activation's dtype, where the op runs in it
        pe = low.u * np.abs(p) + low.tiny if kind == LOW else np.zeros_like(p)
        if op == "bias":
            return a + p, ea + pe
        return a * p, np.abs(p) * ea + np.abs(a) * pe + ea * pe
    if op == "where_const":
        return np.where(m, a, c), np.where(m, ea, 0.0)
    if op == "add_const":
        return a + c, ea
    if op == "mul_const":
        return a * c, abs(c) * ea
    if op == "matmul":
        return matmul(a, ea)
    raise ValueError(op)


def emulate(
    graph: Graph, data: dict[str, np.ndarray], kinds: Sequence[str], low: Low
) -> np.ndarray:
    """The graph in numpy, each op rounded to its dtype in `kinds` (the bound's own check)."""

    def as_kind(v: Any, kind: str) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.asarray(np.asarray(v, np.float64), low.dtype if kind == LOW else np.float32)

    with np.errstate(over="ignore", invalid="ignore"):
        x, w = as_kind(data["x"], LOW), as_kind(data["w"], LOW)
        pool = [as_kind(x.astype(np.float64) @ w.astype(np.float64), LOW), data["t"], data["x"]]
        impl = jnp_impl(np, data, graph.const)
        for (op, ia, ib, _), kind in zip(_ops_of(graph), kinds, strict=True):
            a, b = pool[ia], pool[ib]
            if op == "matmul" and a.shape[-1] != F:
                op = "neg"
            a64, b64 = as_kind(a, kind).astype(np.float64), as_kind(b, kind).astype(np.float64)
            if op == "matmul":
                pool.append(as_kind(as_kind(a, LOW).astype(np.float64) @ w.astype(np.float64), LOW))
                continue
            if op in ("bias", "scale") and kind == LOW:
                pp = as_kind(data["p"], LOW).astype(np.float64)
                pool.append(as_kind(a64 + pp if op == "bias" else a64 * pp, kind))
                continue
            pool.append(as_kind(impl[op](a64, b64), kind))
    return np.asarray(pool[-1], np.float64)


# ----------------------------------------------------------------------- torch


def run_torch(
    graph: Graph, data: dict[str, np.ndarray], torch: Any
) -> tuple[np.ndarray, list[str]]:
    """The graph under ``torch.autocast("cpu", dtype=torch.bfloat16)``: its output
    and the dtype (LOW / WIDE) torch gave each op's result."""
    tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in data.items()}
    kinds: list[str] = []

    def record(v: Any) -> Any:
        kinds.append(LOW if v.dtype == torch.bfloat16 else WIDE)
        return v

    m, p, w, c = tensors["m"], tensors["p"], tensors["w"], graph.const
    linear: set[int] = set()  # ids of matmul results: a bias added to one is a Linear's

    def matmul(a: Any) -> Any:
        out = a @ w
        linear.add(id(out))
        return out

    impl = {
        "exp": lambda a, b: torch.exp(a),
        "log1p_abs": lambda a, b: torch.log(torch.abs(a) + 1.0),
        "tanh": lambda a, b: torch.tanh(a),
        "sigmoid": lambda a, b: torch.sigmoid(a),
        "square": lambda a, b: torch.square(a),
        "neg": lambda a, b: -a,
        "abs": lambda a, b: torch.abs(a),
        "sum": lambda a, b: torch.sum(a, dim=-1, keepdim=True),
        "mean": lambda a, b: torch.mean(a, dim=-1, keepdim=True),
        "add": lambda a, b: a + b,
        "sub": lambda a, b: a - b,
        "mul": lambda a, b: a * b,
        "max": lambda a, b: torch.maximum(a, b),
        "min": lambda a, b: torch.minimum(a, b),
        "where": lambda a, b: torch.where(m, a, b),
        # torch's Linear (addmm) casts its bias to the matmul's dtype; any
        # other float32 vector promotes.
        "bias": lambda a, b: a + (p.to(a.dtype) if id(a) in linear else p),
        "scale": lambda a, b: a * p,
        "where_const": lambda a, b: torch.where(m, a, c),
        "add_const": lambda a, b: a + c,
        "mul_const": lambda a, b: a * c,
        "matmul": lambda a, b: matmul(a),
    }

    def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda a, b: record(fn(a, b))

    recorded = {k: recording(fn) for k, fn in impl.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _evaluate(graph, tensors, recorded)
    kinds = kinds[1:]  # the first matmul is the pool's h, not an op of the graph
    return out.float().numpy().astype(np.float64), kinds
