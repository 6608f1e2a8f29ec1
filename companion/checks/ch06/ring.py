"""Chapter 06, exercise 1: a ring all-reduce of sends and receives, run on 2, 3 and 4 gloo ranks,
first on tensors that split into N chunks of nearly equal length, then on short and uneven ones
(some chunks empty, or of different lengths)."""
from __future__ import annotations

import math
import pickle

import torch

from companion import collectives
from companion.checks import _ranks
from companion.checks._collective_guard import point_to_point_only, ring_direction
from companion.checks.core import CheckFailed, compare, exercise, fresh_seeds, require

__all__ = ["check_ring_all_reduce"]


def _ring_worker(rank: int, world_size: int, packed: bytes, seed: int, lengths: list[int]):
    results, log = [], []
    with point_to_point_only(log):
        answer = pickle.loads(packed)        # imported after patching: `from dist import send`
        for numel in lengths:
            tensor = _ranks.rank_tensor(seed, rank, numel)
            del log[:]
            returned = answer(tensor)
            results.append((tensor, list(log), returned is None or returned is tensor))
    return results


_ORDER_HINT = ("a blocking dist.send returns only once the neighbour has posted the matching "
               "dist.recv (gloo holds a send until its receiver is ready, and NCCL may): if every "
               "rank sends first, or every rank receives first, each waits for a neighbour that is "
               "doing the same. Find an order in which no rank waits on a call its neighbour "
               "cannot reach yet. A request from a non-blocking call must be waited on "
               "before its buffer is read or sent again, and before the function returns.")
_EMPTY_HINT = ("these tensors split unevenly over the ranks: when the tensor is shorter than N, "
               "torch.tensor_split leaves some chunks empty (as do chunks of ceil(numel/N), and "
               "torch.chunk returns fewer than N). A receive posted for an empty chunk that the "
               "neighbour never sends takes the next message in its place (gloo aborts the "
               "process: 'op.preamble.length <= op.nbytes'), and a send that the neighbour "
               "never receives waits forever: both sides must agree on each chunk, empty or not.")


def _ring_on_ranks(world: int, packed: bytes, seed: int, lengths: list[int], timeout: float,
                   uneven: bool):
    """The ring worker on `world` ranks; ranks that hang or die fail with what makes a ring hang
    (`uneven`: the lengths that leave chunks empty or unequal, the likely cause then)."""
    try:
        return _ranks.on_ranks(_ring_worker, world, packed, seed, lengths, timeout=timeout)
    except CheckFailed as e:
        if uneven:
            raise CheckFailed(f"{e.summary} (on {world} ranks, tensors of {lengths} elements; "
                              "the longer ones passed)", got=e.got, hint=_EMPTY_HINT) from None
        if "did not finish" not in e.summary:
            raise
        raise CheckFailed(f"{e.summary} (on {world} ranks)", hint=_ORDER_HINT) from None


def _chunk_hint(got: torch.Tensor, expected: torch.Tensor, own: torch.Tensor,
                uneven: bool) -> str:
    if torch.allclose(got, own):
        return "the tensor is unchanged: write the sum into it in place (tensor.copy_(...))."
    right = float(torch.isclose(got, expected, rtol=1e-4, atol=1e-5).float().mean())
    return (f"{right:.0%} of the elements are right: chunks are sent too early or land in the "
            "wrong slot. After reduce-scatter each rank must hold the complete sum of one chunk, "
            "which has passed through every rank once; trace, for N = 3, which chunk each rank "
            "holds complete after each step." + (" " + _EMPTY_HINT if uneven else ""))


def _judge_ring_traffic(sends: list[list[tuple[int, int]]], numel: int) -> None:
    """Each rank sent at most 2(N-1)·ceil(numel/N) elements, all to one ring neighbour, and the
    ranks together exactly 2(N-1) chunks' worth: 2(N-1)·numel elements (or with chunks padded to
    ceil(numel/N), 2(N-1)·N·ceil)."""
    world = len(sends)
    sent = [sum(b for _, b in log) for log in sends]
    limit, chunk = 2 * (world - 1) * math.ceil(numel / world) * 4, math.ceil(numel / world)
    hint = ("send one chunk (1/N of the tensor) per step, 2(N-1) steps, with dist.isend / "
            "dist.send; sending whole tensors to one rank is the naive all-reduce.")
    for rank in range(world):
        require(sent[rank] <= limit, f"rank {rank} sent {sent[rank]} bytes for a {numel * 4}-"
                f"byte tensor on {world} ranks; a ring sends 2(N-1)/N·S, at most {limit}",
                hint=hint)
    ring = [2 * (world - 1) * numel * 4, 2 * (world - 1) * world * chunk * 4]
    require(sum(sent) in ring, f"the {world} ranks sent {sum(sent)} bytes in all for a "
            f"{numel * 4}-byte tensor; a ring sends exactly 2(N-1)·S = {ring[0]}", hint=hint)
    for rank in range(world):
        require(not sends[rank] or ring_direction(sends[rank], rank, world) is not None,
                f"rank {rank} sent to ranks {sorted({peer for peer, _ in sends[rank]})}, not "
                "only to its neighbour", hint="in a ring, rank r sends only to its right "
                "neighbour (r + 1) % N and receives from its left one.")


@exercise(points=2, timeout=90.0, reference=("companion.collectives.ring_all_reduce",
                                             "companion.collectives.naive_all_reduce",
                                             "companion.collectives.ring_reduce_scatter",
                                             "companion.collectives.ring_all_gather"))
def check_ring_all_reduce(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(tensor, group=None): sum `tensor` over all ranks in place, with a ring of sends."""
    packed, seed = _ranks.packed(answer), fresh_seeds(1)[0]
    for world in (2, 3, 4):
        for lengths, uneven in (([1001, 13], False), ([9, 6, 5, 4, 3, 2, 1], True)):
            per_rank = _ring_on_ranks(world, packed, seed, lengths, worker_timeout, uneven)
            for i, numel in enumerate(lengths):
                expected = sum(_ranks.rank_tensor(seed, r, numel) for r in range(world))
                for rank in range(world):
                    got, sends, in_place = per_rank[rank][i]
                    own = _ranks.rank_tensor(seed, rank, numel)
                    compare(got, expected, name=f"rank {rank}'s tensor ({numel} elements, "
                            f"{world} ranks)", hint=_chunk_hint(got, expected, own, uneven))
                    require(in_place, "return nothing (None): the result goes into the tensor "
                            "itself")
                _judge_ring_traffic([r[i][1] for r in per_rank], numel)
            if not uneven and world == 3:
                sent = sum(b for _, b in per_rank[0][0][1])
    s = 1001 * 4
    return (f"matches the sum on 2, 3 and 4 ranks for 9 lengths, 1 to 1001 (chunks empty or "
            f"unequal); each of 3 ranks sent {sent} bytes for a {s}-byte tensor (2(N-1)/N·S = "
            f"{collectives.ring_bytes_per_rank(s, 3):.0f}; the naive root sends "
            f"{collectives.naive_root_bytes(s, 3)})")
