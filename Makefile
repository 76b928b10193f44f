PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make docs` and `make demo` install only their extras (stamps of their own); the full
# install holds both, so after it neither reinstalls (not while `make test` runs tests).
DOCS_STAMP := $(VENV)/.installed-docs
DEMO_STAMP := $(VENV)/.installed-demo
EIGHT_DEVICES := --xla_force_host_platform_device_count=8
# `make test`'s programs are compiled at LLVM's lowest level, with LLVM's expensive passes
# off (what `jax_disable_most_optimizations` sets): its tests compile far more than they
# run, and LLVM's optimisation is a third of their CPU time or more. The
# optimized HLO, and so every kernel and byte count, is the same at every level; the
# last bits of results are not (LLVM contracts multiply-adds into FMAs above -O0), which
# numerical tests' dtype-derived tolerances cover. Tests of what only an optimising
# backend does (`-m xla_default`: the FMA guard) run apart, at the default level, as do
# `make conformance` and `make test-slow`.
FAST_XLA := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true

.PHONY: test test-slow test-single test-xla-default test-multidevice test-multiprocess demo bench bench-gpu lint clean test-oldest conformance dist wheel-smoke docs matrix \
	docs-serve docs-check

# --no-compile: imports byte-compile the modules they use; pip would compile all ~10k.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -e ".[dev,examples,bench,conformance,docs]"
	touch $(STAMP) $(DOCS_STAMP) $(DEMO_STAMP)

# Two phases, each running its parts side by side so that neither core idles while one
# part finishes its slowest tests: the single- and multi-device suites, then the
# multi-process tests (they wait on their workers much of the time), the wheel smoke
# test and the docs check. The parts' output is not held back until each ends (make's
# --output-sync would: a silent first phase); each line comes out whole as it is
# written, prefixed by its part, and pytest counts tests done (`[ 120/2210]`).
#
# The parts share JAX's persistent compilation cache, in a directory made fresh for the
# run and removed after it: a program compiled in one pytest process (the loss-scale
# update, the guard's step on the same shapes) is read back, not compiled again, in the
# others (a fifth less CPU on tests/skip). It caches the executable XLA compiled for the
# same HLO and options: every test still traces, lowers, runs and checks.
test: $(STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	export JAX_COMPILATION_CACHE_DIR=$$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 && \
	$(MAKE) --no-print-directory -j2 test-single test-multidevice PART=1 && \
	$(MAKE) --no-print-directory -j3 test-multiprocess wheel-smoke docs-check \
		test-xla-default PART=1

# A recipe line's pipe fails when any of its commands does (pytest's status, not sed's).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# In `make test` (PART=1), a pytest command's output, line by line, prefixed by its target.
PYTEST_OPTS := $(if $(PART),-o console_output_style=count)
TAG = $(if $(PART),2>&1 | sed -u 's/^/$@: /')

# tests/repo/test_docs_site.py runs in docs-check, once, after `mkdocs build --strict`.
test-single: $(STAMP)
	XLA_FLAGS="$(FAST_XLA)" $(PY) -m pytest -q $(PYTEST_OPTS) -n 2 -m "not slow and not xla_default" \
		jaxamp tests --ignore=tests/multidevice --ignore=tests/multiprocess --ignore=tests/matrix \
		--ignore=tests/repo/test_docs_site.py $(TAG)

test-xla-default: $(STAMP)
	XLA_FLAGS= $(PY) -m pytest -q $(PYTEST_OPTS) -p no:cacheprovider -m "xla_default and not slow" \
		tests --ignore=tests/multidevice --ignore=tests/multiprocess --ignore=tests/matrix $(TAG)

# What `make test` leaves out for time (pytest -m slow): benchmark smoke runs, and the tests
# tests/ci_budget.py lists, each with what covers its claim in `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow tests --ignore=tests/multidevice --ignore=tests/matrix
	XLA_FLAGS="$(EIGHT_DEVICES) $(FAST_XLA)" $(PY) -m pytest -q -n 2 -m slow tests/multidevice \
		tests/matrix

test-multidevice: $(STAMP)
	XLA_FLAGS="$(EIGHT_DEVICES) $(FAST_XLA)" $(PY) -m pytest -q $(PYTEST_OPTS) -n 1 -m "not slow" \
		tests/multidevice tests/matrix $(TAG)

test-multiprocess: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_OPTS) -m "not slow" tests/multiprocess $(TAG)

