"""``low_precision_state``: any optax optimizer's moments stored in 8 or 16 bits.

The wrapped optimizer never sees the stored form: each step decodes its moments to
float32, runs its update unchanged, and stores the new moments again. So it works for
any optax optimizer (its state is a pytree: which leaves are moments is read off the
tree, not off a list of known optimizers), and a step skipped around it (by
``skip_nonfinite``, ``jaxamp.step``, ``optax.apply_if_finite``) keeps the stored state as
it was, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._utils.dtypes import is_float
from jaxamp.loss_scale import holds_loss_scale
from jaxamp.low_precision_params import _key_parts
from jaxamp.low_precision_state._stored import Quantized8, Rounded16, is_stored

__all__ = ["LowPrecisionState", "low_precision_state"]

#: The 8-bit block code's name, as ``dtype=`` takes it.
EIGHT_BIT = "8bit"

#: Fields that are not moments, kept as they are whatever ``dtype`` says: an
#: accumulator (optax.MultiSteps' sum of a window's gradients: summed, never decayed,
#: so rounding would bias it) and the copies of the params optax's optimizers keep
#: (prodigy's ``params0``, DoG's ``init_params``, COCOB's ``init_particles``,
#: schedule-free's ``z``): they are subtracted from the params, and stored, their
#: difference would be mostly rounding error.
_NOT_MOMENTS = frozenset({"acc_grads", "params0", "init_params", "init_particles", "z"})


class LowPrecisionState(NamedTuple):
    """The state of [`low_precision_state`][jaxamp.low_precision_state].

    Attributes:
      count: int32, the steps stored so far; with the seed, what each step's
        stochastic rounding draws from (a skipped step draws again).
      inner_state: the wrapped optimizer's state, each moment stored as a
        ``Quantized8`` or ``Rounded16`` (``jaxamp.types``).
    """

    count: jax.Array
    inner_state: Any


def _target(dtype: Any, argument: str) -> str | np.dtype | None:
    if dtype is None or (isinstance(dtype, str) and dtype == EIGHT_BIT):
        return dtype
    try:
        d = np.dtype(dtype)
    except (TypeError, ValueError):  # NumPy raises either for a name it does not know
        d = None
    if d == np.dtype(jnp.bfloat16):
        return d
    if d == np.dtype(jnp.float16):
        raise ValueError(
            f"low_precision_state: {argument}=float16 is not offered: a second moment is a "
            "squared gradient, and float16's smallest value (6e-8) is the square of a "
            "gradient of 2.4e-4; below it the moment flushes to zero and Adam divides by "
            f"eps. Write {argument}=jnp.bfloat16 (float32's range) or {argument}='8bit' "
            "(a scale per block)."
        )
    raise ValueError(
        f"low_precision_state: {argument} must be jnp.bfloat16 or '8bit', got {dtype!r}."
    )


def _seed_key(seed: Any) -> jax.Array:
    """The key ``seed`` names: an int's ``jax.random.key``, or the key itself."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        return jax.random.key(int(seed))
    try:
        data, impl = _key_parts(seed, "low_precision_state")
        return jax.random.wrap_key_data(data, impl=impl)
    except (TypeError, ValueError):
        raise TypeError(
            "low_precision_state: `seed` must be an int or a PRNG key (seed=0 or "
            f"seed=jax.random.key(0)), got {seed!r}."
        ) from None


def _held(x: Any) -> bool:
    """A node this wrapper's state keeps whole: a stored moment, or the state of a
    ``low_precision_state`` inside ``inner`` (it stores its own moments; its 8-bit
    scales are not moments, and storing them again would lose the code tags in their
    low bits)."""
    return is_stored(x) or isinstance(x, LowPrecisionState)


