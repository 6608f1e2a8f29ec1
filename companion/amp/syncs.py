"""How often the host reads a value off the device: each read is a host-device sync on a GPU.

`.item()`, `bool(t)`, `float(t)` and `if t:` on a tensor all reach the operator
`aten._local_scalar_dense`, which copies one value to the host; on CUDA the host must wait for
every kernel queued before it. `host_reads(fn)` counts those reads while `fn` runs, on any device
(on the CPU a read costs nothing, but the count is the one a GPU would wait for).

Example:
    >>> scaler = torch.amp.GradScaler("cpu"); scaler.scale(loss).backward()
    >>> host_reads(lambda: (scaler.step(opt), scaler.update()), ignore=step_counters(opt))
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["host_reads", "step_counters"]


class _Reads(TorchDispatchMode):
    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore, self.count = ignore, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].untyped_storage().data_ptr() not in self.ignore:
                self.count += 1
        return func(*args, **(kwargs or {}))


def host_reads(fn: Callable[[], object], *, ignore: Iterable[torch.Tensor] = ()) -> int:
    """The number of values `fn()` copies from a tensor to the host (`aten._local_scalar_dense`),
    leaving out reads of the tensors in `ignore` (by storage)."""
    if not callable(fn):
        raise TypeError(f"host_reads needs a function to call, got {type(fn).__name__}")
    mode = _Reads({t.untyped_storage().data_ptr() for t in ignore})
    with mode:
        fn()
    return mode.count


def step_counters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter step counts. PyTorch keeps them on the host (a CPU tensor)
    unless the optimizer is fused or capturable, so reading them makes no device sync: pass them
    to `host_reads(..., ignore=)` to count only the reads that would wait for a GPU."""
    return [s["step"] for s in optimizer.state.values()
            if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"]
