"""The NVMe tier (ZeRO-Infinity's idea): master weights and optimizer state in files on disk.

When even host RAM cannot hold 16 bytes per parameter, the optimizer's own tensors (fp32 master
weights and Adam's two moments: 12 bytes per parameter) can live in files. Each file is mapped
into memory (`numpy.memmap`); for the step, one parameter group at a time is read into RAM ("paged
in"), stepped, its weights copied up to the device, and written back ("paged out").
Host RAM then holds the gradients (4 bytes per parameter) plus one group's pages during the step.
Cost: every step reads and writes 12 bytes per parameter to the disk, the slowest link in the
machine, which is why it is the last resort (Rajbhandari et al., 2021, "ZeRO-Infinity: Breaking
the GPU Memory Wall for Extreme Scale Deep Learning", SC'21).

Example:
    >>> with NVMeOffloadOptimizer(model.parameters(), directory="/mnt/nvme", lr=1e-3) as opt:
    ...     model.loss(x, y).backward(); opt.step(); opt.zero_grad()
    >>> # leaving the block (or opt.close()) removes the files, also after an error

Simplified vs DeepSpeed: files are mapped and flushed with msync instead of read and written with
asynchronous direct I/O (libaio, bypassing the page cache), pages are whole parameter groups
instead of fixed-size sub-groups, and the next group is not prefetched while one steps.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
import weakref
from typing import Iterable

import numpy as np
import torch

from companion.memory import format_bytes
from companion.offload import CPUOffloadOptimizer, check_settings
from companion.placement import on_disk, on_host

__all__ = ["NVMeOffloadOptimizer", "state_tensor_names"]


def state_tensor_names(optimizer_cls: type = torch.optim.AdamW, **defaults) -> list[str]:
    """Names of the per-parameter state tensors `optimizer_cls` keeps (same shape as the
    parameter), found by stepping it once on a two-element probe: AdamW ["exp_avg",
    "exp_avg_sq"]."""
    probe = torch.zeros(2, requires_grad=True)
    probe.grad = torch.zeros(2)
    opt = optimizer_cls([probe], **defaults)
    opt.step()
    return sorted(k for k, v in opt.state[probe].items()
                  if isinstance(v, torch.Tensor) and v.shape == probe.shape)


class NVMeOffloadOptimizer(CPUOffloadOptimizer):
    """`CPUOffloadOptimizer` whose master weights and optimizer state live in files under
    `directory`, paged into RAM one parameter group at a time for the step.

    Memory: device as `CPUOffloadOptimizer`; host 4 bytes per parameter (gradients) + the largest
    group's master and state while it steps; disk (1 + number of state tensors) x 4 bytes per
    parameter (AdamW: 12), `disk_bytes`. Put each block in its own group for smaller pages.
    Files are removed by `close()`, on leaving a `with` block, when a step fails, and when the
    optimizer is garbage-collected. `step_times` adds the seconds of page_in and page_out.
    Raises a clear error when `directory` is not a writable directory or has too little free
    space.
    """

    _masters_in_arena = _masters_in_ram = False   # the masters live in files

    def __init__(self, params: Iterable, optimizer_cls: type = torch.optim.AdamW, *,
                 directory: str | os.PathLike, pin_memory: bool | None = None, **defaults):
        params = list(params)
        numel = sum(p.numel() for p in _flatten(params))
        check_settings(optimizer_cls, defaults)
        self._names = state_tensor_names(optimizer_cls, **defaults)
        self.workdir = _make_workdir(directory, (1 + len(self._names)) * 4 * numel)
        self._remove = weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)
        self._files: dict[str, np.memmap] = {}
        self.closed = False
        try:
            super().__init__(params, optimizer_cls, pin_memory=pin_memory, **defaults)
        except BaseException:
            self._remove()                         # no files left behind
            raise
        self._times.update(page_in=0.0, page_out=0.0)   # seconds per step, in step_times

    def _file(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A float32 tensor shaped like `like`, backed by the file `name` (zeros when new)."""
        path = os.path.join(self.workdir, name)
        with on_disk():                            # the bytes are on disk, not in RAM
            self._files[name] = np.memmap(path, dtype=np.float32, mode="w+",
                                          shape=tuple(like.shape) or (1,))
            return torch.from_numpy(self._files[name]).view(like.shape)

    def _host_master(self, index: int, p: torch.Tensor) -> torch.Tensor:
        master = self._file(f"p{index}.master", p)
        master.copy_(p.detach())                   # device -> disk
        self._files[f"p{index}.master"].flush()    # msync: written to the file now
        return master

    @property
    def disk_bytes(self) -> int:
        """Bytes of the files that hold the masters and the optimizer state."""
        return sum(os.path.getsize(os.path.join(self.workdir, n)) for n in self._files)

    def _update(self, indices: list[int]) -> None:
        if self.closed:
            raise RuntimeError("this NVMeOffloadOptimizer is closed (its files are removed); "
                               "create a new one to keep training")
        wanted = set(indices)
        try:
            for group in _group_indices(self.param_groups):
                chosen = [i for i in group if i in wanted and self._has_grad[i]]
                if chosen:
                    start = time.perf_counter()  # host clock
                    self._page_in(chosen)          # 1. disk -> RAM
                    middle = time.perf_counter()  # host clock
                    super()._update(chosen)        # 2. step, copy the weights up
                    end = time.perf_counter()  # host clock
                    self._page_out(chosen)         # 3. RAM -> disk
                    self._times["page_in"] += middle - start
                    self._times["page_out"] += time.perf_counter() - end  # host clock
        except BaseException:
            self.close()                           # a failed step leaves no files behind
            raise

    def _page_in(self, indices: list[int]) -> None:
        with on_host():
            for i in indices:
                master = self.master_params[i]
                master.data = master.data.clone()                  # disk -> RAM
                state = self.optimizer.state[master]
                for name in self._names:
                    if name in state:
                        state[name] = state[name].clone()          # disk -> RAM

    def _page_out(self, indices: list[int]) -> None:
        for i in indices:
            master = self.master_params[i]
            state = self.optimizer.state[master]
            for name in ["master"] + self._names:
                key = f"p{i}.{name}"
                ram = master.data if name == "master" else state[name]
                disk = self._file(key, ram) if key not in self._files else _as_tensor(
                    self._files[key], ram)
                disk.copy_(ram)                                    # RAM -> disk
                self._files[key].flush()                           # msync
                if name == "master":
                    master.data = disk
                else:
                    state[name] = disk             # the RAM page is freed here

    def close(self) -> None:
        """Stop the gradient hooks and remove the files."""
        self.remove_hooks()
        self._files.clear()
        self.closed = True
        self._remove()

    def __enter__(self) -> "NVMeOffloadOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_tensor(memmap: np.memmap, like: torch.Tensor) -> torch.Tensor:
    with on_disk():
        return torch.from_numpy(memmap).view(like.shape)


