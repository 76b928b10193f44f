"""Calling an ``autocast`` function: trace, evaluate with the interpreter, cache.

``autocast(f)`` traces `f` to a jaxpr with ``jax.make_jaxpr`` and evaluates it
again with the interpreter (``_interpret``); nothing else is read or changed:
the result depends only on `f`, its arguments and autocast's arguments. Flax
modules are handled here too: an nnx module's state crosses the trace as the
call's input and output, a linen method is lifted through Flax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._utils.conversion_checks import mark_float16_autocast
from jaxamp._utils.dtypes import is_float_dtype
from jaxamp._utils.optional import loaded
from jaxamp._utils.tree import holds_tracer
from jaxamp.casting._autocast import _flax
from jaxamp.casting._autocast._config import Config
from jaxamp.casting._autocast._objects import holder
from jaxamp.casting._fp8._fp8_layers import Name, argument_names, inner_path
from jaxamp.casting._interpreter import _context, _decisions
from jaxamp.casting._interpreter._casts import cast
from jaxamp.casting._interpreter._handlers import HANDLERS
from jaxamp.casting._interpreter._interpret import eval_jaxpr
from jaxamp.casting._rules._scopes import AUTOCAST_SCOPE


def _is_dynamic(x: Any) -> bool:
    # Arrays (and tracers) are traced; Python scalars, strings, modules, ...
    # are fixed at trace time like static arguments, so flags such as
    # `train=False` keep working in Python control flow.
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _static_key(x: Any) -> Any:
    """A static leaf as the eager cache keys it.

    A Python scalar by its type and ``repr``: ``1``, ``1.0`` and ``True`` compare
    equal but trace different programs (``jnp.full((2,), n)`` has their dtypes),
    and so do ``0.0`` and ``-0.0`` (``1 / s``). A plain mutable object hashed by
    identity (a config object whose attributes `f` reads) may have changed since
    it was cached, so it is not cached at all (``TypeError``): such a call traces
    afresh each time. ``jax.jit`` asks static arguments to be immutable instead;
    a frozen dataclass or a named tuple is hashed by value and is cached.
    """
    if isinstance(x, (bool, int, float, complex)):
        return (type(x), repr(x))
    kind = type(x)
    if (
        kind.__hash__ is object.__hash__
        and hasattr(x, "__dict__")
        and not callable(x)
        and not isinstance(x, types.ModuleType)
    ):
        raise TypeError(f"{kind.__name__} is hashed by identity")
    return x


def _run(
    f: Callable[..., Any],
    cfg: Config,
    leaves: list[Any],
    treedef: Any,
    dynamic: list[int],
    dyn: Sequence[Any],
    names: Sequence[Name] | None = None,
) -> Any:
    """Traces `f` on the dynamic leaves and evaluates it with autocast rules; `names`:
    where each leaf sits in the call's arguments (FP8 names its layers by them)."""
    if cfg.compute_dtype == jnp.float16:
        mark_float16_autocast()  # its gradients need a loss scale: warned at the step

    def flat_f(*vals: Any) -> Any:
        full = list(leaves)
        for i, x in zip(dynamic, vals, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        named = cfg.modules or (cfg.fp8 is not None and cfg.fp8.modules)
        with _flax.linen_class_scopes() if named else contextlib.nullcontext():
            return f(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(*dyn)
    config = _context.Config(
        cfg.compute_dtype,
        cfg.rules,
        cfg.unknown_higher_order,
        HANDLERS,
        cfg.modules,
        source_info=cfg.debug,
        lines=cfg.debug or _decisions.active(),  # under `jaxamp.audit`
    )
    at = [names[i] for i in dynamic] if names is not None else None
    ctx = _context.Context.start(config, cfg.fp8, closed.jaxpr, at)
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
            if is_float_dtype(want) and cfg.output_dtype is not None:
                want = cfg.output_dtype
            if is_float_dtype(x.dtype) and x.dtype != want:
                x = cast(ctx, x, want)
            final.append(x)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), final)


