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

from tests.helpers import N_DEV


def _needs_eight_devices(item: pytest.Item) -> bool:
    parts = pathlib.Path(str(item.fspath)).parts
    if "multidevice" in parts:
        return True
    callspec = getattr(item, "callspec", None)
    placement = callspec.params.get("placement", "one") if callspec else "one"
    return "matrix" in parts and placement != "one"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if jax.device_count() >= N_DEV:
        return
    skip = pytest.mark.skip(
        reason=f"needs {N_DEV} devices, JAX sees {jax.device_count()}: run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={N_DEV} (as `make test` does)"
    )
    for item in items:
        if _needs_eight_devices(item):
            item.add_marker(skip)
