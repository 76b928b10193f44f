"""The multi-device tests need 8 (simulated CPU) devices.

Run them as ``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/multidevice``
(``make test`` does); the flag must be set before JAX starts.
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
        if "multidevice" in str(item.fspath):
            item.add_marker(skip)
