"""The ring reduce-scatter in real gloo worker processes (`check_ring_reduce_scatter`): kept for
workbooks that still use it; the chapter's exercise on communication is now `check_prefetch`."""
from __future__ import annotations

import pickle

import torch

from companion import collectives
from companion.checks import _ranks
from companion.checks._collective_guard import point_to_point_only, ring_direction
from companion.checks.core import compare, exercise, fresh_seeds, require

__all__ = ["check_ring_reduce_scatter"]


def _scatter_worker(rank: int, world: int, packed: bytes, seed: int, shards: list[int]):
    """Run the answer on each shard size under the guard: (output, sends as (peer, bytes), whether
    it returned nothing) per size."""
    results, log = [], []
    with point_to_point_only(log):
        answer = pickle.loads(packed)        # imported after patching: `from dist import send`
        for s in shards:
            full = _ranks.rank_tensor(seed, rank, world * s)
            output = torch.zeros(s)
            del log[:]
            returned = answer(output, full.clone())
            results.append((output, list(log), returned is None or returned is output))
    return results


def _scatter_hint(got, rank, world, s, seed) -> str:
    def chunk_sum(c, ranks):
        return sum(_ranks.rank_tensor(seed, r, world * s).view(world, s)[c] for r in ranks)
    if torch.allclose(got, torch.zeros(s)):
        return "the output is still zeros: write the result into `output` (output.copy_(...))."
    if torch.allclose(got * world, chunk_sum(rank, range(world)), atol=1e-5):
        return ("your result is 1/N of the sum: a reduce-scatter sums; averaging is the "
                "caller's job (ShardedOptimizer divides afterwards).")
    for c in range(world):
        if c != rank and torch.allclose(got, chunk_sum(c, range(world)), atol=1e-5):
            return (f"rank {rank} ended with the sum of chunk {c}: it must own chunk {rank}. In "
                    "step k send chunk (rank - k - 1) % N, add into (rank - k - 2) % N.")
    if torch.allclose(got, chunk_sum(rank, [r for r in range(world) if r != rank]), atol=1e-5):
        return "every rank's own part is missing: add your own chunk to what arrives."
    return ("keep one running sum: send it right, receive the left neighbour's, add your own "
            "part of that chunk; after N-1 steps it is your chunk, summed over all ranks.")


def _judge_scatter_traffic(sends: list[tuple[int, int]], rank: int, world: int, s: int) -> None:
    """Exactly (N-1)·s elements sent, all to one ring neighbour: a ring, not a shortcut."""
    sent, ring = sum(b for _, b in sends), (world - 1) * s * 4
    require(sent == ring, f"rank {rank} sent {sent} bytes; a ring reduce-scatter sends exactly "
            f"(N-1)/N of the {world * s * 4}-byte input, {ring} bytes",
            hint="send one chunk (s elements) per step, N-1 steps, with dist.isend / dist.send: a "
                 "reduce-scatter is the first half of the ring all-reduce, nothing more.")
    require(ring_direction(sends, rank, world) is not None, f"rank {rank} sent to ranks "
            f"{sorted({peer for peer, _ in sends})}, not only to its neighbour",
            hint="in a ring, rank r sends only to its right neighbour (r + 1) % N and receives "
                 "from its left one; sending each chunk straight to its owner is not a ring.")


@exercise(points=2, timeout=90.0, reference="companion.collectives.ring_reduce_scatter")
def check_ring_reduce_scatter(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(output, input): sum `input` (N·s elements) over the ranks of the world and leave
    chunk `rank` of the sum in `output` (s elements), with point-to-point sends only."""
    packed, seed = _ranks.packed(answer), fresh_seeds(1)[0]
    shards = [257, 3, 1]
    for world in (2, 3):
        per_rank = _ranks.on_ranks(_scatter_worker, world, packed, seed, shards,
                             timeout=worker_timeout)
        for i, s in enumerate(shards):
            expected = sum(_ranks.rank_tensor(seed, r, world * s) for r in range(world)).view(world, s)
            for rank in range(world):
                got, sends, returned_nothing = per_rank[rank][i]
                compare(got, expected[rank], name=f"rank {rank}'s output (s = {s}, {world} "
                        "ranks)", hint=_scatter_hint(got, rank, world, s, seed))
                require(returned_nothing, "return nothing (None): the result goes into output")
                _judge_scatter_traffic(sends, rank, world, s)
    full = 3 * 257 * 4
    return (f"rank r holds chunk r of the sum on 2 and 3 ranks; each of 3 ranks sent "
            f"{sum(b for _, b in per_rank[0][0][1])} bytes for a {full}-byte input ((N-1)/N·S = "
            f"{collectives.shard_bytes_per_rank(full, 3):.0f}; an all-reduce sends twice that)")
