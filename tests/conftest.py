"""Test set-up: force the simulator unless a GPU run is asked for, hypothesis profiles,
shapes scaled to the device, and the `gpu` marker.

- `pytest`                      -> simulator unless a GPU is present (proto.device.backend decides)
- `PROTO_BACKEND=sim pytest`    -> simulator even on a GPU machine
- `HYPOTHESIS_PROFILE=dev`      -> more examples; `ci` (default) is small and derandomized
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from proto.device import backend  # noqa: F401  (chooses the backend before numba is imported)

settings.register_profile(
    "ci", max_examples=8, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
settings.register_profile(
    "dev", max_examples=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    # On a GPU each example is cheap after compilation, so look at more (and larger) ones.
    "gpu", max_examples=30, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if backend.SIMULATOR else "gpu"))

from tests.helpers import SCALE, launches_of  # noqa: E402  (the shape scale: see tests.helpers)


def pytest_report_header(config):
    return f"proto backend: {backend.describe()}; shape scale x{SCALE}"


def pytest_collection_modifyitems(config, items):
    if not backend.SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device (run this lane on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def scale() -> int:
    return SCALE


@pytest.fixture
def attention_launches(monkeypatch):
    """The kernels kernels.attention's launcher launched, in order (which variant ran)."""
    from kernels import attention
    return launches_of(monkeypatch, attention)
