"""The α–β model of communication: a message of n bytes takes α + β·n seconds.

α is the latency (the fixed cost of any message: software, synchronisation, the wire's delay) and
β the inverse bandwidth (seconds per byte). Two numbers, fitted to timed all-reduces of growing
size, predict what the chapter measures (Hockney 1994; Thakur, Rabenseifner & Gropp 2005, "Optimization
of Collective Communication Operations in MPICH", for the ring's cost):

- ring all-reduce of S bytes on N ranks: 2(N-1) steps of S/N bytes, 2(N-1)·α + 2(N-1)/N·S·β;
- ring reduce-scatter or all-gather of S bytes (the whole tensor): half of that, (N-1) steps;
- naive all-reduce: the root receives and then sends N-1 whole messages, 2(N-1)·(α + S·β);
- b buckets instead of one message: b times the latency, the same bandwidth term;
- and, with backward producing the gradients while buckets are sent, how much communication is
  left after backward ends (`exposed_seconds`), which picks the best bucket size;
- collectives in flight at once (`link_schedule`): NCCL runs a communicator's collectives one
  after another on its stream (one lane); gloo hands each to one of its worker threads, 2 by
  default (`ProcessGroupGloo::Options::threads`, `torch.distributed.ProcessGroupGloo._Options()
  ._threads` reads 2 in torch 2.13), so two run at once: their fixed costs overlap and their
  transfers share the link.

Example:
    >>> alpha, beta = fit_alpha_beta([1e3, 1e6, 1e7], [60e-6, 0.9e-3, 8.5e-3])   # one message
    >>> all_reduce_seconds(100 * 2**20, 4, alpha=alpha, beta=beta)            # 100 MiB, ring
    >>> residuals([1e3, 1e6, 1e7], [60e-6, 0.9e-3, 8.5e-3], alpha=alpha, beta=beta)  # how well

How good is a fit? Two numbers cannot follow a real transport everywhere: gloo switches protocol
with size, and caches and page faults change the slope. `residuals` gives the relative error per
size, which is what a chapter should show beside the fitted line.

Simplified vs real networks: one link per rank at one speed, no contention between links, no
pipelining inside a step (NCCL and gloo split big messages), and no tree algorithms (which trade
bandwidth for a log(N) latency term at small messages), and transfers in flight at once that
share the link evenly (`link_schedule`'s `sharing`).
"""
from __future__ import annotations

import statistics
from typing import Sequence

import torch
import torch.distributed as dist

from companion import collectives
from companion.compat import all_gather_tensor, reduce_scatter_tensor
from companion.cost import stats
from companion.cost.clock import now
from companion.launch import rank_device

__all__ = ["fit_alpha_beta", "fit_all_reduce", "residuals", "all_reduce_seconds",
           "reduce_scatter_seconds", "all_gather_seconds", "exposed_seconds", "best_bucket_count",
           "buckets", "bucketed_exposed", "link_schedule", "time_all_reduce_sizes",
           "time_collectives", "COLLECTIVES"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares (α, β) of seconds ≈ α + β·nbytes, weighting each point by 1/seconds so that
    small messages (which fix α) count as much as large ones (which fix β)."""
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("fit_alpha_beta needs paired sizes and times for at least two sizes")
    if min(seconds) <= 0 or min(nbytes) < 0:
        raise ValueError("times must be positive and sizes non-negative")
    n = torch.tensor(nbytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1) / t[:, None]     # relative errors
    alpha, beta = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution.flatten()
    return float(alpha), float(beta)


def all_reduce_seconds(nbytes: float, world_size: int, *, alpha: float, beta: float,
                       algorithm: str = "ring", buckets: int = 1) -> float:
    """Predicted seconds to all-reduce `nbytes` on `world_size` ranks, sent as `buckets` equal
    all-reduces one after another. algorithm: "ring" or "naive" (gather to a root, send back)."""
    if world_size < 1 or buckets < 1:
        raise ValueError("world_size and buckets must be at least 1")
    if world_size == 1:
        return 0.0
    N, S = world_size, nbytes / buckets
    if algorithm == "ring":
        one = 2 * (N - 1) * (alpha + S / N * beta)
    elif algorithm == "naive":
        one = 2 * (N - 1) * (alpha + S * beta)
    else:
        raise ValueError(f'algorithm must be "ring" or "naive", got {algorithm!r}')
    return buckets * one


def reduce_scatter_seconds(nbytes: float, world_size: int, *, alpha: float, beta: float) -> float:
    """Predicted seconds of a ring reduce-scatter of a whole tensor of `nbytes` (each rank ends
    with its 1/N, summed): N-1 steps of nbytes/N, (N-1)·α + (N-1)/N·nbytes·β."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    N = world_size
    return (N - 1) * (alpha + nbytes / N * beta)


def all_gather_seconds(nbytes: float, world_size: int, *, alpha: float, beta: float) -> float:
    """Predicted seconds of a ring all-gather that rebuilds a tensor of `nbytes` from its N
    shards: the same N-1 steps as a reduce-scatter, without the additions."""
    return reduce_scatter_seconds(nbytes, world_size, alpha=alpha, beta=beta)


def residuals(nbytes: Sequence[float], seconds: Sequence[float], *, alpha: float, beta: float,
              world_size: int | None = None) -> list[float]:
    """Relative error of the fit at each size, (measured - predicted) / predicted: of one message
    (world_size None) or of a ring all-reduce on `world_size` ranks."""
    if len(nbytes) != len(seconds):
        raise ValueError("residuals needs one time per size")
    predict = ((lambda n: alpha + beta * n) if world_size is None else
               (lambda n: all_reduce_seconds(n, world_size, alpha=alpha, beta=beta)))
    return [(t - predict(n)) / predict(n) for n, t in zip(nbytes, seconds)]


def exposed_seconds(backward_seconds: float, nbytes: float, world_size: int, *, alpha: float,
                    beta: float, buckets: int) -> float:
    """Communication left after backward ends, when backward produces `nbytes` of gradients evenly
    over `backward_seconds` and each of `buckets` equal buckets is all-reduced (ring) as soon as
    it is complete and the previous one is done: one link, one all-reduce at a time."""
    each = all_reduce_seconds(nbytes / buckets, world_size, alpha=alpha, beta=beta)
    end = 0.0
    for k in range(1, buckets + 1):
        ready = k * backward_seconds / buckets           # bucket k's last gradient arrives
        end = max(end, ready) + each                     # it waits for the link, then goes
    return end - backward_seconds


def buckets(nbytes: Sequence[float], cap_bytes: float) -> list[tuple[int, float]]:
    """Group gradients, in the order backward makes them, into buckets of at most `cap_bytes`
    (a gradient larger than the cap gets a bucket of its own), as `companion.ddp.DDP` does:
    (index of the gradient that completes the bucket, its bytes) per bucket."""
    if not cap_bytes > 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes!r}")
    out, size, last = [], 0.0, None
    for i, n in enumerate(nbytes):
        if size and size + n > cap_bytes:
            out.append((last, size))
            size = 0.0
        size, last = size + n, i
    if size:
        out.append((last, size))
    return out


def bucketed_exposed(grad_bytes: Sequence[float], backward_seconds: Sequence[float],
                     world_size: int, *, alpha: float, beta: float, cap_bytes: float,
                     seconds=None, lanes: int = 1, sharing: float = 1.0) -> float:
    """Communication left after backward ends when gradient i (in backward order) of
    grad_bytes[i] is ready once backward_seconds[0..i] have passed, buckets of at most
    `cap_bytes` are all-reduced as soon as they are complete, one at a time on the link.
    `seconds(nbytes)`: one bucket's time, default the ring all-reduce at α and β.
    lanes > 1: up to `lanes` buckets in flight at once (gloo's worker threads), each bucket's
    latency 2(N-1)·α overlapping the others' and its transfer sharing the link (`link_schedule`);
    with `seconds` given, its whole time is transfer."""
    if len(grad_bytes) != len(backward_seconds) or not grad_bytes:
        raise ValueError("bucketed_exposed needs one backward time per gradient")
    fixed = 0.0 if seconds is not None else 2 * (world_size - 1) * alpha if world_size > 1 else 0.0
    if seconds is None:
        seconds = lambda n: all_reduce_seconds(n, world_size, alpha=alpha, beta=beta)
    ready, t = [], 0.0
    for dt in backward_seconds:
        t += dt
        ready.append(t)
    messages = []
    for last, size in buckets(grad_bytes, cap_bytes):
        total = seconds(size)
        messages.append((ready[last], min(fixed, total), total - min(fixed, total)))
    end = max(link_schedule(messages, lanes=lanes, sharing=sharing))
    return max(0.0, end - ready[-1])


def link_schedule(messages: Sequence[tuple[float, float, float]], *, lanes: int = 1,
                  sharing: float = 1.0) -> list[float]:
    """When each message ends, for messages (ready, latency, transfer) in issue order. A message
    starts once it is ready and a lane is free (in issue order), pays `latency` seconds beside
    whatever else runs, then `transfer` seconds of the link at its full rate; k transfers at once
    each move at 1 / (1 + sharing·(k-1)) of that rate (sharing 1: they split the link; 0: each
    lane is a link of its own). lanes=1 is one message at a time:
    end = max(previous end, ready) + latency + transfer."""
    if not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"lanes must be a positive int, got {lanes!r}")
    if not 0 <= sharing <= 1:
        raise ValueError(f"sharing must lie in [0, 1], got {sharing!r}")
    if any(min(m) < 0 for m in messages):
        raise ValueError("ready times, latencies and transfers must be non-negative")
    if lanes == 1:                                      # one at a time: a running sum
        ends, end = [], 0.0
        for ready, latency, transfer in messages:
            end = max(end, ready) + latency + transfer
            ends.append(end)
        return ends
    ends: list[float] = [0.0] * len(messages)
    active: dict[int, list[float]] = {}                 # message -> [latency ends, transfer left]
    nxt, t = 0, 0.0
    while nxt < len(messages) or active:
        while nxt < len(messages) and len(active) < lanes and messages[nxt][0] <= t:
            active[nxt] = [t + messages[nxt][1], messages[nxt][2]]           # it starts now
            nxt += 1
        moving = [i for i, (paid, _) in active.items() if paid <= t]
        rate = 1 / (1 + sharing * (len(moving) - 1)) if moving else 0.0
        finish = {i: t + active[i][1] / rate for i in moving}
        events = list(finish.values()) + [paid for paid, _ in active.values() if paid > t]
        if nxt < len(messages) and len(active) < lanes:
            events.append(messages[nxt][0])
        t_next = min(events)
        for i in moving:
            active[i][1] = 0.0 if finish[i] <= t_next else active[i][1] - (t_next - t) * rate
        t = t_next
        for i in [i for i, (paid, left) in active.items() if paid <= t and left == 0.0]:
            ends[i] = t
            del active[i]
    return ends


