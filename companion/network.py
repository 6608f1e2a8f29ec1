"""The α–β model of communication: a message of n bytes takes α + β·n seconds.

α is the latency (the fixed cost of any message: software, synchronisation, the wire's delay) and
β the inverse bandwidth (seconds per byte). Two numbers, fitted to timed all-reduces of growing
size, predict what the chapter measures (Hockney 1994; Thakur, Rabenseifner & Gropp 2005, "Optimization
of Collective Communication Operations in MPICH", for the ring's cost):

- ring all-reduce of S bytes on N ranks: 2(N-1) steps of S/N bytes, 2(N-1)·α + 2(N-1)/N·S·β;
- naive all-reduce: the root receives and then sends N-1 whole messages, 2(N-1)·(α + S·β);
- b buckets instead of one message: b times the latency, the same bandwidth term;
- and, with backward producing the gradients while buckets are sent, how much communication is
  left after backward ends (`exposed_seconds`), which picks the best bucket size.

Example:
    >>> alpha, beta = fit_alpha_beta([1e3, 1e6, 1e7], [60e-6, 0.9e-3, 8.5e-3])   # one message
    >>> all_reduce_seconds(100 * 2**20, 4, alpha=alpha, beta=beta)            # 100 MiB, ring

Simplified vs real networks: one link per rank at one speed, no contention between links, no
pipelining inside a step (NCCL and gloo split big messages), and no tree algorithms (which trade
bandwidth for a log(N) latency term at small messages).
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from companion import collectives

__all__ = ["fit_alpha_beta", "fit_all_reduce", "all_reduce_seconds", "exposed_seconds",
           "best_bucket_count", "time_all_reduce_sizes"]


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


def best_bucket_count(backward_seconds: float, nbytes: float, world_size: int, *, alpha: float,
                      beta: float, most: int = 1024) -> int:
    """The number of equal buckets (1..most) that leaves the least communication exposed."""
    return min(range(1, most + 1), key=lambda b: exposed_seconds(
        backward_seconds, nbytes, world_size, alpha=alpha, beta=beta, buckets=b))


def time_all_reduce_sizes(rank: int, world_size: int, impl: str, sizes: Sequence[int],
                          repeats: int = 5) -> list[float]:
    """A worker for `launch.run`: per size (bytes of float32), the median seconds of `repeats`
    all-reduces after a warm-up, on the slowest rank. impl: "gloo" (dist.all_reduce), "ring" or
    "naive" (ours, from `companion.collectives`)."""
    run = {"ring": collectives.ring_all_reduce, "naive": collectives.naive_all_reduce,
           "gloo": dist.all_reduce}[impl]
    out = []
    for nbytes in sizes:
        tensor = torch.ones(max(nbytes // 4, 1))
        times = []
        for i in range(repeats + 1):                                      # +1: a warm-up
            dist.barrier()                                                # start together
            start = time.perf_counter()
            run(tensor)                                                   # collective
            if i:
                times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    slowest = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)                        # collective
    return slowest.tolist()


def fit_all_reduce(nbytes: Sequence[float], seconds: Sequence[float],
                   world_size: int) -> tuple[float, float]:
    """(α, β) of one message from timed ring all-reduces: fit seconds ≈ A + B·S, then
    A = 2(N-1)·α and B = 2(N-1)/N·β."""
    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends nothing: use world_size >= 2")
    a, b = fit_alpha_beta(nbytes, seconds)
    return a / (2 * (world_size - 1)), b * world_size / (2 * (world_size - 1))
