"""Prefetching: start the next units' all-gathers while this unit computes (ZeRO-3).

FSDP gathers a unit's parameters just before the unit runs. Started only then, the all-gather is
on the critical path: the unit waits for it. With prefetching at depth d, the gathers of units
i+1 … i+d are already in flight (`async_op=True`) while unit i computes, so communication hides
behind computation. It costs memory: d+1 units' full parameters exist at once instead of one,

    gathered bytes at the peak = the largest d+1 consecutive units (+ the units kept whole),

which `predicted_gathered_peak` computes. It sends no extra byte: every unit is gathered once,
only earlier.

`run_with_prefetch` is the idea as one loop; `FSDP(..., prefetch=d)` does the same from its hooks,
in forward (in the order the units ran in the previous forward; the first time, the order they
were registered in) and in backward (the reverse of the order in which forward saved each unit's
weights for backward).

What the libraries do: FSDP2 overlaps one all-gather ahead by default, in forward and in backward
("the next FSDP module based on the reverse post-forward order");
`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` take a list, and "a list
with at least length two is required for more aggressive overlap and will use more reserved
memory" (torch/distributed/fsdp/_fully_shard/_fully_shard.py). DeepSpeed's ZeRO-3 fetches up to
`stage3_prefetch_bucket_size` parameter elements ahead of use, 5e7 by default
(deepspeed/runtime/zero/config.py).

Example:
    >>> outputs = run_with_prefetch(layers, gather, compute, depth=1)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["run_with_prefetch", "predicted_gathered_peak", "ahead"]


def _check_depth(depth: Any) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"the prefetch depth is a whole number of units >= 0 (0: no "
                         f"prefetching), got {depth!r}")


def run_with_prefetch(units: Sequence, gather: Callable, compute: Callable, depth: int) -> list:
    """Run `units` in order, gathering units i+1 … i+depth while unit i computes.

    Memory: at most depth+1 units' gathered weights at once (unit i's and the depth in flight).
    Traffic: each unit gathered once, as without prefetching.

    Args:
        units: the units, in the order they run.
        gather: gather(unit) -> (weights, work) starts the unit's all-gather asynchronously;
            `weights` is the buffer it fills, whole once `work.wait()` has returned.
        compute: compute(unit, weights) -> output runs the unit, then frees its weights.
        depth: how many units ahead to gather (0: gather each unit just before it runs).
    Returns: the outputs of compute, in the order of `units`.
    """
    _check_depth(depth)
    units = list(units)
    in_flight: dict[int, tuple] = {}                      # unit index -> (weights, work)
    outputs = []
    for i, unit in enumerate(units):
        for j in range(i, min(i + depth + 1, len(units))):    # 1. unit i and the next `depth`
            if j not in in_flight:
                in_flight[j] = gather(units[j])              # asynchronous all-gather
        weights, work = in_flight.pop(i)
        work.wait()                                          # 2. sync point: unit i is whole
        outputs.append(compute(unit, weights))               # 3. while i+1 … i+depth arrive
    return outputs


def predicted_gathered_peak(unit_bytes: Sequence[int], *, prefetch: int = 0,
                            keep: Sequence[bool] | None = None) -> int:
    """Bytes of gathered parameters at the forward's peak, the units running in order.

    While unit i computes, units i … i+prefetch are gathered, and every earlier unit j with
    keep[j] is still whole (not resharded after forward: the root unit, or every unit with
    `reshard_after_forward=False`). The peak is the largest such total over i; for equal units
    and no unit kept, (1 + prefetch) units.
    """
    _check_depth(prefetch)
    keep = [False] * len(unit_bytes) if keep is None else list(keep)
    if len(keep) != len(unit_bytes):
        raise ValueError(f"keep has {len(keep)} entries for {len(unit_bytes)} units: give one "
                         "True/False per unit")
    return max((sum(b for b, k in zip(unit_bytes[:i], keep) if k) +
                sum(unit_bytes[i:i + prefetch + 1]) for i in range(len(unit_bytes))), default=0)


def ahead(order: Sequence[int], current: int, depth: int) -> list[int]:
    """The `depth` entries that follow `current` in `order` ([] if it is not there): the units
    to prefetch once `current` has been gathered."""
    if current not in order:
        return []
    start = list(order).index(current) + 1
    return list(order[start:start + depth])
