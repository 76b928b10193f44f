"""bfloat16 / float16 params without a float32 master copy: stochastic rounding and Kahan.

Two optax transformations, [`apply_with_stochastic_rounding`][jaxamp.apply_with_stochastic_rounding]
and [`apply_with_kahan_summation`][jaxamp.apply_with_kahan_summation], placed *last* in a chain,
and the array op the first applies, [`stochastic_round`][jaxamp.stochastic_round]. Each computes, in
float32, the low-precision value it wants a param to take (``new``) and returns
the update ``new - p`` in float32. ``optax.apply_updates`` then computes
``(p + (new - p)).astype(p.dtype)``: the difference of two bfloat16 values is
exact in float32 unless one is more than ``2**15`` times the other (float16: ``2**12``),
so the sum is ``new`` exactly and the cast changes nothing. Because the choice is
carried by ordinary updates, ``optax.apply_updates``, [`jaxamp.step`][jaxamp.step] (which
fuses the add into its ``lax.cond``) and a skipped step (zero updates, or the
params passed through, with the whole inner state kept) need no special case.

The one exception to exactness is an update that shrinks a weight's magnitude by
more than that factor in one step: the result is then within float32 rounding of
the value chosen (an error of at most ``2**-24 * |p|``), never farther.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._utils.conversion_checks import _stacklevel
from jaxamp._utils.deprecation import add_note, deprecated_aliases
from jaxamp._utils.dtypes import HALF_DTYPES

__all__ = [
    "KahanSummationState",
    "StochasticRoundingState",
    "apply_with_kahan_summation",
    "apply_with_stochastic_rounding",
    "stochastic_round",
]


def _is_low(x: Any) -> bool:
    """A bfloat16 or float16 array: the leaves these transformations round."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.dtype(dtype) in HALF_DTYPES


def _is_dtype(a: Any) -> bool:
    """A dtype as a user writes one (``jnp.bfloat16``, ``np.dtype``, ``"bfloat16"``), not
    an array: what tells 0.3's ``(x, dtype, key)`` from ``(key, x, dtype)`` (a key and an
    array can look alike: a raw ``PRNGKey`` is a uint32 vector)."""
    if hasattr(a, "shape"):
        return False
    try:
        np.dtype(a)
    except TypeError:
        return False
    return True


def _key_first(f: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Takes 0.3's order ``(x, dtype, key)`` too, with a ``DeprecationWarning``, until
    jaxamp 0.5: told apart by where the dtype is (second, not last), or ``key=`` beside
    positional arguments."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> jax.Array:
        old = ("key" in kwargs and 0 < len(args) <= 2) or (
            len(args) == 3 and _is_dtype(args[1]) and not _is_dtype(args[2])
        )
        if old:
            warnings.warn(
                "jaxamp.stochastic_round(x, dtype, key) is deprecated and will be an error in "
                "jaxamp 0.5: the key comes first, as in jax.random: "
                "jaxamp.stochastic_round(key, x, dtype).",
                DeprecationWarning,
                stacklevel=_stacklevel(),
            )
            kwargs.update(zip(("x", "dtype", "key"), args, strict=False))
            args = ()
        return f(*args, **kwargs)

    add_note(
        wrapper,
        "Until jaxamp 0.5 the order of jaxamp 0.3, ``stochastic_round(x, dtype, key)``, also "
        "works, with a ``DeprecationWarning``.",
    )
    return wrapper


@_key_first
def stochastic_round(key: jax.Array, x: jax.Array, dtype: Any) -> jax.Array:
    """Array op: rounds float32 ``x`` to ``dtype`` (bfloat16 or float16) stochastically, unbiased.

    The optax transformation that applies updates to params with it is
    [`apply_with_stochastic_rounding`][jaxamp.apply_with_stochastic_rounding].

    Each element goes to one of its two neighbours in ``dtype``, ``down <= x <
    up``, and to ``up`` with probability ``(x - down) / (up - down)``; so the
    expected result is ``x`` exactly (that probability is a multiple of ``2**-16`` for
    bfloat16, ``2**-13`` for float16, and the uniform draw has ``2**-23`` resolution, so
    it is not rounded). A value of ``dtype`` comes back unchanged; inf and NaN pass
    through; a finite value beyond ``dtype``'s range saturates to its largest
    finite value (never rounds up to inf). The draws are ``jax.random.uniform(key,
    x.shape)``: a deterministic function of ``key`` and the shape only, so the same
    under any sharding (``jax_threefry_partitionable``, the default). A float32
    subnormal ``x`` (below 1.2e-38; no weight lives there) is read as 0 by backends
    that flush subnormals to zero (XLA on CPU and GPU), so it rounds to 0.

    Args:
      key: a PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``); first, as in
        ``jax.random``.
      x: a float32 array.
      dtype: ``jnp.bfloat16`` or ``jnp.float16``.

    Returns:
      An array of ``dtype`` and ``x``'s shape.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> x = jnp.full(10_000, 1.0 + 2.0**-10)  # a quarter of the way to the next bfloat16
      >>> r = jaxamp.stochastic_round(jax.random.key(0), x, jnp.bfloat16)
      >>> sorted(set(r.tolist())), round(float(r.astype(jnp.float32).mean()) - 1.0, 4)
      ([1.0, 1.0078125], 0.001)
    """
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"stochastic_round: `x` must be float32, got {x.dtype}.")
    if np.dtype(dtype) not in HALF_DTYPES:
        raise TypeError(f"stochastic_round: `dtype` must be bfloat16 or float16, got {dtype}.")
    _key_parts(key, "stochastic_round")  # a clear error for an int or a batch of keys
    return _round_with_draw(x, jax.random.uniform(key, x.shape, jnp.float32), dtype)


