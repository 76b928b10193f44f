"""What ``autocast`` was asked to do, checked once when it is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.dtypes import is_float_dtype
from jaxamp.casting._fp8 import _fp8_config
from jaxamp.casting._rules._policy import Policy
from jaxamp.casting._rules._resolve import resolve_modules, resolve_rules
from jaxamp.casting._rules._rules import DEFAULT_RULES


@dataclasses.dataclass(frozen=True)
class Config:
    compute_dtype: np.dtype
    output_dtype: np.dtype | None
    rules: Mapping[str, str]
    modules: tuple[tuple[str, Any], ...]
    unknown_higher_order: str
    # find_overflow: name nnx module calls even without `modules=` rules, and
    # keep each equation's traceback and name stack in the result.
    debug: bool = False
    # FP8 matrix products (``jaxamp.fp8``), or None.
    fp8: _fp8_config.Fp8Config | None = None


def _default_dtype() -> np.dtype:
    # float16 mirrors torch.autocast on CUDA; TPUs have no fast float16.
    return np.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


def _resolve_dtype(dtype: Any, policy: Policy | str | None) -> tuple[np.dtype, np.dtype | None]:
    if policy is not None and dtype is not None:
        raise ValueError("autocast: pass either dtype= or policy=, not both")
    if policy is not None:
        if isinstance(policy, str):
            policy = Policy.from_string(policy)
        if not isinstance(policy, Policy):
            raise TypeError(
                f"autocast: policy must be a jaxamp.Policy or a policy string, got "
                f"{type(policy).__name__}"
            )
        return np.dtype(policy.compute_dtype), np.dtype(policy.output_dtype)
    if dtype is None:
        return _default_dtype(), None
    try:
        resolved = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(
            f"autocast: dtype={dtype!r} is not a dtype; write jnp.float16 or 'float16' "
            "(jnp.bfloat16 or 'bfloat16')"
        ) from e
    if not is_float_dtype(resolved):
        raise ValueError(
            f"autocast: dtype must be a floating dtype such as jnp.float16 or "
            f"jnp.bfloat16, got {resolved.name}"
        )
    return resolved, None


def build_config(
    dtype: Any,
    policy: Policy | str | None,
    rules: Mapping[Any, str] | None,
    modules: Mapping[str, Any] | None,
    unknown_higher_order: str,
    debug: bool = False,
    fp8: Any = None,
) -> Config:
    compute_dtype, output_dtype = _resolve_dtype(dtype, policy)
    if compute_dtype.itemsize == 1:
        raise ValueError(
            f"autocast: dtype={compute_dtype.name} would run every matrix product's result "
            "and the ops after it in 8 bits. FP8 is an option of autocast: write "
            "jaxamp.autocast(f, dtype=jnp.bfloat16, fp8=jaxamp.fp8())"
        )
    resolved_rules = {**DEFAULT_RULES, **resolve_rules(rules)}
    resolved_modules = resolve_modules(modules)
    if unknown_higher_order not in ("warn", "as_written", "error"):
        raise ValueError(
            "autocast: unknown_higher_order must be 'warn', 'as_written' or 'error', "
            f"got {unknown_higher_order!r}"
        )
    return Config(
        compute_dtype,
        output_dtype,
        MappingProxyType(resolved_rules),
        resolved_modules,
        unknown_higher_order,
        debug,
        _fp8_config.resolve(fp8),
    )
