"""Activation offload: tensors saved for backward wait on the host between forward and backward.

`to_host` / `to_device` are the two copies every offload in the course makes; `OffloadActivations`
uses them in saved-tensor hooks (the idea of `torch.autograd.graph.save_on_cpu`). Memory: the
device keeps the small saved tensors and the parameters, the large ones wait on the host. Cost:
each moved tensor crosses the host-device link twice (down in forward, up in backward).

Example:
    >>> with offload_activations(min_bytes=2**20) as moved:
    ...     loss = model.loss(x, y)                  # large saved tensors go to the host
    >>> loss.backward()                              # and come back as backward needs them
    >>> moved.bytes_to_host, moved.tensors_kept

Simplified vs PyTorch's save_on_cpu: it skips parameters and small tensors, and copies on the
current stream as save_on_cpu does (no overlap with compute on a side stream).
"""
from __future__ import annotations

import torch

from companion.placement import on_host

__all__ = ["to_host", "to_device", "can_pin", "OffloadActivations", "offload_activations"]


def to_host(t: torch.Tensor, *, dtype: torch.dtype | None = None,
            pin_memory: bool | None = None) -> torch.Tensor:
    """A copy of `t` in host memory, contiguous, in `dtype` (default: t's).

    Pinned (page-locked) when `t` is on a GPU, so that copies to and from it can run
    asynchronously: the copy is queued on the current CUDA stream and returns at once, so device
    work queued after it sees it, but CPU code must wait before reading its values
    (`torch.cuda.current_stream().synchronize()`, a host-device sync). On a CPU-only machine it is
    allocated inside `companion.placement.on_host()`, so trackers count it as host memory.

        >>> master = to_host(weight, dtype=torch.float32)     # (same shape) fp32 on the host

    Simplified vs PyTorch: `t.to("cpu", dtype, non_blocking=True)` with pinned memory, plus the
    host label on a CPU-only machine. `pin_memory=True` without an accelerator does not pin (there
    is nothing to copy to asynchronously), as save_on_cpu does, where torch.empty would raise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_host copies a tensor, got a {type(t).__name__}: pass a "
                        "torch.Tensor (torch.tensor(...) makes one)")
    pin = (t.is_cuda if pin_memory is None else bool(pin_memory)) and can_pin()
    with on_host():
        out = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=pin)
        out.copy_(t, non_blocking=pin)                     # device -> host (async on CUDA)
    return out


def can_pin() -> bool:
    """Whether page-locked host memory exists here: only with an accelerator (CUDA, or another
    backend torch.accelerator knows)."""
    accelerator = getattr(torch, "accelerator", None)           # torch 2.6 and later
    return torch.cuda.is_available() or bool(accelerator and accelerator.is_available())


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of host tensor `t` on `device` (a new tensor also when device is the CPU).

        >>> weight_again = to_device(to_host(weight), weight.device)

    Simplified vs PyTorch: `t.to(device, non_blocking=t.is_pinned(), copy=True)`, nothing more;
    from pinned memory the copy is queued on the current stream, which later kernels wait for."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_device copies a tensor, got a {type(t).__name__}")
    return t.to(device, non_blocking=t.is_pinned(), copy=True)   # host -> device


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Tensors saved for backward that hold at least `min_bytes` go to the host in forward and
    come back to their device in backward.

    Memory: the device keeps only the small saved tensors and the parameters; the large ones wait
    on the host. Cost: each one crosses the link twice (down in forward, up in backward).
    Counters: `bytes_to_host`, `bytes_to_device`, `tensors_moved`, `tensors_kept`.

        >>> with offload_activations(min_bytes=2**20) as moved:
        ...     model.loss(x, y).backward()
        >>> moved.bytes_to_host

    Kept on the device: parameters and views of them (they stay there anyway), tensors under
    `min_bytes`, and expanded tensors (a stride of 0: the device holds only their small source,
    while a host copy would hold every repeated element). Tensors that do not require grad (an
    input, a mask, a module buffer) are moved like save_on_cpu moves them; one that the caller
    still holds, such as a buffer, is then copied without freeing device memory.

    Simplified vs PyTorch's save_on_cpu: it skips parameters, small and expanded tensors; like it,
    a tensor saved twice is copied twice, the copies run on the current stream (not overlapped
    with compute on a side stream), and `pin_memory=True` pins only where an accelerator exists.
    Unlike it, a saved tensor is copied on a CPU-only machine too (save_on_cpu's `t.cpu()` is the
    tensor itself there), so a saved tensor changed in place after forward gives the gradient of
    forward's values here, where save_on_cpu on a CPU uses the changed values and plain autograd
    raises.
    """

    def __init__(self, *, min_bytes: int = 2**20, pin_memory: bool | None = None):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        self.min_bytes, self.pin_memory = min_bytes, pin_memory
        self.bytes_to_host = self.bytes_to_device = self.tensors_moved = self.tensors_kept = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or _is_parameter(t) or _is_expanded(t):
            self.tensors_kept += 1
            return t                               # small, or on the device anyway
        self.bytes_to_host += nbytes
        self.tensors_moved += 1
        return t.device, to_host(t, pin_memory=self.pin_memory)     # device -> host

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        self.bytes_to_device += host.numel() * host.element_size()
        return to_device(host, device)                              # host -> device

    def __enter__(self) -> "OffloadActivations":
        super().__enter__()
        return self


def offload_activations(*, min_bytes: int = 2**20,
                        pin_memory: bool | None = None) -> OffloadActivations:
    """`with offload_activations(min_bytes=...) as moved:` — see `OffloadActivations`."""
    return OffloadActivations(min_bytes=min_bytes, pin_memory=pin_memory)


def _is_parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter), or a view of one (a Linear saves weight.t())."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def _is_expanded(t: torch.Tensor) -> bool:
    """Repeats elements through a stride of 0 (`x.expand(...)`): its storage is smaller."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))