def _round_with_draw(x: jax.Array, draw: jax.Array, dtype: Any) -> jax.Array:
    """``stochastic_round`` with its uniform draw (float32 in [0, 1), ``x``'s shape)
    given, for ``low_precision_state``, which draws fused bits (``_utils/draws.py``)."""
    # Work on magnitudes, so that "up" is away from zero for either sign, and clip
    # to the finite range first, so that rounding to nearest cannot give inf.
    big = jnp.finfo(dtype).max.astype(jnp.float32)
    a = jnp.minimum(jnp.abs(x), big)
    nearest = a.astype(dtype)
    above = nearest.astype(jnp.float32) > a
    other = jnp.nextafter(nearest, jnp.where(above, 0.0, jnp.inf).astype(dtype))
    down = jnp.where(above, other, nearest)
    up = jnp.where(above, nearest, other)
    # Both differences are exact in float32 and the gap is a power of two, so the
    # probability is exact; above the largest finite value the gap is inf (p = 0).
    # Below 2**-60 all three are first scaled by 2**64 (exact): a bfloat16 gap there
    # can be a float32 subnormal (under 2**-118 it is), which XLA flushes to zero, and
    # every such value would round down.
    s = jnp.where(a < 2.0**-60, jnp.float32(2.0**64), jnp.float32(1.0))
    down32 = down.astype(jnp.float32) * s
    p_up = (a * s - down32) / (up.astype(jnp.float32) * s - down32)
    rounded = jnp.copysign(jnp.where(draw < p_up, up, down), x.astype(dtype))
    return jnp.where(jnp.isfinite(x), rounded, x.astype(dtype))  # inf and NaN as they are