#: Where each leaf of a call sits in its arguments (``_fp8_layers.argument_names``),
#: computed when called: only a trace under ``fp8=`` reads it.
Names = Callable[[], Sequence[Name]] | None


def _leaf_names(
    f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], is_node: Any, held: bool
) -> list[Name]:
    """The names of the leaves of ``(args, kwargs)``; `held`: ``args[0]`` is a plain
    object's attributes (``_objects``), named by their paths under ``self``."""
    names = argument_names(f, args[1:] if held else args, kwargs, is_node)
    if held:
        own = jax.tree_util.tree_flatten_with_path(args[0])[0]
        names = [("self", inner_path(p)) for p, _ in own] + names
    return names


def _state_names(
    names: Callable[[], Sequence[Name]], node_idx: list[int], has_self: bool, state: Any,
    rest: list[int],
) -> list[Name]:  # fmt: skip
    """The names of an nnx call's traced values: each state leaf by its module's place
    in the call, then its path in the module; then the other dynamic leaves."""
    given = names()
    where = [given[i] for i in node_idx] + [("self", "")] * has_self
    own = []
    for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        arg, path = where[p[0].key]
        own.append((arg, "/".join(filter(None, (path, inner_path(p[1:]))))))
    return own + [given[i] for i in rest]


def make_wrapper(f: Callable[..., Any], cfg: Config) -> Callable[..., Any]:
    """``f`` in mixed precision: a function with ``f``'s metadata, or a method bound
    to the module when ``f`` is an nnx module or one of its methods."""
    call = _Call(f, cfg)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    nnx = loaded("flax.nnx")
    node = f if nnx is not None and nnx.graph.is_graph_node(f) else getattr(f, "__self__", None)
    if node is not None and nnx is not None and nnx.graph.is_graph_node(node):
        # autocast(module) or autocast(module.method) is a method bound to the
        # module, so nnx.capture / nnx.view find the module behind it.
        return types.MethodType(_ModuleMethod(call, node, f is node), node)
    return wrapper


class _ModuleMethod:
    """The function of ``autocast(module)``, bound to the module: attribute reads go
    to the module (``amp.lin``, ``amp.eval()``), and bound to another module (the
    copy ``nnx.merge`` makes in a pure function) it runs on that one."""

    def __init__(self, call: _Call, module: Any, whole: bool) -> None:
        self._call, self._module, self._whole = call, module, whole
        self._method = type(module).__call__ if whole else call.f.__func__
        functools.update_wrapper(self, self._method)

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        if module is self._module:
            return self._call(*args, **kwargs)
        f = module if self._whole else types.MethodType(self._method, module)
        return _Call(f, self._call.cfg)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the function itself lacks.
        module = self.__dict__.get("_module")
        if module is None:
            raise AttributeError(name)
        return getattr(module, name)


