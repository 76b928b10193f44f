"""Writes ``codes_before_per_block_choice.npz``: a moment's codes and scales as the 8-bit
code stored them before each block chose its code (one code per family, the scales'
low bits 0), and the values they decoded to then. Run from the repository root:
``python tests/low_precision_state/data/make_codes_before_per_block_choice.py``."""

import subprocess
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

BEFORE = "40c686c^"  # the last commit with one code per family
HERE = Path(__file__).resolve().parent

source = subprocess.run(
    ["git", "show", f"{BEFORE}:jaxamp/low_precision_state/_codes.py"],
    check=True,
    capture_output=True,
    text=True,
).stdout
old = types.ModuleType("codes_before")
exec(compile(source, "codes_before", "exec"), old.__dict__)

rng = np.random.default_rng(45)
x = rng.standard_normal((6, 96)) * np.exp(rng.uniform(-12, 12, (6, 96)))
x[1::2] = np.abs(x[1::2])  # non-negative rows
x[4, 40] = np.inf  # a NaN scale
x[5, :32] = 0.0  # an all-zero block
codes, scales = old.quantize(jnp.asarray(x, jnp.float32), jax.random.key(45), 32)
values = old.dequantize(codes, scales, 32)
np.savez_compressed(
    HERE / "codes_before_per_block_choice.npz",
    codes=np.asarray(codes),
    scales=np.asarray(scales),
    values=np.asarray(values),
)
