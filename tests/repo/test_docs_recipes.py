"""The recipes pages run as written (issue 35, items 10-12): docs/logging.md with
examples/log_metrics.py, docs/migration.md (after blocks, and the before blocks whose
packages are installed), docs/routes.md (the single-device routes; the pmap route runs
on 8 simulated devices in tests/multidevice/test_routes_pmap.py).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxamp

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def run_blocks(page: str, codes: list[str], namespace: dict | None = None) -> dict:
    namespace = {} if namespace is None else namespace
    for i, code in enumerate(codes):
        exec(compile(code, f"docs/{page}[python block {i}]", "exec"), namespace)
    return namespace


def _load_example(name: str):
    key = f"example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _same_value(text: str, value) -> bool:
    """A CSV cell (Python's repr of the logged value) against the value on the device."""
    value = np.asarray(value).item()
    if isinstance(value, bool):
        return text == str(value)
    if isinstance(value, float) and math.isnan(value):
        return text == "nan"
    return type(value)(text) == value  # floats: repr round-trips exactly


def _assert_rows_are_the_metrics(rows, per_step) -> None:
    assert len(rows) == len(per_step)
    for i, (row, m) in enumerate(zip(rows, per_step, strict=True)):
        assert int(row["step"]) == i
        assert set(row) == {"step", *m}, row
        for key, value in m.items():
            assert _same_value(row[key], value), (i, key, row[key], value)


# ---------------------------------------------------------------------------------------
# Item 10: logging


def test_logging_doc_blocks_run_and_the_csv_rows_are_the_metrics(tmp_path, monkeypatch):
    """Every step's row is written, the last, shorter window's too; each window is
    fetched after the next window's first step is dispatched, and checked after its
    rows are written."""
    monkeypatch.chdir(tmp_path)
    events, real_jit, real_get = [], jax.jit, jax.device_get

    def jit(f, *args, **kwargs):  # records the page's train_step dispatches
        jitted = real_jit(f, *args, **kwargs)
        if getattr(f, "__name__", "") != "train_step":
            return jitted
        return lambda *a: events.append("step") or jitted(*a)

    def device_get(x):
        if sys._getframe(1).f_code.co_filename.startswith("docs/"):
            events.append("fetch")
        return real_get(x)

    monkeypatch.setattr(jax, "jit", jit)
    monkeypatch.setattr(jax, "device_get", device_get)
    monkeypatch.setattr(
        csv.DictWriter, "writerow", _recording(csv.DictWriter.writerow, events, "row")
    )
    monkeypatch.setattr(jaxamp, "check_health", _recording(jaxamp.check_health, events, "check"))
    codes = blocks("logging.md")
    assert len(codes) == 2
    ns = run_blocks("logging.md", codes)
    steps, every = ns["STEPS"], ns["LOG_EVERY"]
    assert steps % every != 0  # a last, partial window
    expected = ["row"]  # the header (DictWriter.writeheader writes it with writerow)
    for first in range(0, steps, every):
        n = min(every, steps - first)
        next_step = ["step"] if first + n < steps else []  # dispatched before the fetch
        expected += ["step"] * (n - (first > 0)) + next_step + ["fetch"] + ["row"] * n + ["check"]
    assert events == expected
    monkeypatch.undo()
    rows = _rows(tmp_path / "metrics.csv")
    # The reference: the same jitted step from the same start, each step's metrics
    # fetched at once (a host sync per step, which the recipe avoids).
    params = {"w": jax.random.normal(jax.random.key(0), (8, 1)) * 0.1}
    opt_state, per_step = ns["tx"].init(params), []
    for _ in range(steps):
        params, opt_state, m = ns["train_step"](params, opt_state, ns["x"], ns["y"])
        per_step.append(jax.device_get(m))
    _assert_rows_are_the_metrics(rows, per_step)
    assert {float(r["loss_scale"]) for r in rows} == {2.0**15}


def _recording(fn, events: list[str], name: str):
    def recorded(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)

    return recorded


def test_log_metrics_example_rows_are_the_metrics(tmp_path, capsys):
    ex = _load_example("log_metrics")
    path = tmp_path / "metrics.csv"
    ex.main(str(path), steps=35)
    assert "wrote 35 rows" in capsys.readouterr().out
    rows = _rows(path)
    train_step, params, opt_state, step = ex.setup()
    per_step = []
    for _ in range(35):
        params, opt_state, step, m = train_step(params, opt_state, step)
        per_step.append(jax.device_get(m))
    _assert_rows_are_the_metrics(rows, per_step)
    bad = rows[ex.BAD_STEP]
    assert bad["skipped"] == "True" and bad["loss"] == "nan" and bad["skipped_steps"] == "1"
    assert float(bad["loss_scale"]) == float(rows[ex.BAD_STEP - 1]["loss_scale"]) / 2


def test_log_metrics_loop_transfers_once_per_window_and_is_guarded(tmp_path, monkeypatch):
    """The loop runs under transfer_guard("disallow"): one device_get per window of 10,
    and a transfer slipped into the loop (outside the logging point) raises."""
    ex = _load_example("log_metrics")
    fetched, real_get = [], jax.device_get

    def device_get(x):  # counts the example's own fetches (not jaxamp's at construction)
        fetched.append(sys._getframe(1).f_globals.get("__name__"))
        return real_get(x)

    real_make = ex.make_train_step

    def make_train_step(*args):  # records each step's dispatch among the fetches
        step = real_make(*args)
        return lambda *a: fetched.append("step") or step(*a)

    monkeypatch.setattr(jax, "device_get", device_get)
    monkeypatch.setattr(ex, "make_train_step", make_train_step)
    logged = []
    ex.train(35, lambda step, row: logged.append(step))
    assert fetched.count(ex.__name__) == 4 and logged == list(range(35))
    # Each full window is fetched after the next window's first step is dispatched, so
    # the device runs that step while the rows are written; the last 5 after the loop.
    order = ["fetch" if f == ex.__name__ else f for f in fetched if f in ("step", ex.__name__)]
    assert order == (["step"] * 11 + ["fetch"] + ["step"] * 10 + ["fetch"]) + (
        ["step"] * 10 + ["fetch"] + ["step"] * 4 + ["fetch"]
    )
    monkeypatch.setattr(ex, "make_train_step", real_make)

    # A transfer in the loop raises. On a CPU JAX does not guard device-to-host reads
    # (the array is in host memory already), so the slip here is the other direction:
    # a Python number sent to the device every step, as `train_step(..., i)` would.
    real_stack = ex.stack_window

    def transfer_in_the_loop(window):
        jax.numpy.asarray(len(window))
        return real_stack(window)

    monkeypatch.setattr(ex, "stack_window", transfer_in_the_loop)
    with pytest.raises(Exception, match="Disallowed host-to-device"):
        ex.train(10, lambda step, row: None)


def test_log_metrics_tensorboard_and_wandb_lines(tmp_path) -> None:
    """The one line that changes for TensorBoard and for wandb, against stand-ins that
    record the calls (neither package is installed here)."""
    ex = _load_example("log_metrics")

    class SummaryWriter:
        def __init__(self) -> None:
            self.calls = []

        def add_scalar(self, tag, value, step) -> None:
            self.calls.append((tag, value, step))

    class Wandb:
        def __init__(self) -> None:
            self.calls = []

        def log(self, row, step) -> None:
            self.calls.append((row, step))

    tb, wandb = SummaryWriter(), Wandb()
    ex.train(10, ex.tensorboard_logger(tb))
    ex.train(10, lambda step, row: wandb.log(row, step=step))  # as the docstring writes it
    assert len(wandb.calls) == 10 and wandb.calls[3][1] == 3
    keys = set(wandb.calls[0][0])
    assert {"loss", "loss_scale", "skipped", "skipped_steps"} <= keys
    assert len(tb.calls) == 10 * len(keys)
    assert {(tag, step) for tag, _, step in tb.calls} == {(k, s) for k in keys for s in range(10)}


# ---------------------------------------------------------------------------------------
# Item 11: migration rows


def _sections(page: str) -> tuple[str, list[tuple[str, str, str]]]:
    """The setup block, then per section (name, before block, after block)."""
    codes = blocks(page)
    setup, rest = codes[0], codes[1:]
    assert setup.startswith("# setup") and len(rest) % 2 == 0
    out = []
    for before, after in zip(rest[::2], rest[1::2], strict=True):
        assert before.startswith("# before: ") and after.startswith("# after: ")
        out.append((before.splitlines()[0][len("# before: ") :], before, after))
    return setup, out


MIGRATIONS = ["optax.apply_if_finite", "flax.training.dynamic_scale", "jmp"]


@pytest.mark.parametrize("name", MIGRATIONS)
def test_migration_before_and_after_train_alike(name: str) -> None:
    """Both blocks run on the same batches (one with an inf); their parameters agree
    to float32 rounding (each skips the bad batch: the parameters it would have made
    are NaN) and so do their loss scales, exactly (powers of two)."""
    setup, sections = _sections("migration.md")
    assert [s[0] for s in sections] == MIGRATIONS
    _, before, after = next(s for s in sections if s[0] == name)
    package = {"optax.apply_if_finite": "optax", "jmp": "jmp"}.get(name, "flax")
    after_ns = run_blocks("migration.md", [setup, after])
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: the after block ran alone")
    before_ns = run_blocks("migration.md", [setup, before])
    got, want = after_ns["params"], before_ns["params"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.all(np.isfinite(a))
        # Unscaling by a power of two is exact; what remains is the order of float32
        # operations inside jaxamp's lax.cond (last bits after 7 steps of size ~1e-2).
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = jax.tree.leaves(jax.tree.map(lambda p, q: float(np.abs(p - q).max()),
                                         got, after_ns["init_params"]))  # fmt: skip
    assert max(moved) > 1e-3  # the runs trained: the comparison is not of two no-ops
    if "scale" in before_ns:
        assert after_ns["scale"] == before_ns["scale"], (after_ns["scale"], before_ns["scale"])


# ---------------------------------------------------------------------------------------
# Item 12: routes real programs take


ROUTES = [
    "pmap", "nnx_split", "flax_checkpoints", "model_dtype", "equinox", "huggingface",
    "pmap_no_scale", "pmap_checkpoint",
]  # fmt: skip


def _route_blocks() -> dict[str, str]:
    """docs/routes.md's blocks by section (the pmap ones run here on one device and in
    tests/multidevice on eight)."""
    codes = blocks("routes.md")
    assert len(codes) == len(ROUTES) and codes[0].startswith("# under pmap")
    return dict(zip(ROUTES, codes, strict=True))


def test_routes_huggingface_model_trains_under_autocast_and_evaluates_in_it(capsys):
    """The bound `FlaxPreTrainedModel.__call__` under autocast: its products run in
    float16 (train and eval), its params stay float32, the loss falls, eval's logits
    come back float32."""
    import jax.numpy as jnp

    pytest.importorskip("transformers")
    ns = run_blocks("routes.md", [_route_blocks()["huggingface"]])
    assert {x.dtype for x in jax.tree.leaves(ns["params"])} == {jnp.dtype(jnp.float32)}
    assert ns["logits"].dtype == jnp.float32
    batch, params = ns["batch"], ns["params"]
    train = _dot_dtypes(lambda p: ns["loss_fn"](p, batch, jax.random.key(0)), params)
    evaluate = _dot_dtypes(lambda p: ns["eval_step"](p, batch), params)
    assert train and set(train) == {"float16"}, train
    assert evaluate and set(evaluate) == {"float16"}, evaluate
    out = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert int(jaxamp.metrics(ns["opt_state"])["skipped_steps"]) <= 1  # start-up backoff
    assert "eval logits float32" in out


def test_routes_pmap_no_scale_checks_and_skips_with_scale_one(capsys):
    ns = run_blocks("routes.md", [_route_blocks()["pmap_no_scale"]])
    m = jax.device_get(ns["metrics"])
    assert (m["loss_scale"] == 1).all() and (m["skipped_steps"] == 1).all()
    assert "scale 1, skipped 1" in capsys.readouterr().out


def test_routes_pmap_checkpoint_resumes_bit_for_bit(capsys):
    run_blocks("routes.md", [_route_blocks()["pmap_checkpoint"]])
    assert "resumed bit for bit: True" in capsys.readouterr().out


def test_routes_nnx_split_train_state_keeps_batch_stats_and_explain_names_modules(capsys):
    ns = run_blocks("routes.md", [_route_blocks()["nnx_split"]])
    why = ns["why"]
    assert int(jax.device_get(ns["state"].loss_scale.skipped_steps)) == 1
    assert why.last and all(not name.endswith(".value") for name in why.last), why.last
    assert "lin.kernel" in capsys.readouterr().out


def test_routes_flax_checkpoints_restores_a_zero_scale_and_both_checks_catch_it(capsys):
    ns = run_blocks("routes.md", [_route_blocks()["flax_checkpoints"]])
    assert float(ns["restored"].loss_scale.scale) == 0.0
    out = capsys.readouterr().out.splitlines()
    replaced = [line for line in out if line.startswith("scale (0.0) must lie in")]
    restored = [line for line in out if "holds an invalid loss-scale state" in line]
    assert len(replaced) == 1 and len(restored) == 1, out
    assert "checkpoint_100" in restored[0] and "opt_state.loss_scale" in restored[0]


def _dot_dtypes(f, *args) -> list[str]:
    """The operand dtype of each dot_general ``f`` runs (nested jaxprs included)."""
    found = []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(str(eqn.invars[0].aval.dtype))
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def test_routes_model_dtype_flag_claims(capsys):
    """What docs/routes.md says of a model's own dtype=float16 under autocast."""
    import jax.numpy as jnp

    import jaxamp

    ns = run_blocks("routes.md", [_route_blocks()["model_dtype"]])
    out = capsys.readouterr().out
    assert "dtype=float32: autocast on -> float32, off -> float32" in out
    assert "dtype=float16: autocast on -> float16, off -> float16" in out
    net, params, x = ns["Net"], ns["params"], ns["x"]
    f32, f16 = net(), net(dtype=jnp.float16)

    def dots(model, **kw):
        return _dot_dtypes(jaxamp.autocast(model.apply, **kw), params, x)

    # autocast still picks the products' dtype: bfloat16 between the model's casts
    assert dots(f16, dtype=jnp.bfloat16) == ["bfloat16", "bfloat16"]
    # but the per-module float32 find_overflow suggests does not reach a self-cast layer
    first_f32 = {"dtype": jnp.float16, "modules": {"Dense_0": "float32"}}
    assert dots(f32, **first_f32) == ["float32", "float16"]
    assert dots(f16, **first_f32) == ["float16", "float16"]
    # and enabled=False leaves the model's float16 products
    assert dots(f32, dtype=jnp.float16, enabled=False) == ["float32", "float32"]
    assert dots(f16, dtype=jnp.float16, enabled=False) == ["float16", "float16"]


# ---------------------------------------------------------------------------------------
# Issue 32's review: find_overflow after a skipped step


def test_guide_find_overflow_after_a_skip_tests_the_scale_the_step_used(capsys):
    """docs/guide.md's recipe keeps the scale before the step and finds the overflow it
    caused (3.0 * 2**15 past float16's 65504). The state after the skip holds the
    backed-off 2**14, at which the same batch fits: passed that, find_overflow finds
    nothing, which is why the recipe keeps the scale from before. The step donates its
    state: without the copy, the kept scale would be a deleted buffer."""
    import jax.numpy as jnp
    import optax

    (recipe,) = [code for code in blocks("guide.md") if "scale=used" in code]
    ns = run_blocks(
        "guide.md", [recipe], {"jax": jax, "jnp": jnp, "optax": optax, "jaxamp": jaxamp}
    )
    report = ns["report"]
    assert report.found and report.loss_scale == 2.0**15
    assert (report.primitive, report.pass_, report.dtype) == ("dot_general", "backward", "float16")
    assert "dot_general" in capsys.readouterr().out
    after = ns["w_state"]
    assert float(jaxamp.get_loss_scale(after).scale) == 2.0**14
    assert not jaxamp.find_overflow(ns["sum_loss"], scale=after)(ns["w"], ns["batch"]).found
    kept = jaxamp.get_loss_scale(after)  # no copy
    ns["w_step"](ns["w"], after, ns["batch"])
    assert kept.scale.is_deleted() and not ns["used"].is_deleted()


def test_no_page_tells_find_overflow_to_test_the_state_after_the_step():
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    told = [
        f"{page.relative_to(ROOT)}: {m.group(0)}"
        for page in pages
        for m in re.finditer(r"loss_scale=(opt_state|optimizer|state)\b", page.read_text())
    ]
    assert told == []


def test_routes_equinox_both_loops_take_the_same_steps_and_keep_the_fields(capsys):
    """What docs/routes.md says of equinox's loop: eqx.filter_value_and_grad with the scale
    by hand + tx.update + eqx.apply_updates, and value_and_grad(inexact_only=True) +
    jaxamp.step on the whole model, take the same steps, skip the same one, and keep the
    model's fields; explain names the leaves by their paths in the whole model."""
    import equinox as eqx

    ns = run_blocks("routes.md", [_route_blocks()["equinox"]])
    models, states = ns["models"], ns["states"]
    by_hand, fused = (eqx.filter(models[n], eqx.is_array) for n in ("by_hand", "fused"))
    moved = jax.tree.map(
        lambda a, b: float(abs(a - b).max()), by_hand, eqx.filter(ns["model"], eqx.is_array)
    )
    assert max(jax.tree.leaves(moved)) > 0  # the finite steps were taken
    jax.tree.map(np.testing.assert_array_equal, by_hand, fused)
    for name in ("by_hand", "fused"):
        assert int(jaxamp.metrics(states[name])["skipped_steps"]) == 1
        got = models[name]
        assert got.act is jax.nn.gelu and got.drop.inference is False and got.drop.p == 0.1
    out = capsys.readouterr().out
    assert "by_hand ('lin.weight'" in out and "fused ('lin.weight'" in out
