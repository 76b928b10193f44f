"""The public face of autocast: ``autocast``, ``full_precision``, ``keep_float32``.

``autocast(f)`` traces `f` to a jaxpr with ``jax.make_jaxpr`` and evaluates it
again with the interpreter (``_interpret``); nothing else is read or changed:
the result depends only on `f`, its arguments and autocast's arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._autocast import _flax, _fp8, _rules
from jaxamp._autocast._interpret import (
    AUTOCAST_SCOPE,
    FULL_PRECISION_SCOPE,
    KEEP_FLOAT32_SCOPE,
    Context,
    eval_jaxpr,
)
from jaxamp._autocast._rules import DEFAULT_RULES, is_float
from jaxamp._policy import Policy

__all__ = ["autocast", "debugging_autocast", "full_precision", "keep_float32"]


def _default_dtype() -> np.dtype:
    # float16 mirrors torch.autocast on CUDA; TPUs have no fast float16.
    return np.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


def _is_dynamic(x: Any) -> bool:
    # Arrays (and tracers) are traced; Python scalars, strings, modules, ...
    # are fixed at trace time like static arguments, so flags such as
    # `train=False` keep working in Python control flow.
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


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
    if not is_float(resolved):
        raise ValueError(
            f"autocast: dtype must be a floating dtype such as jnp.float16 or "
            f"jnp.bfloat16, got {resolved.name}"
        )
    return resolved, None


@dataclasses.dataclass(frozen=True)
class _Config:
    compute_dtype: np.dtype
    output_dtype: np.dtype | None
    rules: Mapping[str, str]
    modules: tuple[tuple[str, Any], ...]
    unknown_higher_order: str
    # find_overflow: name nnx module calls even without `modules=` rules, and
    # keep each equation's traceback and name stack in the result.
    debug: bool = False
    # FP8 matrix products (``jaxamp.fp8``), or None.
    fp8: _fp8.Fp8Config | None = None


def _run(
    f: Callable[..., Any],
    cfg: _Config,
    leaves: list[Any],
    treedef: Any,
    dynamic: list[int],
    dyn: Sequence[Any],
) -> Any:
    """Traces `f` on the dynamic leaves and evaluates it with autocast rules."""

    def flat_f(*vals: Any) -> Any:
        full = list(leaves)
        for i, x in zip(dynamic, vals, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        named = cfg.modules or (cfg.fp8 is not None and cfg.fp8.modules)
        with _flax.linen_class_scopes() if named else contextlib.nullcontext():
            return f(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(*dyn)
    ctx = Context(
        cfg.compute_dtype,
        cfg.rules,
        cfg.unknown_higher_order,
        cfg.modules,
        source_info=cfg.debug,
    )
    ctx.fp8 = _fp8.plan(cfg.fp8, closed.jaxpr, ctx)
    # f's float32 outputs count as float32 uses: the elementwise ops right
    # before them run in float32 (the output is returned in float32 anyway).
    wide_out = cfg.output_dtype is None or cfg.output_dtype.itemsize >= 4
    with jax.named_scope(AUTOCAST_SCOPE):
        outs, _ = eval_jaxpr(closed.jaxpr, closed.consts, dyn, ctx, float32_outputs=wide_out)
        final = []
        for x, shape in zip(outs, jax.tree_util.tree_leaves(out_shape), strict=True):
            # A literal output (a constant `False`) comes back as a Python scalar.
            x = x if hasattr(x, "dtype") else jnp.asarray(x, shape.dtype)
            want = shape.dtype
            if is_float(want) and cfg.output_dtype is not None:
                want = cfg.output_dtype
            if is_float(x.dtype) and x.dtype != want:
                x = ctx.cast(x, want)
            final.append(x)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), final)


def _make_wrapper(f: Callable[..., Any], cfg: _Config) -> Callable[..., Any]:
    cache: dict[Any, Callable[..., Any]] = {}
    linen_lifted: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        nnx = _flax.nnx_module()
        is_node = nnx.graph.is_graph_node if nnx is not None else (lambda x: False)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
        node_idx = [i for i, x in enumerate(leaves) if is_node(x)]
        fn = f
        self_node = None
        if is_node(f):
            self_node = f
        elif getattr(f, "__self__", None) is not None and is_node(f.__self__):
            self_node = f.__self__
        if not node_idx and self_node is None:
            dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
            dyn = [leaves[i] for i in dynamic]
            return _dispatch(fn, leaves, treedef, dynamic, dyn, ())
        return _call_nnx(nnx, leaves, treedef, node_idx, self_node)

    def _dispatch(
        fn: Callable[..., Any],
        leaves: list[Any],
        treedef: Any,
        dynamic: list[int],
        dyn: list[Any],
        closed_over: Any,
    ) -> Any:
        if any(isinstance(x, jax.core.Tracer) for x in dyn):
            return _run(fn, cfg, leaves, treedef, dynamic, dyn)
        # Eager call: one jitted program per call signature (jit caches per
        # shapes and dtypes), instead of re-tracing `f` op by op every call. The
        # key holds everything that changes the answer: the static leaves, and
        # what `fn` closes over (an nnx graph's static attributes, such as the
        # mode model.eval() sets, and the call's static arguments).
        static = tuple(x for i, x in enumerate(leaves) if i not in set(dynamic))
        try:
            key = (treedef, tuple(dynamic), static, closed_over)
            hash(key)
        except TypeError:
            return _run(fn, cfg, leaves, treedef, dynamic, dyn)
        jitted = cache.get(key)
        if jitted is None:
            template = list(leaves)
            for i in dynamic:
                template[i] = None

            def flat(*vals: Any) -> Any:
                return _run(fn, cfg, template, treedef, dynamic, vals)

            jitted = cache[key] = jax.jit(flat)
            if len(cache) > 64:
                cache.pop(next(iter(cache)))
        return jitted(*dyn)

    def _call_nnx(
        nnx: Any, leaves: list[Any], treedef: Any, node_idx: list[int], self_node: Any
    ) -> Any:
        # nnx modules are split into a graph definition and a state pytree;
        # the state is traced like any other input and the updated state
        # (BatchStat, RNG counts, ...) is written back after the call, as
        # nnx.jit does.
        nodes = tuple(leaves[i] for i in node_idx) + ((self_node,) if self_node is not None else ())
        graphdef, state = nnx.split(nodes)
        state_leaves, state_def = jax.tree_util.tree_flatten(state)
        rest = [i for i, x in enumerate(leaves) if i not in set(node_idx) and _is_dynamic(x)]
        static_leaves = list(leaves)
        for i in node_idx:
            static_leaves[i] = None
        nstate = len(state_leaves)
        method = f.__func__ if self_node is not None and self_node is not f else None

        def pure(*vals: Any) -> Any:
            merged = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, vals[:nstate]))
            full = list(static_leaves)
            for i, x in zip(node_idx, merged, strict=False):
                full[i] = x
            for i, x in zip(rest, vals[nstate:], strict=True):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            target = f
            if self_node is not None:
                target = merged[-1] if method is None else functools.partial(method, merged[-1])
            # FP8 names nnx modules too: its first / last layers and modules= rules.
            named = cfg.modules or cfg.debug or cfg.fp8 is not None
            names = _flax.nnx_scopes(nnx, merged) if named else contextlib.nullcontext()
            # The leaf objects now (a Variable in the state is the live one).
            before = {
                path: jax.tree_util.tree_leaves(var)
                for path, var in _flax.flat_variables(nnx, nnx.state(merged))
            }
            with names:
                out = target(*a, **k)
            # Only the Variables the call changed or created (BatchStat, RNG
            # counts, sow, nnx.capture's __captures__) come back and are
            # written back: unchanged parameters must not be written from
            # inside a trace.
            updated = {
                path for path, var in _flax.flat_variables(nnx, nnx.state(merged))
                if path not in before or not _flax.same_leaves(before[path], var)
            }  # fmt: skip
            return out, nnx.state(merged, lambda path, _: path in updated)

        flat_args = [*state_leaves, *(leaves[i] for i in rest)]
        p_leaves, p_def = jax.tree_util.tree_flatten((tuple(flat_args), {}))
        statics = tuple(x for i, x in enumerate(static_leaves) if i not in set(rest))
        closed_over = (graphdef, treedef, tuple(rest), statics, id(method), self_node is None)
        out, updated = _dispatch(
            pure, p_leaves, p_def, list(range(len(p_leaves))), p_leaves, closed_over
        )
        if _flax.flat_variables(nnx, updated):
            nnx.update(nodes, updated)
        return out

    def linen_call(*args: Any, **kwargs: Any) -> Any:
        if not linen_lifted:
            from flax.core import lift
            from flax.linen import transforms as nn_transforms

            def core(fn: Callable[..., Any]) -> Callable[..., Any]:
                def inner(
                    scope_fn: Any,
                    repack_fn: Any,
                    variable_groups: Any,
                    rng_groups: Any,
                    *a: Any,
                    **k: Any,
                ) -> Any:
                    def pure(variable_groups: Any, rng_groups: Any, a: Any, k: Any) -> Any:
                        scope = scope_fn(variable_groups, rng_groups)
                        y = fn(scope, *a, **k)
                        return y, repack_fn(scope)

                    return _make_wrapper(pure, cfg)(variable_groups, rng_groups, a, k)

                return lift.pack(
                    inner, (True,), (True,), (True,), name="autocast", enable_kwargs=True
                )

            linen_lifted.append(nn_transforms.lift_transform(core, f))
        return linen_lifted[0](*args, **kwargs)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args and _flax.is_bound_linen(args[0]) and not _flax.is_bound_linen(f):
            # The decorator form on a linen method: lift through flax so that
            # parameters, collections and RNGs cross the trace (init and apply).
            return linen_call(*args, **kwargs)
        return call(*args, **kwargs)

    nnx = _flax.nnx_module()
    node = f if nnx is not None and nnx.graph.is_graph_node(f) else getattr(f, "__self__", None)
    if node is not None and nnx is not None and nnx.graph.is_graph_node(node):
        # autocast(module) or autocast(module.method) is a method bound to the
        # module, so nnx.capture / nnx.view find the module behind it.
        @functools.wraps(getattr(f, "__func__", type(f).__call__))
        def method(_module: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(*args, **kwargs)

        return types.MethodType(method, node)
    return wrapper


def autocast(
    f: Callable[..., Any] | None = None,
    dtype: Any = None,
    *,
    policy: Policy | str | None = None,
    enabled: bool = True,
    rules: Mapping[Any, str] | None = None,
    modules: Mapping[str, Any] | None = None,
    unknown_higher_order: str = "warn",
    fp8: _fp8.Fp8Config | bool | None = None,
    device_type: None = None,
) -> Callable[..., Any]:
    """Runs `f` in mixed precision, choosing each operation's dtype by op class.

    Like ``torch.autocast``: matrix products and convolutions run in `dtype`;
    numerically sensitive ops (exp, log, division, sums, softmax, norm
    statistics, losses, linear algebra, FFTs, and the elementwise steps that
    feed them) in float32; everything else follows torch's type promotion: a
    float32 value meeting an activation promotes the op to float32, unless it is
    a scalar or vector broadcast into it (a Dense bias, a norm scale, a fill),
    which is cast down, so the activations between two matmuls stay in `dtype`.
    An explicit ``x.astype(jnp.float32)`` of a lower-precision value, or
    ``jaxamp.keep_float32(x)``, is kept: the ops after it run in float32 until
    a matmul. Only trace-time constants saturate when cast down
    (``finfo(float32).min`` masks stay finite); a run-time value beyond the
    dtype's range overflows to inf, where the loss scale and
    [`jaxamp.find_overflow`][jaxamp.find_overflow] see it. The result depends only on `f`'s
    program and these arguments; nothing in JAX or in `f` is patched.
    Parameters stay in their own dtype and outputs come back in the dtypes `f`
    returns without autocast (or the policy's ``output_dtype``), so
    ``autocast(f)`` is a drop-in for `f`. It
    composes with ``jit``, ``grad`` (backward ops run in the dtype of their
    forward ops), ``vmap``, control flow, ``remat``, custom derivatives, Flax
    linen (also as a decorator on a ``@nn.compact`` method) and nnx modules
    (state updates are written back). Eager calls are compiled once per
    input signature.

    Arrays among the arguments are traced; every other argument (Python
    scalars, strings, modules) is fixed at trace time, like a static argument.

    Args:
      f: the function to transform, e.g. a Flax ``model.apply``, an nnx module
        or a linen method. Without it, returns a decorator.
      dtype: the lower-precision dtype (``jnp.float16`` or ``jnp.bfloat16``).
        Defaults to float16 (bfloat16 on TPU).
      policy: a [`jaxamp.Policy`][jaxamp.Policy] (or policy string) instead of `dtype`:
        its ``compute_dtype`` is the lower-precision dtype and floating
        outputs are cast to its ``output_dtype``.
      enabled: if False, return `f` itself.
      rules: per-call overrides of ``jaxamp.DEFAULT_RULES``: primitive name
        (or primitive) -> ``"lower"``, ``"float32"``, ``"elementwise"``,
        ``"follow"``, ``"widest"`` or ``"as_written"``. E.g.
        ``{"dot_general": "float32"}`` keeps matmuls in float32. An unknown
        name raises ``ValueError`` naming the closest known ones.
      modules: per-module rules by Flax module path: pattern -> ``"float32"``
        (the module runs in full precision, like ``full_precision``) or a
        mapping of primitive rules for the ops of that module. A pattern is
        matched (``fnmatch``) against each module's name and class name (linen
        ``LayerNorm_0`` and ``nn.LayerNorm(name="ln")`` both match
        ``"LayerNorm"``), or, with a ``/``, against its path, e.g.
        ``{"LayerNorm": "float32", "head": "float32"}``; a module's rule
        covers its submodules. Modules that ``nnx.scan`` / ``nnx.vmap``
        rebuild are matched by class only.
      unknown_higher_order: what to do with a primitive that carries a jaxpr
        but is not in the table: ``"warn"`` (default) or ``"as_written"`` run
        it in its original dtypes, ``"error"`` raises.
      fp8: [`jaxamp.fp8`][jaxamp.fp8]``(...)`` (or True for its defaults): the
        matrix products that run in `dtype` run as FP8 GEMMs with current
        scaling instead (float8_e4m3fn operands, float8_e5m2 gradients,
        float32 accumulation, results in `dtype`). Default None: no FP8.
      device_type: not taken (``torch.autocast``'s ``"cuda"`` / ``"cpu"``): JAX runs on
        its default device. Given, it raises a ``TypeError`` saying what to write.

    Returns:
      A function with the signature of `f`.

    Raises:
      TypeError: if `f` is not callable.
      ValueError: if `dtype` is not floating, both `dtype` and `policy` are
        given, or a rule names an unknown primitive or op class.

    Examples:
      >>> model = flax.linen.Dense(16)
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> y = jaxamp.autocast(model.apply, dtype=jnp.float16)(params, jnp.ones((2, 8)))
      >>> y.dtype  # the matmul ran in float16; the output keeps f's dtype
      dtype('float32')
    """
    write = "jaxamp.autocast(f, dtype=jnp.float16) (or @jaxamp.autocast(dtype=...) on f)."
    if device_type is not None:
        raise TypeError(
            f"autocast: got device_type={device_type!r}, but jaxamp.autocast takes no device "
            "type (torch.autocast's 'cuda' / 'cpu'): JAX runs on its default device. It wraps "
            f"the function to run in mixed precision: write {write}"
        )
    if f is None:
        return _Decorator(functools.partial(
            autocast, dtype=dtype, policy=policy, enabled=enabled, rules=rules,
            modules=modules, unknown_higher_order=unknown_higher_order, fp8=fp8,
        ))  # fmt: skip
    named = _dtype_named(f)  # torch.autocast(torch.float16)'s spelling: a dtype first
    if named is not None:
        raise TypeError(
            f"autocast: the first argument is the function to run in mixed precision, got "
            f"the dtype {named}. autocast wraps a function and takes the dtype by keyword: "
            f"write jaxamp.autocast(f, dtype=jnp.{named}) (or @jaxamp.autocast(dtype=jnp."
            f"{named}) on f)."
        )
    if isinstance(f, str):
        raise TypeError(
            f"autocast: the first argument is the function to run in mixed precision, got "
            f"the string {f!r}. jaxamp.autocast takes no device type (torch.autocast's "
            f"'cuda' / 'cpu'): JAX runs on its default device. Write {write}"
        )
    if not callable(f):
        raise TypeError(f"autocast: f must be callable, got {type(f).__name__}")
    cfg = _build_config(dtype, policy, rules, modules, unknown_higher_order, fp8=fp8)
    if not enabled:
        return f
    return _make_wrapper(f, cfg)


def _dtype_named(x: Any) -> str | None:
    """The name of ``x`` if it is a dtype (``jnp.float16``, ``np.float16``, a dtype
    object or a dtype's name), else None: never a function to wrap."""
    is_dtype = (
        isinstance(x, np.dtype | str | type(jnp.float16))
        or isinstance(x, type)
        and issubclass(x, np.generic)
    )
    if not is_dtype:
        return None
    try:
        return np.dtype(jnp.dtype(x)).name
    except TypeError:
        return None


class _Decorator:
    """``autocast(dtype=...)`` without a function: a decorator, and not a context manager."""

    def __init__(self, bind: Callable[..., Any]) -> None:
        self._bind = bind

    def __call__(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return self._bind(f)

    def __enter__(self) -> None:
        # torch.autocast is a context manager; a JAX program is a traced function.
        raise TypeError(
            "jaxamp.autocast is a function transformation, not a context manager: JAX "
            "traces functions, so autocast wraps the function to run in mixed precision. "
            "Write f_amp = jaxamp.autocast(f, dtype=jnp.float16) and call f_amp(...), or "
            "put @jaxamp.autocast(dtype=jnp.float16) on f. Inside it, "
            "jaxamp.full_precision(g) is torch's autocast(enabled=False)."
        )

    def __exit__(self, *exc: Any) -> None:
        return None


def _build_config(
    dtype: Any,
    policy: Policy | str | None,
    rules: Mapping[Any, str] | None,
    modules: Mapping[str, Any] | None,
    unknown_higher_order: str,
    debug: bool = False,
    fp8: Any = None,
) -> _Config:
    compute_dtype, output_dtype = _resolve_dtype(dtype, policy)
    if compute_dtype.itemsize == 1:
        raise ValueError(
            f"autocast: dtype={compute_dtype.name} would run every matrix product's result "
            "and the ops after it in 8 bits. FP8 is an option of autocast: write "
            "jaxamp.autocast(f, dtype=jnp.bfloat16, fp8=jaxamp.fp8())"
        )
    resolved_rules = {**DEFAULT_RULES, **_rules.resolve_rules(rules)}
    resolved_modules = _rules.resolve_modules(modules)
    if unknown_higher_order not in ("warn", "as_written", "error"):
        raise ValueError(
            "autocast: unknown_higher_order must be 'warn', 'as_written' or 'error', "
            f"got {unknown_higher_order!r}"
        )
    return _Config(
        compute_dtype,
        output_dtype,
        MappingProxyType(resolved_rules),
        resolved_modules,
        unknown_higher_order,
        debug,
        _fp8.resolve(fp8),
    )


def debugging_autocast(
    f: Callable[..., Any],
    dtype: Any,
    rules: Mapping[Any, str] | None,
    modules: Mapping[str, Any] | None,
) -> Callable[..., Any]:
    """``autocast(f, dtype=dtype, rules=rules, modules=modules)`` for ``find_overflow``.

    The same casts; in addition every equation it evaluates keeps the
    traceback and name stack it had in `f` (so a jaxpr of the result points at
    the user's source lines and module scopes), and nnx module calls are named
    by their path in the graph even without ``modules=``.
    """
    return _make_wrapper(f, _build_config(dtype, None, rules, modules, "warn", debug=True))


def full_precision(g: Callable[..., Any]) -> Callable[..., Any]:
    """Marks `g` as a region that runs in full precision inside autocast.

    PyTorch's ``custom_fwd(cast_inputs=torch.float32)`` and
    ``autocast(enabled=False)``: `g` gets its inputs in the dtypes it has
    without autocast (float32 for a float32 model) and every operation of `g`,
    forward and backward, runs as written. An ``autocast`` nested inside `g`
    switches lower precision back on for its own function. Outside autocast,
    ``full_precision(g)`` behaves exactly like `g`.

    Args:
      g: the function to protect.

    Returns:
      A function with the signature of `g`.

    Raises:
      TypeError: if `g` is not callable.

    Examples:
      >>> @jaxamp.full_precision
      ... def loss_fn(logits, labels):
      ...   return optax.softmax_cross_entropy(logits, labels).mean()
    """
    if not callable(g):
        raise TypeError(f"full_precision: g must be callable, got {type(g).__name__}")

    @functools.wraps(g)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return g(*args, **kwargs)

    return wrapper


def keep_float32(tree: Any) -> Any:
    """Marks the floating leaves of `tree` as float32 on purpose for ``autocast``.

    Inside ``autocast``, the marked values are float32 and so are the ops that
    use them, until a matrix product or convolution consumes them (what
    ``x.astype(jnp.float32)`` does to a float16 value). Use it where the
    float32 request is not visible in the program: ``x.astype(jnp.float32)``
    of a value that is already float32 in `f` (logits before a loss) leaves no
    trace in a jaxpr, so autocast cannot tell it from no cast at all. Outside
    ``autocast`` it is ``x.astype(jnp.float32)`` for each floating leaf (and
    XLA removes the marker).

    Args:
      tree: an array or a pytree of arrays.

    Returns:
      `tree` with every floating leaf in float32.

    Examples:
      >>> def loss_fn(params, x, y):
      ...   logits = jaxamp.keep_float32(model.apply(params, x))
      ...   return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    """

    def mark(x: Any) -> Any:
        if not is_float(jnp.result_type(x)):
            return x
        with jax.named_scope(KEEP_FLOAT32_SCOPE):
            # reduce_precision to float32's own format: an identity equation
            # that stays in the jaxpr (a same-dtype astype would be dropped).
            return lax.reduce_precision(jnp.asarray(x, jnp.float32), 8, 23)

    return jax.tree_util.tree_map(mark, tree)
