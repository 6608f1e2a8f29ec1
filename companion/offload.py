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

Simplified vs DeepSpeed (ZeRO-Offload): one process (no ZeRO partitioning across ranks), a copy per
parameter instead of contiguous buckets, PyTorch's fused CPU optimizer instead of DeepSpeed's
CPUAdam, and no one-step delayed update (which overlaps the CPU step with the next forward).
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
import weakref
from typing import Callable, Iterable

import torch

from companion.activation_offload import (OffloadActivations, can_pin, offload_activations,
                                          to_device, to_host)
from companion.cost.clock import now
from companion.placement import on_host

__all__ = ["to_host", "to_device", "CPUOffloadOptimizer", "OffloadActivations",
           "offload_activations", "step_phases"]


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


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """ZeRO-Offload for one device: the weights stay on the device, everything else on the host.

    Memory, per parameter with AdamW: device 4 bytes (fp32 weights) or 2 (16-bit weights);
    host 4 (fp32 master) + 4 (fp32 gradient) + 8 (two moments), + 2 for the 16-bit copy sent up
    when the weights are 16-bit. Cost per step: gradients down and weights up over the
    host-device link, and the optimizer on the CPU. In fp32 training equals `optimizer_cls` on
    the device when both use the same implementation (fused, foreach or loop): bit for bit on a
    CPU-only machine, within rounding against a GPU's kernels.

        >>> opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
        >>> for x, y in data:
        ...     model.loss(x, y).backward(); opt.step(); opt.zero_grad()

    Args: `params` (tensors or param groups, like any optimizer), `optimizer_cls` (run on the host;
    `fused=True` is chosen when it supports it, else `foreach=True`), `pin_memory` (default: when
    the weights are on CUDA), `**defaults` for optimizer_cls (lr, betas, weight_decay, ...).
    Create it after loading the weights: the masters are copied from them here.

    Gradient clipping: after backward the gradients are on the host and the device's `p.grad` is
    None, so `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` clips nothing (and returns
    0). Call `opt.clip_grad_norm_(max_norm)` between backward and step instead.
    One optimizer per set of parameters: its hooks stay on them until `remove_hooks()` (or until
    it is garbage-collected); call it before creating another.

    Simplified vs DeepSpeed: see the module docstring. `step_times` holds, per step, the seconds
    spent in the gradient hooks (`copy_down`, inside backward), waiting for their copies at the
    start of step (`wait`, inside step), stepping on the host and copying up (issue time on CUDA
    unless `profile`).
    """

    def __init__(self, params: Iterable, optimizer_cls: type = torch.optim.AdamW, *,
                 pin_memory: bool | None = None, profile: bool = False, **defaults):
        if isinstance(params, (torch.Tensor, torch.nn.Module)):
            raise TypeError("CPUOffloadOptimizer takes an iterable of parameters: pass "
                            "model.parameters(), not the model or one tensor")
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
        self.profile, self.step_times = profile, []
        self._times = dict.fromkeys(("copy_down", "wait", "host_step", "copy_up"), 0.0)
        self.master_params, self._grads, self._staging, self._has_grad = [], [], [], []
        self._hooks: list = []
        self._host_copies(self._params)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": self.master_params[start:start + len(g["params"])]}
                  for g, start in zip(self.param_groups, _starts(self.param_groups))]
        self.optimizer = _fastest(optimizer_cls, groups, defaults)   # runs on the host
        weakref.finalize(self, _remove, self._hooks)

    def _host_copies(self, params: list[torch.Tensor]) -> None:
        """Host buffers and a gradient hook for each of `params` (appended to the lists)."""
        # 1. On the host: an fp32 master copy of each weight, a gradient buffer, and for 16-bit
        #    weights a 16-bit copy to send up (half the bytes on the link).
        first = len(self.master_params)
        masters = [self._host_master(i, p) for i, p in enumerate(params, first)]
        self.master_params += masters
        self._grads += [self._host_empty(m, torch.float32) for m in masters]
        self._staging += [self._host_empty(p, p.dtype) if p.dtype != torch.float32 else None
                          for p in params]
        self._has_grad += [False] * len(params)
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
        super().add_param_group(param_group)        # checks duplicates, fills defaults
        group = self.param_groups[-1]
        _check_params(self._params + group["params"])
        self._params += group["params"]
        self._host_copies(group["params"])
        self.optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                        "params": self.master_params[-len(group["params"]):]})

    def _host_master(self, index: int, p: torch.Tensor) -> torch.Tensor:
        return to_host(p.detach(), dtype=torch.float32, pin_memory=self._pin)

    def _host_empty(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with on_host():
            return torch.zeros(like.shape, dtype=dtype, pin_memory=self._pin)

    def _copy_down(self, i: int, p: torch.Tensor) -> None:
        """Runs inside backward when p.grad is complete: move it to the host, free it here."""
        start, host, grad = time.perf_counter(), self._grads[i], p.grad  # host clock
        if grad is None:
            raise RuntimeError(f"parameter {i} has no gradient when this optimizer's hook runs: "
                               "another CPUOffloadOptimizer on the same parameters moved it first. "
                               "Call old.remove_hooks() (or old.close()) before creating a new one")
        if self._has_grad[i]:                      # a second backward before step: accumulate
            self._wait()                           # host-device sync
            with on_host():
                host.add_(grad.to("cpu", torch.float32))           # device -> host, then add
        elif self._stream is None:
            host.copy_(grad)                                       # device -> host
        else:
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._stream):
                host.copy_(grad, non_blocking=True)                # device -> host, async
            grad.record_stream(self._stream)       # not reused before the copy has read it
        self._has_grad[i] = True
        p.grad = None                              # the device keeps only the weights
        self._times["copy_down"] += time.perf_counter() - start  # host clock

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()             # host-device sync: every copy has landed

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Wait for the gradients, step on the host, copy the weights up. Returns closure()."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()  # host clock
        self._wait()                               # 1. every gradient is on the host
        self._times["wait"] += time.perf_counter() - start  # host clock
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})   # lr schedules
        self._update(list(range(len(self._params))))                 # 2. and 3.
        self.step_times.append(dict(self._times))
        self._times = dict.fromkeys(self._times, 0.0)
        return loss

    def _update(self, indices: list[int]) -> None:
        """Step the host optimizer over the masters in `indices` that have a gradient, and copy
        those weights up to the device."""
        start, chosen = time.perf_counter(), set(indices)  # host clock
        for i, (master, grad) in enumerate(zip(self.master_params, self._grads)):
            master.grad = grad if i in chosen and self._has_grad[i] else None   # None: skipped
        with on_host():
            self.optimizer.step()                  # on the CPU: fused AdamW when available
        middle = time.perf_counter()  # host clock
        if self._stream is not None:               # kernels still reading the weights go first
            self._stream.wait_stream(torch.cuda.current_stream(self._params[0].device))
        for i in [i for i in indices if self._has_grad[i]]:
            source = self.master_params[i]
            if self._staging[i] is not None:       # 16-bit weights: cast on the host
                source = self._staging[i].copy_(source)
            with _on(self._stream):
                self._params[i].copy_(source, non_blocking=self._pin)   # host -> device
        if self._stream is not None:               # the next forward waits for the weights
            torch.cuda.current_stream(self._params[0].device).wait_stream(self._stream)
            if self.profile:
                self._wait()                       # host-device sync, for honest timings
        self._times["host_step"] += middle - start
        self._times["copy_up"] += time.perf_counter() - middle  # host clock

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the host gradients so that their total norm is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` does on the device; returns the norm before clipping.
        Call it between backward and step.

            >>> model.loss(x, y).backward(); opt.clip_grad_norm_(1.0); opt.step()
        """
        self._wait()                               # host-device sync: the gradients have landed
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

    def state_dict(self) -> dict:
        """The host optimizer's state (moments, step counts) and hyperparameters."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict()` returned (moments onto the host masters, hyperparameters).

            >>> new = CPUOffloadOptimizer(model.parameters()); new.load_state_dict(old.state_dict())

        Simplified vs DeepSpeed: the masters are not in it; they are copied from the device
        weights when the optimizer is created, so load the model's weights first."""
        self.optimizer.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})

    def remove_hooks(self) -> None:
        """Stop moving gradients down (the hooks stay on the parameters otherwise)."""
        _remove(self._hooks)
        self._hooks.clear()


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
    sizes = [len(g["params"]) for g in groups]
    return [sum(sizes[:k]) for k in range(len(sizes))]


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
