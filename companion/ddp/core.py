"""Distributed data parallel from scratch: gradient hooks, buckets, and overlap with backward.

Each of N processes holds a full copy of the model and trains on its own slice of the batch. After
backward the gradients must be averaged over ranks, so that every copy takes the same step.

- Naive (`average_gradients`): after backward, one all-reduce per parameter. Correct, but the
  network idles during backward and the GPU idles during communication, and many small messages
  each pay a fixed latency.
- `DDP` (Li et al., "PyTorch Distributed", VLDB 2020): parameters are grouped into buckets of about
  `bucket_cap_mb`; a hook on each parameter notes when its gradient is final, and when a bucket is
  complete its all-reduce starts *asynchronously* while backward goes on with earlier layers.

Memory: each rank keeps full weights, gradients and optimizer state (data parallelism saves none;
chapter 07's ZeRO shards them), plus the buckets: one more copy of the gradients, unless
`gradient_as_bucket_view=True` makes every `param.grad` a view into its bucket (autograd then
accumulates straight into the bucket, and the copy disappears). Communication: one all-reduce of
all gradients per step, 2(N-1)/N·S bytes per rank with a ring.

Example (inside a rank started by `companion.launch.run`):
    >>> model = DDP(make_model(), bucket_cap_mb=1.0)       # doctest: +SKIP
    >>> loss_fn(model(x), y).backward()                      # buckets all-reduce during backward
    >>> model.finish_gradient_synchronization()             # wait for the last ones
    >>> optimizer.step()

Simplified vs PyTorch: buckets are filled in reverse parameter order and a bucket is closed
before the parameter that would take it past the cap (a parameter larger than the cap gets a
bucket of its own); PyTorch closes a bucket once it has reached the cap (so buckets can exceed it)
and makes the first bucket small (1 MiB) so communication starts sooner. No bucket rebuilding
from the order seen in the first step, no find_unused_parameters (a parameter without a gradient
contributes zeros and then receives the average), and finishing is explicit, where torch queues
it at the end of backward. Wrapping a module again (a cell run twice) moves its gradient hooks to
the new wrapper, and the old one refuses to run; PyTorch's DDP would keep both wrappers' hooks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from companion.hooks import OwnedHooks

__all__ = ["DDP", "SyncStats", "BucketTimes", "average_gradients", "broadcast_parameters",
           "accumulation_step"]


@dataclasses.dataclass
class SyncStats:
    """How many all-reduces a rank started, and how many bytes they carried in total."""

    all_reduces: int = 0
    bytes: int = 0


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank, so all replicas start identical."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, dist.get_global_rank(group, 0) if group else 0,
                           group=group)                                   # collective


def average_gradients(module: nn.Module, group=None) -> None:
    """The naive DDP step: after backward, all-reduce each gradient and divide by the world size."""
    world = dist.get_world_size(group)
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)                      # collective, blocking
            param.grad /= world


@dataclasses.dataclass
class BucketTimes:
    """When one step's communication happened, in seconds since that step's forward began."""

    backward_end: float = 0.0                     # the last gradient hook of the backward
    buckets: list = dataclasses.field(default_factory=list)   # (bucket, bytes, start, end) each


@dataclasses.dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor                 # (sum of numels,) one buffer that is all-reduced at once
    views: list[torch.Tensor]          # slices of flat, one per parameter
    index: int = 0                     # its place in launch order
    ready: set = dataclasses.field(default_factory=set)
    work: object = None                # the async all-reduce's handle while it runs


class DDP(nn.Module):
    """Average gradients over ranks in buckets, overlapping the all-reduces with backward.

    Args:
        module: the model, identical architecture on every rank.
        bucket_cap_mb: the largest bucket in MiB. Small buckets start communicating sooner but pay
            more per-message latency; large ones overlap less.
        process_group: the group to average over (default: the whole world).
        gradient_as_bucket_view: make each `param.grad` a view into its bucket, so gradients are
            not stored twice (set at every forward; `zero_grad(set_to_none=True)` is fine).

    `last_times` (a `BucketTimes`) says when each bucket's all-reduce started and ended in the
    last step, against the end of its backward: the picture of overlap.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, process_group=None,
                 gradient_as_bucket_view: bool = False):
        super().__init__()
        self.module, self.process_group = module, process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.stats, self.last_times = SyncStats(), BucketTimes()
        self._sync, self._pending, self._next, self._t0 = True, False, 0, 0.0
        self._clock = _Marks(any(p.is_cuda for p in module.parameters()))
        broadcast_parameters(module, process_group)                       # 1. same start
        trainable = [p for p in module.parameters() if p.requires_grad]   # shared ones once
        self.buckets = _make_buckets(trainable[::-1], int(bucket_cap_mb * 2**20))  # 2. buckets
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._hooks = OwnedHooks(self, trainable, "_on_grad_ready")      # 3. one hook each

    def forward(self, *args, **kwargs):
        if self._hooks.replaced:
            raise RuntimeError("a newer DDP wraps this module's parameters (it took over their "
                               "gradient hooks): call the new wrapper, not this one")
        if self._pending:
            raise RuntimeError("gradients from the last backward are still being averaged: call "
                               "model.finish_gradient_synchronization() after backward, before "
                               "optimizer.step() and the next forward.")
        if self.gradient_as_bucket_view:
            self._point_grads_into_buckets()
        if self._sync:
            self._t0, self.last_times = self._clock.mark(), BucketTimes()
        return self.module(*args, **kwargs)

    def _point_grads_into_buckets(self) -> None:
        """Make every `param.grad` a view of its slice of the bucket (autograd then accumulates
        in place, into the bucket): a gradient set to None starts again from zero."""
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is None:
                    view.zero_()
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad.reshape(-1))
                else:
                    continue
                param.grad = view.view_as(param)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block, backward only accumulates local gradients (no communication)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Hook: `param.grad` is final for this backward. Launch every bucket that is complete."""
        if not self._sync:
            return
        self._pending = True
        self.last_times.backward_end = self._clock.mark()       # a mark: seconds in finish
        self._bucket_of[param].ready.add(param)
        while self._next < len(self.buckets) and self._is_full(self.buckets[self._next]):
            self._launch(self.buckets[self._next])      # in bucket order, the same on every rank
            self._next += 1

    @staticmethod
    def _is_full(bucket: _Bucket) -> bool:
        return len(bucket.ready) == len(bucket.params)

    def _launch(self, bucket: _Bucket) -> None:
        for param, view in zip(bucket.params, bucket.views):
            if param.grad is None:
                view.zero_()                            # unused in this step: contribute zeros
            elif param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad.reshape(-1))      # the copy a bucket view avoids
        bucket.flat.div_(self.world_size)               # average = sum of (grad / N)
        nbytes = bucket.flat.numel() * bucket.flat.element_size()
        times = [bucket.index, nbytes, self._clock.mark(), None]   # launched now
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group,
                                      async_op=True)    # collective, asynchronous
        self.stats.all_reduces += 1
        self.stats.bytes += nbytes
        self.last_times.buckets.append(times)
        bucket.work.get_future().then(                  # runs when the all-reduce completes;
            lambda _: times.__setitem__(3, self._clock.mark()))   # on CUDA, on NCCL's stream

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averages into `param.grad`."""
        if not self._pending:
            return
        for bucket in self.buckets[self._next:]:        # buckets with a parameter never used
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()                          # sync point: communication done
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is None:
                    param.grad = view.view_as(param).clone()
                elif param.grad.data_ptr() != view.data_ptr():
                    param.grad.copy_(view.view_as(param))
            bucket.ready.clear()
            bucket.work = None
        self._pending, self._next = False, 0
        self._clock.resolve(self.last_times, self._t0)


class _Marks:
    """Points in time for `BucketTimes`. On the CPU, the host clock. On CUDA, events recorded on
    the current stream: the host clock there would time launches (kernels and NCCL's all-reduces
    are queued, not done, when a call returns), and an all-reduce's `.then()` callback runs as
    soon as the collective is queued, with NCCL's stream current, so an event recorded in it
    completes when the all-reduce does. `resolve` turns marks into seconds after a sync."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()                  # host clock: CPU work is synchronous
        event = torch.cuda.Event(enable_timing=True)
        event.record()                                  # on the current stream
        return event

    def resolve(self, times: BucketTimes, t0) -> None:
        """Replace every mark in `times` by its seconds since `t0`."""
        if self.cuda:
            torch.cuda.synchronize()                    # host-device sync: every event done
        since = (lambda m: t0.elapsed_time(m) / 1000) if self.cuda else (lambda m: m - t0)
        times.backward_end = since(times.backward_end)
        for row in times.buckets:
            row[2] = since(row[2])
            row[3] = since(row[3]) if row[3] is not None else None   # callback not run yet


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Group parameters, in the order given, into buckets of one dtype each, starting a new
    bucket when the next parameter would take it past cap_bytes: every bucket holds at most
    cap_bytes, except that a parameter larger than the cap gets a bucket of its own."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if not groups or size + nbytes > cap_bytes or groups[-1][0].dtype != param.dtype:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += nbytes
    buckets = []
    for group in groups:
        flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                           device=group[0].device)
        views = list(torch.split(flat, [p.numel() for p in group]))
        buckets.append(_Bucket(group, flat, views, index=len(buckets)))
    return buckets


def accumulation_step(model: DDP, micro_batches: list, loss_fn: Callable,
                      optimizer: torch.optim.Optimizer) -> float:
    """One optimizer step over k micro-batches, communicating only after the last backward.

    Each micro-batch's loss is divided by k, so the accumulated gradient is the mean over all of
    them; `no_sync` skips the all-reduce for the first k-1 backwards. Returns the mean loss.
    """
    k, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total += float(loss.detach())
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()
    return total
