"""The matrix's cells off one device need 8 (simulated CPU) devices.

Run it as ``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/matrix``
(``make test`` runs the CI subset so, ``make matrix`` the whole product); the flag
must be set before JAX starts. Without it, the one-device cells (and the user-input
cells, all on one device) run and the others are skipped with this reason.
"""

from __future__ import annotations

import jax
import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if jax.device_count() >= 8:
        return
    skip = pytest.mark.skip(
        reason=f"needs 8 devices, JAX sees {jax.device_count()}: run with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (as `make test` does)"
    )
    for item in items:
        callspec = getattr(item, "callspec", None)
        placement = callspec.params.get("placement", "one") if callspec else "one"
        if "matrix" in str(item.fspath) and placement != "one":
            item.add_marker(skip)
