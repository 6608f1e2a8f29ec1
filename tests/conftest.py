import pathlib

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """GPU tests are marked `gpu` and skipped on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO
