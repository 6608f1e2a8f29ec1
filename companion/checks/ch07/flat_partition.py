"""Exercise 1: which flat pieces of the parameters a rank owns (`check_flat_partition`)."""
from __future__ import annotations

import random

from companion.checks.ch07._common import _compare_whole, _differs
from companion.checks.core import call, exercise, fresh_seeds
from companion.zero import flat_partition

__all__ = ["check_flat_partition"]


def _whole_tensors(numels, world, rank):
    """Known wrong: whole parameters, each to the least-loaded rank (ZeroRedundancyOptimizer)."""
    loads, owner = [0] * world, []
    for n in numels:
        r = loads.index(min(loads))
        owner.append(r)
        loads[r] += n
    return [(i, 0, n) for i, n in enumerate(numels) if owner[i] == rank]


def _slices(numels, world, rank, s, *, remainder=False):
    """Known wrong: slices of s elements, the last rank taking the rest if `remainder`."""
    return _pieces(numels, rank * s, sum(numels) if remainder and rank == world - 1
                   else (rank + 1) * s)


def _inclusive_stop(numels, world, rank):
    return [(i, a, b - 1) for i, a, b in flat_partition(numels, world, rank)]


def _flat_coordinates(numels, world, rank):
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    return [(i, a + offsets[i], b + offsets[i]) for i, a, b in flat_partition(numels, world, rank)]


def _pieces(numels, lo, hi):
    out, offset = [], 0
    for i, n in enumerate(numels):
        if max(lo, offset) < min(hi, offset + n):
            out.append((i, max(lo, offset) - offset, min(hi, offset + n) - offset))
        offset += n
    return out


def _partition_cases(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    big = [rng.randint(900, 1100)] + [rng.randint(1, 30) for _ in range(5)]   # one large matrix
    odd = [rng.randint(1, 40) for _ in range(rng.randint(3, 8))]
    return [(big, 2), (big, 4), (odd, 3), (odd, 7), ([5], 4), ([3, 3], 2)]


def _partition_mistakes(numels, world) -> dict:
    """Known-wrong partitions, each on every rank, and their hints (the first that matches is
    shown). Matched on all ranks at once: on one rank two mistakes can give the same pieces."""
    floor = sum(numels) // world
    wrong = {
        "split by elements, not whole tensors: with one large matrix, whole tensors leave one "
        "rank holding almost everything.": _whole_tensors,
        "stop is exclusive, like a Python slice: a piece (i, start, stop) holds elements "
        "start … stop-1.": _inclusive_stop,
        "every rank gets s = ceil(Ψ/N) elements (-(-total // N)): all shards must be the same "
        "size for the collectives; the last one is padded.":
            lambda *a: _slices(*a, floor, remainder=True),
        "use s = ceil(Ψ / N) elements per rank (-(-total // N)): with the floor, the last "
        "elements belong to no rank.": lambda *a: _slices(*a, floor),
        "when N divides Ψ, ceil(Ψ/N) = Ψ/N: use -(-total // N), not total // N + 1.":
            lambda *a: _slices(*a, floor + 1),
        "start and stop count inside each parameter (subtract where the parameter begins in "
        "the flat vector).": _flat_coordinates}
    return {text: [fn(numels, world, r) for r in range(world)] for text, fn in wrong.items()}


@exercise(points=1, reference=("companion.zero.flat_partition",
                               "companion.zero.FlatLayout"))
def check_flat_partition(answer) -> str:
    """answer(numels, world_size, rank) -> [(param index, start, stop), ...]: the pieces of the
    flattened parameters that `rank` owns, start/stop inside each parameter."""
    for seed in fresh_seeds(2):
        for numels, world in _partition_cases(seed):
            want = [flat_partition(numels, world, rank) for rank in range(world)]
            got = [call(answer, list(numels), world, rank) for rank in range(world)]
            mistake = [text for text, wrong in _partition_mistakes(numels, world).items()
                       if not _differs(got, wrong)]
            for rank in range(world):
                _compare_whole(got[rank], want[rank],
                               name=f"rank {rank}'s pieces of {numels} on {world} ranks",
                               items="pieces (index, start, stop)",
                               hint=mistake[0] if mistake else
                               "rank r owns flat elements [r·s, (r+1)·s) with s = ceil(Ψ/N); "
                               "list each parameter that range overlaps, in order, and leave "
                               "out those it misses.")
    numels, world = _partition_cases(0)[1]
    ours = [sum(b - a for _, a, b in flat_partition(numels, world, r)) for r in range(world)]
    whole = [sum(b - a for _, a, b in _whole_tensors(numels, world, r)) for r in range(world)]
    return (f"{sum(numels)} elements on {world} ranks: largest slice {max(ours)} elements "
            f"(whole tensors: {max(whole)})")