def best_bucket_count(backward_seconds: float, nbytes: float, world_size: int, *, alpha: float,
                      beta: float, most: int = 1024) -> int:
    """The number of equal buckets (1..most) that leaves the least communication exposed."""
    return min(range(1, most + 1), key=lambda b: exposed_seconds(
        backward_seconds, nbytes, world_size, alpha=alpha, beta=beta, buckets=b))


def time_all_reduce_sizes(rank: int, world_size: int, impl: str, sizes: Sequence[int],
                          repeats: int = 5, *, every: bool = False) -> list:
    """A worker for `launch.run`: per size (bytes of float32), the median seconds of `repeats`
    all-reduces after a warm-up, on the slowest rank. The sizes are interleaved: each round times
    every size once, in a new random order (`stats.round_order`), so a slow moment of the machine
    spreads over all of them and no size always follows the same one. impl: "gloo" (dist.all_reduce), "ring" or "naive" (ours, `companion.collectives`).
    every=True: each size's list of `repeats` times (the slowest rank's per call) instead."""
    run = {"ring": collectives.ring_all_reduce, "naive": collectives.naive_all_reduce,
           "gloo": dist.all_reduce}[impl]
    device = rank_device()
    tensors = [torch.ones(max(nbytes // 4, 1), device=device) for nbytes in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(repeats + 1):                                          # round 0: warm-up
        for k in stats.round_order(len(sizes), r):                        # same order on every rank
            dist.barrier()                                                # start together
            start = now(device)                                           # host-device sync
            run(tensors[k])                                               # collective
            if r:
                times[k].append(now(device) - start)                      # host-device sync
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)                        # collective
    if every:
        return slowest.tolist()
    return [statistics.median(row) for row in slowest.tolist()]


def time_collectives(rank: int, world_size: int, sizes: Sequence[int],
                     repeats: int = 5) -> dict[str, list[list[float]]]:
    """A worker for `launch.run`: {collective: [size][round] seconds, the slowest rank's} for
    torch's all_reduce, reduce-scatter and all-gather of a tensor of each size (bytes of float32,
    the whole tensor), all interleaved in rounds after a warm-up round. A transport's collectives
    need not follow the ring formulas (gloo's reduce-scatter does not): fit each one on its own."""
    scatter, gather = reduce_scatter_tensor, all_gather_tensor
    calls, device = [], rank_device()
    for kind in COLLECTIVES:
        for nbytes in sizes:
            n = max(nbytes // 4 // world_size, 1) * world_size
            full, shard = torch.ones(n, device=device), torch.ones(n // world_size, device=device)
            calls.append((kind, {"all_reduce": lambda f=full: dist.all_reduce(f),
                                 "reduce_scatter": lambda f=full, s=shard: scatter(s, f),
                                 "all_gather": lambda f=full, s=shard: gather(f, s)}[kind]))
    times = [[] for _ in calls]
    for r in range(repeats + 1):
        for i in stats.round_order(len(calls), r):                        # same order on every rank
            dist.barrier()                                                # start together
            start = now(device)                                           # host-device sync
            calls[i][1]()                                                 # collective
            if r:
                times[i].append(now(device) - start)                      # host-device sync
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)                        # collective
    rows = slowest.tolist()
    return {kind: rows[j * len(sizes):(j + 1) * len(sizes)] for j, kind in enumerate(COLLECTIVES)}


def fit_all_reduce(nbytes: Sequence[float], seconds: Sequence[float],
                   world_size: int) -> tuple[float, float]:
    """(α, β) of one message from timed ring all-reduces: fit seconds ≈ A + B·S, then
    A = 2(N-1)·α and B = 2(N-1)/N·β."""
    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends nothing: use world_size >= 2")
    a, b = fit_alpha_beta(nbytes, seconds)
    return a / (2 * (world_size - 1)), b * world_size / (2 * (world_size - 1))
