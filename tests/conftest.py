import os

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Fixtures that spawn several processes: every test using one is slow (``pytest -m "not slow"`` skips it).
MULTI_PROCESS_FIXTURES = {"four_ranks"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MULTI_PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def device_path(monkeypatch):
    """The CPU takes a device's path through every value check (``nopad.core._errors.HOST_VALUES_CHECKED``):
    for tests that measure a GPU's sync contract on a CPU. Without it, checks that read CPU tensors
    (host memory, no device sync) show up in the counts."""
    # private: the switch that makes the CPU take a device's path through every value check
    import nopad.core._errors

    monkeypatch.setattr(nopad.core._errors, "HOST_VALUES_CHECKED", False)
