"""float16 silu of a very negative activation (issue 31, D7)."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

F16 = jnp.float16


def test_silu_between_minus_20_and_minus_17_is_not_flushed_to_zero():
    v = np.array([[-17.5, -18.5, -19.5, -20.0]], np.float32)
    eye = np.eye(4, dtype=np.float32)

    def f(a, i):
        return jax.nn.silu(a @ i)  # a @ i makes `a` a float16 activation, exactly

    ref = np.asarray(f(v, eye))
    got = np.asarray(jaxamp.autocast(f, dtype=F16)(v, eye), np.float32)
    # silu in float32, rounded once to float16: within half a subnormal step
    # (these results are float16 subnormals), and never 0.
    step = float(jnp.finfo(F16).smallest_subnormal)
    assert np.all(got != 0), got
    np.testing.assert_allclose(got, ref, rtol=float(jnp.finfo(F16).eps), atol=step / 2)
