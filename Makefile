PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MULTIDEVICE := XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,examples,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 jaxamp tests --ignore=tests/multidevice
	$(MULTIDEVICE) $(PY) -m pytest -q tests/multidevice

demo: $(STAMP)
	$(PY) examples/train_lm.py

bench: $(STAMP)
	$(PY) benchmarks/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs
