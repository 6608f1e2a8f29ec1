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


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Each test leaves torch's thread count as it found it. One that left 2 threads made every
    later test on its xdist worker 4-40x slower (on 2 cores, two workers' OpenMP threads wait for
    each other)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Tiny models: two threads on a loaded 2-core machine only wait for each other (a check of
    chapter 03's exercise 1 took 0.63 s with 2, 0.02 s with 1). Modules of small checks use it
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO
