"""The ring checks of chapters 06 and 07 hold an answer to a ring: point-to-point calls only (an
allowlist, under dist.* and distributed_c10d.*), exactly a ring's bytes, every send to one neighbour.

Each answer below gives the right sums without being a ring, so only the guard can catch it. They
live at module level, so the gloo workers can import them by name.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from companion import collectives
from companion.checks import ch06, ch07
from companion.checks._collective_guard import point_to_point_only, ring_direction
from companion.checks.core import CheckFailed


# ---------------------------------------------------------------- reduce-scatter (chapter 07)

def _swap_all(sends: dict, receive_from: list, like: torch.Tensor) -> list:
    """isend each sends[peer] to peer, then recv one tensor from each of receive_from."""
    requests = [dist.isend(t.contiguous(), peer) for peer, t in sends.items()]
    arrived = []
    for peer in receive_from:
        arrived.append(torch.empty_like(like))
        dist.recv(arrived[-1], peer)
    for request in requests:
        request.wait()
    return arrived


def rs_straight_to_owner(output, input):
    """Chunk c goes straight to rank c: (N-1)·s elements, as many bytes as the ring, not a ring."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = input.view(world, -1)
    others = [c for c in range(world) if c != rank]
    arrived = _swap_all({c: chunks[c] for c in others}, others, output)
    output.copy_(chunks[rank] + sum(arrived))


def rs_all_to_all_single(output, input):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(input)
    dist.all_to_all_single(out, input.contiguous())
    output.copy_(out.view(world, -1).sum(0))


def rs_all_gather_object(output, input):
    rank, world = dist.get_rank(), dist.get_world_size()
    objects = [None] * world
    dist.all_gather_object(objects, input)
    output.copy_(sum(objects).view(world, -1)[rank])


def rs_c10d_all_reduce(output, input):
    total = input.clone()
    distributed_c10d.all_reduce(total)
    output.copy_(total.view(dist.get_world_size(), -1)[dist.get_rank()])


def rs_process_group_all_reduce(output, input):
    """The ProcessGroup's own method, below the Python API: no bytes go through a send."""
    total = input.clone()
    dist.group.WORLD.allreduce([total]).wait()
    output.copy_(total.view(dist.get_world_size(), -1)[dist.get_rank()])


def rs_ring_plus_a_copy(output, input):
    """The ring, and the whole input sent to the right neighbour as well."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _swap_all({(rank + 1) % world: input}, [(rank - 1) % world], input)
    collectives.ring_reduce_scatter(output, input)


def rs_left_ring(output, input):
    """A correct ring that runs the other way round: sends left, receives from the right."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = input.view(world, -1)
    sending = chunks[(rank + 1) % world].clone()
    for step in range(world - 1):
        buffer = torch.empty_like(output)
        request = dist.isend(sending, (rank - 1) % world)
        dist.recv(buffer, (rank + 1) % world)
        request.wait()
        buffer += chunks[(rank + step + 2) % world]
        sending = buffer
    output.copy_(sending)


@pytest.mark.parametrize("answer, words", [
    (rs_straight_to_owner, "not a ring"),
    (rs_all_to_all_single, "dist.all_to_all_single is a collective"),
    (rs_all_gather_object, "dist.all_gather_object is a collective"),
    (rs_c10d_all_reduce, "dist.all_reduce is a collective"),
    (rs_process_group_all_reduce, "sent 0 bytes"),
    (rs_ring_plus_a_copy, "sends exactly"),
], ids=lambda v: getattr(v, "__name__", None))
def test_reduce_scatter_that_is_not_a_ring_fails_with_its_hint(answer, words):
    with pytest.raises(CheckFailed) as info:
        ch07.check_ring_reduce_scatter(answer)
    assert words in str(info.value)


def test_a_ring_either_way_round_passes_the_reduce_scatter_check(capsys):
    ch07.check_ring_reduce_scatter(rs_left_ring)
    assert "passed" in capsys.readouterr().out


# ---------------------------------------------------------------- all-reduce (chapter 06)

def ar_straight_to_owner(tensor, group=None):
    """Chunk c (padded to ceil(numel/N)) to its owner c, the owner's sum back to everyone: a
    ring's bytes, but not a ring (on 3 ranks each rank sends to both others)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = torch.zeros(-(-tensor.numel() // world) * world)
    padded[:tensor.numel()] = tensor.view(-1)
    chunks = padded.view(world, -1)
    others = [c for c in range(world) if c != rank]
    mine = chunks[rank] + sum(_swap_all({c: chunks[c] for c in others}, others, chunks[rank]))
    for c, total in zip(others, _swap_all({c: mine for c in others}, others, mine)):
        chunks[c] = total
    chunks[rank] = mine
    tensor.view(-1).copy_(padded[:tensor.numel()])


def ar_all_to_all_single(tensor, group=None):
    out = torch.empty(tensor.numel() * dist.get_world_size())
    dist.all_to_all_single(out, tensor.repeat(dist.get_world_size()))
    tensor.copy_(out.view(dist.get_world_size(), -1).sum(0).view_as(tensor))


def ar_all_gather_object(tensor, group=None):
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, tensor)
    tensor.copy_(sum(objects))


def ar_c10d_all_reduce(tensor, group=None):
    distributed_c10d.all_reduce(tensor)


def ar_process_group_all_reduce(tensor, group=None):
    dist.group.WORLD.allreduce([tensor]).wait()


@pytest.mark.parametrize("answer, words", [
    (ar_straight_to_owner, "not only to its neighbour"),
    (ar_all_to_all_single, "dist.all_to_all_single is a collective"),
    (ar_all_gather_object, "dist.all_gather_object is a collective"),
    (ar_c10d_all_reduce, "dist.all_reduce is a collective"),
    (ar_process_group_all_reduce, "sent 0 bytes in all"),
], ids=lambda v: getattr(v, "__name__", None))
def test_all_reduce_that_is_not_a_ring_fails_with_its_hint(answer, words):
    with pytest.raises(CheckFailed) as info:
        ch06.check_ring_all_reduce(answer)
    assert words in str(info.value)


# ---------------------------------------------------------------- the guard itself

def test_the_guard_restores_torch_distributed_and_reads_directions():
    before = {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single", "isend")}
    c10d_before = distributed_c10d.isend
    with point_to_point_only([]):
        assert dist.all_reduce is not before["all_reduce"]
        assert distributed_c10d.all_to_all_single is dist.all_to_all_single
        assert dist.get_rank is distributed_c10d.get_rank      # queries are left alone
        with pytest.raises(RuntimeError, match="all_gather_object is a collective"):
            dist.all_gather_object([None], 1)
    assert {name: getattr(dist, name) for name in before} == before
    assert distributed_c10d.isend is c10d_before
    assert ring_direction([(2, 4), (2, 8)], 1, 3) == 1
    assert ring_direction([(0, 4)], 1, 3) == -1
    assert ring_direction([(0, 4), (2, 4)], 1, 3) is None
    assert ring_direction([], 1, 3) is None
