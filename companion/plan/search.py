"""Search the levers' combinations for the fastest plan that fits, predicting few peaks.

A planner weighs every combination of its levers' values (micro-batch, checkpoint segments,
offload, precision, ...). Predicting a plan's step time is arithmetic; predicting its peak can
cost a simulated training step (`plan_model`, for a model other than the course GPT, simulates
two micro-batch sizes of every combination of the other levers: seconds each at scale). With the
other levers fixed, a larger micro-batch keeps more activations alive at once, so its peak is no
smaller: the micro-batch sizes that fit form a prefix of their ascending list, and a binary
search finds where that prefix ends with about log2(n + 1) predicted peaks instead of n. (One
exception in the course's predictions: the whole batch at once keeps no gradients between
micro-batches, so where half a batch saves fewer bytes than the gradients, the whole batch can
need less than half of it; search such a batch's plans apart.) Nothing is promised for the other
levers (checkpoint_sequential's segments are uneven: 5 blocks in 3 segments can need more than
in 2), nor for the time of any lever: every plan that fits is timed.

Example (4 peaks predicted of the 8 plans):
    >>> levers = {"micro_batch": [1, 2, 4, 8], "offload": [False, True]}
    >>> peak = lambda p: 3 * p["micro_batch"] + (2 if p["offload"] else 10)       # bytes
    >>> seconds = lambda p: 8 / p["micro_batch"] + (3 if p["offload"] else 0)
    >>> fastest_fitting(levers, peak, seconds, 20)
    {'micro_batch': 2, 'offload': False}

Simplified vs the course's planner: `plan` predicts every candidate's peak (for the course GPT
a peak is a formula, `predict_memory`) and simulates only the fastest few that fit.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

__all__ = ["all_plans", "fastest_fitting_brute", "fastest_fitting"]


def all_plans(levers: dict[str, list]) -> list[dict]:
    """Every combination of the levers' values, as {lever: value} dicts."""
    return [dict(zip(levers, values)) for values in itertools.product(*levers.values())]


def fastest_fitting_brute(levers: dict[str, list], predict_peak: Callable[[dict], float],
                          predict_time: Callable[[dict], float], budget: float) -> dict | None:
    """The naive search: predict every plan's peak, time those that fit, keep the fastest."""
    fits = [p for p in all_plans(levers) if predict_peak(p) <= budget]   # len(grid) peaks
    return min(fits, key=predict_time, default=None)


def fastest_fitting(levers: dict[str, list], predict_peak: Callable[[dict], float],
                    predict_time: Callable[[dict], float], budget: float, *,
                    monotone: str = "micro_batch") -> dict | None:
    """The fastest plan whose predicted peak is at most `budget`, or None when none is; each
    lever's values in ascending order, the peak never smaller for a larger `monotone` value
    (the other levers fixed). Predicts no peak that an earlier one already decides."""
    sizes = levers[monotone]
    others = {name: values for name, values in levers.items() if name != monotone}
    best, best_time = None, math.inf
    for rest in all_plans(others):
        def plan(i: int) -> dict:                     # in the levers' own order
            return {name: sizes[i] if name == monotone else rest[name] for name in levers}
        # 1. Binary search for the prefix that fits: sizes[:lo] fit, sizes[hi:] do not.
        lo, hi = 0, len(sizes)
        while lo < hi:
            mid = (lo + hi) // 2
            if predict_peak(plan(mid)) <= budget:     # one simulated step, at scale
                lo = mid + 1
            else:
                hi = mid
        # 2. Time every plan of the prefix: the time of no lever is promised an order.
        for i in range(lo):
            seconds = predict_time(plan(i))
            if seconds < best_time:
                best, best_time = plan(i), seconds
    return best
