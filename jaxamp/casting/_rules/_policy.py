"""Mixed-precision casting policies.

A [`Policy`][jaxamp.Policy] names three floating dtypes: the dtype parameters are stored
in (``param_dtype``), the dtype matrix products and convolutions run in
(``compute_dtype``) and the dtype a model hands back (``output_dtype``). It is
a small immutable value: hashable, usable as a static argument to ``jax.jit``,
and printable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.dtypes import is_float_dtype

__all__ = ["Policy"]

# Every spelling `Policy.from_string` accepts for a dtype, mapped to the dtype.
_DTYPE_NAMES: dict[str, np.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "f32": jnp.dtype(jnp.float32),
    "fp32": jnp.dtype(jnp.float32),
    "full": jnp.dtype(jnp.float32),
    "single": jnp.dtype(jnp.float32),
    "float16": jnp.dtype(jnp.float16),
    "f16": jnp.dtype(jnp.float16),
    "fp16": jnp.dtype(jnp.float16),
    "half": jnp.dtype(jnp.float16),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "bf16": jnp.dtype(jnp.bfloat16),
    "float64": jnp.dtype(jnp.float64),
    "f64": jnp.dtype(jnp.float64),
    "fp64": jnp.dtype(jnp.float64),
    "double": jnp.dtype(jnp.float64),
}

# Short names used by `Policy.to_string` and `repr`.
_SHORT = {
    jnp.dtype(jnp.float32): "f32",
    jnp.dtype(jnp.float16): "f16",
    jnp.dtype(jnp.bfloat16): "bf16",
    jnp.dtype(jnp.float64): "f64",
}

_FIELD_NAMES: dict[str, str] = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "outputs": "output_dtype",
    "o": "output_dtype",
}

_F32 = jnp.dtype(jnp.float32)
_F16 = jnp.dtype(jnp.float16)
_BF16 = jnp.dtype(jnp.bfloat16)

# Whole-policy names. "half" is Keras' "mixed_float16": parameters and outputs
# stay float32 (so optimizer updates and losses are full precision) and only the
# compute runs in float16. This is NOT jmp's "half" (jmp.get_policy("half") puts
# all three in half precision); `Policy.from_string` documents every difference.
_NAMED_POLICIES: dict[str, tuple[np.dtype, np.dtype, np.dtype]] = {
    "full": (_F32, _F32, _F32),
    "half": (_F32, _F16, _F32),
    "mixed_float16": (_F32, _F16, _F32),
    "mixed_bfloat16": (_F32, _BF16, _F32),
}


def _as_float_dtype(value: Any, field: str) -> np.dtype:
    """Canonicalises `value` to a floating numpy dtype or raises ValueError."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"{field}={value!r} is not a known dtype name; expected one of "
                f"{sorted(_DTYPE_NAMES)}"
            )
        return _DTYPE_NAMES[key]
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"{field}={value!r} is not a dtype") from e
    if not is_float_dtype(dtype):
        raise ValueError(f"{field} must be a floating dtype, got {dtype.name}")
    return dtype


