"""Offload: keep master weights, optimizer state and activations in host memory, not on the device.

Adam in fp32 needs 16 bytes per parameter (weights 4, gradients 4, two moments 8); the forward
needs only the 4 bytes of weights. ZeRO-Offload (Ren et al., 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", USENIX ATC) keeps the rest on the host and splits a step in three:
  1. backward on the device; each gradient is copied down to the host as soon as it is ready, and
     its device copy freed;
  2. the optimizer steps on the CPU, over fp32 master weights and state that live on the host;
  3. the updated weights are copied back up.
Device memory: the weights (plus activations and a gradient in flight). Host memory: fp32 master
weights, gradients and optimizer state (16 bytes per parameter with Adam, 2 more for the 16-bit
copy of 16-bit weights). Cost: the model crosses the host-device link twice per step (gradients
down, weights up), and a CPU optimizer step.

`offload_activations` (from `companion.activation_offload`) does the same for activations: tensors
saved for backward go to the host in forward and come back in backward (device activation memory
for transfer time).

Example:
    >>> opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)     # AdamW on the host
    >>> model.loss(x, y).backward()                                # gradients move down as ready
    >>> opt.step(); opt.zero_grad()                                # CPU step, weights move up
    >>> with offload_activations(min_bytes=2**20) as moved:
    ...     model.loss(x, y).backward()                            # moved.bytes_to_host

What crosses the link is carved from one `HostArena` (pinned on CUDA): gradients land in the
weights' dtype (2 bytes each with 16-bit weights) and become fp32 on the host; the host steps one
parameter group at a time and queues that group's weights up at once, so on CUDA the copy of group
g overlaps the host step of group g + 1; `delay=1` is ZeRO-Offload's delayed parameter update.

Simplified vs DeepSpeed (ZeRO-Offload): one process (no ZeRO partitioning across ranks), a copy per
parameter instead of contiguous buckets, PyTorch's fused CPU optimizer instead of DeepSpeed's
CPUAdam, and the delayed update's host step in a Python thread (PyTorch's CPU kernels release the
interpreter lock, so it runs beside forward and backward).
"""
from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import functools
import itertools
import math
import statistics
import time
import weakref
from typing import Callable, Iterable

import torch

from companion.activation_offload import (OffloadActivations, can_pin, offload_activations,
                                          to_device, to_host)
from companion.cost.clock import now
from companion.placement import on_host

__all__ = ["to_host", "to_device", "CPUOffloadOptimizer", "HostArena", "pinned_reserved",
           "OffloadActivations", "offload_activations", "step_phases", "Link", "schedule_groups"]

ALIGN = 64                 # bytes: where each tensor carved from an arena starts
ARENA_CHUNK = 2**30        # bytes: the largest block an arena allocates (unless a tensor is larger)


