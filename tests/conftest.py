import logging

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fusepatch_logs(caplog):
    caplog.set_level(logging.INFO, logger="fusepatch")
    yield


@pytest.fixture(autouse=True)
def _no_disable(monkeypatch):
    monkeypatch.delenv("FUSEPATCH_DISABLE", raising=False)
    monkeypatch.delenv("FUSEPATCH_PREFER", raising=False)