class _Call:
    """One ``autocast(f)``: how a call of it reaches ``_run``, and its eager-call cache."""

    def __init__(self, f: Callable[..., Any], cfg: Config) -> None:
        self.f = f
        self.cfg = cfg
        self.cache: dict[Any, Callable[..., Any]] = {}
        self.linen_lifted: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and _flax.is_bound_linen(args[0]) and not _flax.is_bound_linen(self.f):
            # The decorator form on a linen method: lift through flax so that
            # parameters, collections and RNGs cross the trace (init and apply).
            return self._linen_call(*args, **kwargs)
        fn, held = self.f, holder(self.f, _is_dynamic)
        if held is not None:
            # A plain object's attributes are read at each call, its arrays traced
            # like arguments (``_objects``).
            state, fn = held
            args = (state, *args)
        nnx = loaded("flax.nnx")
        is_node = nnx.graph.is_graph_node if nnx is not None else (lambda x: False)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
        node_idx = [i for i, x in enumerate(leaves) if is_node(x)]
        self_node = None
        if is_node(self.f):
            self_node = self.f
        elif getattr(self.f, "__self__", None) is not None and is_node(self.f.__self__):
            self_node = self.f.__self__
        names = None
        if self.cfg.fp8 is not None:  # FP8 names layers by the weights they read
            names = functools.partial(_leaf_names, self.f, args, kwargs, is_node, held is not None)
        if node_idx or self_node is not None:
            return self._call_nnx(nnx, fn, leaves, treedef, node_idx, self_node, names)
        dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
        return self._dispatch(
            fn, leaves, treedef, dynamic, (), *(leaves[i] for i in dynamic), names=names
        )

    def _dispatch(
        self,
        fn: Callable[..., Any],
        leaves: list[Any],
        treedef: Any,
        dynamic: list[int],
        closed_over: Any,
        *dyn: Any,
        names: Names = None,
    ) -> Any:
        """``fn`` on ``leaves`` (the ``dynamic`` ones replaced by ``dyn``), under autocast;
        `names`: where each leaf sits in the call's arguments, read only by a trace
        (an eager call that hits the cache does not pay for it)."""
        if holds_tracer(dyn):
            return _run(fn, self.cfg, leaves, treedef, dynamic, dyn, names and names())
        # Eager call: one jitted program per call signature (jit caches per
        # shapes and dtypes), instead of re-tracing `f` op by op every call. The
        # key holds everything that changes the answer: the static leaves, and
        # what `fn` closes over (an nnx graph's static attributes, such as the
        # mode model.eval() sets, and the call's static arguments).
        try:
            static = tuple(_static_key(x) for i, x in enumerate(leaves) if i not in set(dynamic))
            key = (treedef, tuple(dynamic), static, closed_over)
            hash(key)
        except TypeError:
            return _run(fn, self.cfg, leaves, treedef, dynamic, dyn, names and names())
        jitted = self.cache.get(key)
        if jitted is None:
            template = list(leaves)
            for i in dynamic:
                template[i] = None
            cfg = self.cfg
            # The names follow from `treedef`, part of the key; read now, so that the
            # cached function holds no array of this call.
            at = names and names()

            def flat(*vals: Any) -> Any:
                return _run(fn, cfg, template, treedef, dynamic, vals, at)

            jitted = self.cache[key] = jax.jit(flat)
            if len(self.cache) > 64:
                self.cache.pop(next(iter(self.cache)))
        return jitted(*dyn)

    def _call_nnx(
        self,
        nnx: Any,
        fn: Callable[..., Any],
        leaves: list[Any],
        treedef: Any,
        node_idx: list[int],
        self_node: Any,
        names: Names,
    ) -> Any:
        """A call with nnx modules: split into a graph and a state, the state traced like
        any other input and the updated state (BatchStat, RNG counts, ...) written back
        after the call, as ``nnx.jit`` does."""
        nodes = tuple(leaves[i] for i in node_idx) + ((self_node,) if self_node is not None else ())
        graphdef, state = nnx.split(nodes)
        state_leaves, state_def = jax.tree_util.tree_flatten(state)
        rest = [i for i, x in enumerate(leaves) if i not in set(node_idx) and _is_dynamic(x)]
        static_leaves = list(leaves)
        for i in node_idx:
            static_leaves[i] = None
        method = self.f.__func__ if self_node is not None and self_node is not self.f else None
        call = _NnxCall(
            self, fn, nnx, graphdef, state_def, len(state_leaves), treedef, node_idx, rest
        )
        pure = functools.partial(call, static_leaves, self_node, method)
        flat_args = [*state_leaves, *(leaves[i] for i in rest)]
        p_leaves, p_def = jax.tree_util.tree_flatten((tuple(flat_args), {}))
        statics = tuple(x for i, x in enumerate(static_leaves) if i not in set(rest))
        try:
            statics = tuple(_static_key(x) for x in statics)
        except TypeError:
            statics = [statics]  # unhashable: `_dispatch` runs the call uncached
        closed_over = (graphdef, treedef, tuple(rest), statics, id(method), self_node is None)
        dynamic = list(range(len(p_leaves)))
        if names is not None:
            names = functools.partial(
                _state_names, names, node_idx, self_node is not None, state, rest
            )
        out, updated = self._dispatch(
            pure, p_leaves, p_def, dynamic, closed_over, *p_leaves, names=names
        )
        if _flax.flat_variables(nnx, updated):
            nnx.update(nodes, updated)
        return out

    def _linen_call(self, *args: Any, **kwargs: Any) -> Any:
        if self.linen_lifted is None:
            self.linen_lifted = _lift_linen(self.f, self.cfg)
        return self.linen_lifted(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _NnxCall:
    """The pure function of an nnx call that ``_dispatch`` traces: the modules merged
    from the traced state, ``f`` called, and the state it changed returned."""

    owner: _Call
    fn: Callable[..., Any]  # what the call runs: `f`, or its plain object's method
    nnx: Any
    graphdef: Any  # the modules' graph, from nnx.split
    state_def: Any  # the treedef of their state
    nstate: int  # how many of the traced values are state leaves (the rest: `rest`)
    treedef: Any  # the treedef of the call's (args, kwargs)
    node_idx: list[int]  # where the modules sit among the call's leaves
    rest: list[int]  # where the other dynamic leaves sit

    def __call__(self, static_leaves: list[Any], self_node: Any, method: Any, *vals: Any) -> Any:
        nnx, cfg = self.nnx, self.owner.cfg
        state = jax.tree_util.tree_unflatten(self.state_def, vals[: self.nstate])
        merged = nnx.merge(self.graphdef, state)
        full = list(static_leaves)
        for i, x in zip(self.node_idx, merged, strict=False):
            full[i] = x
        for i, x in zip(self.rest, vals[self.nstate :], strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(self.treedef, full)
        target = self.fn
        if self_node is not None:
            target = merged[-1] if method is None else functools.partial(method, merged[-1])
        # FP8 names nnx modules too: its first / last layers and modules= rules;
        # and `jaxamp.audit`, whose reports name each op's module.
        if cfg.modules or cfg.debug or cfg.fp8 is not None or _decisions.active():
            _flax.name_nnx_calls(nnx, merged)
        # The leaf objects now (a Variable in the state is the live one).
        before = {
            path: jax.tree_util.tree_leaves(var)
            for path, var in _flax.flat_variables(nnx, nnx.state(merged))
        }
        out = target(*a, **k)
        # Only the Variables the call changed or created (BatchStat, RNG counts,
        # sow, nnx.capture's __captures__) come back and are written back:
        # unchanged parameters must not be written from inside a trace.
        updated = {
            path
            for path, var in _flax.flat_variables(nnx, nnx.state(merged))
            if path not in before or not _flax.same_leaves(before[path], var)
        }
        return out, nnx.state(merged, lambda path, _: path in updated)


def _lift_linen(f: Callable[..., Any], cfg: Config) -> Callable[..., Any]:
    """``f`` (a linen method) lifted through Flax, its body run under autocast."""
    from flax.core import lift
    from flax.linen import transforms as nn_transforms

    def core(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(
            scope_fn: Any, repack_fn: Any, variable_groups: Any, rng_groups: Any, *a: Any, **k: Any
        ) -> Any:
            def pure(variable_groups: Any, rng_groups: Any, a: Any, k: Any) -> Any:
                scope = scope_fn(variable_groups, rng_groups)
                y = fn(scope, *a, **k)
                return y, repack_fn(scope)

            return make_wrapper(pure, cfg)(variable_groups, rng_groups, a, k)

        return lift.pack(inner, (True,), (True,), (True,), name="autocast", enable_kwargs=True)

    return nn_transforms.lift_transform(core, f)
