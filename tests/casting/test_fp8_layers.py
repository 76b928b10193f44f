"""An FP8 product's layer: its module path, or the weight it reads where module paths
do not tell layers apart (equinox's class scopes, an nnx module merged inside the
function, a plain function of weights). ``jaxamp.fp8_select`` must then select
one layer, not all those sharing a path."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

D, BATCH = 32, 16
BUDGET = 2 * 2.0**-4  # test_fp8_select's: two e4m3 unit roundoffs of gradient error
FP8 = "float8_e4m3fn"


def _hostile_input() -> tuple[jax.Array, jax.Array]:
    """An input whose feature 0 is 1e5 times the others, and the column scale that
    undoes it in the first layer's weight: the same product in exact arithmetic and
    in bfloat16, but e4m3 scaled by the amax (~1e5) flushes every other feature, so
    the first layer's weight gradient is lost in FP8 (test_fp8_select's layer)."""
    s = jnp.ones(D).at[0].set(1e5)
    x = jax.random.normal(jax.random.key(9), (BATCH, D))
    return x * s, s


def _rows(f, *args) -> list:
    """audit's per-op rows of the products."""
    return [r for r in jaxamp.audit(f)(*args).ops if r.primitive == "dot_general"]


def _layers(f, *args) -> dict[str, list[str]]:
    """layer -> the dtypes its products ran in, from audit's per-op view."""
    found: dict[str, list[str]] = {}
    for r in _rows(f, *args):
        found.setdefault(r.layer, []).append(r.dtype)
    return found


def test_equinox_layers_sharing_a_class_scope_are_selected_one_by_one():
    """An ``eqx.nn.MLP``: its Linear layers share one class path, and it holds its
    activation functions as fields, which fp8_select takes as ``eqx.filter_grad``
    does (its floating arrays differentiated, the rest as they are)."""
    x, s = _hostile_input()
    model = eqx.nn.MLP(D, D, D, 2, activation=jnp.tanh, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.layers[0].weight, model, model.layers[0].weight / s)

    def loss(model, x):
        return jnp.mean(jnp.tanh(jax.vmap(model)(x)) ** 2)

    def rows(select):
        cfg = jaxamp.fp8(first_last_bf16=False, select=select)
        f = eqx.filter_jit(jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=cfg))
        return [(r.module, r.layer, r.dtype) for r in _rows(f, model, x)]

    names = [f"layers/{i}/weight" for i in range(3)]
    selection = jaxamp.fp8_select(loss, budget=BUDGET, first_last_bf16=False)(model, x)
    assert dict(selection) == {names[0]: False, names[1]: True, names[2]: True}
    assert selection.alone[names[0]] > BUDGET >= selection.error > 0
    # Every product sits under the same class scope; each is its own layer.
    path = "eqx.nn.MLP/eqx.nn.Linear"
    assert rows(selection) == [(path, names[0], "bfloat16"), (path, names[1], FP8),
                               (path, names[2], FP8)]  # fmt: skip


def test_an_nnx_module_merged_inside_the_function_is_named_by_its_state():
    """The conformance harness's route: no module scopes at all, one path ``""``.
    (fp8_select on named layers: the equinox test above.)"""

    class Mlp(nnx.Module):
        def __init__(self) -> None:
            self.a = nnx.Linear(D, D, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(D, D, rngs=nnx.Rngs(1))
            self.c = nnx.Linear(D, D, rngs=nnx.Rngs(2))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))

    graphdef, params = nnx.split(Mlp())

    def loss(params, x):
        return jnp.mean(jnp.tanh(nnx.merge(graphdef, params)(x)) ** 2)

    x = jax.random.normal(jax.random.key(9), (BATCH, D))
    cfg = jaxamp.fp8(first_last_bf16=False, select={"a/kernel": False})
    rows = _rows(jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=cfg), params, x)
    assert [(r.module, r.layer, r.dtype) for r in rows] == [
        ("", "a/kernel", "bfloat16"), ("", "b/kernel", FP8), ("", "c/kernel", FP8)
    ]  # fmt: skip


def test_a_plain_function_names_its_layers_by_argument_and_key():
    k = jax.random.split(jax.random.key(1), 4)
    w0, w1, w2 = (jax.random.normal(k[i], (D, D)) / np.sqrt(D) for i in range(3))

    def loss(first, rest, x):  # a bare array argument is named by the argument
        h = jnp.tanh(x @ first)
        h = jnp.tanh(h @ rest["mid"])
        return jnp.mean(jnp.tanh(h @ rest["out"]) ** 2)

    args = (w0, {"mid": w1, "out": w2}, jax.random.normal(k[3], (BATCH, D)))
    # `rest` is read by most products: it holds their weights; the first product
    # reads `first` and `x`, one product each: `first` comes first.
    cfg = jaxamp.fp8(first_last_bf16=False, select={"mid": False})
    f = jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=cfg)
    assert _layers(f, *args) == {"first": [FP8], "mid": ["bfloat16"], "out": [FP8]}


def test_a_layer_called_twice_is_one_layer():
    """A module path read with one weight in both calls is one layer, and a weight
    read under two class scopes is one layer per scope (its module path)."""
    keys = jax.random.split(jax.random.key(2), 2)
    model = eqx.nn.Sequential([eqx.nn.Linear(D, D, key=k) for k in keys])

    def loss(model, x):
        y = jax.vmap(model)(x)
        return jnp.mean(jax.vmap(model)(jnp.tanh(y)) ** 2)

    x = jax.random.normal(jax.random.key(3), (BATCH, D))
    cfg = jaxamp.fp8(first_last_bf16=False, select={"layers/0/weight": False})
    ran = _layers(jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=cfg), model, x)
    assert ran == {"layers/0/weight": ["bfloat16"] * 2, "layers/1/weight": [FP8] * 2}