def _flatten(params: list) -> list[torch.Tensor]:
    out = []
    for p in params:
        out.extend(p["params"] if isinstance(p, dict) else [p])
    return [p for p in out if isinstance(p, torch.Tensor)]


def _group_indices(groups: list[dict]) -> list[list[int]]:
    out, start = [], 0
    for g in groups:
        out.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
    return out


def _free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free


def _make_workdir(directory: str | os.PathLike, needed: int) -> str:
    """A new, empty folder under `directory` for this optimizer's files; clear errors if not."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or pathlib.Path) to a folder on your "
                        f"fastest disk, got {directory!r}")
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"NVMe offload directory {directory!r} does not exist or is not a "
                                 "directory: create it first, or pass one on your fastest disk")
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"cannot write to the NVMe offload directory {directory!r}: "
                              "pass a directory you can write to")
    free = _free_bytes(directory)
    if free < needed:
        raise OSError(errno.ENOSPC, f"the NVMe tier needs {format_bytes(needed)} for master "
                      f"weights and optimizer state, but {directory!r} has {format_bytes(free)} "
                      "free: free some space or choose a larger disk")
    try:
        return tempfile.mkdtemp(prefix="nvme-offload-", dir=directory)
    except OSError as e:
        raise PermissionError(f"cannot write to the NVMe offload directory {directory!r} "
                              f"({e.strerror}): pass a directory you can write to") from None
