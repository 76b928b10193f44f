"""Thread safety and history independence of ``jaxamp.autocast``.

* ``autocast(modules=...)`` on nnx modules, called from two threads at once,
  leaves the user's classes as they were and gives each thread the
  single-threaded answer.
* The autocast program does not depend on what was traced before it: a
  ``jax.nn.log_softmax`` already traced in float32 (JAX caches nested jits'
  jaxprs) gives the same autocast result as in a fresh process.
* An explicit ``preferred_element_type=jnp.float32`` is kept however ``matmul``
  was imported.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        if _SYNC:  # both threads are inside a trace now (and so inside autocast's patch)
            _SYNC[0].wait(timeout=30)
            time.sleep(random.random() * 0.02)
        return self.head(self.norm(nnx.relu(self.l1(x))))


_SYNC: list[threading.Barrier] = []


def test_modules_rules_from_two_threads_leave_classes_unpatched():
    originals = {cls: cls.__dict__["__call__"] for cls in (_Net, nnx.Linear, nnx.LayerNorm)}
    x = jax.random.normal(jax.random.key(0), (4, 8))
    modules = {"head": "float32", "LayerNorm": "float32"}
    want = np.asarray(jaxamp.autocast(_Net(nnx.Rngs(0)), dtype=jnp.float16, modules=modules)(x))
    for cls, fn in originals.items():
        assert cls.__dict__["__call__"] is fn

    rounds = 10
    barrier = threading.Barrier(2)
    results: list[list[np.ndarray]] = [[], []]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(rounds):
                model = _Net(nnx.Rngs(0))
                fn = jaxamp.autocast(model, dtype=jnp.float16, modules=modules)  # a new trace
                barrier.wait()
                results[k].append(np.asarray(fn(x)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    _SYNC.append(threading.Barrier(2))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _SYNC.clear()
    assert not errors, errors
    left = [cls.__name__ for cls, fn in originals.items() if cls.__dict__["__call__"] is not fn]
    for cls, fn in originals.items():  # undo a leak before asserting: later tests use these
        cls.__call__ = fn
    assert not left, f"{left} __call__ left patched by autocast(modules=...)"
    for k in range(2):
        assert len(results[k]) == rounds
        for out in results[k]:
            np.testing.assert_array_equal(out, want)


# --------------------------------------------------------------------------
# History independence.
# --------------------------------------------------------------------------

_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
import jaxamp
x = jax.random.normal(jax.random.key(0), (4, 32))
w = 0.5 * jax.random.normal(jax.random.key(1), (32, 50))
def f(x, w):
    return jax.nn.log_softmax(x @ w)
{warm}
out = jaxamp.autocast(f, dtype=jnp.float16)(x, w)
print(out.dtype.name)
print(np.asarray(out, np.float32).tobytes().hex())
"""


def _inputs():
    x = jax.random.normal(jax.random.key(0), (4, 32))
    w = 0.5 * jax.random.normal(jax.random.key(1), (32, 50))
    return x, w


def _log_softmax_of_matmul(x, w):
    return jax.nn.log_softmax(x @ w)


def _fresh(warm: str) -> tuple[str, np.ndarray]:
    code = textwrap.dedent(_PROGRAM).format(warm=warm)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    dtype, data = proc.stdout.split()[-2:]
    return dtype, np.frombuffer(bytes.fromhex(data), np.float32).reshape(4, 50)


def test_log_softmax_same_answer_whether_or_not_traced_before():
    fresh_dtype, fresh = _fresh(warm="")
    warm_dtype, warm = _fresh(warm="f(x, w)  # traced in float32 first")
    assert (warm_dtype, fresh_dtype) == ("float32", "float32")
    np.testing.assert_array_equal(warm, fresh)


def test_log_softmax_in_process_equals_fresh_process():
    x, w = _inputs()
    _log_softmax_of_matmul(x, w)  # a float32 trace first (as any test before may do)
    out = jaxamp.autocast(_log_softmax_of_matmul, dtype=jnp.float16)(x, w)
    fresh_dtype, fresh = _fresh(warm="")
    assert out.dtype.name == fresh_dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), fresh)


def _kl(x, w):
    z = x @ w
    return optax.kl_divergence(jax.nn.log_softmax(z), jax.nn.softmax(z))


def test_kl_of_own_softmax_is_zero_under_autocast():
    """KL(p || p) = 0: log_softmax and softmax of the same logits must agree to ~1e-7."""
    x, w = _inputs()
    ref = _kl(x, w)  # float32 trace first
    assert np.abs(np.asarray(ref)).max() < 1e-6
    out = jaxamp.autocast(_kl, dtype=jnp.float16)(x, w)
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
