"""How many segments: the activation peak and the recompute time of `checkpoint_sequential`
predicted, and measured per segment count."""
from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Callable, Sequence

import torch

from companion.memory import track
from companion.cost.clock import now
from companion.cost.stats import interleave

__all__ = ["predicted_activation_units", "predicted_activation_bytes", "segments_for_budget",
           "sqrt_segments", "predicted_time_ratio", "SegmentRun", "profile_segments", "plan_cost",
           "checkpoint_plan"]


def predicted_activation_units(n_layers: int, segments: int) -> int:
    """Layer outputs held at the peak of backward with `checkpoint_sequential(…, segments, …)`.

    The inputs of the checkpointed segments stay alive (segments - 1 of them, the first is the
    network's own input, counted here too), plus one segment's layer outputs while it is
    recomputed or held: the longest segment, which is the last one. With segments = 1 that is
    all n layers.
    """
    size = n_layers // segments
    longest = n_layers - size * (segments - 1)
    return (segments - 1) + longest


def predicted_activation_bytes(n_layers: int, segments: int, layer_bytes: int,
                               checkpoint_bytes: int | None = None) -> int:
    """`predicted_activation_units` in bytes, when a checkpoint (one layer's input, `checkpoint_bytes`)
    is smaller than everything a layer saves (`layer_bytes`), as in a transformer block."""
    checkpoint_bytes = layer_bytes if checkpoint_bytes is None else checkpoint_bytes
    longest = predicted_activation_units(n_layers, segments) - (segments - 1)
    return (segments - 1) * checkpoint_bytes + longest * layer_bytes


def segments_for_budget(n_layers: int, layer_bytes: int, budget_bytes: int) -> int | None:
    """The fewest segments whose predicted activation peak fits `budget_bytes`, or None.

    Fewest, because each extra checkpointed segment means more recompute; None when even the
    best split (near √n segments) does not fit.
    """
    for segments in range(1, n_layers + 1):
        if predicted_activation_units(n_layers, segments) * layer_bytes <= budget_bytes:
            return segments
    return None


def sqrt_segments(n_layers: int) -> int:
    """The segment count near √n that minimises `predicted_activation_units`."""
    return min(range(1, n_layers + 1), key=lambda s: (predicted_activation_units(n_layers, s), s))


def predicted_time_ratio(n_layers: int, segments: int) -> float:
    """Step time with checkpointing over step time without, counting compute only.

    A backward costs about two forwards, so a plain step is 3 forward-units; every layer in a
    checkpointed segment runs forward once more: at most 4/3 when all of them are recomputed.
    """
    recomputed = (n_layers // segments) * (segments - 1)
    return (3 * n_layers + recomputed) / (3 * n_layers)


@dataclasses.dataclass(frozen=True)
class SegmentRun:
    """One segment count, measured: peaks are bytes above what was live before the step."""

    segments: int
    peak_bytes: int          # everything the step allocated: activations, temporaries, gradients
    activation_bytes: int    # the most bytes saved for backward at any one time
    seconds: float           # median of the timed steps
    fastest: float = 0.0     # the fastest and slowest timed step
    slowest: float = 0.0
    times: tuple[float, ...] = ()   # every timed step, for companion.cost.stats.compare


def profile_segments(step: Callable[[int], object], counts: Sequence[int], *,
                     device: torch.device | str | None = None, repeats: int = 5) -> list[SegmentRun]:
    """Measure `step(segments)` (one forward and backward) for each segment count.

    Per count: one warm-up run (it also allocates the gradients, so later runs measure activations,
    not gradients) and one run under `companion.memory.track`. Then `repeats` rounds of timed runs
    without the tracker (it slows operators down), `companion.cost.stats.interleave`d: each round
    runs every count once, from a rotated start, so that a moment when other work takes the
    machine slows all counts alike rather than one; the median of each count's runs is kept, with
    the fastest, the slowest and every run (`times`, for `companion.cost.stats.compare`).
    """
    device = torch.device(device) if device is not None else None
    trackers = {}
    for segments in counts:
        step(segments)                                          # warm-up
        with track(device) as trackers[segments]:
            step(segments)
    times = interleave({segments: (lambda s=segments: step(s)) for segments in counts},
                       rounds=repeats, warmup=0, clock=lambda: now(device))  # host-device sync
    return [SegmentRun(s, trackers[s].peak, _saved_peak(trackers[s].timeline()),
                       statistics.median(times[s]), min(times[s]), max(times[s]), tuple(times[s]))
            for s in counts]


def _saved_peak(timeline: dict[str, list]) -> int:
    """The most bytes saved for backward at once. The tracker labels a saved leaf that requires
    grad a parameter; inside a step those are the inputs `Checkpoint.backward` rebuilds as leaves
    (the model's parameters exist before the step and are not counted), so both kinds add up."""
    return max((a + p for a, p in zip(timeline["activations"], timeline["parameters"])), default=0)


def plan_cost(starts: Sequence[int], saved: Sequence[int], inputs: Sequence[int],
              cost: Sequence[float]) -> tuple[int, float]:
    """(peak bytes, recompute cost) of cutting layers 0..n-1 into segments that begin at `starts`.

    Every segment but the last is checkpointed: its input (`inputs[start]` bytes) is kept, and its
    layers' saved tensors (`saved[i]` bytes each) are dropped and recomputed in backward, costing
    the sum of their `cost[i]`. The last segment runs plainly. The peak is the kept inputs plus the
    largest segment's saved bytes: the last segment's are held from forward, each other's while it
    is recomputed (the bound Chen et al. 2016, arXiv:1604.06174, §4 use)."""
    ends = list(starts[1:]) + [len(saved)]
    kept = sum(inputs[start] for start in starts[:-1])
    largest = max(sum(saved[a:b]) for a, b in zip(starts, ends))
    return kept + largest, sum(sum(cost[a:b]) for a, b in zip(starts[:-1], ends[:-1]))


def checkpoint_plan(saved: Sequence[int], inputs: Sequence[int], cost: Sequence[float],
                    budget: int) -> list[int] | None:
    """The segment starts (0 first) whose `plan_cost` peak fits `budget` with the least recompute
    (fewest segments among equals), or None if no plan fits. Tries every plan: 2^(n-1) of them,
    fine for the few dozen layers of a notebook; a dynamic program over (start, largest segment)
    does it in polynomial time."""
    n, best = len(saved), None
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            starts = [0, *cuts]
            peak, recompute = plan_cost(starts, saved, inputs, cost)
            if peak <= budget and (best is None or recompute < best[0]):
                best = (recompute, starts)
    return None if best is None else best[1]