def test_a_selection_naming_no_layer_warns_with_the_layers_there_are():
    x = jax.random.normal(jax.random.key(4), (BATCH, D))
    w = jax.random.normal(jax.random.key(5), (D, D))
    cfg = jaxamp.fp8(first_last_bf16=False, select={"Dense_0": False})
    f = jaxamp.autocast(lambda w, x: jnp.sum(x @ w), dtype=jnp.bfloat16, fp8=cfg)
    with pytest.warns(UserWarning, match=r"names \['Dense_0'\], no layer .* layers: \['w'\]"):
        jax.make_jaxpr(f)(w, x)
    ok = jaxamp.autocast(
        lambda w, x: jnp.sum(x @ w), dtype=jnp.bfloat16,
        fp8=jaxamp.fp8(first_last_bf16=False, select={"w": False}),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _layers(ok, w, x) == {"w": ["bfloat16"]}


def test_two_arguments_of_one_structure_are_told_apart_by_their_argument():
    """Two models of one class (a generator and a discriminator, an encoder and a
    decoder) hold weights at the same paths: each layer is its own, named with its
    argument, and a selection turns off one layer, not its twin in the other model."""
    keys = jax.random.split(jax.random.key(6), 4)
    g = eqx.nn.Sequential([eqx.nn.Linear(D, D, key=k) for k in keys[:2]])
    d = eqx.nn.Sequential([eqx.nn.Linear(D, D, key=k) for k in keys[2:]])

    def loss(g, d, x):
        return jnp.mean(jax.vmap(d)(jnp.tanh(jax.vmap(g)(x))) ** 2)

    x = jax.random.normal(jax.random.key(7), (BATCH, D))
    cfg = jaxamp.fp8(first_last_bf16=False, select={"d/layers/0/weight": False})
    ran = _layers(jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=cfg), g, d, x)
    assert ran == {
        "g/layers/0/weight": [FP8],
        "g/layers/1/weight": [FP8],
        "d/layers/0/weight": ["bfloat16"],
        "d/layers/1/weight": [FP8],
    }


def test_the_batch_read_by_several_layers_does_not_name_them():
    """The q, k, v projections all read the batch, as often as each reads the weights'
    argument: the argument holding more of the arrays read holds the weights."""
    k = jax.random.split(jax.random.key(8), 3)
    weights = {n: jax.random.normal(k[i], (D, D)) / np.sqrt(D) for i, n in enumerate("qkv")}
    x = jax.random.normal(jax.random.key(9), (BATCH, D))

    def f(inputs, weights):  # "inputs" sorts before "weights"
        q, k, v = (inputs @ weights[n] for n in "qkv")
        return jnp.sum(jnp.tanh(q) * jnp.tanh(k) * v)

    cfg = jaxamp.fp8(first_last_bf16=False)
    ran = _layers(jaxamp.autocast(f, dtype=jnp.bfloat16, fp8=cfg), x, weights)
    assert ran == {"q": [FP8], "k": [FP8], "v": [FP8]}


def test_a_tie_names_the_layer_by_the_first_argument():
    """One product reads the weight and the batch once each: JAX's convention
    (``jax.grad`` differentiates the first argument) puts the parameters first."""
    x = jax.random.normal(jax.random.key(10), (BATCH, D))
    w = jax.random.normal(jax.random.key(11), (D, D))
    cfg = jaxamp.fp8(first_last_bf16=False)
    f = jaxamp.autocast(lambda w, batch: jnp.sum(batch @ w), dtype=jnp.bfloat16, fp8=cfg)
    assert _layers(f, w, x) == {"w": [FP8]}


def test_a_jitted_layer_function_shows_each_layer_it_is_called_for():
    """One nested jit called on three weights is autocast once per layer: audit's
    rows, and so ``fp8_select``'s candidates, hold every layer, not the first call's."""

    @jax.jit
    def dense(h, w):
        return jnp.tanh(h @ w)

    def loss(ws, x):
        for n in "abc":
            x = dense(x, ws[n])
        return jnp.mean(x**2)

    k = jax.random.split(jax.random.key(12), 3)
    ws = {n: jax.random.normal(k[i], (D, D)) / np.sqrt(D) for i, n in enumerate("abc")}
    x = jax.random.normal(jax.random.key(13), (BATCH, D)).astype(jnp.bfloat16)
    cfg = jaxamp.fp8(first_last_bf16=False)
    ran = _layers(jaxamp.autocast(loss, dtype=jnp.bfloat16, fp8=cfg), ws, x)
    assert ran == {"a": [FP8], "b": [FP8], "c": [FP8]}


def test_an_eager_call_that_hits_the_cache_does_not_name_its_layers(monkeypatch):
    """Layer names are read by a trace only: a repeated eager call pays nothing for them."""
    from jaxamp.casting._autocast import _wrapper

    calls = []
    real = _wrapper.argument_names
    monkeypatch.setattr(_wrapper, "argument_names", lambda *a: calls.append(1) or real(*a))
    f = jaxamp.autocast(
        lambda w, x: x @ w, dtype=jnp.bfloat16, fp8=jaxamp.fp8(first_last_bf16=False)
    )
    w, x = jnp.ones((D, D)), jnp.ones((BATCH, D))
    for _ in range(3):
        f(w, x)
    assert len(calls) == 1