def _leaves(updates: Any, params: Any, fn: str) -> tuple[Any, list[Any], list[Any]]:
    if params is None:
        raise ValueError(
            f"{fn}: `params` is required: the update is computed from the params' "
            "low-precision values. Call tx.update(updates, opt_state, params)."
        )
    treedef = jax.tree.structure(updates)
    try:
        p_leaves = treedef.flatten_up_to(params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{fn}: `params` must have the updates' tree structure: {e}") from None
    u_leaves = treedef.flatten_up_to(updates)
    for u, p in zip(u_leaves, p_leaves, strict=True):
        if _is_low(p) and jnp.shape(u) != jnp.shape(p):
            raise ValueError(
                f"{fn}: an update of shape {jnp.shape(u)} for a param of shape {jnp.shape(p)}."
            )
    return treedef, u_leaves, p_leaves


def _exact_update(new: jax.Array, p: jax.Array) -> jax.Array:
    """The float32 update that ``optax.apply_updates`` turns into ``new`` exactly."""
    return new.astype(jnp.float32) - p.astype(jnp.float32)


class StochasticRoundingState(NamedTuple):
    """State of [`apply_with_stochastic_rounding`][jaxamp.apply_with_stochastic_rounding].

    Attributes:
      key: the raw data (uint32) of the PRNG key the next step draws from; each
        step splits it, so the run is a deterministic function of the initial key.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> tx = jaxamp.apply_with_stochastic_rounding(jax.random.key(0))
      >>> tx.init({"w": jnp.ones(2, jnp.bfloat16)}).key.dtype
      dtype('uint32')
    """

    key: jax.Array


def _key_parts(key: Any, fn: str) -> tuple[jax.Array, Any]:
    """``key``'s raw data and its implementation; a clear error for anything else."""
    try:
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            if jnp.shape(key) != ():
                raise ValueError(f"{fn}: `key` must be a single key, got shape {key.shape}.")
            return jax.random.key_data(key), jax.random.key_impl(key)
        arr = jnp.asarray(key)
    except (AttributeError, TypeError):
        raise TypeError(
            f"{fn}: `key` must be a PRNG key (jax.random.key(seed) or "
            f"jax.random.PRNGKey(seed)), got {type(key).__name__}."
        ) from None
    if arr.dtype != jnp.uint32 or arr.ndim != 1:
        raise TypeError(
            f"{fn}: `key` must be a PRNG key (jax.random.key(seed) or "
            f"jax.random.PRNGKey(seed)), got an array of {arr.dtype} and shape {arr.shape}."
        )
    return arr, None


def apply_with_stochastic_rounding(key: jax.Array) -> optax.GradientTransformation:
    """Optax transformation: applies updates to bfloat16 / float16 params with stochastic rounding.

    The array op it applies to each param is [`stochastic_round`][jaxamp.stochastic_round].

    Place it last in the chain: it turns the update it receives into the one that
    lands on the rounded value, so a transformation after it (a scale, a schedule)
    changes that update and the rounding is lost, and one before it receives
    gradients, not updates. Neither can be detected; both train like plain
    bfloat16 params, or worse. For each bfloat16 or float16 param it computes
    ``p + u`` in float32 and rounds it to the param's dtype with
    [`stochastic_round`][jaxamp.stochastic_round], so that an update smaller than half an ulp of the
    weight moves it with the right probability instead of vanishing: unbiased,
    with no extra buffer. The returned updates are float32 and make
    ``optax.apply_updates`` (and [`jaxamp.step`][jaxamp.step]) produce the rounded values
    exactly. Params of other dtypes (float32 norms, integer counters) get their
    updates unchanged.

    Randomness: the state holds the key; every step splits it, and leaf ``i`` of
    the params (in ``jax.tree.leaves`` order) draws from ``fold_in(step_key, i)``
    for its whole global shape. Under ``pmap`` / ``shard_map`` with replicated
    params every device holds the same key and so draws the same bits: replicas
    stay identical with no communication (do not fold in the device index).
    Under ``jit`` with params sharded over a mesh the bits depend only on the key
    and the global shape, so the result is the same for any sharding. A skipped
    step ([`jaxamp.skip_nonfinite`][jaxamp.skip_nonfinite]) keeps the key, so it repeats nothing.

    Args:
      key: a PRNG key (``jax.random.key(seed)`` or ``jax.random.PRNGKey(seed)``).

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      [`StochasticRoundingState`][jaxamp.types.StochasticRoundingState].

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> tx = optax.chain(
      ...     optax.sgd(1e-4), jaxamp.apply_with_stochastic_rounding(jax.random.key(0)))
      >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> grads = {"w": -jnp.ones(10_000, jnp.bfloat16)}
      >>> updates, state = tx.update(grads, state, params)
      >>> new = optax.apply_updates(params, updates)["w"]
      >>> new.dtype, float(new.astype(jnp.float32).mean()) > 1.00005  # plain bf16: 1.0
      (dtype(bfloat16), True)
    """
    fn = "jaxamp.apply_with_stochastic_rounding"
    data, impl = _key_parts(key, fn)

    def as_key(raw: jax.Array) -> jax.Array:
        return raw if impl is None else jax.random.wrap_key_data(raw, impl=impl)

    def as_data(k: jax.Array) -> jax.Array:
        return k if impl is None else jax.random.key_data(k)

    def init_fn(params: optax.Params) -> StochasticRoundingState:
        del params
        return StochasticRoundingState(jnp.array(data, copy=True))

    def update_fn(
        updates: optax.Updates, state: StochasticRoundingState, params: optax.Params = None
    ) -> tuple[optax.Updates, StochasticRoundingState]:
        treedef, u_leaves, p_leaves = _leaves(updates, params, fn)
        next_key, step_key = jax.random.split(as_key(state.key))
        out = []
        for i, (u, p) in enumerate(zip(u_leaves, p_leaves, strict=True)):
            if not _is_low(p):
                out.append(u)
                continue
            x = p.astype(jnp.float32) + u.astype(jnp.float32)
            new = stochastic_round(jax.random.fold_in(step_key, i), x, p.dtype)
            out.append(_exact_update(new, p))
        return treedef.unflatten(out), StochasticRoundingState(as_data(next_key))

    return optax.GradientTransformation(init_fn, update_fn)


class KahanSummationState(NamedTuple):
    """State of [`apply_with_kahan_summation`][jaxamp.apply_with_kahan_summation].

    Attributes:
      compensation: per bfloat16 / float16 param, an array of its shape and dtype
        holding what rounding the param has lost so far (``None`` for other params).

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> params = {"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}
      >>> state = jaxamp.apply_with_kahan_summation().init(params)
      >>> state.compensation["w"].dtype, state.compensation["b"]
      (dtype(bfloat16), None)
    """

    compensation: Any


def apply_with_kahan_summation() -> optax.GradientTransformation:
    """Optax transformation: applies updates to bfloat16 / float16 params with Kahan summation.

    Place it last in the chain (as
    [`apply_with_stochastic_rounding`][jaxamp.apply_with_stochastic_rounding]: a
    transformation after it changes the update it chose, silently). The state holds a compensation
    buffer of each low-precision param's shape and dtype (2 bytes per bfloat16 param). Each step
    adds the update and the compensation to the param in float32, rounds to the nearest
    low-precision value, and keeps what that rounding lost in the buffer for the next step: small
    updates accumulate until they move the weight, deterministically. The returned updates are
    float32 and make ``optax.apply_updates`` (and [`jaxamp.step`][jaxamp.step]) produce those values
    exactly. Params of other dtypes get their updates unchanged.

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      [`KahanSummationState`][jaxamp.types.KahanSummationState].

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = optax.chain(optax.sgd(1e-3), jaxamp.apply_with_kahan_summation())
      >>> params = {"w": jnp.ones(1, jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> for _ in range(10):  # each update alone is far below bfloat16's half ulp at 1.0
      ...     updates, state = tx.update({"w": -jnp.ones(1, jnp.bfloat16)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> float(params["w"][0])  # 1.01 rounded to bfloat16; plain bfloat16 stays at 1.0
      1.0078125
    """
    fn = "jaxamp.apply_with_kahan_summation"

    def init_fn(params: optax.Params) -> KahanSummationState:
        comp = jax.tree.map(lambda p: jnp.zeros_like(p) if _is_low(p) else None, params)
        return KahanSummationState(comp)

    def update_fn(
        updates: optax.Updates, state: KahanSummationState, params: optax.Params = None
    ) -> tuple[optax.Updates, KahanSummationState]:
        treedef, u_leaves, p_leaves = _leaves(updates, params, fn)
        try:
            c_leaves = treedef.flatten_up_to(state.compensation)
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{fn}: the state does not match the params' tree (pass the state that "
                f"tx.init(params) returned): {e}"
            ) from None
        out, comps = [], []
        for u, p, c in zip(u_leaves, p_leaves, c_leaves, strict=True):
            if not _is_low(p):
                out.append(u)
                comps.append(None)
                continue
            if c is None or c.dtype != p.dtype or c.shape != p.shape:
                raise ValueError(
                    f"{fn}: a {p.dtype}{list(p.shape)} param has no matching compensation "
                    "buffer: the params changed dtype or shape since tx.init(params)."
                )
            y = u.astype(jnp.float32) + c.astype(jnp.float32)
            new = (p.astype(jnp.float32) + y).astype(p.dtype)  # round to nearest
            d = _exact_update(new, p)
            out.append(d)
            # What this step's rounding lost (y - d is exact in float32 up to y's
            # own rounding), carried into the next step in the param's dtype.
            comps.append((y - d).astype(p.dtype))
        return treedef.unflatten(out), KahanSummationState(treedef.unflatten(comps))

    return optax.GradientTransformation(init_fn, update_fn)


# The transformations' deprecated spellings, served with a DeprecationWarning until 0.5.
_RENAMED = {
    "stochastic_rounding": (
        "jaxamp.apply_with_stochastic_rounding",
        apply_with_stochastic_rounding,
    ),
    "kahan_summation": ("jaxamp.apply_with_kahan_summation", apply_with_kahan_summation),
}
# Hidden from type checkers, as in jaxamp/__init__.py: they see the 0.4 names only.
if not TYPE_CHECKING:
    __getattr__ = deprecated_aliases(
        "jaxamp.low_precision_params", _RENAMED, removed_in="0.5", note=False
    )
