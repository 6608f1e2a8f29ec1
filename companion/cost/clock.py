"""Wall-clock time of device work: the one place where the package starts and stops a timer.

CUDA kernels (and NCCL collectives) run asynchronously: a call returns once the work is queued,
so a timer read right after it measures the launch, not the work. Every timer of the package
therefore waits for the device on both ends (`synchronize`, a host-device sync). On the CPU the
sync does nothing. A test (`tests/test_clock.py`) checks that no module reads the clock by itself.

Example:
    >>> with Stopwatch(device) as watch:
    ...     model.loss(x, y).backward()
    >>> watch.seconds
"""
from __future__ import annotations

import time

import torch

__all__ = ["synchronize", "Stopwatch", "now"]


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait until `device` has finished its queued work; `None`: every visible GPU (DataParallel
    runs on several). Nothing to wait for on the CPU."""
    if device is None:
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)                      # host-device sync
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)                             # host-device sync


def now(device: torch.device | str | None = "cpu") -> float:
    """The clock, in seconds, once `device` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """`with Stopwatch(device) as w:` times the block's work on `device`: it waits for the device
    before starting and before stopping; `w.seconds` is the time between."""

    def __init__(self, device: torch.device | str | None = "cpu"):
        self.device, self.seconds, self._start = device, 0.0, 0.0

    def __enter__(self) -> "Stopwatch":
        self._start = now(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = now(self.device) - self._start
