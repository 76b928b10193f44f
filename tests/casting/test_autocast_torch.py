"""jaxamp.autocast against torch.autocast("cpu", dtype=torch.bfloat16) (issue 31).

Random graphs of activations, float32 inputs, parameters and constants
(``tests/casting/autocast_graphs.py``) run under torch.autocast, which reports the dtype
it gives each op; jaxamp.autocast in bfloat16 must then be finite where torch
is, and within the error bound of those dtypes against exact float64
arithmetic. torch's own result is checked against the same bound, so the bound
is known to hold for the program it describes.

torch is not among ``make test``'s dependencies (its wheel and CUDA libraries
are gigabytes): ``pip install -e '.[torch]'`` to run this file.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import jaxamp
from tests.casting import autocast_graphs as G

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install -e '.[torch]' (a large download)"
)

_graphs = st.builds(
    G.Graph,
    st.lists(
        st.tuples(st.sampled_from(G.OPS), st.integers(0, 29), st.integers(0, 29)),
        min_size=1,
        max_size=6,
    ).map(tuple),
    st.sampled_from([0.5, 2.0, 3.0]),
)


def test_torch_dtypes_of_the_ops_the_bound_is_written_for():
    # What the graphs rely on: CPU autocast runs matmuls in bfloat16 and promotes
    # a bfloat16 activation meeting a float32 tensor; a Python scalar does not.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, w, p = torch.ones(2, 3), torch.ones(3, 3), torch.ones(3)
        h = a @ w
        assert h.dtype == torch.bfloat16
        assert (h + a).dtype == torch.float32
        assert torch.where(h > 0, h, a).dtype == torch.float32
        assert (h * 2.0).dtype == torch.bfloat16
        # A float32 vector promotes too; a Linear casts its bias with the matmul.
        assert (h * p).dtype == torch.float32
        assert torch.nn.functional.linear(a, w, p).dtype == torch.bfloat16


@settings(max_examples=60, deadline=None, derandomize=True)
@given(graph=_graphs, seed=st.integers(0, 2**30))
# A float32 parameter vector meeting an activation: torch promotes a per-channel
# scale, and a bias anywhere but on a matmul's result (Linear casts that one).
@example(graph=G.Graph((("scale", 2, 2),), 2.0), seed=0)
@example(graph=G.Graph((("tanh", 2, 2), ("bias", 0, 0)), 2.0), seed=1)
@example(graph=G.Graph((("bias", 2, 2), ("tanh", 0, 0)), 2.0), seed=2)
def test_random_programs_in_bfloat16_are_within_the_bound_of_torchs_dtypes(graph, seed):
    data = G.make_data(seed)
    torch_out, kinds = G.run_torch(graph, data, torch)
    exact, bound = G.reference(graph, data, kinds, G.BFLOAT16)
    assume(np.isfinite(exact).all() and np.abs(exact).max() < 1e30)
    assume(np.isfinite(torch_out).all())
    assert (np.abs(torch_out - exact) <= 4 * bound).all(), (graph, kinds)  # the bound holds
    got = jaxamp.autocast(G.run_jnp(graph), dtype=jnp.bfloat16)(*[data[k] for k in "xwtpm"])
    assert got.dtype == jnp.float32
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), (graph, kinds)
    assert (np.abs(got - exact) <= 4 * bound).all(), (graph, kinds)