def check_settings(optimizer_cls: type, defaults: dict) -> None:
    """Let `optimizer_cls` validate `defaults` (lr, betas, ...) on a probe tensor: a bad value or
    a misspelt name raises here, with what to fix, instead of being ignored."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class such as "
                        f"torch.optim.AdamW, got {optimizer_cls!r}")
    try:
        optimizer_cls([torch.zeros(1, requires_grad=True)], **defaults)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{optimizer_cls.__name__} rejects the settings {defaults}: {e}. Check "
                      "each name and value (e.g. lr=1e-3, weight_decay=0.1)") from None


def _fastest(optimizer_cls: type, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """optimizer_cls over host tensors, with PyTorch's fastest CPU path: fused (on the CPU, one
    loop over every tensor's elements per parameter group, all of the update in one pass), else
    foreach (one kernel per operation over all tensors), else the per-tensor loop."""
    if "fused" in defaults or "foreach" in defaults:
        return optimizer_cls(groups, **defaults)           # the caller chose
    for choice in ({"fused": True}, {"foreach": True}, {}):
        try:
            return optimizer_cls(groups, **defaults, **choice)
        except (TypeError, RuntimeError, ValueError):      # not supported by this optimizer
            continue
    raise AssertionError("unreachable: the settings were checked, the last choice adds nothing")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pinned_reserved(sizes: Iterable[int], *, arena: bool = True,
                    chunk_bytes: int = ARENA_CHUNK) -> int:
    """Host bytes really reserved for pinned buffers of `sizes` bytes.

    PyTorch's pinned allocations go through its caching host allocator, which rounds every block
    up to a power of two (`CachingHostAllocator.h`, `c10::llvm::PowerOf2Ceil`): a 40.96 MB tensor
    takes 64 MiB. With `arena=False` each size is its own block; with `arena=True` the sizes are
    carved, largest first, from a few blocks that are themselves powers of two (`HostArena`), so
    only what the last blocks leave unfilled is lost.

        >>> pinned_reserved([40_960_000], arena=False) / 2**20
        64.0
    """
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be non-negative byte counts, got {sizes}")
    if not arena:
        return sum(_pow2_at_least(s) for s in sizes if s)
    return sum(size for size, _ in _pack(sizes, chunk_bytes))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _pack(sizes: list[int], chunk_bytes: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Blocks (size, [(index, offset), ...]) for `sizes`, first fit, largest tensors first: each
    block the largest power of two that the bytes still to place fill (at most chunk_bytes), or
    the next power of two of a tensor larger than that, filled with every tensor left that fits."""
    blocks, left = [], sorted(range(len(sizes)), key=lambda i: -sizes[i])
    while left:
        total = sum(_aligned(sizes[i]) for i in left)
        size = max(_pow2_at_least(sizes[left[0]]), min(chunk_bytes, 1 << (total.bit_length() - 1)))
        placed, rest, offset = [], [], 0
        for i in left:
            if offset + sizes[i] <= size:
                placed.append((i, offset))
                offset = _aligned(offset + sizes[i])
            else:
                rest.append(i)
        blocks.append((size, placed))
        left = rest
    return blocks


