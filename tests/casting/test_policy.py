"""Tests for jaxamp.Policy."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("P = F32, C = F16, O = BF16", (F32, F16, BF16)),
        ("c=half", (F32, F16, F32)),  # missing keys: Policy()'s defaults
        ("p=f16", (F16, F16, F32)),
        ("o=bf16", (F32, F16, BF16)),
        ("half", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("full", (F32, F32, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
    ],
)
def test_from_string(spec, expected):
    policy = jaxamp.Policy.from_string(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
    assert jaxamp.Policy.from_string(policy.to_string()) == policy


@pytest.mark.parametrize(
    "spec, part",
    [
        ("params=float32,compute=float17", "float17"),
        ("p=f32,x=f16", "'x'"),
        ("p=f32,p=f16", "given twice"),
        ("p=f32,,o=f32", "bad policy part"),
        ("quarter", "quarter"),
        ("", "empty"),
    ],
)
def test_from_string_errors_name_the_bad_part(spec, part):
    with pytest.raises(ValueError, match=part):
        jaxamp.Policy.from_string(spec)


def test_constructor_validates_and_canonicalises():
    policy = jaxamp.Policy(jnp.float32, "bf16", np.float32)
    assert policy.compute_dtype == BF16 and isinstance(policy.param_dtype, np.dtype)
    with pytest.raises(ValueError, match="compute_dtype"):
        jaxamp.Policy(jnp.float32, jnp.int8, jnp.float32)
    with pytest.raises(TypeError):
        jaxamp.Policy.from_string(3)
    # Frozen and hashable: usable as a static jit argument.
    with pytest.raises(AttributeError):
        policy.compute_dtype = F16
    assert hash(policy) == hash(jaxamp.Policy(F32, BF16, F32))


def test_repr():
    assert repr(jaxamp.Policy.from_string("half")) == (
        "Policy(param_dtype=float32, compute_dtype=float16, output_dtype=float32)"
    )


def test_casts_only_floating_leaves():
    policy = jaxamp.Policy.from_string("p=f32,c=bf16,o=f16")
    tree = {
        "w": jnp.ones((2,), F32),
        "h": np.ones(3, np.float16),
        "i": jnp.arange(3),
        "b": jnp.array([True]),
        "key": jax.random.key(0),
        "s": 1.5,
        "n": None,
    }
    for cast, dtype in [
        (policy.cast_to_compute, BF16),
        (policy.cast_to_output, F16),
        (policy.cast_to_param, F32),
    ]:
        out = cast(tree)
        assert out["w"].dtype == dtype and out["h"].dtype == dtype
        assert out["i"].dtype == tree["i"].dtype and out["b"].dtype == jnp.bool_
        assert out["key"] is tree["key"] and out["s"] == 1.5 and out["n"] is None
    # Under jit too.
    out = jax.jit(policy.cast_to_compute)(tree)
    assert out["w"].dtype == BF16 and out["i"].dtype == tree["i"].dtype


def test_flax_kwargs():
    policy = jaxamp.Policy.from_string("p=f32,c=bf16,o=f32")
    layer = nn.Dense(3, **policy.flax_kwargs())
    x = jnp.ones((2, 4))
    params = layer.init(jax.random.key(0), x)
    assert params["params"]["kernel"].dtype == F32
    assert layer.apply(params, x).dtype == BF16
    assert policy.with_output_dtype(jnp.float16).output_dtype == F16


def test_default_policy_is_api_md_mixed_float16():
    import jax.numpy as jnp

    import jaxamp

    p = jaxamp.Policy()
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.float16),
        jnp.dtype(jnp.float32),
    )
    assert p == jaxamp.Policy.from_string("half")


@pytest.mark.parametrize(
    "spec", ["full", "f32", "bf16", "float16", "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"]
)
def test_same_policy_as_jmp_where_the_docs_say_so(spec):
    jmp = pytest.importorskip("jmp")
    ours, theirs = jaxamp.Policy.from_string(spec), jmp.get_policy(spec)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        jnp.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    )


def test_differences_from_jmp_are_the_documented_ones():
    # Policy.from_string's docstring and docs/autocast.md list exactly these.
    jmp = pytest.importorskip("jmp")
    half = jnp.dtype(jmp.half_dtype())  # bfloat16 on TPU, float16 elsewhere

    def both(spec):
        p, q = jaxamp.Policy.from_string(spec), jmp.get_policy(spec)
        return (
            (p.param_dtype, p.compute_dtype, p.output_dtype),
            tuple(jnp.dtype(d) for d in (q.param_dtype, q.compute_dtype, q.output_dtype)),
        )

    assert both("half") == ((F32, F16, F32), (half, half, half))
    assert both("c=f16") == ((F32, F16, F32), (F32, F16, F16))
    assert both("p=f16") == ((F16, F16, F32), (F16, F16, F16))
    assert both("c=half") == ((F32, F16, F32), (F32, half, half))
