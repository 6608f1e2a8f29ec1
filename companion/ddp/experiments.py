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

__all__ = ["time_training_step", "profile_buckets", "step_memory", "concurrent_all_reduces"]


def time_training_step(rank: int, world_size: int, impl: str, width: int, depth: int, batch: int,
                       steps: int, bucket_cap_mb: float = 25.0, micro_steps: int = 1,
                       use_no_sync: bool = True) -> dict:
    """A worker for `launch.run`: train an MLP (depth Linear+ReLU layers of `width`) on `batch`
    rows per rank and micro-step, and return the median seconds per optimizer step of `steps`
    timed steps (after one warm-up step), the fastest and slowest of them, every step's seconds
    ("times", for `companion.cost.stats.compare`), and the bytes all-reduced per step.
    impl: "ours", "torch", "naive" or "none" (every rank trains on its own, no communication:
    what the ranks cost each other by sharing the machine)."""
    torch.manual_seed(0)
    device = rank_device()
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    model.to(device)
    if impl == "ours":
        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb)
    elif impl == "torch":
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    elif impl in ("naive", "none"):
        broadcast_parameters(model)
        wrapped = model
    else:
        raise ValueError(f"impl must be 'ours', 'torch', 'naive' or 'none', got {impl!r}")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    seconds = []
    for _ in range(steps + 1):
        dist.barrier()
        start = now(device)                                               # host-device sync
        for i in range(micro_steps):
            skip = use_no_sync and i < micro_steps - 1 and impl not in ("naive", "none")
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

    One copy of the model per cap, stepped in `steps` interleaved rounds after a warm-up round:
    each round runs one step at every cap and one `loss.backward()` with no communication (under
    no_sync), in a new random order (`cost.stats.round_order`, the same on every rank), so a slow
    moment of the machine falls on every cap rather than on one.

    Returns the model's gradient bytes and number of tensors, the median seconds of the
    `loss.backward()` call with no communication (with every one, "backward_alone"), and per cap:
    buckets, the median step seconds with the fastest, the slowest and every one, the median
    seconds of the `loss.backward()` call while buckets are launched, and the last step's
    `BucketTimes`. Both backward times run from the call to its return, so they compare like with
    like.
    """
    from companion.cost import stats

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(depth)
                               for m in (nn.Linear(width, width, bias=False), nn.ReLU())])

    device = rank_device()
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    models = [make_model().to(device) for _ in caps_mb]
    wrapped = [DDP(m, bucket_cap_mb=cap, gradient_as_bucket_view=True)
               for m, cap in zip(models, caps_mb)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-4) for m in models]
    out = {"gradient_bytes": sum(p.numel() * p.element_size() for p in models[0].parameters()),
           "parameters": len(list(models[0].parameters())), "caps": {}}
    step_s = [[] for _ in caps_mb]
    backward_s = [[] for _ in caps_mb]
    local: list[float] = []

    def alone():
        with wrapped[0].no_sync():
            loss = nn.functional.mse_loss(wrapped[0](x), y)
            dist.barrier()                                                # start together
            start = now(device)                                           # host-device sync
            loss.backward()
            seconds = now(device) - start                                 # host-device sync
        optimizers[0].zero_grad()
        return seconds

    for r in range(steps + 1):                                   # round 0: warm-up, untimed
        for i in stats.round_order(len(caps_mb) + 1, r):
            if i == len(caps_mb):
                seconds = alone()
                if r:
                    local.append(seconds)
                continue
            whole, backward = _timed_steps(wrapped[i], optimizers[i], x, y, 1)
            if r:
                step_s[i] += whole
                backward_s[i] += backward
    for i, cap in enumerate(caps_mb):
        out["caps"][cap] = {"buckets": len(wrapped[i].buckets), "times": wrapped[i].last_times,
                            "seconds": statistics.median(step_s[i]), "fastest": min(step_s[i]),
                            "slowest": max(step_s[i]), "step_times": step_s[i],
                            "backward_seconds": statistics.median(backward_s[i]),
                            "backward_times": backward_s[i]}
    out["backward_seconds"] = statistics.median(local)
    out["backward_alone"] = local
    return out


def concurrent_all_reduces(rank: int, world_size: int, large_bytes: int, small_bytes: int,
                           trials: int = 5) -> dict:
    """A worker for `launch.run`: does gloo run two asynchronous all-reduces one after the other,
    or at once? Each trial launches an all-reduce of `large_bytes`, then one of `small_bytes`
    (float32), waits for the small one only and notes whether the large one is still in flight,
    then waits for it; and times each of the two alone. Returns, on this rank, how many trials
    found the large one still running when the small one had finished, whether both sums came
    out right once both were waited for, the median seconds from the launches to each completion,
    and each alone."""
    device = rank_device()
    large = torch.ones(max(large_bytes // 4, 1), device=device)
    small = torch.ones(max(small_bytes // 4, 1), device=device)
    dist.all_reduce(large)                                                # warm-up
    dist.all_reduce(small)                                                # warm-up
    overtaken, small_done, large_done, large_alone, small_alone = 0, [], [], [], []
    summed = True
    for _ in range(trials):
        large.fill_(1.0)
        small.fill_(1.0)
        dist.barrier()
        start = now(device)                                               # host-device sync
        first = dist.all_reduce(large, async_op=True)
        second = dist.all_reduce(small, async_op=True)
        second.wait()
        small_done.append(now(device) - start)                            # host-device sync
        still = not first.is_completed()
        overtaken += still
        first.wait()
        large_done.append(now(device) - start)                            # host-device sync
        summed &= bool((large == world_size).all() and (small == world_size).all())
        for tensor, into in ((large, large_alone), (small, small_alone)):
            dist.barrier()
            start = now(device)                                           # host-device sync
            dist.all_reduce(tensor)                                       # collective
            into.append(now(device) - start)                              # host-device sync
    med = statistics.median
    return {"trials": trials, "overtaken": overtaken, "summed": summed,
            "small_done": med(small_done),
            "large_done": med(large_done), "large_alone": med(large_alone),
            "small_alone": med(small_alone)}


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