class HostArena:
    """Host buffers carved from a few large allocations, pinned where an accelerator exists.

    Each allocation is a power of two of bytes, which PyTorch's caching host allocator keeps as it
    is (it rounds every pinned block up to a power of two), and holds many tensors: the bytes
    reserved are within a block's tail of the bytes used (DeepSpeed likewise pins flat buffers
    per parameter group). `reserved` counts what was allocated, `used` what the tensors hold.

        >>> arena = HostArena(pin=torch.cuda.is_available())
        >>> grads = arena.carve([(p.shape, p.dtype) for p in model.parameters()])
    """

    def __init__(self, *, pin: bool, chunk_bytes: int = ARENA_CHUNK):
        if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"chunk_bytes must be a power of two, got {chunk_bytes}")
        self.pin, self.chunk_bytes = bool(pin), chunk_bytes
        self.blocks: list[torch.Tensor] = []
        self.used = 0

    @property
    def reserved(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def carve(self, requests: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        """Zero-filled tensors of the requested (shape, dtype), views into new blocks."""
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in requests]
        out: list[torch.Tensor | None] = [None] * len(requests)
        for size, placed in _pack(sizes, self.chunk_bytes):
            with on_host():
                block = torch.zeros(size, dtype=torch.uint8, pin_memory=self.pin)
            self.blocks.append(block)
            for i, offset in placed:
                shape, dtype = requests[i]
                out[i] = block[offset:offset + sizes[i]].view(dtype).view(shape)
        self.used += sum(sizes)
        return out


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """ZeRO-Offload for one device: the weights stay on the device, everything else on the host.

    Memory, per parameter with AdamW: device 4 bytes (fp32 weights) or 2 (16-bit weights);
    host 4 (fp32 master) + 4 (fp32 gradient) + 8 (two moments), + 2 for the 16-bit buffer that
    gradients land in and weights leave from when the weights are 16-bit. What crosses the link
    (the gradients as they land, the weights as they leave) is carved from a `HostArena`, pinned
    on CUDA: `host_ledger()` says what is reserved. In fp32 training equals `optimizer_cls` on
    the device when both use the same implementation (fused, foreach or loop): bit for bit on a
    CPU-only machine, within rounding against a GPU's kernels.

        >>> opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
        >>> for x, y in data:
        ...     model.loss(x, y).backward(); opt.step(); opt.zero_grad()

    The step, per parameter group g (`timeline` records it): the host steps g, then its weights
    are queued up the link, so on CUDA group g's copy up runs while the host steps group g + 1.
    Gradients travel in the weights' dtype (2 bytes with 16-bit weights, as ZeRO-Offload sends
    them) and become fp32 on the host; a second backward before `step` lands in the same buffers
    and is added on the host. `bytes_down` and `bytes_up` count what crossed.

    `delay=1` is ZeRO-Offload's delayed parameter update (Ren et al. 2021, §5): after `exact_steps`
    exact steps, `step` starts the host step in a background thread and returns, so it runs while
    the next forward and backward do; its weights are copied up at the following `step`. The
    weights that compute a gradient are then one step staler than in exact training: the forward
    after step t uses the updates of steps up to t - 1. It costs a second set of landing buffers
    on the host for fp32 weights (4 bytes per parameter; none for 16-bit weights). Call
    `synchronize()` before reading the weights (evaluation, a checkpoint), or `host_weights()` to
    read every update so far without changing what the next forward uses.

    Args: `params` (tensors or param groups, like any optimizer), `optimizer_cls` (run on the host;
    `fused=True` is chosen when it supports it, else `foreach=True`), `pin_memory` (default: when
    the weights are on CUDA), `delay` (0 or 1), `exact_steps` (steps before the delay starts, at
    least 1: the first allocates the optimizer state), `**defaults` for optimizer_cls.
    Create it after loading the weights: the masters are copied from them here.

    Gradient clipping: after backward the gradients are on the host and the device's `p.grad` is
    None, so `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` clips nothing (and returns
    0). Call `opt.clip_grad_norm_(max_norm)` between backward and step instead.
    One optimizer per set of parameters: its hooks stay on them until `remove_hooks()` (or until
    it is garbage-collected); call it before creating another.

    Simplified vs DeepSpeed: see the module docstring. `step_times` holds, per step, the seconds
    spent in the gradient hooks (`copy_down`, inside backward), waiting for their copies at the
    start of step (`wait`, inside step), stepping on the host and queueing the copies up (issue
    time on CUDA unless `profile`).
    """

    _masters_in_arena = _masters_in_ram = True    # NVMeOffloadOptimizer keeps them in files

    def __init__(self, params: Iterable, optimizer_cls: type = torch.optim.AdamW, *,
                 pin_memory: bool | None = None, profile: bool = False, delay: int = 0,
                 exact_steps: int = 1, **defaults):
        if isinstance(params, (torch.Tensor, torch.nn.Module)):
            raise TypeError("CPUOffloadOptimizer takes an iterable of parameters: pass "
                            "model.parameters(), not the model or one tensor")
        if delay not in (0, 1) or isinstance(delay, bool):
            raise ValueError(f"delay must be 0 (exact) or 1 (ZeRO-Offload's delayed parameter "
                             f"update), got {delay!r}")
        if isinstance(exact_steps, bool) or not isinstance(exact_steps, int) or exact_steps < 1:
            raise ValueError(f"exact_steps must be an int >= 1 (the first step allocates the "
                             f"optimizer state), got {exact_steps!r}")
        params = list(params)
        if not params:
            raise ValueError("CPUOffloadOptimizer got no parameters: pass model.parameters()")
        check_settings(optimizer_cls, defaults)
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        _check_params(self._params)
        first = self._params[0]
        self._stream = torch.cuda.Stream(first.device) if first.is_cuda else None
        self._pin = (self._stream is not None if pin_memory is None else bool(pin_memory)) \
            and can_pin()                          # no accelerator: nothing to pin for
        self.arena = HostArena(pin=self._pin)
        self.profile, self.step_times, self.timeline = profile, [], []
        self.delay, self.exact_steps, self.steps_taken = delay, exact_steps, 0
        self.bytes_down = self.bytes_up = 0
        self._times = dict.fromkeys(("copy_down", "wait", "host_step", "copy_up"), 0.0)
        self.master_params, self._grads, self._landing, self._has_grad = [], [], [], []
        self._pending: list = []                   # per parameter: None, or the landing to add
        self._spare: list = []                     # delay=1: the other set of landing buffers
        self._extra: list = []                     # fp32 weights, a second backward: landing
        self._hooks: list = []
        self._background = None                    # delay=1: the host step in flight
        self._host_copies(self._params)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": self.master_params[start:start + len(g["params"])]}
                  for g, start in zip(self.param_groups, _starts(self.param_groups))]
        self.optimizer = _fastest(optimizer_cls, groups, defaults)   # runs on the host
        weakref.finalize(self, _remove, self._hooks)

    def _host_copies(self, params: list[torch.Tensor]) -> None:
        """Host buffers and a gradient hook for each of `params` (appended to the lists)."""
        # 1. What crosses the link comes from the arena: the buffer each gradient lands in, in the
        #    weights' dtype, and the weights that go up (the fp32 master itself, or on CUDA the
        #    16-bit landing buffer again, which the master is cast into after the step). The rest
        #    (fp32 masters and gradients of 16-bit weights, the moments) is plain host memory.
        sixteen = [p.dtype != torch.float32 for p in params]
        in_arena = [not s and self._masters_in_arena for s in sixteen]
        requests = [(p.shape, p.dtype) for p in params]
        requests += [(p.shape, torch.float32) for p, a in zip(params, in_arena) if a]
        carved = self.arena.carve(requests)
        landing, arena_masters = carved[:len(params)], iter(carved[len(params):])
        first = len(self.master_params)
        for index, (p, s, a, land) in enumerate(zip(params, sixteen, in_arena, landing), first):
            master = next(arena_masters).copy_(p.detach()) if a else self._host_master(index, p)
            self.master_params.append(master)
            self._grads.append(self._host_empty(master, torch.float32) if s else land)
            self._landing.append(land)
        self._has_grad += [False] * len(params)
        self._pending += [None] * len(params)
        if self.delay:                             # fp32 weights: a second gradient buffer
            spare = iter(self.arena.carve([(p.shape, p.dtype) for p, s in zip(params, sixteen)
                                           if not s]))
            self._spare += [None if s else next(spare) for s in sixteen]
        if self._stream is not None:
            torch.cuda.synchronize(params[0].device)   # host-device sync: the masters landed
        # 2. A hook per weight: its gradient goes down as soon as backward has finished it. The
        #    hooks hold the optimizer weakly; when it is garbage-collected they are removed.
        me, start = weakref.ref(self), len(self._hooks)
        self._hooks += [p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, me, i))
                        for i, p in enumerate(params, start)]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters, as on any torch optimizer: they get host copies and hooks
        and are stepped on the host like the others."""
        if not hasattr(self, "optimizer"):          # torch.optim.Optimizer.__init__'s groups
            return super().add_param_group(param_group)
        self.synchronize()
        super().add_param_group(param_group)        # checks duplicates, fills defaults
        group = self.param_groups[-1]
        _check_params(self._params + group["params"])
        self._params += group["params"]
        self._host_copies(group["params"])
        self.optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                        "params": self.master_params[-len(group["params"]):]})

    def _host_master(self, index: int, p: torch.Tensor) -> torch.Tensor:
        return to_host(p.detach(), dtype=torch.float32, pin_memory=False)

    def _host_empty(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with on_host():
            return torch.zeros(like.shape, dtype=dtype)

    def host_ledger(self) -> dict[str, int]:
        """Host bytes by what holds them: the arena's reserved bytes (pinned on CUDA) and what
        its tensors use, the plain fp32 masters and gradients of 16-bit weights, the optimizer's
        state (moments and step counters, once the first step has made them)."""
        plain = [m for m in self.master_params
                 if self._masters_in_ram and not _in_arena(m, self.arena)]
        grads = [g for g, land in zip(self._grads, self._landing) if g is not land]
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        ledger = {"arena reserved": self.arena.reserved, "arena used": self.arena.used,
                  "masters outside the arena": sum(_nbytes(t) for t in plain),
                  "fp32 gradients outside the arena": sum(_nbytes(t) for t in grads),
                  "optimizer state": sum(_nbytes(t) for t in state)}
        ledger["total reserved"] = (ledger["arena reserved"] + ledger["masters outside the arena"]
                                    + ledger["fp32 gradients outside the arena"]
                                    + ledger["optimizer state"])
        return ledger

    def _copy_down(self, i: int, p: torch.Tensor) -> None:
        """Runs inside backward when p.grad is complete: move it to the host, free it here."""
        start, grad = time.perf_counter(), p.grad  # host clock
        if grad is None:
            raise RuntimeError(f"parameter {i} has no gradient when this optimizer's hook runs: "
                               "another CPUOffloadOptimizer on the same parameters moved it first. "
                               "Call old.remove_hooks() (or old.close()) before creating a new one")
        land, add = self._landing[i], self._has_grad[i]
        if add:                                    # a second backward before step: accumulate
            self._drain(i)                         # fold the previous one in (its copy landed)
            if land is self._grads[i] and self._stream is None:
                land = None                        # no stream: the copy is done on return
            elif land is self._grads[i]:           # fp32 weights: the sum so far is there
                land = self._extra_landing(i)
        if land is None:
            with on_host():
                self._grads[i].add_(grad)          # device -> host and added, at once
            self._pending[i] = None
        else:
            landed = self._send_down(land, grad)
            self._pending[i] = (land, add, landed) if add or land is not self._grads[i] else None
        self.bytes_down += _nbytes(grad)
        self._has_grad[i] = True
        p.grad = None                              # the device keeps only the weights
        self._times["copy_down"] += time.perf_counter() - start  # host clock

    def _send_down(self, host: torch.Tensor, grad: torch.Tensor):
        """Queue grad -> host in grad's dtype (nothing is cast on the device); returns the event
        that marks its end on CUDA, None where the copy is done on return."""
        if self._stream is None:
            host.copy_(grad)                                       # device -> host
            return None
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            host.copy_(grad, non_blocking=self._pin)               # device -> host, async
            landed = torch.cuda.Event()
            landed.record(self._stream)
        grad.record_stream(self._stream)           # not reused before the copy has read it
        return landed

    def _extra_landing(self, i: int) -> torch.Tensor:
        if not self._extra:
            self._extra = [None] * len(self._params)
        if self._extra[i] is None:                 # once: a second buffer for this fp32 weight
            self._extra[i] = self.arena.carve([(self._params[i].shape, torch.float32)])[0]
        return self._extra[i]

    def _drain(self, i: int) -> None:
        """Make the host's fp32 gradient of parameter i whole: wait for its copy, then convert
        (16-bit weights) or add (a later micro-batch) on the host."""
        if self._pending[i] is None:
            return
        land, add, landed = self._pending[i]
        if landed is not None:
            landed.synchronize()                   # the host waits for this copy only
        if self._background is not None:
            self._background.result()              # delay=1: the host step reads these buffers
        with on_host():
            if add:
                self._grads[i].add_(land)          # a later micro-batch, added on the host
            else:
                self._grads[i].copy_(land)         # 16-bit -> fp32, on the host
        self._pending[i] = None

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()             # host-device sync: every copy has landed

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Wait for the gradients, step on the host group by group, copy the weights up.
        Returns closure(). With delay=1 (after exact_steps), the host step of these gradients
        runs in the background and its weights go up at the next step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()  # host clock
        self._wait()                               # 1. every gradient is on the host
        if self._background is not None:
            self._background.result()              # delay=1: step t-1's host step is done
        for i in range(len(self._params)):
            self._drain(i)
        self._times["wait"] += time.perf_counter() - start  # host clock
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})   # lr schedules
        chosen = [i for i in range(len(self._params)) if self._has_grad[i]]
        if not (self.delay and self.steps_taken >= self.exact_steps):
            self._update(chosen)                   # 2. and 3.
        else:
            self._finish_background()              # step t-1's weights go up now
            grads = list(self._grads)
            self._swap_landing()                   # the next backward lands elsewhere
            self._background = _BACKGROUND.submit(self._host_only, chosen, grads)
        self.steps_taken += 1
        self.step_times.append(dict(self._times))
        self._times = dict.fromkeys(self._times, 0.0)
        return loss

    def _groups_of(self, indices: list[int]) -> list[list[int]]:
        chosen, out, start = set(indices), [], 0
        for g in self.param_groups:
            out.append([i for i in range(start, start + len(g["params"])) if i in chosen])
            start += len(g["params"])
        return [g for g in out if g]

    def _update(self, indices: list[int]) -> None:
        """Step the host optimizer over the masters in `indices` that have a gradient, one
        parameter group at a time, queueing each group's weights up the link as soon as the
        host has stepped it (so the copy of group g overlaps the host step of group g + 1)."""
        self.timeline = []
        origin = time.perf_counter()  # host clock
        if self._stream is not None:               # kernels still reading the weights go first
            self._stream.wait_stream(torch.cuda.current_stream(self._params[0].device))
        for g, group in enumerate(self._groups_of(indices)):
            t0 = time.perf_counter()  # host clock
            self._host_step(group)
            t1 = time.perf_counter()  # host clock
            self._copy_up(group)
            t2 = time.perf_counter()  # host clock
            self.timeline += [(g, "host_step", t0 - origin, t1 - origin),
                              (g, "copy_up", t1 - origin, t2 - origin)]
            self._times["host_step"] += t1 - t0
            self._times["copy_up"] += t2 - t1
        if self._stream is not None:               # the next forward waits for the weights
            torch.cuda.current_stream(self._params[0].device).wait_stream(self._stream)
            if self.profile:
                t0 = time.perf_counter()  # host clock
                self._wait()                       # host-device sync, for honest timings
                self._times["copy_up"] += time.perf_counter() - t0  # host clock

    def _host_step(self, indices: list[int], grads: list | None = None) -> None:
        """Step the host optimizer over the masters in `indices` only. It walks every parameter
        group it holds in Python, so it is shown only the groups that `indices` fall in: stepping
        G groups one at a time then costs one walk over the model, not G."""
        every, starts = self.optimizer.param_groups, _starts(self.param_groups)
        touched = sorted({bisect.bisect_right(starts, i) - 1 for i in indices})
        self.optimizer.param_groups = [every[k] for k in touched]
        for i in indices:                          # the other masters' gradients are None
            self.master_params[i].grad = (grads or self._grads)[i]
        try:
            with on_host():
                self.optimizer.step()              # on the CPU: fused AdamW when available
        finally:
            self.optimizer.param_groups = every
            for i in indices:
                self.master_params[i].grad = None

    @torch.no_grad()
    def _copy_up(self, group: list[int]) -> None:
        for i in group:
            source = self.master_params[i]
            if self._landing[i] is not self._grads[i] and self._stream is not None:
                source = self._landing[i].copy_(source)   # 16-bit weights: cast on the host
            # without a stream the weights are host memory too: copy_ casts them in one pass
            with _on(self._stream):
                self._params[i].copy_(source, non_blocking=self._pin)   # host -> device
            self.bytes_up += _nbytes(self._params[i])

    def _host_only(self, indices: list[int], grads: list) -> None:
        """delay=1, in the background thread: the host step only (the weights go up later)."""
        self._wait()                               # the copies up that read the masters ended
        start = time.perf_counter()  # host clock
        self._host_step(indices, grads)
        self._late = (indices, time.perf_counter() - start)  # host clock

    def _finish_background(self) -> None:
        if self._background is None:
            return
        background, self._background = self._background, None
        background.result()                        # re-raises what the thread raised
        indices, seconds = self._late
        self._times["host_step"] += seconds        # ran behind forward and backward
        start = time.perf_counter()  # host clock
        self._copy_up(indices)
        if self._stream is not None:
            torch.cuda.current_stream(self._params[0].device).wait_stream(self._stream)
        self._times["copy_up"] += time.perf_counter() - start  # host clock

    def _swap_landing(self) -> None:
        """delay=1: the next backward of fp32 weights lands in the other gradient buffer, while
        the host steps with this one (16-bit weights land in their 16-bit buffer, which the host
        reads only after this step has finished)."""
        for i in range(len(self._params)):
            if self._landing[i] is self._grads[i]:
                self._grads[i], self._spare[i] = self._spare[i], self._grads[i]
                self._landing[i] = self._grads[i]

    def synchronize(self) -> None:
        """delay=1: finish the host step in flight and copy its weights up (before evaluating,
        saving, or reading the weights). Nothing to do with delay=0."""
        if self._background is not None:
            self._finish_background()
            self._wait()

    def host_weights(self) -> list[torch.Tensor]:
        """The fp32 masters on the host once the host step in flight (delay=1) has ended: every
        update so far. Unlike `synchronize()` nothing goes up, so training goes on as it would
        have (with delay=1 the next forward still uses the weights one update older)."""
        if self._background is not None:
            self._background.result()              # the thread's host step is done
        return list(self.master_params)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the host gradients so that their total norm is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` does on the device; returns the norm before clipping.
        Call it between backward and step.

            >>> model.loss(x, y).backward(); opt.clip_grad_norm_(1.0); opt.step()
        """
        self._wait()                               # host-device sync: the gradients have landed
        for i in range(len(self._params)):
            self._drain(i)
        grads = [g for g, has in zip(self._grads, self._has_grad) if has]
        if not grads:
            raise RuntimeError("no gradients to clip: call clip_grad_norm_ after backward")
        with on_host():
            total = torch.nn.utils.get_total_norm(grads, norm_type)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)   # the same rule as PyTorch
            torch._foreach_mul_(grads, coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients on the host (and any on the device)."""
        super().zero_grad(set_to_none)
        self._has_grad = [False] * len(self._params)
        self._pending = [None] * len(self._params)

    def state_dict(self) -> dict:
        """The host optimizer's state (moments, step counts) and hyperparameters."""
        self.synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict()` returned (moments onto the host masters, hyperparameters).

            >>> new = CPUOffloadOptimizer(model.parameters()); new.load_state_dict(old.state_dict())

        Simplified vs DeepSpeed: the masters are not in it; they are copied from the device
        weights when the optimizer is created, so load the model's weights first."""
        self.synchronize()
        self.optimizer.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})

    def remove_hooks(self) -> None:
        """Stop moving gradients down (the hooks stay on the parameters otherwise)."""
        _remove(self._hooks)
        self._hooks.clear()


class Link:
    """The host-device link as an offloaded step uses it. `copy(dst, src)` queues a copy and
    returns: on CUDA it is `dst.copy_(src, non_blocking=True)` on the current stream, which into
    or out of pinned memory returns before a byte has moved; `synchronize()` waits until every
    queued copy has landed. Until then a host destination holds whatever it held before, and the
    host reads it at its peril: the GPU keeps its own order (work queued on the same stream after
    a copy runs after it), the host does not.

        >>> link = Link(device)
        >>> link.copy(host_buffer, p.grad)        # device -> host, queued
        >>> link.synchronize()                     # now host_buffer holds the gradient

    `copies` and `bytes` count what was queued. On a CPU, copies are done on return."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device if device is not None else "cpu")
        self.copies = self.bytes = 0

    @staticmethod
    def _check(dst, src) -> None:
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            raise TypeError(f"Link.copy(dst, src) takes two tensors, got "
                            f"{type(dst).__name__} and {type(src).__name__}")
        if dst.shape != src.shape:
            raise ValueError(f"Link.copy: dst has shape {tuple(dst.shape)}, src "
                             f"{tuple(src.shape)}: copy each tensor into its own buffer")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        self._check(dst, src)
        with torch.no_grad():
            dst.copy_(src, non_blocking=True)
        self.copies += 1
        self.bytes += _nbytes(src)
        return dst

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()    # host-device sync


def schedule_groups(ready, down, step, up, *, barrier: bool = False
                    ) -> dict[tuple[str, int], float]:
    """Start times of the offloaded step's three stages for each parameter group g, as early as
    each resource allows: the copy down of g (on the device-to-host link, after backward made
    its gradients at `ready[g]`), its host step (on the CPU, once its copy has landed) and its
    copy up (on the host-to-device link, once its step is done). Groups go in the order given;
    each resource does one thing at a time; the two directions of the link are separate
    (PCIe is full duplex). `barrier`: the step clips by the global gradient norm or checks for
    inf/NaN (fp16 loss scaling), so no host step starts before the last copy down has landed
    (DeepSpeed's ZeRO-Offload step). Returns {("down", g): start, ("step", g): start,
    ("up", g): start}.

        >>> schedule_groups([0, 1], [1, 1], [2, 2], [1, 1])[("up", 1)]
        5.0
        >>> schedule_groups([0, 1], [1, 1], [2, 2], [1, 1], barrier=True)[("up", 1)]
        6.0"""
    ready, stages = _durations("ready", ready), [_durations(n, v) for n, v in
                                                 (("down", down), ("step", step), ("up", up))]
    if any(len(v) != len(ready) for v in stages):
        raise ValueError("ready, down, step and up need one value per group each, got lengths "
                         f"{[len(ready)] + [len(v) for v in stages]}")
    out, free, landed = {}, [0.0, 0.0, 0.0], []    # when each resource is next free
    for g, at in enumerate(ready):                 # 1. the copies down, as backward makes them
        out[("down", g)] = start = max(at, free[0])
        free[0] = start + stages[0][g]
        landed.append(free[0])
    last = max(landed, default=0.0)
    for g in range(len(ready)):                    # 2. each host step, then its copy up
        at = last if barrier else landed[g]
        for r, (name, seconds) in enumerate(zip(("step", "up"), stages[1:]), 1):
            out[(name, g)] = start = max(at, free[r])
            at = free[r] = start + seconds[g]
    return out


def _durations(name: str, values) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a list of seconds, got {values!r:.80}") from None
    if any(not (math.isfinite(v) and v >= 0) for v in out):
        raise ValueError(f"{name} must hold finite, non-negative seconds, got {out}")
    return out


_BACKGROUND = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="offload-dpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_arena(t: torch.Tensor, arena: HostArena) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == b.untyped_storage().data_ptr() for b in arena.blocks)


def step_phases(loss_fn: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, *,
                steps: int = 5, device: torch.device | str | None = None) -> dict[str, float]:
    """Median seconds of each phase of `steps` training steps: forward (`loss_fn()`), backward,
    optimizer step; for a `CPUOffloadOptimizer` also its copy_down (the gradient hooks: part of
    backward), wait (for those copies at the start of step: part of step), host_step and copy_up
    (part of step). One warm-up step first (it allocates the state).

        >>> step_phases(lambda: model.loss(x, y), opt, steps=5, device="cuda")
        {'forward': 0.012, 'backward': 0.025, 'step': 0.004, ...}

    Simplified vs torch.profiler: wall-clock medians with a host-device sync around each phase
    (the syncs remove the overlap between phases that real training has), no per-kernel view."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    device = device if device is not None else "cpu"
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for n in range(steps + 1):
        t0 = now(device)                           # host-device sync around each phase
        loss = loss_fn()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return the loss tensor, got {type(loss).__name__}")
        t1 = now(device)
        loss.backward()
        t2 = now(device)
        optimizer.step()
        t3 = now(device)
        optimizer.zero_grad()
        if n:                                      # the first step is the warm-up
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(seconds)
    out = {name: statistics.median(values) for name, values in times.items()}
    for name in getattr(optimizer, "step_times", [{}])[-1]:
        out[name] = statistics.median(s[name] for s in optimizer.step_times[-steps:])
    return out


def _grad_hook(owner: weakref.ref, i: int, p: torch.Tensor) -> None:
    optimizer = owner()
    if optimizer is not None:
        optimizer._copy_down(i, p)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _starts(groups: list[dict]) -> list[int]:
    """Index of each group's first parameter in the flat list of every group's parameters."""
    return list(itertools.accumulate((len(g["params"]) for g in groups), initial=0))[:-1]


def _check_params(params: list[torch.Tensor]) -> None:
    for p in params:
        if not (p.is_floating_point() and p.requires_grad):
            raise ValueError(f"every parameter must be a floating-point tensor that requires "
                             f"grad; got {p.dtype} with requires_grad={p.requires_grad}: pass only "
                             "the trainable ones, [p for p in model.parameters() if p.requires_grad]")
    if len({p.device for p in params}) > 1:
        devices = sorted({str(p.device) for p in params})
        raise ValueError(f"parameters on several devices ({devices}): one CPUOffloadOptimizer "
                         "per device")
