"""Where a tensor's bytes live: on the device, on the host, or on disk.

Offloading keeps some tensors in host (CPU) memory, or in files, while the model trains on the
device. On CUDA the storage's device says where it lives. On a machine without a GPU, device and
host are the same RAM, so offloading code says it explicitly: storages allocated inside
`with on_host():` are host memory, inside `with on_disk():` files mapped into memory.
`companion.memory`'s trackers read this to count device and host bytes apart, and `memory_budget`
caps the device only.

Example:
    >>> with memory_budget("1 MiB"), on_host():
    ...     master = torch.zeros(2**20)        # 4 MiB on the host: no OutOfMemoryError

Simplified vs PyTorch: PyTorch has no such scope; on a GPU it needs none (`tensor.device` tells).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["DEVICE", "HOST", "DISK", "on_host", "on_disk", "storage_place"]

DEVICE, HOST, DISK = range(3)
_PLACE = threading.local()                # the scope set by on_host / on_disk, per thread


@contextlib.contextmanager
def _placed(where: int) -> Iterator[None]:
    before = getattr(_PLACE, "where", DEVICE)
    _PLACE.where = where
    try:
        yield
    finally:
        _PLACE.where = before


def on_host() -> contextlib.AbstractContextManager[None]:
    """Count the CPU storages allocated inside the block as host memory, not device memory.

    On CUDA this changes nothing (CPU storages are host memory anyway). On the CPU it is how
    offloading code says "this tensor lives on the host": trackers report its bytes as
    `host_current` / `host_peak`, and `memory_budget` does not count them. Per thread, like
    `torch.no_grad()`."""
    return _placed(HOST)


def on_disk() -> contextlib.AbstractContextManager[None]:
    """CPU storages allocated inside the block are files mapped into memory (the NVMe tier):
    trackers count them neither as device nor as host bytes."""
    return _placed(DISK)


def storage_place(storage_device: str, tracked_device: str) -> int | None:
    """DEVICE, HOST or DISK for a new storage on `storage_device`, seen by a tracker of
    `tracked_device` ("cpu" or "cuda"); None when that tracker does not count it."""
    scope = getattr(_PLACE, "where", DEVICE)
    if storage_device == "cpu" and scope == DISK:
        return DISK
    if storage_device == "cpu" and (tracked_device != "cpu" or scope == HOST):
        return HOST                                    # CPU memory while the device is a GPU
    return DEVICE if storage_device == tracked_device else None
