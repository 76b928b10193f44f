"""The public API, pinned: every name of ``jaxamp``, ``jaxamp.nnx``, ``jaxamp.compat`` and
``jaxamp.checkpoint``, with each function's and class's parameters (names, kinds, defaults).

The snapshot was taken from main's tree in the old layout, before the package was re-cut by
concept (issue 32), names added on main since included: moving modules must change nothing
here. A deliberate change of the public API is listed in ``CHANGED``, ``RENAMED_PARAMETERS``
or ``RENAMED`` (and in the CHANGELOG), and its old spelling tested below: it works, with a
``DeprecationWarning``, until 0.5.
"""

import copy
import dataclasses
import enum
import inspect
import types
import warnings

import pytest

import jaxamp

# Deliberate changes since the snapshot: parameters made keyword-only in 0.4 (passed
# by position they still work, with a DeprecationWarning, until 0.5).
CHANGED = {
    ("jaxamp", "dynamic_scale"): (
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "min_scale",
        "max_scale",
        "max_consecutive_nonfinite",
    ),
    ("jaxamp", "static_scale"): ("skip_nonfinite",),
}

# One vocabulary (issue 32): a parameter that takes an optimizer state or a loss-scale
# state is `opt_state_or_loss_scale_state`, one that needs a loss-scale state is
# `loss_scale_state`. The old keyword still works, with a DeprecationWarning, until 0.5:
# the published signature lists it, keyword-only, with a default that says so, and shows
# the required parameters from the renamed one on as `<required>`, so that what binds
# by signature (jax.jit's argnames, Signature.bind, functools.partial, equinox) takes
# the old keyword as it did.
EITHER = "opt_state_or_loss_scale_state"
RENAMED_PARAMETERS = {
    ("jaxamp", "get_loss_scale"): {"opt_state": EITHER},
    ("jaxamp", "stepped"): {"opt_state": EITHER},
    ("jaxamp", "where_stepped"): {"opt_state": EITHER},
    ("jaxamp", "scale"): {"state": "loss_scale_state"},
    ("jaxamp", "unscale_and_check"): {"state": "loss_scale_state"},
    ("jaxamp", "update"): {"state": "loss_scale_state"},
}

# Renamed public names: the optax transformations say what they do to the updates,
# apart from the array op `stochastic_round`. The old names are served, with a
# DeprecationWarning, until 0.5, and are no longer in `__all__`.
RENAMED = {
    ("jaxamp", "stochastic_rounding"): "apply_with_stochastic_rounding",
    ("jaxamp", "kahan_summation"): "apply_with_kahan_summation",
}


# Names added since the snapshot, with their description (issue 43: gradients
# unscale_and_check returned, told apart by their type).
_NO = "<no default>"
ADDED = {
    ("jaxamp", "Unscaled"): (
        "class",
        [("tree", "POSITIONAL_OR_KEYWORD", _NO)],
        {
            "__init__": [
                ("self", "POSITIONAL_OR_KEYWORD", _NO),
                ("tree", "POSITIONAL_OR_KEYWORD", _NO),
            ],
            "tree_flatten_with_keys": [("self", "POSITIONAL_OR_KEYWORD", _NO)],
            "tree_unflatten": [
                ("aux", "POSITIONAL_OR_KEYWORD", _NO),
                ("children", "POSITIONAL_OR_KEYWORD", _NO),
            ],
        },
        {},
    ),
    # Issue 44: "no loss-scale state here" told apart by its type, not by its message.
    ("jaxamp", "LossScaleNotFound"): (
        "class",
        [
            ("detail", "POSITIONAL_OR_KEYWORD", _NO),
            ("fn", "POSITIONAL_OR_KEYWORD", "None"),
            ("got", "KEYWORD_ONLY", "None"),
        ],
        {
            "__init__": [
                ("self", "POSITIONAL_OR_KEYWORD", _NO),
                ("detail", "POSITIONAL_OR_KEYWORD", _NO),
                ("fn", "POSITIONAL_OR_KEYWORD", "None"),
                ("got", "KEYWORD_ONLY", "None"),
            ],
        },
        {},
    ),
}


def params(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [
        (p.name, p.kind.name, "<no default>" if p.default is p.empty else repr(p.default))
        for p in sig.parameters.values()
    ]


def describe(obj):
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__)
    if inspect.isclass(obj):
        members = {}
        for name, v in vars(obj).items():
            if name.startswith("_"):
                continue
            if isinstance(v, property):
                members[name] = "property"
            elif callable(v) or isinstance(v, (classmethod, staticmethod)):
                members[name] = params(getattr(obj, name))
        extra = {}
        if issubclass(obj, enum.Enum):
            extra["members"] = [(m.name, m.value) for m in obj]
        elif dataclasses.is_dataclass(obj):
            extra["fields"] = [f.name for f in dataclasses.fields(obj)]
        elif hasattr(obj, "_fields"):
            extra["fields"] = list(obj._fields)
        if "__init__" in vars(obj):
            members["__init__"] = params(obj.__init__)
        return ("class", params(obj), members, extra)
    if callable(obj):
        return ("function", params(obj))
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return ("mapping", sorted(dict(obj).items()))
    return ("value", repr(obj))


def snapshot_now():
    return {
        ns.__name__: {
            "__all__": list(ns.__all__),
            **{n: describe(getattr(ns, n)) for n in ns.__all__},
        }
        for ns in (jaxamp, jaxamp.nnx, jaxamp.compat, jaxamp.checkpoint)
    }


def expected():
    """The snapshot with the deliberate changes made."""
    want = copy.deepcopy(SNAPSHOT)
    for (ns, name), keyword_only in CHANGED.items():
        kind, params = want[ns][name]
        params = [(p, "KEYWORD_ONLY" if p in keyword_only else k, d) for p, k, d in params]
        want[ns][name] = (kind, params)
    for (ns, name), renames in RENAMED_PARAMETERS.items():
        kind, params = want[ns][name]
        ((old, new),) = renames.items()
        at = [p for p, _, _ in params].index(old)
        params = [
            (new if p == old else p, k, "<required>" if i >= at and d == "<no default>" else d)
            for i, (p, k, d) in enumerate(params)
        ]
        want[ns][name] = (kind, [*params, (old, "KEYWORD_ONLY", f"<deprecated: use {new}=>")])
    for (ns, old), new in RENAMED.items():
        want[ns][new] = want[ns].pop(old)
        want[ns]["__all__"] = sorted(new if n == old else n for n in want[ns]["__all__"])
    for (ns, name), described in ADDED.items():
        want[ns][name] = described
        want[ns]["__all__"] = sorted([*want[ns]["__all__"], name])
    return want


def test_the_public_api_is_the_pinned_one():
    now, want = snapshot_now(), expected()
    assert now.keys() == want.keys()
    for ns, names in want.items():
        assert now[ns]["__all__"] == names["__all__"], ns
        for name, pinned in names.items():
            assert now[ns][name] == pinned, f"{ns}.{name}"


def test_the_old_positional_spellings_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"growth_factor, backoff_factor by position"):
        old = jaxamp.dynamic_scale(8.0, 4.0, 0.25)
    new = jaxamp.dynamic_scale(8.0, growth_factor=4.0, backoff_factor=0.25)
    assert [float(x) for x in jax_leaves(old)] == [float(x) for x in jax_leaves(new)]
    with pytest.warns(DeprecationWarning, match=r"skip_nonfinite by position"):
        assert jaxamp.static_scale(4.0, False).mode == "static_unchecked"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings do not warn
        jaxamp.dynamic_scale(8.0, growth_interval=3)
        jaxamp.static_scale(4.0, skip_nonfinite=False)
    with pytest.raises(TypeError, match="multiple values for argument 'growth_factor'"):
        jaxamp.dynamic_scale(8.0, 4.0, growth_factor=2.0)
    with pytest.raises(TypeError, match=r"takes 1 positional argument\(s\) \(8 until jaxamp 0.5"):
        jaxamp.dynamic_scale(*range(1, 10))


def test_the_old_keywords_still_work_with_a_deprecation_warning():
    import jax.numpy as jnp
    import optax

    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    opt_state = tx.init({"w": jnp.ones(2)})
    ls = jaxamp.get_loss_scale(opt_state)
    old_spellings = {
        "get_loss_scale": lambda: jaxamp.get_loss_scale(opt_state=opt_state),
        "stepped": lambda: jaxamp.stepped(opt_state=opt_state),
        "where_stepped": lambda: jaxamp.where_stepped(opt_state=opt_state, new=1.0, old=0.0),
        "scale": lambda: jaxamp.scale(state=ls, tree=jnp.float32(2.0)),
        "unscale_and_check": lambda: jaxamp.unscale_and_check(state=ls, grads=jnp.ones(2)),
        "update": lambda: jaxamp.update(state=ls, finite=True),
    }
    new_spellings = {
        "get_loss_scale": lambda: jaxamp.get_loss_scale(**{EITHER: opt_state}),
        "stepped": lambda: jaxamp.stepped(**{EITHER: opt_state}),
        "where_stepped": lambda: jaxamp.where_stepped(**{EITHER: opt_state}, new=1.0, old=0.0),
        "scale": lambda: jaxamp.scale(loss_scale_state=ls, tree=jnp.float32(2.0)),
        "unscale_and_check": lambda: jaxamp.unscale_and_check(
            loss_scale_state=ls, grads=jnp.ones(2)
        ),
        "update": lambda: jaxamp.update(loss_scale_state=ls, finite=True),
    }
    assert old_spellings.keys() == {name for _, name in RENAMED_PARAMETERS}
    for name, call in old_spellings.items():
        ((old, new),) = RENAMED_PARAMETERS["jaxamp", name].items()
        with pytest.warns(DeprecationWarning, match=rf"jaxamp.{name}: the argument {old}= is now"):
            got = call()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new keyword does not warn
            want = new_spellings[name]()
        assert str(jax_leaves(got)) == str(jax_leaves(want)), name
    with pytest.raises(TypeError, match=r"got both opt_state= and opt_state_or_loss_scale_state="):
        jaxamp.stepped(opt_state=opt_state, opt_state_or_loss_scale_state=opt_state)


def renamed_calls():
    """Per renamed function: (the old keyword, a LossScaleState or optimizer state to pass
    by it, the function's other arguments by keyword)."""
    import jax.numpy as jnp
    import optax

    tx = jaxamp.skip_nonfinite(optax.sgd(0.1), jaxamp.dynamic_scale())
    opt_state = tx.init({"w": jnp.ones(2)})
    ls = jaxamp.get_loss_scale(opt_state)
    return {
        "get_loss_scale": ("opt_state", opt_state, {}),
        "stepped": ("opt_state", opt_state, {}),
        "where_stepped": ("opt_state", opt_state, {"new": jnp.float32(1), "old": jnp.float32(0)}),
        "scale": ("state", ls, {"tree": jnp.float32(2.0)}),
        "unscale_and_check": ("state", ls, {"grads": jnp.ones(2)}),
        "update": ("state", ls, {"finite": True}),
    }


def test_the_old_keywords_work_through_what_binds_by_signature():
    """jax.jit's donate_argnames / static_argnames, Signature.bind, functools.partial's
    signature and equinox.filter_jit read the published signature: given the old keyword
    they work as in 0.3, with the DeprecationWarning (each was an error before)."""
    import functools

    import jax

    calls = renamed_calls()
    assert calls.keys() == {name for _, name in RENAMED_PARAMETERS}
    jax.clear_caches()  # the warnings are raised while tracing: no trace cached elsewhere
    for name, (old, state, rest) in calls.items():
        f = getattr(jaxamp, name)
        want = jax_leaves(f(state, **rest))
        jax.jit(f, static_argnames=old)  # constructing it checked the name
        bound = inspect.signature(f).bind(**{old: state}, **rest)
        assert bound.arguments[old] is state, name
        partial = functools.partial(f, **{old: state})
        assert old in inspect.signature(partial).parameters, name
        copy_of = jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, state)
        donating = jax.jit(f, donate_argnames=old)
        with pytest.warns(DeprecationWarning, match=rf"jaxamp.{name}: the argument {old}=") as w:
            got = donating(**{old: copy_of}, **rest)
        assert w[0].filename == __file__, (name, w[0].filename)  # the caller's line, not jax's
        assert str(jax_leaves(got)) == str(want), name
        with pytest.warns(DeprecationWarning, match=rf"jaxamp.{name}: the argument {old}="):
            got = jax.jit(partial)(**rest)
        assert str(jax_leaves(got)) == str(want), name
    eqx = pytest.importorskip("equinox")
    for name, (old, state, rest) in calls.items():
        f = getattr(jaxamp, name)
        with pytest.warns(DeprecationWarning, match=rf"jaxamp.{name}: the argument {old}=") as w:
            got = eqx.filter_jit(f)(**{old: state}, **rest)
        assert w[0].filename == __file__, (name, w[0].filename)
        assert str(jax_leaves(got)) == str(jax_leaves(f(state, **rest))), name


def test_an_old_keyword_under_a_transformation_warns_at_the_users_line():
    """Under default filters a DeprecationWarning shows only when it is attributed to the
    user's code: raised from inside jax's tracing machinery (the jitted function is
    jaxamp's own), it would be hidden."""
    import functools

    import jax

    ls = renamed_calls()["update"][1]
    jax.clear_caches()  # the warning is raised while tracing: no trace cached by earlier tests

    @jax.jit
    def step(ls):
        return jaxamp.update(state=ls, finite=True)

    calls = {
        "jax.jit(jaxamp.update)": lambda: jax.jit(jaxamp.update)(state=ls, finite=True),
        "jax.jit(partial(jaxamp.update))": lambda: jax.jit(
            functools.partial(jaxamp.update, state=ls)
        )(finite=True),
        "a jitted function of the user's": lambda: step(ls),
    }
    for how, call in calls.items():
        with pytest.warns(DeprecationWarning, match="jaxamp.update: the argument state=") as w:
            call()
        code = call.__code__ if "user" not in how else step.__wrapped__.__code__
        lines = range(code.co_firstlineno, code.co_firstlineno + 3)
        assert w[0].filename == __file__ and w[0].lineno in lines, (how, w[0].filename)


def test_the_old_keyword_with_the_new_one_by_position_is_one_clear_error():
    ls = renamed_calls()["scale"][1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        with pytest.raises(TypeError, match=r"got both state= and loss_scale_state= \(by pos"):
            jaxamp.scale(ls, state=ls)
        with pytest.raises(TypeError, match=r"got both state= and loss_scale_state=; pass"):
            jaxamp.scale(loss_scale_state=ls, state=ls, tree=1.0)


def test_a_wrapper_filling_in_the_published_defaults_changes_nothing():
    """``BoundArguments.apply_defaults`` (jax's resolve_kwargs does it) passes the markers
    of the published signature: they stand for arguments not given."""
    for name, (old, state, rest) in renamed_calls().items():
        f = getattr(jaxamp, name)
        bound = inspect.signature(f).bind(**{old: state}, **rest)
        bound.apply_defaults()
        with pytest.warns(DeprecationWarning, match=rf"the argument {old}="):
            got = f(*bound.args, **bound.kwargs)
        assert str(jax_leaves(got)) == str(jax_leaves(f(state, **rest))), name
        bound = inspect.signature(f).bind(state, **rest)
        bound.apply_defaults()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert str(jax_leaves(f(*bound.args, **bound.kwargs))) == str(
                jax_leaves(f(state, **rest))
            )
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'finite'"):
        jaxamp.update(renamed_calls()["update"][1])


def test_each_renamed_parameter_says_in_its_docstring_that_the_old_keyword_works_until_0_5():
    for (_, name), renames in RENAMED_PARAMETERS.items():
        ((old, _),) = renames.items()
        doc = " ".join(getattr(jaxamp, name).__doc__.split())
        assert f"Until jaxamp 0.5 the keyword ``{old}=`` also works" in doc, name


def test_the_deprecated_names_are_hidden_from_type_checkers():
    """A module ``__getattr__`` makes a type checker type every unknown ``jaxamp.x`` as
    Any (no misspelling flagged): it is defined only under ``if not TYPE_CHECKING``."""
    import ast
    import pathlib

    for module in (jaxamp, jaxamp.low_precision_params):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        guarded = [
            node
            for node in tree.body
            if isinstance(node, ast.If) and ast.unparse(node.test) == "not TYPE_CHECKING"
            for node in node.body
        ]
        defines = lambda node: (
            "__getattr__"
            in {  # noqa: E731
                getattr(n, "id", getattr(n, "name", None)) for n in ast.walk(node)
            }
            and isinstance(node, ast.Assign | ast.FunctionDef)
        )
        assert [n for n in tree.body if defines(n)] == [], module.__name__
        assert [n for n in guarded if defines(n)], module.__name__
        assert callable(vars(module)["__getattr__"])  # served at run time


def test_the_old_names_still_work_with_a_deprecation_warning():
    import jaxamp.low_precision_params as lpp

    for (_, old), new in RENAMED.items():
        assert old not in jaxamp.__all__ and old not in lpp.__all__
        for module in (jaxamp, lpp):
            with pytest.warns(
                DeprecationWarning, match=rf"\.{old} is deprecated .* use jaxamp\.{new}"
            ):
                alias = getattr(module, old)
            assert alias is getattr(jaxamp, new), (module.__name__, old)
    with pytest.warns(DeprecationWarning, match="use jaxamp.apply_with_kahan_summation"):
        from jaxamp import kahan_summation  # noqa: F401
    with pytest.raises(AttributeError, match="has no attribute 'stochastic_roundings'"):
        jaxamp.stochastic_roundings  # noqa: B018


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


# fmt: off
SNAPSHOT = {'jaxamp': {'AuditReport': ('class',
                            [('platform', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('matmuls', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('converts', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('ops', 'POSITIONAL_OR_KEYWORD', '()')],
                            {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('platform', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('matmuls', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('converts', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('ops', 'POSITIONAL_OR_KEYWORD', '()')],
                             'converts_of_at_least': [('self',
                                                       'POSITIONAL_OR_KEYWORD',
                                                       '<no default>'),
                                                      ('elements',
                                                       'POSITIONAL_OR_KEYWORD',
                                                       '<no default>')],
                             'flagged': 'property',
                             'large_converts': 'property'},
                            {'fields': ['platform', 'matmuls', 'converts', 'ops']}),
            'ConversionWarning': ('class', None, {}, {}),
            'DEFAULT_RULES': ('mapping',
                              [('abs', 'elementwise'),
                               ('acos', 'float32'),
                               ('add', 'elementwise'),
                               ('asin', 'float32'),
                               ('atan2', 'widest'),
                               ('bessel_i0e', 'float32'),
                               ('bessel_i1e', 'float32'),
                               ('bitcast_convert_type', 'as_written'),
                               ('broadcast_in_dim', 'elementwise'),
                               ('cbrt', 'elementwise'),
                               ('ceil', 'elementwise'),
                               ('cholesky', 'float32'),
                               ('cholesky_update', 'float32'),
                               ('clamp', 'elementwise'),
                               ('concatenate', 'widest'),
                               ('conv_general_dilated', 'lower'),
                               ('convert_element_type', 'elementwise'),
                               ('copy', 'elementwise'),
                               ('copy_p', 'elementwise'),
                               ('cos', 'elementwise'),
                               ('cosh', 'float32'),
                               ('cumlogsumexp', 'float32'),
                               ('cumprod', 'float32'),
                               ('cumsum', 'float32'),
                               ('custom_linear_solve', 'as_written'),
                               ('debug_callback', 'as_written'),
                               ('digamma', 'float32'),
                               ('div', 'float32'),
                               ('dot_general', 'lower'),
                               ('dynamic_slice', 'elementwise'),
                               ('dynamic_update_slice', 'widest'),
                               ('eig', 'float32'),
                               ('eigh', 'float32'),
                               ('erf', 'elementwise'),
                               ('erf_inv', 'float32'),
                               ('erfc', 'elementwise'),
                               ('exp', 'float32'),
                               ('exp2', 'float32'),
                               ('expand_dims', 'elementwise'),
                               ('expm1', 'float32'),
                               ('fft', 'float32'),
                               ('floor', 'elementwise'),
                               ('gather', 'elementwise'),
                               ('geqp3', 'float32'),
                               ('geqrf', 'float32'),
                               ('hessenberg', 'float32'),
                               ('householder_product', 'float32'),
                               ('igamma', 'float32'),
                               ('igamma_grad_a', 'float32'),
                               ('igammac', 'float32'),
                               ('integer_pow', 'float32'),
                               ('io_callback', 'as_written'),
                               ('lgamma', 'float32'),
                               ('log', 'float32'),
                               ('log1p', 'float32'),
                               ('logistic', 'elementwise'),
                               ('lu', 'float32'),
                               ('max', 'elementwise'),
                               ('min', 'elementwise'),
                               ('mul', 'elementwise'),
                               ('neg', 'elementwise'),
                               ('nextafter', 'elementwise'),
                               ('pad', 'elementwise'),
                               ('polygamma', 'float32'),
                               ('pow', 'float32'),
                               ('pure_callback', 'as_written'),
                               ('qr', 'float32'),
                               ('ragged_dot', 'lower'),
                               ('ragged_dot_general', 'lower'),
                               ('random_gamma_grad', 'float32'),
                               ('reduce', 'as_written'),
                               ('reduce_max', 'float32'),
                               ('reduce_precision', 'elementwise'),
                               ('reduce_prod', 'float32'),
                               ('reduce_sum', 'float32'),
                               ('reduce_window', 'as_written'),
                               ('rem', 'elementwise'),
                               ('reshape', 'elementwise'),
                               ('rev', 'elementwise'),
                               ('round', 'elementwise'),
                               ('rsqrt', 'float32'),
                               ('scatter', 'as_written'),
                               ('scatter-add', 'as_written'),
                               ('scatter-apply', 'as_written'),
                               ('scatter-max', 'as_written'),
                               ('scatter-min', 'as_written'),
                               ('scatter-mul', 'as_written'),
                               ('scatter-sub', 'as_written'),
                               ('scatter_add', 'as_written'),
                               ('scatter_apply', 'as_written'),
                               ('scatter_max', 'as_written'),
                               ('scatter_min', 'as_written'),
                               ('scatter_mul', 'as_written'),
                               ('scatter_sub', 'as_written'),
                               ('schur', 'float32'),
                               ('select_and_gather_add', 'as_written'),
                               ('select_and_scatter', 'as_written'),
                               ('select_and_scatter_add', 'as_written'),
                               ('select_n', 'elementwise'),
                               ('sign', 'elementwise'),
                               ('sin', 'elementwise'),
                               ('sinh', 'float32'),
                               ('slice', 'elementwise'),
                               ('sqrt', 'elementwise'),
                               ('square', 'float32'),
                               ('squeeze', 'elementwise'),
                               ('sub', 'elementwise'),
                               ('svd', 'float32'),
                               ('tan', 'float32'),
                               ('tanh', 'elementwise'),
                               ('transpose', 'elementwise'),
                               ('triangular_solve', 'float32'),
                               ('tridiagonal', 'float32'),
                               ('tridiagonal_solve', 'float32'),
                               ('zeta', 'float32')]),
            'Explanation': ('class',
                            [('skipped_steps', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('loss_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('last', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('counts', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('n_leaves', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('spike_skips', 'POSITIONAL_OR_KEYWORD', 'None'),
                             ('last_was_spike', 'POSITIONAL_OR_KEYWORD', 'None')],
                            {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('skipped_steps',
                                           'POSITIONAL_OR_KEYWORD',
                                           '<no default>'),
                                          ('loss_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('last', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('counts', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('n_leaves', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('spike_skips', 'POSITIONAL_OR_KEYWORD', 'None'),
                                          ('last_was_spike', 'POSITIONAL_OR_KEYWORD', 'None')]},
                            {'fields': ['skipped_steps',
                                        'loss_scale',
                                        'last',
                                        'counts',
                                        'n_leaves',
                                        'spike_skips',
                                        'last_was_spike']}),
            'Fp8Config': ('class',
                          [('scaling', 'POSITIONAL_OR_KEYWORD', "'tensorwise'"),
                           ('modules', 'POSITIONAL_OR_KEYWORD', '()'),
                           ('first_last_bf16', 'POSITIONAL_OR_KEYWORD', 'True'),
                           ('batched', 'POSITIONAL_OR_KEYWORD', 'False')],
                          {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('scaling', 'POSITIONAL_OR_KEYWORD', "'tensorwise'"),
                                        ('modules', 'POSITIONAL_OR_KEYWORD', '()'),
                                        ('first_last_bf16', 'POSITIONAL_OR_KEYWORD', 'True'),
                                        ('batched', 'POSITIONAL_OR_KEYWORD', 'False')]},
                          {'fields': ['scaling', 'modules', 'first_last_bf16', 'batched']}),
            'KahanSummationState': ('class',
                                    [('compensation', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                                    {},
                                    {'fields': ['compensation']}),
            'LossScaleState': ('class',
                               [('scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('growth_tracker', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('hysteresis_tracker', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('nonfinite_streak', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('skipped_steps', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('min_scale_backoffs', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('growth_factor', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('backoff_factor', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('growth_interval', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('hysteresis', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('hysteresis_refill', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('min_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('max_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('max_consecutive_nonfinite',
                                 'POSITIONAL_OR_KEYWORD',
                                 '<no default>'),
                                ('raise_at_min_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('mode', 'POSITIONAL_OR_KEYWORD', "<Mode.DYNAMIC: 'dynamic'>")],
                               {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('growth_tracker',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('hysteresis_tracker',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('nonfinite_streak',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('skipped_steps',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('min_scale_backoffs',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('growth_factor',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('backoff_factor',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('growth_interval',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('hysteresis',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('hysteresis_refill',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('min_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('max_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('max_consecutive_nonfinite',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('raise_at_min_scale',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('mode',
                                              'POSITIONAL_OR_KEYWORD',
                                              "<Mode.DYNAMIC: 'dynamic'>")],
                                'dynamic': 'property',
                                'enabled': 'property',
                                'replace': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                            ('updates', 'VAR_KEYWORD', '<no default>')],
                                'skip_nonfinite': 'property'},
                               {'fields': ['scale',
                                           'growth_tracker',
                                           'hysteresis_tracker',
                                           'nonfinite_streak',
                                           'skipped_steps',
                                           'min_scale_backoffs',
                                           'growth_factor',
                                           'backoff_factor',
                                           'growth_interval',
                                           'hysteresis',
                                           'hysteresis_refill',
                                           'min_scale',
                                           'max_scale',
                                           'max_consecutive_nonfinite',
                                           'raise_at_min_scale',
                                           'mode']}),
            'Mode': ('class',
                     [('value', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                      ('names', 'POSITIONAL_OR_KEYWORD', 'None'),
                      ('module', 'KEYWORD_ONLY', 'None'),
                      ('qualname', 'KEYWORD_ONLY', 'None'),
                      ('type', 'KEYWORD_ONLY', 'None'),
                      ('start', 'KEYWORD_ONLY', '1'),
                      ('boundary', 'KEYWORD_ONLY', 'None')],
                     {'checks': 'property', 'scales': 'property'},
                     {'members': [('DYNAMIC', 'dynamic'),
                                  ('STATIC', 'static'),
                                  ('STATIC_UNCHECKED', 'static_unchecked'),
                                  ('CHECK_ONLY', 'check_only'),
                                  ('DISABLED', 'disabled')]}),
            'MultiTransformState': ('class',
                                    [('inner_states', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                     ('loss_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                     ('nonfinite_leaves', 'POSITIONAL_OR_KEYWORD', 'None'),
                                     ('spikes', 'POSITIONAL_OR_KEYWORD', 'None')],
                                    {},
                                    {'fields': ['inner_states',
                                                'loss_scale',
                                                'nonfinite_leaves',
                                                'spikes']}),
            'NonfiniteLeaves': ('class',
                                [('signed_counts', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                 ('layout', 'POSITIONAL_OR_KEYWORD', 'None')],
                                {'count': 'property', 'last': 'property'},
                                {'fields': ['signed_counts', 'layout']}),
            'OverflowReport': ('class',
                               [('found', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('compute_dtype', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('loss_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('primitive', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('pass_', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('dtype', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('low_precision', 'POSITIONAL_OR_KEYWORD', 'False'),
                                ('nonfinite', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('module_path', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('module_class', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('name_stack', 'POSITIONAL_OR_KEYWORD', "''"),
                                ('file', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('line', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('function', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('scan_iterations', 'POSITIONAL_OR_KEYWORD', '()'),
                                ('magnitude', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('magnitude_source', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('dtype_max', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('ratio', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('opaque', 'POSITIONAL_OR_KEYWORD', 'False'),
                                ('suggested_loss_scale', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('suggested_modules', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('suggested_rules', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('suggested_dtype', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('advice', 'POSITIONAL_OR_KEYWORD', "''")],
                               {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('found', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('compute_dtype',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('loss_scale',
                                              'POSITIONAL_OR_KEYWORD',
                                              '<no default>'),
                                             ('primitive', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('pass_', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('dtype', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('low_precision', 'POSITIONAL_OR_KEYWORD', 'False'),
                                             ('nonfinite', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('module_path', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('module_class', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('name_stack', 'POSITIONAL_OR_KEYWORD', "''"),
                                             ('file', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('line', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('function', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('scan_iterations', 'POSITIONAL_OR_KEYWORD', '()'),
                                             ('magnitude', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('magnitude_source', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('dtype_max', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('ratio', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('opaque', 'POSITIONAL_OR_KEYWORD', 'False'),
                                             ('suggested_loss_scale',
                                              'POSITIONAL_OR_KEYWORD',
                                              'None'),
                                             ('suggested_modules', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('suggested_rules', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('suggested_dtype', 'POSITIONAL_OR_KEYWORD', 'None'),
                                             ('advice', 'POSITIONAL_OR_KEYWORD', "''")],
                                'scan_iteration': 'property'},
                               {'fields': ['found',
                                           'compute_dtype',
                                           'loss_scale',
                                           'primitive',
                                           'pass_',
                                           'dtype',
                                           'low_precision',
                                           'nonfinite',
                                           'module_path',
                                           'module_class',
                                           'name_stack',
                                           'file',
                                           'line',
                                           'function',
                                           'scan_iterations',
                                           'magnitude',
                                           'magnitude_source',
                                           'dtype_max',
                                           'ratio',
                                           'opaque',
                                           'suggested_loss_scale',
                                           'suggested_modules',
                                           'suggested_rules',
                                           'suggested_dtype',
                                           'advice']}),
            'Policy': ('class',
                       [('param_dtype', 'POSITIONAL_OR_KEYWORD', "<class 'jax.numpy.float32'>"),
                        ('compute_dtype', 'POSITIONAL_OR_KEYWORD', "<class 'jax.numpy.float16'>"),
                        ('output_dtype', 'POSITIONAL_OR_KEYWORD', "<class 'jax.numpy.float32'>")],
                       {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                     ('param_dtype',
                                      'POSITIONAL_OR_KEYWORD',
                                      "<class 'jax.numpy.float32'>"),
                                     ('compute_dtype',
                                      'POSITIONAL_OR_KEYWORD',
                                      "<class 'jax.numpy.float16'>"),
                                     ('output_dtype',
                                      'POSITIONAL_OR_KEYWORD',
                                      "<class 'jax.numpy.float32'>")],
                        'cast_to_compute': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                            ('tree', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'cast_to_output': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                           ('tree', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'cast_to_param': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                          ('tree', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'compute_dtype': [('x', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'flax_kwargs': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'from_string': [('spec', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'output_dtype': [('x', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'param_dtype': [('x', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'to_string': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                        'with_output_dtype': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                              ('dtype', 'POSITIONAL_OR_KEYWORD', '<no default>')]},
                       {'fields': ['param_dtype', 'compute_dtype', 'output_dtype']}),
            'SkipNonfiniteState': ('class',
                                   [('inner_state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                    ('loss_scale', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                    ('acc', 'POSITIONAL_OR_KEYWORD', 'None'),
                                    ('mini_step', 'POSITIONAL_OR_KEYWORD', 'None'),
                                    ('nonfinite_leaves', 'POSITIONAL_OR_KEYWORD', 'None'),
                                    ('spikes', 'POSITIONAL_OR_KEYWORD', 'None')],
                                   {},
                                   {'fields': ['inner_state',
                                               'loss_scale',
                                               'acc',
                                               'mini_step',
                                               'nonfinite_leaves',
                                               'spikes']}),
            'SpikeRule': ('class',
                          [('window', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                           ('sigmas', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                           ('warmup', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                           ('loss', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                           ('grad_norm', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                          {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('window', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('sigmas', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('warmup', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('loss', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('grad_norm', 'POSITIONAL_OR_KEYWORD', '<no default>')]},
                          {'fields': ['window', 'sigmas', 'warmup', 'loss', 'grad_norm']}),
            'SpikeState': ('class',
                           [('losses', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('grad_norms', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('count', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('skips', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('skipped', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('pending', 'POSITIONAL_OR_KEYWORD', 'None')],
                           {},
                           {'fields': ['losses',
                                       'grad_norms',
                                       'count',
                                       'skips',
                                       'skipped',
                                       'pending']}),
            'StochasticRoundingState': ('class',
                                        [('key', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                                        {},
                                        {'fields': ['key']}),
            'TrainState': ('class',
                           [('step', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('apply_fn', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('params', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('tx', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                           {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                         ('step', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                         ('apply_fn', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                         ('params', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                         ('tx', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                         ('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                            'apply_gradients': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                                ('grads', 'KEYWORD_ONLY', '<no default>'),
                                                ('finite', 'KEYWORD_ONLY', 'None'),
                                                ('extra_args', 'KEYWORD_ONLY', 'None'),
                                                ('kwargs', 'VAR_KEYWORD', '<no default>')],
                            'loss_scale': 'property',
                            'replace': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('updates', 'VAR_KEYWORD', '<no default>')]},
                           {'fields': ['step', 'apply_fn', 'params', 'tx', 'opt_state']}),
            '__all__': ['AuditReport',
                        'ConversionWarning',
                        'DEFAULT_RULES',
                        'Explanation',
                        'Fp8Config',
                        'KahanSummationState',
                        'LossScaleState',
                        'Mode',
                        'MultiTransformState',
                        'NonfiniteLeaves',
                        'OverflowReport',
                        'Policy',
                        'SkipNonfiniteState',
                        'SpikeRule',
                        'SpikeState',
                        'StochasticRoundingState',
                        'TrainState',
                        'all_finite',
                        'audit',
                        'autocast',
                        'check_health',
                        'check_in_sync',
                        'checkpoint',
                        'compat',
                        'dynamic_scale',
                        'explain',
                        'find_overflow',
                        'fp8',
                        'full_precision',
                        'get_loss_scale',
                        'kahan_summation',
                        'keep_float32',
                        'metrics',
                        'multi_transform',
                        'nnx',
                        'no_scale',
                        'scale',
                        'select_tree',
                        'skip_nonfinite',
                        'spike_rule',
                        'static_scale',
                        'step',
                        'stepped',
                        'stochastic_round',
                        'stochastic_rounding',
                        'unscale_and_check',
                        'update',
                        'value_and_grad',
                        'where_stepped'],
            'all_finite': ('function',
                           [('tree', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                            ('axis_name', 'KEYWORD_ONLY', 'None')]),
            'audit': ('function',
                      [('fn', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                       ('args', 'VAR_POSITIONAL', '<no default>'),
                       ('kwargs', 'VAR_KEYWORD', '<no default>')]),
            'autocast': ('function',
                         [('f', 'POSITIONAL_OR_KEYWORD', 'None'),
                          ('dtype', 'POSITIONAL_OR_KEYWORD', 'None'),
                          ('policy', 'KEYWORD_ONLY', 'None'),
                          ('enabled', 'KEYWORD_ONLY', 'True'),
                          ('rules', 'KEYWORD_ONLY', 'None'),
                          ('modules', 'KEYWORD_ONLY', 'None'),
                          ('unknown_higher_order', 'KEYWORD_ONLY', "'warn'"),
                          ('fp8', 'KEYWORD_ONLY', 'None'),
                          ('device_type', 'KEYWORD_ONLY', 'None')]),
            'check_health': ('function',
                             [('opt_state_or_loss_scale_state',
                               'POSITIONAL_OR_KEYWORD',
                               '<no default>')]),
            'check_in_sync': ('function',
                              [('opt_state_or_loss_scale_state',
                                'POSITIONAL_OR_KEYWORD',
                                '<no default>')]),
            'checkpoint': ('module', 'jaxamp.checkpoint'),
            'compat': ('module', 'jaxamp.compat'),
            'dynamic_scale': ('function',
                              [('init_scale', 'POSITIONAL_OR_KEYWORD', '32768.0'),
                               ('growth_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                               ('backoff_factor', 'POSITIONAL_OR_KEYWORD', '0.5'),
                               ('growth_interval', 'POSITIONAL_OR_KEYWORD', '2000'),
                               ('hysteresis', 'POSITIONAL_OR_KEYWORD', '1'),
                               ('min_scale', 'POSITIONAL_OR_KEYWORD', '1.0'),
                               ('max_scale', 'POSITIONAL_OR_KEYWORD', '16777216.0'),
                               ('max_consecutive_nonfinite', 'POSITIONAL_OR_KEYWORD', 'None'),
                               ('hysteresis_refill', 'KEYWORD_ONLY', "'finite_and_backoff'"),
                               ('raise_at_min_scale', 'KEYWORD_ONLY', 'False')]),
            'explain': ('function',
                        [('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                         ('params', 'POSITIONAL_OR_KEYWORD', 'None')]),
            'find_overflow': ('function',
                              [('loss_fn', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                               ('args', 'VAR_POSITIONAL', '<no default>'),
                               ('loss_scale', 'KEYWORD_ONLY', '32768.0'),
                               ('dtype', 'KEYWORD_ONLY', "<class 'jax.numpy.float16'>"),
                               ('argnums', 'KEYWORD_ONLY', '0'),
                               ('rules', 'KEYWORD_ONLY', 'None'),
                               ('modules', 'KEYWORD_ONLY', 'None'),
                               ('autocast', 'KEYWORD_ONLY', 'True'),
                               ('kwargs', 'VAR_KEYWORD', '<no default>')]),
            'fp8': ('function',
                    [('scaling', 'POSITIONAL_OR_KEYWORD', "'tensorwise'"),
                     ('modules', 'KEYWORD_ONLY', 'None'),
                     ('first_last_bf16', 'KEYWORD_ONLY', 'True'),
                     ('batched', 'KEYWORD_ONLY', 'False')]),
            'full_precision': ('function', [('g', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'get_loss_scale': ('function',
                               [('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'kahan_summation': ('function', []),
            'keep_float32': ('function', [('tree', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'metrics': ('function',
                        [('opt_state_or_loss_scale_state',
                          'POSITIONAL_OR_KEYWORD',
                          '<no default>')]),
            'multi_transform': ('function',
                                [('transforms', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                 ('param_labels', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                 ('loss_scale', 'POSITIONAL_OR_KEYWORD', 'None'),
                                 ('max_consecutive_nonfinite', 'KEYWORD_ONLY', 'None'),
                                 ('axis_name', 'KEYWORD_ONLY', 'None'),
                                 ('spikes', 'KEYWORD_ONLY', 'None')]),
            'nnx': ('module', 'jaxamp.nnx'),
            'no_scale': ('function', []),
            'scale': ('function',
                      [('state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                       ('tree', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'select_tree': ('function',
                            [('pred', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('on_true', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                             ('on_false', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'skip_nonfinite': ('function',
                               [('inner', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('loss_scale', 'POSITIONAL_OR_KEYWORD', 'None'),
                                ('every_k', 'KEYWORD_ONLY', '1'),
                                ('max_consecutive_nonfinite', 'KEYWORD_ONLY', 'None'),
                                ('axis_name', 'KEYWORD_ONLY', 'None'),
                                ('spikes', 'KEYWORD_ONLY', 'None')]),
            'spike_rule': ('function',
                           [('window', 'KEYWORD_ONLY', '128'),
                            ('sigmas', 'KEYWORD_ONLY', '6.0'),
                            ('warmup', 'KEYWORD_ONLY', 'None'),
                            ('loss', 'KEYWORD_ONLY', 'True'),
                            ('grad_norm', 'KEYWORD_ONLY', 'True')]),
            'static_scale': ('function',
                             [('scale', 'POSITIONAL_OR_KEYWORD', '32768.0'),
                              ('skip_nonfinite', 'POSITIONAL_OR_KEYWORD', 'True')]),
            'step': ('function',
                     [('tx', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                      ('grads', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                      ('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                      ('params', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                      ('finite', 'KEYWORD_ONLY', 'None'),
                      ('extra_args', 'VAR_KEYWORD', '<no default>')]),
            'stepped': ('function', [('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'stochastic_round': ('function',
                                 [('x', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                  ('dtype', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                  ('key', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'stochastic_rounding': ('function', [('key', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'unscale_and_check': ('function',
                                  [('state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                   ('grads', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                   ('axis_name', 'KEYWORD_ONLY', 'None')]),
            'update': ('function',
                       [('state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                        ('finite', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
            'value_and_grad': ('function',
                               [('fun', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                ('argnums', 'POSITIONAL_OR_KEYWORD', '0'),
                                ('has_aux', 'POSITIONAL_OR_KEYWORD', 'False'),
                                ('inexact_only', 'KEYWORD_ONLY', 'False')]),
            'where_stepped': ('function',
                              [('opt_state', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                               ('new', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                               ('old', 'POSITIONAL_OR_KEYWORD', '<no default>')])},
 'jaxamp.checkpoint': {'__all__': ['check_restorable', 'restore'],
                       'check_restorable': ('function',
                                            [('saved', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('target', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                             ('where', 'KEYWORD_ONLY', "'the checkpoint'")]),
                       'restore': ('function',
                                   [('checkpointer', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                    ('target', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                    ('directory', 'KEYWORD_ONLY', 'None'),
                                    ('step', 'KEYWORD_ONLY', 'None')])},
 'jaxamp.compat': {'__all__': ['apex_loss_scaler',
                               'deepspeed_fp16_config',
                               'deepspeed_loss_scaler',
                               'flax_dynamic_scale',
                               'jmp_dynamic_loss_scale',
                               'keras_loss_scale_optimizer',
                               'megatron_grad_scaler',
                               'megengine_grad_scaler',
                               'mindspore_dynamic',
                               'mindspore_fixed',
                               'paddle_grad_scaler',
                               'torch_grad_scaler'],
                   'apex_loss_scaler': ('function',
                                        [('loss_scale', 'POSITIONAL_OR_KEYWORD', "'dynamic'"),
                                         ('init_scale', 'POSITIONAL_OR_KEYWORD', '65536.0'),
                                         ('scale_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                         ('scale_window', 'POSITIONAL_OR_KEYWORD', '2000'),
                                         ('min_loss_scale', 'POSITIONAL_OR_KEYWORD', 'None'),
                                         ('max_loss_scale',
                                          'POSITIONAL_OR_KEYWORD',
                                          '16777216.0')]),
                   'deepspeed_fp16_config': ('function',
                                             [('fp16', 'POSITIONAL_OR_KEYWORD', '<no default>')]),
                   'deepspeed_loss_scaler': ('function',
                                             [('init_scale', 'POSITIONAL_OR_KEYWORD', '4294967296'),
                                              ('scale_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                              ('scale_window', 'POSITIONAL_OR_KEYWORD', '1000'),
                                              ('min_scale', 'POSITIONAL_OR_KEYWORD', '1'),
                                              ('delayed_shift', 'POSITIONAL_OR_KEYWORD', '1'),
                                              ('consecutive_hysteresis',
                                               'POSITIONAL_OR_KEYWORD',
                                               'False'),
                                              ('raise_error_at_min_scale',
                                               'POSITIONAL_OR_KEYWORD',
                                               'True')]),
                   'flax_dynamic_scale': ('function',
                                          [('growth_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                           ('backoff_factor', 'POSITIONAL_OR_KEYWORD', '0.5'),
                                           ('growth_interval', 'POSITIONAL_OR_KEYWORD', '2000'),
                                           ('fin_steps', 'POSITIONAL_OR_KEYWORD', '0'),
                                           ('scale', 'POSITIONAL_OR_KEYWORD', '65536.0'),
                                           ('minimum_scale',
                                            'POSITIONAL_OR_KEYWORD',
                                            '1.1754943508222875e-38')]),
                   'jmp_dynamic_loss_scale': ('function',
                                              [('loss_scale',
                                                'POSITIONAL_OR_KEYWORD',
                                                '<no default>'),
                                               ('counter', 'POSITIONAL_OR_KEYWORD', '0'),
                                               ('period', 'POSITIONAL_OR_KEYWORD', '2000'),
                                               ('factor', 'POSITIONAL_OR_KEYWORD', '2'),
                                               ('min_loss_scale', 'POSITIONAL_OR_KEYWORD', '1.0')]),
                   'keras_loss_scale_optimizer': ('function',
                                                  [('initial_scale',
                                                    'POSITIONAL_OR_KEYWORD',
                                                    '32768.0'),
                                                   ('dynamic_growth_steps',
                                                    'POSITIONAL_OR_KEYWORD',
                                                    '2000')]),
                   'megatron_grad_scaler': ('function',
                                            [('initial_scale',
                                              'POSITIONAL_OR_KEYWORD',
                                              '4294967296.0'),
                                             ('min_scale', 'POSITIONAL_OR_KEYWORD', '1.0'),
                                             ('growth_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                             ('backoff_factor', 'POSITIONAL_OR_KEYWORD', '0.5'),
                                             ('growth_interval', 'POSITIONAL_OR_KEYWORD', '1000'),
                                             ('hysteresis', 'POSITIONAL_OR_KEYWORD', '2')]),
                   'megengine_grad_scaler': ('function',
                                             [('init_scale', 'POSITIONAL_OR_KEYWORD', '16.0'),
                                              ('growth_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                              ('backoff_factor', 'POSITIONAL_OR_KEYWORD', '0.5'),
                                              ('growth_interval',
                                               'POSITIONAL_OR_KEYWORD',
                                               '2000')]),
                   'mindspore_dynamic': ('function',
                                         [('init_loss_scale',
                                           'POSITIONAL_OR_KEYWORD',
                                           '16777216.0'),
                                          ('scale_factor', 'POSITIONAL_OR_KEYWORD', '2'),
                                          ('scale_window', 'POSITIONAL_OR_KEYWORD', '2000')]),
                   'mindspore_fixed': ('function',
                                       [('loss_scale', 'POSITIONAL_OR_KEYWORD', '128.0'),
                                        ('drop_overflow_update', 'POSITIONAL_OR_KEYWORD', 'True')]),
                   'paddle_grad_scaler': ('function',
                                          [('enable', 'POSITIONAL_OR_KEYWORD', 'True'),
                                           ('init_loss_scaling',
                                            'POSITIONAL_OR_KEYWORD',
                                            '32768.0'),
                                           ('incr_ratio', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                           ('decr_ratio', 'POSITIONAL_OR_KEYWORD', '0.5'),
                                           ('incr_every_n_steps', 'POSITIONAL_OR_KEYWORD', '1000'),
                                           ('decr_every_n_nan_or_inf',
                                            'POSITIONAL_OR_KEYWORD',
                                            '2'),
                                           ('use_dynamic_loss_scaling',
                                            'POSITIONAL_OR_KEYWORD',
                                            'True'),
                                           ('init_scale', 'KEYWORD_ONLY', 'None'),
                                           ('growth_factor', 'KEYWORD_ONLY', 'None'),
                                           ('backoff_factor', 'KEYWORD_ONLY', 'None'),
                                           ('growth_interval', 'KEYWORD_ONLY', 'None'),
                                           ('enabled', 'KEYWORD_ONLY', 'None'),
                                           ('defaults', 'KEYWORD_ONLY', "'paddle2'")]),
                   'torch_grad_scaler': ('function',
                                         [('init_scale', 'POSITIONAL_OR_KEYWORD', '65536.0'),
                                          ('growth_factor', 'POSITIONAL_OR_KEYWORD', '2.0'),
                                          ('backoff_factor', 'POSITIONAL_OR_KEYWORD', '0.5'),
                                          ('growth_interval', 'POSITIONAL_OR_KEYWORD', '2000'),
                                          ('enabled', 'POSITIONAL_OR_KEYWORD', 'True')])},
 'jaxamp.nnx': {'Optimizer': ('class',
                              [('args', 'VAR_POSITIONAL', '<no default>'),
                               ('kwargs', 'VAR_KEYWORD', '<no default>')],
                              {'__init__': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                            ('model', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                            ('tx', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                            ('wrt',
                                             'KEYWORD_ONLY',
                                             "<class 'flax.nnx.variablelib.Param'>"),
                                            ('graph', 'KEYWORD_ONLY', 'None')],
                               'keep': [('self', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                        ('model', 'POSITIONAL_OR_KEYWORD', '<no default>')],
                               'loss_scale': 'property',
                               'update': [('self', 'POSITIONAL_ONLY', '<no default>'),
                                          ('model', 'POSITIONAL_ONLY', '<no default>'),
                                          ('grads', 'POSITIONAL_ONLY', '<no default>'),
                                          ('kwargs', 'VAR_KEYWORD', '<no default>')]},
                              {}),
                '__all__': ['Optimizer', 'value_and_grad'],
                'value_and_grad': ('function',
                                   [('f', 'POSITIONAL_OR_KEYWORD', '<no default>'),
                                    ('argnums', 'POSITIONAL_OR_KEYWORD', '0'),
                                    ('has_aux', 'POSITIONAL_OR_KEYWORD', 'False')])}}
# fmt: on