# An sdist and a wheel of the distribution `jax-mixed-precision` (import name `jaxamp`).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --quiet --outdir dist .

# The built wheel, not an editable install, in a fresh virtual environment, run from
# outside the repository: import, the README quick start, one example.
SMOKE := build/wheel-smoke
wheel-smoke: dist
	rm -rf $(SMOKE) && $(PYTHON) -m venv $(SMOKE)
	$(SMOKE)/bin/python -m pip install --quiet --no-compile dist/*.whl
	cd /tmp && $(CURDIR)/$(SMOKE)/bin/python $(CURDIR)/.ci/wheel_smoke.py $(CURDIR) $(TAG)
	$(SMOKE)/bin/python -m pip uninstall --quiet -y flax
	cd /tmp && $(CURDIR)/$(SMOKE)/bin/python $(CURDIR)/tests/utils/without_flax.py $(TAG)

# The documentation site (docs/ and every public docstring) into site/; warnings are errors.
# It works opened from disk (site/index.html) or served (`make docs-serve`).
# It needs the `docs` extra only (MkDocs reads the docstrings without importing jaxamp):
# its own stamp, as the demo's, not the test environment's 1.2 GB.
$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The built site at http://127.0.0.1:8000/ (Ctrl-C stops it).
docs-serve: docs
	$(PY) -m http.server --bind 127.0.0.1 --directory site 8000

# The site read as a browser reads it (tests/repo/test_docs_site.py: every link and anchor,
# API examples as code, no Sphinx roles, search from disk), then screenshots of the
# home page, a guide, an API page and a search, from disk, with headless Chromium (for
# people to look at; skipped where there is no chromium, as in CI).
SHOTS := site-screenshots
SHOT_PAGES := index start/pytorch guide api/jaxamp index.html?q=dynamic_scale
CHROMIUM ?= $(shell command -v chromium || command -v chromium-browser)
docs-check: $(STAMP) docs
	$(PY) -m pytest -q $(PYTEST_OPTS) -p no:cacheprovider tests/repo/test_docs_site.py $(TAG)
	@if [ -z "$(CHROMIUM)" ]; then echo "docs-check: no chromium, screenshots skipped"; \
	else rm -rf $(SHOTS) && mkdir -p $(SHOTS) && for page in $(SHOT_PAGES); do \
		case $$page in *\?*) url=$$page;; *) url=$$page.html;; esac; \
		png=$(SHOTS)/$$(echo $$page | sed 's/\.html//; s/[^a-z0-9_]/-/g').png; \
		profile=$$(mktemp -d); \
		$(CHROMIUM) --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
			--disable-background-networking --disable-component-update --disable-sync \
			--user-data-dir=$$profile --virtual-time-budget=5000 --window-size=1280,2000 \
			--screenshot=$(CURDIR)/$$png "file://$(CURDIR)/site/$$url" >/dev/null 2>&1; \
		rm -rf $$profile; test -s $$png || { echo "docs-check: no screenshot of $$url"; exit 1; }; \
		echo "$$png"; done; fi

# jaxamp.autocast + loss scaling on third-party models (tests/conformance; CI runs a
# 10-step subset of the same tests in `make test`): all models, both dtypes, 30 steps,
# residual and compile measurements, FP8's rows (with fp8_select's too) and bfloat16's
# noise floor (fp8.noise_floor); writes the tables in benchmarks/RESULTS.md even
# when some fail, then exits with pytest's status.
CONFORMANCE_ROWS := runs/conformance/rows.jsonl
conformance: $(STAMP)
	rm -f $(CONFORMANCE_ROWS)
	st=0; \
	CONFORMANCE_FULL=1 CONFORMANCE_OUT=$(CONFORMANCE_ROWS) $(PY) -m pytest -q -n 2 \
		tests/conformance || st=$$?; \
	CONFORMANCE_FULL=1 CONFORMANCE_OUT=$(CONFORMANCE_ROWS) XLA_FLAGS=$(EIGHT_DEVICES) $(PY) -m pytest -q \
		tests/multidevice/test_conformance_mesh.py || st=$$?; \
	CONFORMANCE_FULL=1 CONFORMANCE_OUT=$(CONFORMANCE_ROWS) $(PY) -m tests.conformance.fp8 noise || st=$$?; \
	$(PY) tests/conformance/report.py $(CONFORMANCE_ROWS) benchmarks/RESULTS.md; \
	exit $$st

# Issue 30's differential matrix (tests/matrix): the whole product of training paths,
# optimizer modes, placements and model states (1512 cells), issue 43's composition
# axis (the guard inside and around optax's structures, issue 45's stored moments
# among them: 366 cells) and user-input axis (params' dtype: 72 cells; a Python-object
# model and constants built by each jnp constructor: 31). Of the 1981 cells, 1618 run a
# fixed sequence and 10 hypothesis-drawn ones, checked after every call against plain
# optax / Flax / float32; 363 must refuse by name. `make test` runs a fixed subset of
# 44 cells.
# Most of a cell's time is compiling programs that other cells compile too (the
# reference optimizer's step is the same under every path): JAX's persistent compilation
# cache, in a directory made fresh for the run and removed after it, compiles each
# program once; at LLVM's lowest level (as `make test`'s cells run) that halves the CPU
# time of a sample of cells.
matrix: $(STAMP)
	cache=$$(mktemp -d) && st=0; \
	MATRIX_FULL=1 XLA_FLAGS="$(EIGHT_DEVICES) $(FAST_XLA)" JAX_COMPILATION_CACHE_DIR=$$cache \
		JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
		$(PY) -m pytest -q -n 2 -p no:cacheprovider tests/matrix || st=$$?; \
	rm -rf $$cache; exit $$st

# The demo needs jaxamp, matplotlib and tqdm only: its own stamp installs the
# `examples` extra into the same venv (`make test` adds the rest later).
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[examples]"
	touch $(DEMO_STAMP)

# The table, the run's figures and the plot that docs/demo.md and docs/guide.md show are
# written by this run (docs/_generated/): the pages show the last `make demo`.
demo: $(DEMO_STAMP)
	$(PY) examples/train_lm.py --docs docs/_generated

bench: $(STAMP)
	$(PY) benchmarks/run.py

# Issue 13's GPU figures (benchmarks/gpu.py; about 9 minutes on an H200), then issue 33's
# FP8 ones (benchmarks/gpu_fp8.py, about 5 more: tokens/s of the ~124M GPT in float32,
# bfloat16, float16 and FP8 tensorwise / rowwise autocast, and the cuBLASLt FP8 custom
# calls in each step's optimized HLO; alone: make bench-gpu-fp8). Needs a Python whose
# jax sees a CUDA GPU (pip install "jax[cuda13]" flax optax jmp orbax-checkpoint tqdm
# matplotlib), not this CPU venv: GPU_PYTHON=/path/to/python make bench-gpu.
GPU_PYTHON ?= python3
GPU_OUT ?= benchmarks/gpu_results
.PHONY: bench-gpu-fp8
bench-gpu: bench-gpu-fp8
	$(GPU_PYTHON) benchmarks/gpu.py --out $(GPU_OUT)

bench-gpu-fp8:
	$(GPU_PYTHON) benchmarks/gpu_fp8.py --out $(GPU_OUT)/fp8.json

# The ~0.9B GPT (issue 46's ~1B row): bfloat16 autocast against FP8, apart from
# bench-gpu's 8-minute budget until it is timed on a GPU.
.PHONY: bench-gpu-fp8-1b
bench-gpu-fp8-1b:
	$(GPU_PYTHON) benchmarks/gpu_fp8.py --size xl --only bf16_autocast,fp8_tensorwise,fp8_rowwise \
		--warmup 3 --rounds 3 --steps 5 --out $(GPU_OUT)/fp8_1b.json

# The library's tests on the oldest versions pyproject.toml admits (not run by CI:
# a second environment of ~600 MB). The multi-device, checkpoint and example tests
# use newer JAX APIs (jax.shard_map, AxisType) and run on the newest only.
OLDEST := .venv-oldest
test-oldest:
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet "jax==0.5.0" "jaxlib==0.5.0" "flax==0.10.2" \
		"optax==0.2.4" "chex==0.1.90" "orbax-checkpoint==0.11.0" pytest hypothesis
	$(OLDEST)/bin/python -m pip install --quiet --no-deps -e .
	$(OLDEST)/bin/python -m pytest -q tests/loss_scale/test_state.py tests/compat/test_compat.py \
		tests/skip/test_skip_nonfinite.py tests/utils/test_tree.py tests/casting/test_autocast.py \
		tests/casting/test_policy.py tests/utils/test_jax_compat.py tests/casting/test_rules.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(OLDEST) runs
