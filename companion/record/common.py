"""What every recorded experiment shares: a median time, and a record of which sizes it read.

Example:
    >>> seconds = median_seconds(lambda: a @ b, repeats=5, device=a.device)
    >>> s = SizesRead(sizes("cuda")); s.width; s.read          # {'width': 4096}
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
from companion.cost.clock import now

__all__ = ["median_seconds", "SizesRead"]


def median_seconds(fn: Callable[[], object], *, repeats: int,
                   device: torch.device | str) -> float:
    """Median wall seconds of `repeats` calls of `fn` after one warm-up call; on CUDA each call
    sits between two synchronizations, so the time is the device's, not the launch's."""
    fn()                                                    # warm-up: kernels, caches, state
    times = []
    for _ in range(max(1, repeats)):
        start = now(device)                                 # host-device sync
        fn()
        times.append(now(device) - start)                   # host-device sync
    return statistics.median(times)


class SizesRead:
    """A `companion.device.Sizes` that remembers the fields read from it (`.read`), so that a
    recorded run lists exactly the sizes its experiment used."""

    def __init__(self, sizes) -> None:
        self._sizes, self.read = sizes, {}

    def __getattr__(self, name: str):
        value = getattr(self._sizes, name)
        self.read[name] = value
        return value
