"""The three collectives ZeRO needs, on one process group, each counting the bytes it moves.

- all-gather: every rank contributes its shard (s elements), every rank receives the full N·s.
- reduce-scatter: every rank contributes a full N·s tensor, rank r receives the sum of chunk r.
- all-reduce: every rank contributes a tensor and receives the sum (DDP, replicated parameters).

`Comm.traffic` counts the bytes this rank sends. With `ring=True` every collective runs on
`companion.collectives`' ring of point-to-point sends and each `isend` is counted: a measurement.
With `ring=False` (the default) torch's collectives run (gloo or NCCL, asynchronous, their own
algorithms) and the counter adds what a ring would send, (N-1)/N of the full tensor for a gather
or scatter, 2(N-1)/N for an all-reduce; tests hold the two counts equal. `Comm.payload` adds up the
full tensors handed to each kind of collective (the paper's Ψ, in bytes). `count_collectives()`
counts the same payload for code that calls torch.distributed directly (FSDP2, ZeroRedundancy-
Optimizer).

Example (inside a rank started by `companion.launch.run`):
    >>> comm = Comm(ring=True)
    >>> full = torch.empty(comm.world_size * 4)
    >>> comm.all_gather(full, torch.ones(4)).wait()          # doctest: +SKIP
    >>> comm.traffic.sent_bytes                               # (N-1)·16 bytes

Simplified vs PyTorch: the ring is synchronous (its `wait()` returns at once); torch's collectives
overlap with computation. `reduce_scatter` always sums; callers divide to average.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from companion import collectives
from companion.collectives import Traffic
from companion.compat import all_gather_tensor, reduce_scatter_tensor

__all__ = ["Comm", "count_collectives"]


class _Done:
    """The handle of a collective that has already finished (the synchronous ring)."""

    def wait(self) -> bool:
        return True


class Comm:
    """Collectives over `group` (default: the whole world) with byte counters.

    Args:
        group: the process group.
        ring: run on companion.collectives' ring (counted at each send) instead of torch's.
    """

    def __init__(self, group=None, *, ring: bool = False):
        self.group, self.ring = group, ring
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.traffic = Traffic()
        self.payload: collections.Counter = collections.Counter()   # kind -> bytes of full tensors

    def reset(self) -> None:
        """Zero the counters (e.g. before the step to be measured)."""
        self.traffic, self.payload = Traffic(), collections.Counter()

    def _count(self, kind: str, full: torch.Tensor, ring_share: float):
        nbytes = full.numel() * full.element_size()
        self.payload[kind] += nbytes
        if not self.ring:                      # what a ring sends; the ring counts its own sends
            self.traffic.sent_bytes += int(round(ring_share * nbytes))
            self.traffic.received_bytes += int(round(ring_share * nbytes))
            self.traffic.messages += 2 * (self.world_size - 1) if kind == "all_reduce" \
                else self.world_size - 1

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False,
                   count: bool = True):
        """Every rank's `shard` (s elements) into `full` (N·s, rank order). `shard` may be a
        view of full's own chunk (in place). count=False leaves the counters alone."""
        if count:
            self._count("all_gather", full, (self.world_size - 1) / self.world_size)
        if self.ring:
            collectives.ring_all_gather(full, shard, self.group,
                                        stats=self.traffic if count else None)
            return _Done()
        work = all_gather_tensor(full, shard, group=self.group, async_op=async_op)  # collective
        return work if async_op else _Done()

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, *, async_op: bool = False):
        """Sum `full` (N·s) over ranks; chunk r of the sum lands in rank r's `shard` (s)."""
        self._count("reduce_scatter", full, (self.world_size - 1) / self.world_size)
        if self.ring:
            collectives.ring_reduce_scatter(shard, full, self.group, stats=self.traffic)
            return _Done()
        work = reduce_scatter_tensor(shard, full, group=self.group,
                                     async_op=async_op)                          # collective
        return work if async_op else _Done()

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False):
        """Sum `tensor` over ranks, in place."""
        self._count("all_reduce", tensor, 2 * (self.world_size - 1) / self.world_size)
        if self.ring:
            collectives.ring_all_reduce(tensor, self.group, stats=self.traffic)
            return _Done()
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)     # collective
        return work if async_op else _Done()


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Inside, torch's all-gather, reduce-scatter, all-reduce and broadcast add the bytes of the
    full tensor they move (payload) to the yielded Counter, by kind. Works on any code that calls
    them through `torch.distributed` (ours with ring=False, FSDP2, ZeroRedundancyOptimizer)."""
    counter: collections.Counter = collections.Counter()
    full = {"all_gather_single": (0, "output_tensor", "all_gather"),       # where the full
            "all_gather_into_tensor": (0, "output_tensor", "all_gather"),  # tensor is passed
            "reduce_scatter_single": (1, "input", "reduce_scatter"),
            "reduce_scatter_tensor": (1, "input", "reduce_scatter"),
            "all_reduce": (0, "tensor", "all_reduce"),
            "broadcast": (0, "tensor", "broadcast")}
    saved = {n: getattr(dist, n) for n in full if hasattr(dist, n)}

    def counted(original, position, keyword, kind):
        def call(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs[keyword]
            counter[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(fn, *full[name]))
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