def _cast_tree(tree: Any, dtype: np.dtype) -> Any:
    def cast(x: Any) -> Any:
        # Only arrays with a floating dtype are cast: ints, bools, PRNG keys,
        # Python scalars and non-array leaves pass through untouched.
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) and is_float_dtype(x.dtype):
            return x if x.dtype == dtype else jnp.asarray(x, dtype=dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision casting policy: parameter, compute and output dtypes.

    Attributes:
      param_dtype: dtype parameters are kept in (and updated in by the
        optimizer). Usually float32.
      compute_dtype: dtype matrix products and convolutions run in; the
        ``dtype`` that [`jaxamp.autocast`][jaxamp.autocast] uses when given this policy.
      output_dtype: dtype floating outputs are returned in.

    ``Policy()`` is float32 params and outputs with float16 compute (like
    ``Policy.from_string("half")``). All three are canonicalised to
    ``numpy.dtype`` objects and must be floating. A ``Policy`` is hashable, so it
    can be a static argument of ``jax.jit`` or a field of a Flax module.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> policy = jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> policy
      Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
      >>> policy.cast_to_compute(jnp.ones(2)).dtype
      dtype(bfloat16)
    """

    # float32 master weights and outputs, float16 compute: torch.autocast's on CUDA.
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float16
    output_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_float_dtype(getattr(self, field), field))

    def __repr__(self) -> str:
        return (
            f"Policy(param_dtype={self.param_dtype.name}, "
            f"compute_dtype={self.compute_dtype.name}, "
            f"output_dtype={self.output_dtype.name})"
        )

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parses a policy from a string.

        Accepted forms (case-insensitive, spaces ignored):

        * long: ``"params=float32,compute=bfloat16,output=float32"``;
        * short: ``"p=f32,c=bf16,o=f32"`` (keys ``p``/``c``/``o``, dtypes
          ``f32``/``f16``/``bf16``/``f64``, or ``half`` = float16 and
          ``full`` = float32); keys left out take ``Policy()``'s defaults
          (params float32, compute float16, output float32);
        * ``"full"``: float32 everywhere;
        * ``"half"`` (also ``"mixed_float16"``): float32 params and outputs,
          float16 compute, as Keras' ``"mixed_float16"``; ``"mixed_bfloat16"``
          likewise with bfloat16 compute;
        * a bare dtype name such as ``"bfloat16"``: that dtype for all three.

        The grammar looks like jmp's ``jmp.get_policy`` and agrees with it on
        ``"full"``, bare dtype names and strings that give all three keys
        (``"p=f32,c=f16,o=f32"``). It differs in three places:

        * ``"half"``: jmp gives half precision for params, compute *and*
          output; here params and outputs stay float32 (Keras' meaning).
        * keys left out: jmp lets compute follow params and output follow
          compute (``"c=f16"`` is ``p=f32,c=f16,o=f16`` there, ``"p=f16"``
          all float16); here they take ``Policy()``'s defaults (``"c=f16"`` is
          ``p=f32,c=f16,o=f32``, ``"p=f16"`` is ``p=f16,c=f16,o=f32``).
        * the dtype ``half``: jmp means bfloat16 on TPU and float16 elsewhere;
          here it is always float16.

        Write all three keys to get the same policy from both libraries.

        Args:
          spec: the policy string.

        Returns:
          The parsed [`Policy`][jaxamp.Policy].

        Raises:
          ValueError: if any part of the string is not understood; the message
            names that part.

        Examples:
          >>> jaxamp.Policy.from_string("p=f32,c=f16,o=f32").compute_dtype
          dtype('float16')
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.from_string expects a str, got {type(spec).__name__}")
        text = spec.strip().lower().replace(" ", "")
        if not text:
            raise ValueError("empty policy string")
        if text in _NAMED_POLICIES:
            return cls(*_NAMED_POLICIES[text])
        if "=" not in text and "," not in text:
            if text in _DTYPE_NAMES:
                dtype = _DTYPE_NAMES[text]
                return cls(dtype, dtype, dtype)
            raise ValueError(
                f"unknown policy {spec!r}: expected 'full', 'half', a dtype name or "
                "'params=...,compute=...,output=...'"
            )
        values: dict[str, np.dtype] = {}
        for part in text.split(","):
            key, sep, name = part.partition("=")
            if not sep or not key or not name:
                raise ValueError(f"bad policy part {part!r} in {spec!r}: expected key=dtype")
            if key not in _FIELD_NAMES:
                raise ValueError(
                    f"unknown policy key {key!r} in {spec!r}: expected params/p, "
                    "compute/c or output/o"
                )
            field = _FIELD_NAMES[key]
            if field in values:
                raise ValueError(f"policy key {key!r} given twice in {spec!r}")
            if name not in _DTYPE_NAMES:
                raise ValueError(f"unknown dtype {name!r} for {key!r} in {spec!r}")
            values[field] = _DTYPE_NAMES[name]
        return cls(**values)

    def to_string(self) -> str:
        """Returns the short string form, which `from_string` parses back.

        Returns:
          A string such as ``"p=f32,c=bf16,o=f32"``.

        Examples:
          >>> jaxamp.Policy.from_string("half").to_string()
          'p=f32,c=f16,o=f32'
        """

        def short(d: np.dtype) -> str:
            return _SHORT.get(d, d.name)

        return (
            f"p={short(self.param_dtype)},c={short(self.compute_dtype)},"
            f"o={short(self.output_dtype)}"
        )

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating array leaves of `tree` to ``param_dtype``.

        Args:
          tree: any pytree; integer, bool and non-array leaves pass through.

        Returns:
          A pytree of the same structure.

        Examples:
          >>> params = policy.cast_to_param(params)
        """
        return _cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating array leaves of `tree` to ``compute_dtype``.

        Args:
          tree: any pytree; integer, bool and non-array leaves pass through.

        Returns:
          A pytree of the same structure.

        Examples:
          >>> x = policy.cast_to_compute(x)
        """
        return _cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating array leaves of `tree` to ``output_dtype``.

        Args:
          tree: any pytree; integer, bool and non-array leaves pass through.

        Returns:
          A pytree of the same structure.

        Examples:
          >>> logits = policy.cast_to_output(logits)
        """
        return _cast_tree(tree, self.output_dtype)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy with another ``output_dtype``.

        Args:
          dtype: the new output dtype.

        Returns:
          A new [`Policy`][jaxamp.Policy].

        Examples:
          >>> policy.with_output_dtype(jnp.bfloat16)
          Policy(param_dtype=float32, compute_dtype=float16, output_dtype=bfloat16)
        """
        return dataclasses.replace(self, output_dtype=dtype)

    def flax_kwargs(self) -> dict[str, np.dtype]:
        """Keyword arguments that hand this policy to a Flax module.

        Flax linen and nnx layers (``Dense``/``Linear``, ``Conv``,
        ``LayerNorm``, ``MultiHeadDotProductAttention``, ...) take ``dtype``
        (computation dtype) and ``param_dtype`` (parameter dtype).

        Returns:
          ``{"dtype": compute_dtype, "param_dtype": param_dtype}``.

        Examples:
          >>> layer = flax.linen.Dense(128, **policy.flax_kwargs())
          >>> linear = flax.nnx.Linear(64, 128, rngs=rngs, **policy.flax_kwargs())
        """
        return {"dtype": self.compute_dtype, "param_dtype": self.param_dtype}
