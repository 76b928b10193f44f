"""``low_precision_state``'s arguments as users from optax, torchao and bitsandbytes spell
them: each one either does what was asked or is refused at construction or init, naming
the argument and what to write instead; never a state silently left in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.low_precision_state._stored import is_stored

PARAMS = {"w": jnp.ones((16, 64)), "b": jnp.zeros(8)}


def _n_stored(state: object) -> int:
    return sum(map(is_stored, jax.tree.leaves(state, is_leaf=is_stored)))


@pytest.mark.parametrize(
    ("inner", "dtype"),
    [
        # PyTorch's (torchao, bitsandbytes) names for Adam's moments
        (optax.adam(1e-3), {"exp_avg": "8bit", "exp_avg_sq": "8bit"}),
        # adafactor's second moment is v_row / v_col / v, not nu
        (optax.adafactor(1e-3), {"nu": "8bit"}),
        # a named_chain's names are not state fields
        (optax.named_chain(("adam", optax.adam(1e-3))), {"adam": "8bit"}),
        # one known field and one misspelt
        (optax.adam(1e-3), {"mu": "8bit", "nuu": jnp.bfloat16}),
    ],
)
def test_mapping_with_a_field_the_state_lacks_is_refused_at_init(inner, dtype) -> None:
    tx = jaxamp.low_precision_state(inner, dtype, min_size=64)
    with pytest.raises(ValueError, match=r"dtype.*names? .*no field") as err:
        tx.init(PARAMS)
    # it lists the fields there are, to copy from
    assert "count" in str(err.value)


def test_mapping_with_the_state_fields_stores_them() -> None:
    tx = jaxamp.low_precision_state(optax.adam(1e-3), {"mu": "8bit", "nu": None}, min_size=64)
    state = tx.init(PARAMS)
    assert _n_stored(state) == 1
    # a field present but with every leaf below min_size is no error (a small model)
    tx = jaxamp.low_precision_state(optax.adam(1e-3), {"mu": "8bit"}, min_size=10**6)
    assert _n_stored(tx.init(PARAMS)) == 0


@pytest.mark.parametrize("dtype", ["8-bit", "8 bit", "float8"])
def test_unknown_dtype_string_names_the_argument(dtype) -> None:
    with pytest.raises(ValueError, match=r"dtype must be jnp.bfloat16 or '8bit'"):
        jaxamp.low_precision_state(optax.adam(1e-3), dtype)
    with pytest.raises(ValueError, match=r"dtype\['mu'\] must be jnp.bfloat16 or '8bit'"):
        jaxamp.low_precision_state(optax.adam(1e-3), {"mu": dtype})


@pytest.mark.parametrize("seed", [None, 1.5, "0", True, jnp.zeros((3,), jnp.uint32)])
def test_bad_seed_is_refused_at_construction(seed) -> None:
    with pytest.raises(TypeError, match=r"`seed` must be"):
        jaxamp.low_precision_state(optax.adam(1e-3), "8bit", seed=seed)


def test_seed_as_a_jax_key_is_that_key() -> None:
    # jaxamp.apply_with_stochastic_rounding takes a key: a key here means the same as
    # the int it was made from.
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), PARAMS)

    def stored(seed):
        tx = jaxamp.low_precision_state(optax.adam(1e-3), "8bit", min_size=64, seed=seed)
        return tx.update(grads, tx.init(PARAMS), PARAMS)[1]

    want = stored(7)
    for seed in (jax.random.key(7), jax.random.PRNGKey(7), np.int64(7)):
        got = stored(seed)
        same = jax.tree.map(lambda a, b: bool((a == b).all()), got, want)
        assert all(jax.tree.leaves(same))


@pytest.mark.parametrize(
    ("outer", "rel"), [("8bit", 2**-2), (jnp.bfloat16, 2**-6)], ids=["8bit", "bf16"]
)
def test_a_wrapped_optimizer_wrapped_again_keeps_its_own_stored_state(outer, rel) -> None:
    """An optimizer already wrapped (in a chain the user wraps as a whole, or twice by
    mistake) keeps its own stored moments: the outer wrapper stores only the moments of
    the rest. Its 8-bit scales (float32, at least min_size of them here) are not
    moments: stored again they lost the code tags in their low bits and the step
    failed."""
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.float32)}
    grads = [jax.tree.map(lambda x, i=i: x * 10.0**-i, params) for i in range(3)]
    inner = jaxamp.low_precision_state(optax.adam(1e-3), "8bit", block_size=32, min_size=64)
    momentum = optax.sgd(1e-3, momentum=0.9)
    tx = jaxamp.low_precision_state(optax.chain(inner, momentum), outer, min_size=64)
    ref = optax.chain(inner, momentum)  # the momentum's trace in float32
    state, ref_state = jax.jit(tx.init)(params), jax.jit(ref.init)(params)
    step, ref_step = jax.jit(tx.update), jax.jit(ref.update)
    for g in grads:
        u, state = step(g, state, params)
        u_ref, ref_state = ref_step(g, ref_state, params)
        # the stored trace moves the update by at most a few of its format's steps
        want = np.asarray(u_ref["w"])
        np.testing.assert_allclose(np.asarray(u["w"]), want, atol=rel * np.abs(want).max())
        # the inner wrapper's state as the inner wrapper alone keeps it, bit for bit
        kept = jax.tree.map(lambda a, b: bool((a == b).all()), state.inner_state[0], ref_state[0])
        assert all(jax.tree.leaves(kept))
    assert _n_stored(state.inner_state[0]) == 2 and _n_stored(state.inner_state[1]) == 1
