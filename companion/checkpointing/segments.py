"""How many segments: the activation peak and the recompute time of `checkpoint_sequential`
predicted, and measured per segment count."""
from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Callable, Sequence

import torch

from companion.checkpointing.function import _run, checkpoint
from companion.memory import track
from companion.cost.clock import now
from companion.cost.stats import interleave

__all__ = ["predicted_activation_units", "predicted_activation_bytes", "segments_for_budget",
           "sqrt_segments", "predicted_time_ratio", "SegmentRun", "profile_segments", "plan_cost",
           "checkpoint_plan", "UnevenLayer", "measure_plan"]


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
    runs every count once, in a new random order, so that a moment when other work takes the
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
              cost: Sequence[float], *, bound: bool = False) -> tuple[int, float]:
    """(peak bytes, recompute cost) of cutting layers 0..n-1 into segments that begin at `starts`.

    Every segment but the last is checkpointed: its input (`inputs[start]` bytes) is kept, and its
    layers' saved tensors (`saved[i]` bytes each; a layer's input is not among them) are dropped
    and recomputed in backward, costing the sum of their `cost[i]`. The last segment runs plainly.
    Backward runs the segments last to first and frees each checkpoint when its segment is done, so
    the peak is the largest of:
    - the last segment: its saved bytes, beside every checkpoint;
    - checkpointed segment j, while recomputed: its saved bytes, beside the checkpoints of
      segments 0..j (its own input included, the recomputation starts from it); the later
      segments' checkpoints are already freed.
    That is the peak measured for the reentrant design (`checkpoint(fn, x)`, `measure_plan`).
    `bound=True` gives instead Chen et al.'s count (2016, arXiv:1604.06174: the kept checkpoints
    plus the largest segment, their O(k) + O(n/k) for k segments), an upper bound, equal when the
    largest segment is the last (`checkpoint_sequential` on equal layers).
    Exact for layers that do not save their own input (`UnevenLayer`). A layer that does (Linear)
    saves, as the first layer of a recomputed segment, the checkpoint itself: count each input in
    `saved[i]`, and then a segment's own checkpoint must not be added again (this function adds it).

    Example:
        >>> plan_cost([0, 1], [12, 1, 1], [1, 1, 1], [3.0, 1.0, 1.0])   # (max(1 + 12, 1 + 2), 3.0)
        (13, 3.0)
    """
    ends = list(starts[1:]) + [len(saved)]
    # 1. The checkpoints alive while segment j runs backward: inputs of segments 0..j.
    alive = list(itertools.accumulate(inputs[start] for start in starts[:-1]))
    alive.append(alive[-1] if alive else 0)           # the last segment: every checkpoint
    held = [sum(saved[a:b]) for a, b in zip(starts, ends)]
    # 2. Chen et al.'s bound adds all checkpoints to the largest segment; the exact peak pairs each
    #    segment with the checkpoints alive at its backward.
    peak = alive[-1] + max(held) if bound else max(a + h for a, h in zip(alive, held))
    return peak, sum(sum(cost[a:b]) for a, b in zip(starts[:-1], ends[:-1]))


def checkpoint_plan(saved: Sequence[int], inputs: Sequence[int], cost: Sequence[float],
                    budget: int, *, bound: bool = False) -> list[int] | None:
    """The segment starts (0 first) whose `plan_cost` peak fits `budget` (peak <= budget) with the
    least recompute (fewest segments among equals), or None if no plan fits. `bound=True` plans
    with Chen et al.'s upper bound instead of the exact peak: a plan that fits, but sometimes not
    the cheapest one, and None when only the exact peak fits. Tries every plan: 2^(n-1) of them,
    fine for the few dozen layers of a notebook; Checkmate (Jain et al., MLSys 2020) solves the
    general graph as an integer program."""
    n, best = len(saved), None
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            starts = [0, *cuts]
            peak, recompute = plan_cost(starts, saved, inputs, cost, bound=bound)
            if peak <= budget and (best is None or recompute < best[0]):
                best = (recompute, starts)
    return None if best is None else best[1]


class UnevenLayer(torch.nn.Module):
    """A layer that saves `copies` tensors the size of its input for backward, and not its input:
    tanh of the input repeated `copies` times, summed back to the input's shape (B, W) -> (B, W).
    A stack of them has uneven `saved` and equal `inputs`, as `plan_cost` counts them."""

    def __init__(self, copies: int):
        super().__init__()
        self.copies = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.tanh(x.repeat(1, self.copies))            # (B, copies·W): tanh saves it
        return wide.view(x.shape[0], self.copies, x.shape[1]).sum(1)   # (B, W): saves nothing


def measure_plan(layers: Sequence[Callable], starts: Sequence[int], x: torch.Tensor, *,
                 checkpoint_fn: Callable = checkpoint, step_peak: bool = False) -> int:
    """The most bytes saved for backward at once (`SegmentRun.activation_bytes`' measure) when
    `layers` run on `x` as the plan `starts`: every segment but the last under `checkpoint_fn`
    (the reentrant `checkpoint`; PyTorch's is `partial(torch.utils.checkpoint.checkpoint,
    use_reentrant=True)`), then backward. `x` must require grad; the step works on its own copy of
    it, so the first checkpoint is counted as `plan_cost` counts `inputs[0]`. `step_peak=True`
    gives instead the whole step's peak (`SegmentRun.peak_bytes`' measure: saved tensors, and
    backward's temporaries and the gradients flowing back, which `plan_cost` does not count)."""
    def loss() -> torch.Tensor:
        # Inside a function, so no name here keeps a segment's input alive through backward.
        h = x.clone()                                          # the step's input: counted
        for a, b in bounds[:-1]:
            h = checkpoint_fn(_run(layers[a:b]), h)
        a, b = bounds[-1]
        return _run(layers[a:b])(h).sum()

    bounds = list(zip(starts, list(starts[1:]) + [len(layers)]))
    with track(x.device) as tracker:
        loss().backward()
    return tracker.peak if step_peak else _saved_peak(tracker.timeline())