def _names(path: tuple[Any, ...]) -> list[str]:
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def low_precision_state(
    inner: optax.GradientTransformation | optax.MultiSteps,
    /,
    dtype: Any,
    *,
    block_size: int = 256,
    min_size: int = 4096,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s moments in bfloat16 or in 8 bits; ``inner`` computes in float32.

    Each step decodes the stored moments to float32, runs ``inner.update`` on them
    unchanged, and stores the new moments with stochastic rounding (unbiased: a
    moment's decay by ``b2 = 0.999``, far below a step of either format, is kept in
    expectation, where rounding to nearest would lose it); in 8 bits a signed block (a
    first moment) rounds to nearest where its value moved by more than half a step,
    stochastically where nearest would give the stored value back. Between steps no
    float32 copy exists.

    - ``jnp.bfloat16``: 2 bytes per element (float32's range, 8 bits of precision).
    - ``"8bit"``: 1 byte per element and a float32 scale per ``block_size`` elements
      of a row (about 1.016 bytes at 256): minifloat codes with relative precision,
      each block choosing among 4, 3 or 2 exponent bits (the rest mantissa) from its
      values, signed codes for blocks with negative values (a first moment) and
      non-negative ones with one more bit of precision for the others (a second
      moment, where a positive value is never stored as 0). See docs/optimizer_state.md.

    The moments are the floating leaves of ``inner``'s state with at least
    ``min_size`` elements (smaller ones, and counts and hyperparameters, stay as
    they are), except optax.MultiSteps' gradient sum, the copies of the params that
    optax's prodigy, DoG, COCOB and schedule-free keep (``params0``, ``init_params``,
    ``init_particles``, ``z``) and the state of a ``low_precision_state`` inside
    ``inner`` (kept as it stores it). Put the wrapper *inside* the
    guard and around the optimizer itself:
    ``jaxamp.skip_nonfinite(jaxamp.low_precision_state(optax.adamw(1e-3), "8bit"))``.

    Args:
      inner: the optax optimizer whose state is stored.
      dtype: ``jnp.bfloat16`` or ``"8bit"`` for every moment; or a mapping from the
        state's field names to either, or to ``None`` (stays as it is), e.g.
        ``{"mu": "8bit", "nu": jnp.bfloat16}`` for optax.adam's moments; fields not
        named stay as they are.
      block_size: elements per block of the 8-bit code, along a moment's last axis
        (the axis stays whole, so a sharded moment quantizes its own blocks); a power
        of two.
      min_size: moments with fewer elements stay as they are.
      seed: the stochastic rounding's seed, an int or a PRNG key
        (``jax.random.key(0)``, as ``apply_with_stochastic_rounding`` takes); each step
        draws from it and the step count.

    Returns:
      An optax transformation (extra arguments passed through to ``inner``) whose
      state is a ``LowPrecisionState``.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.low_precision_state(optax.adam(1e-3), "8bit")
      >>> state = tx.init({"w": jnp.zeros((64, 256))})
      >>> mu = state.inner_state[0].mu["w"]
      >>> mu.codes.dtype, mu.codes.shape, mu.scales.shape
      (dtype('uint8'), (64, 256), (64, 1))
    """
    # Duck-typed, as optax and the guard take it: optax.MultiSteps is an object with
    # init and update, not a GradientTransformation.
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            "low_precision_state: `inner` must be an optax optimizer (an "
            f"optax.GradientTransformation), got {type(inner).__name__}."
        )
    if isinstance(dtype, Mapping):
        if not dtype:  # would store nothing, silently: every moment left in float32
            raise ValueError(
                "low_precision_state: dtype is an empty mapping, which stores no moment. "
                "Write dtype='8bit' or dtype=jnp.bfloat16 for every moment, or name the "
                "state's fields, e.g. {'mu': '8bit', 'nu': jnp.bfloat16} for optax.adam's."
            )
        fields = {str(k): _target(v, f"dtype[{k!r}]") for k, v in dtype.items()}
        kept = sorted(_NOT_MOMENTS.intersection(k for k, v in fields.items() if v is not None))
        if kept:  # would be ignored, silently
            raise ValueError(
                f"low_precision_state: dtype names {', '.join(map(repr, kept))}, which is "
                "never stored: a gradient sum or a copy of the params, not a moment (stored, "
                "the difference from the params would be mostly rounding error). Leave it "
                "out of the mapping."
            )
        everywhere = None
    else:
        fields, everywhere = {}, _target(dtype, "dtype")
        if everywhere is None:
            raise ValueError("low_precision_state: dtype must be jnp.bfloat16 or '8bit', got None.")
    for name, value in (("block_size", block_size), ("min_size", min_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"low_precision_state: `{name}` must be an int >= 0, got {value!r}.")
    if block_size < 1 or block_size & (block_size - 1):
        # A checkpoint does not record the block size. Two powers of two cut a row into
        # as many blocks only where each is one block (read the same): a restore into
        # another size fails on the scales' shape. Other sizes can cut as many blocks at
        # other places, which would decode every moment silently wrong.
        raise ValueError(
            f"low_precision_state: `block_size` must be a power of two (64, 128, 256, ...), "
            f"got {block_size}: a checkpoint does not record it, and two powers of two never "
            "cut a row into as many blocks at different places (a restore into another size "
            "fails instead of reading the codes with the wrong scales)."
        )
    seed_key = _seed_key(seed)
    inner = optax.with_extra_args_support(inner)

    def target(path: tuple[Any, ...], leaf: Any) -> Any:
        names = _names(path)
        if _held(leaf) or not is_float(leaf) or jnp.ndim(leaf) == 0 or jnp.size(leaf) < min_size:
            return None
        if _NOT_MOMENTS.intersection(names):
            return None
        if everywhere is not None:
            return everywhere
        for name in reversed(names):  # the innermost field that is named
            if name in fields:
                return fields[name]
        return None

    def store(stored: Any, new: Any, key: jax.Array) -> Any:
        """``new`` (the wrapped optimizer's state) in ``stored``'s form."""
        leaves, treedef = jax.tree.flatten(stored, is_leaf=_held)
        news = treedef.flatten_up_to(new)
        out = []
        for i, (s, n) in enumerate(zip(leaves, news, strict=True)):
            out.append(s.restore(n, jax.random.fold_in(key, i)) if is_stored(s) else n)
        return jax.tree.unflatten(treedef, out)

    def init_fn(params: Any) -> LowPrecisionState:
        state = inner.init(params)
        if holds_loss_scale(state):
            raise ValueError(
                "low_precision_state: `inner` holds a loss scale (a jaxamp guard): the "
                "guard goes outside, around the stored state, so that a skipped step keeps "
                "it. Write jaxamp.skip_nonfinite(jaxamp.low_precision_state(optimizer, "
                "dtype)), not the other way round."
            )
        key = seed_key
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_held)
        _check_fields(fields, leaves)
        out = []
        for i, (path, leaf) in enumerate(leaves):
            t = target(path, leaf)
            k = jax.random.fold_in(key, i)
            if t is None:
                out.append(leaf)
            elif t == EIGHT_BIT:
                out.append(Quantized8.store(leaf, k, block_size, leaf.dtype))
            else:
                out.append(Rounded16.store(leaf, k, leaf.dtype))
        return LowPrecisionState(jnp.zeros([], jnp.int32), jax.tree.unflatten(treedef, out))

    def update_fn(
        updates: Any, state: LowPrecisionState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LowPrecisionState]:
        state = _rewrapped(state, params, init_fn)
        values = jax.tree.map(
            lambda s: s.value() if is_stored(s) else s, state.inner_state, is_leaf=_held
        )
        updates, new = inner.update(updates, values, params, **extra_args)
        key = jax.random.fold_in(seed_key, state.count)
        stored = store(state.inner_state, new, key)
        return updates, LowPrecisionState(state.count + 1, stored)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_fields(fields: Mapping[str, Any], leaves: list[tuple[Any, Any]]) -> None:
    """Refuses a ``dtype`` mapping that names a field the state has not: that field's
    moments would silently stay as they are."""
    present = {name for path, _ in leaves for name in _names(path)}
    missing = [name for name in fields if name not in present]
    if missing:
        raise ValueError(
            f"low_precision_state: dtype names {', '.join(map(repr, missing))}, which "
            "the state of `inner` has no field called, so nothing there would be stored. "
            f"Its fields are: {', '.join(sorted(present)) or '(none)'}. Write those names, "
            "e.g. {'mu': '8bit', 'nu': jnp.bfloat16} for optax.adam's moments, or "
            "dtype='8bit' for every moment. Fields are attributes of the state's nodes "
            "(a NamedTuple's or a dataclass's), not keys of a dict: for a state kept in "
            "dicts, write one dtype for every moment."
        )


def _rewrapped(state: Any, params: Any, init_fn: Any) -> Any:
    """``state`` with its stored moments as ``Quantized8`` / ``Rounded16`` again, where
    a holder turned them into mappings of their fields.

    Flax's ``nnx.Optimizer`` does: its ``nnx.update`` of the optimizer state replaces a
    pytree node that sits in a parameter mapping (each moment here) by an ``nnx.State``
    of its fields. The arrays, and their order, are unchanged (field names sort as the
    fields are declared), so the structure ``init`` builds for these params puts them
    back. Anything else is left for the wrapped optimizer to reject as it would.
    """
    if params is None or any(map(is_stored, jax.tree.leaves(state, is_leaf=is_stored))):
        return state
    template = jax.eval_shape(init_fn, params)
    if not any(map(is_stored, jax.tree.leaves(template, is_leaf=is_stored))):
        return state
    leaves, want = jax.tree.leaves(state), jax.tree.leaves(template)
    same = len(leaves) == len(want) and all(
        jnp.shape(a) == b.shape and jnp.result_type(a) == b.dtype
        for a, b in zip(leaves, want, strict=True)
    )
    return jax.tree.unflatten(jax.tree.structure(template), leaves) if same else state
