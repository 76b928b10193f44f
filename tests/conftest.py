"""Setup every test folder shares: the suites that need 8 (simulated CPU) devices.

``tests/multidevice`` and the matrix's cells off one device (``tests/matrix``) need
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``make test`` sets it; the flag
must be set before JAX starts). Without it they are skipped with that reason; the
matrix's one-device cells (and its user-input cells, all on one device) still run.
"""

from __future__ import annotations

import pathlib

import jax
import pytest

from tests.ci_budget import LEFT_OUT
from tests.helpers import N_DEV


def _needs_eight_devices(item: pytest.Item) -> bool:
    parts = pathlib.Path(str(item.fspath)).parts
    if "multidevice" in parts:
        return True
    callspec = getattr(item, "callspec", None)
    placement = callspec.params.get("placement", "one") if callspec else "one"
    return "matrix" in parts and placement != "one"


# tests/ci_budget.py's entries as pytest node ids.
_LEFT_OUT = {f"{path}::{name}" for path, names in LEFT_OUT.items() for name in names}


def _left_out(item: pytest.Item) -> str | None:
    """The entry naming this test: its node id, or its function's."""
    function = item.nodeid.split("[", 1)[0]
    return next((k for k in (item.nodeid, function) if k in _LEFT_OUT), None)


def _mark_left_out(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``slow`` the tests tests/ci_budget.py leaves to ``make test-slow``; an
    entry of a collected file that names no test is an error (renamed, or removed),
    unless the run named single tests."""
    used = set()
    for item in items:
        if (key := _left_out(item)) is not None:
            item.add_marker(pytest.mark.slow)
            used.add(key)
    files = {item.nodeid.split("::", 1)[0] for item in items}
    stale = [k for k in _LEFT_OUT if k.split("::", 1)[0] in files and k not in used]
    if stale and not any("::" in str(a) for a in config.args):
        raise pytest.UsageError(
            "tests/ci_budget.py names tests that do not exist (rename or remove them): "
            + ", ".join(stale)
        )


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_left_out(config, items)
    if jax.device_count() >= N_DEV:
        return
    skip = pytest.mark.skip(
        reason=f"needs {N_DEV} devices, JAX sees {jax.device_count()}: run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={N_DEV} (as `make test` does)"
    )
    for item in items:
        if _needs_eight_devices(item):
            item.add_marker(skip)
