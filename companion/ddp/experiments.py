"""Measuring DDP on real ranks: workers for `companion.launch.run` that time a training step, time
it against the bucket size (with each bucket's all-reduce on a timeline), and measure what the
buckets cost in memory. Used by chapter 06 and benchmarks/bench_ddp.py."""
from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist
from torch import nn

from companion.ddp.core import DDP, average_gradients, broadcast_parameters
from companion.cost.clock import now
from companion.launch import rank_device

__all__ = ["time_training_step", "profile_buckets", "step_memory"]


def time_training_step(rank: int, world_size: int, impl: str, width: int, depth: int, batch: int,
                       steps: int, bucket_cap_mb: float = 25.0, micro_steps: int = 1,
                       use_no_sync: bool = True) -> dict:
    """A worker for `launch.run`: train an MLP (depth Linear+ReLU layers of `width`) on `batch`
    rows per rank and micro-step, and return the median seconds per optimizer step of `steps`
    timed steps (after one warm-up step), the fastest and slowest of them, every step's seconds
    ("times", for `companion.cost.stats.compare`), and the bytes all-reduced per step.
    impl: "ours", "torch" or "naive"."""
    torch.manual_seed(0)
    device = rank_device()
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    model.to(device)
    if impl == "ours":
        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb)
    elif impl == "torch":
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    else:
        broadcast_parameters(model)
        wrapped = model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    seconds = []
    for _ in range(steps + 1):
        dist.barrier()
        start = now(device)                                               # host-device sync
        for i in range(micro_steps):
            skip = use_no_sync and i < micro_steps - 1 and impl != "naive"
            with wrapped.no_sync() if skip else contextlib.nullcontext():
                nn.functional.mse_loss(wrapped(x), y).backward()
            if impl == "ours":
                wrapped.finish_gradient_synchronization()     # a no-op after a no_sync pass
        if impl == "naive":
            average_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(now(device) - start)                               # host-device sync
    sent = wrapped.stats.bytes / (steps + 1) if impl == "ours" else None
    return {"seconds": statistics.median(seconds[1:]), "fastest": min(seconds[1:]),
            "slowest": max(seconds[1:]), "times": seconds[1:], "all_reduce_bytes": sent}


def profile_buckets(rank: int, world_size: int, width: int, depth: int, batch: int,
                    caps_mb: list[float], steps: int = 5) -> dict:
    """A worker for `launch.run`: an MLP of `depth` bias-free Linear(width, width) + ReLU layers
    (equal gradients, so that buckets are equal too) trained with our DDP at each bucket cap.

    Returns the model's gradient bytes and number of tensors, the median seconds of a
    `loss.backward()` call with no communication (under no_sync), and per cap: buckets, the
    median step seconds (after a warm-up step) with the fastest and slowest, the median seconds
    of the `loss.backward()` call while buckets are launched, and the last step's `BucketTimes`.
    Both backward times run from the call to its return, so they compare like with like.
    """
    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(depth)
                               for m in (nn.Linear(width, width, bias=False), nn.ReLU())])

    device = rank_device()
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    model = make_model().to(device)
    out = {"gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "parameters": len(list(model.parameters())), "caps": {}}
    for cap in caps_mb:
        model = make_model().to(device)            # a fresh one: DDP's hooks stay on a model
        wrapped = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        steps_s, backward_s = _timed_steps(wrapped, optimizer, x, y, steps + 1)
        out["caps"][cap] = {"buckets": len(wrapped.buckets), "times": wrapped.last_times,
                            "seconds": statistics.median(steps_s[1:]), "fastest": min(steps_s[1:]),
                            "slowest": max(steps_s[1:]), "step_times": steps_s[1:],
                            "backward_seconds": statistics.median(backward_s[1:]),
                            "backward_times": backward_s[1:]}
    local = []
    for _ in range(steps):
        with wrapped.no_sync():
            loss = nn.functional.mse_loss(wrapped(x), y)
            start = now(device)                                           # host-device sync
            loss.backward()
            local.append(now(device) - start)                             # host-device sync
        optimizer.zero_grad()
    out["backward_seconds"] = statistics.median(local)
    out["backward_alone"] = local
    return out


def _timed_steps(wrapped: DDP, optimizer, x: torch.Tensor, y: torch.Tensor,
                 steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each whole step, and of each step's `loss.backward()` call."""
    seconds, backward = [], []
    for _ in range(steps):
        dist.barrier()                                                    # start together
        start = now(x.device)                                             # host-device sync
        loss = nn.functional.mse_loss(wrapped(x), y)
        before = now(x.device)                                            # host-device sync
        loss.backward()                            # buckets launch from the hooks in here
        backward.append(now(x.device) - before)                           # host-device sync
        wrapped.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()                      # the next forward points .grad into buckets
        seconds.append(now(x.device) - start)                             # host-device sync
    return seconds, backward


def step_memory(rank: int, world_size: int, width: int, depth: int, batch: int,
                gradient_as_bucket_view: bool) -> dict:
    """A worker for `launch.run`: bytes one rank holds after two DDP steps of an MLP, measured with
    `companion.memory.track` from before DDP is built, with the tracker's breakdown by kind.

    The parameters show up in it too (DDP's broadcast of rank 0's parameters hands them to the
    tracker), so held = parameters + gradients + buckets when the buckets are a copy, and
    parameters + gradients when `gradient_as_bucket_view` makes the gradients the buckets."""
    from companion.memory import track

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    with track("cpu") as tracker:
        wrapped = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
        for _ in range(2):                       # the second step reuses what the first made
            nn.functional.mse_loss(wrapped(x), y).backward()
            wrapped.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    buckets = sum(b.flat.numel() * b.flat.element_size() for b in wrapped.buckets)
    return {"held": tracker.current, "buckets": buckets, "by_kind": tracker.breakdown("current"),
            "gradients": sum(p.numel() * p.element_size() for p in model.parameters())}
