"""companion.collectives: naive and ring all-reduce against dist.all_reduce, and their traffic."""
import pytest
import torch
import torch.distributed as dist

from companion import collectives, launch
from companion.compat import all_gather_tensor, reduce_scatter_tensor
from companion.collectives import Traffic

LENGTHS = [1, 2, 3, 5, 12, 1001]


def _inputs(rank, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(-50, 50, (numel,), generator=g, dtype=dtype)


def _compare_with_gloo(rank, world_size, seed):
    """For every length and dtype: ours against dist.all_reduce on the same inputs."""
    worst = 0.0
    for impl in (collectives.ring_all_reduce, collectives.naive_all_reduce):
        for numel in LENGTHS:
            for dtype in (torch.float32, torch.float64, torch.int64):
                ours = _inputs(rank, numel, dtype, seed)
                theirs = ours.clone()
                assert impl(ours) is None                       # in place, like dist.all_reduce
                dist.all_reduce(theirs)
                worst = max(worst, float((ours.double() - theirs.double()).abs().max()))
        grid = _inputs(rank, 35, torch.float32, seed).reshape(5, 7).t()   # non-contiguous (7, 5)
        expected = grid.clone()
        dist.all_reduce(expected)
        impl(grid)
        worst = max(worst, float((grid - expected).abs().max()))
    return worst


def _traffic(rank, world_size, numel):
    ring, naive = Traffic(), Traffic()
    collectives.ring_all_reduce(torch.ones(numel), stats=ring)
    collectives.naive_all_reduce(torch.ones(numel), stats=naive)
    return ring, naive


def _subgroup(rank, world_size):
    group = dist.new_group([1, 2])
    x = torch.full((4,), float(rank))
    if rank in (1, 2):
        collectives.ring_all_reduce(x, group)
    y = torch.full((5,), float(rank))
    if rank in (1, 2):
        collectives.naive_all_reduce(y, group)
    return x.tolist(), y.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_gloo_all_reduce_for_any_length_and_dtype(world_size):
    worst = launch.run(_compare_with_gloo, world_size, 7, timeout=60)
    assert max(worst) < 1e-5


def test_four_ranks_with_fewer_elements_than_ranks():
    assert max(launch.run(_compare_with_gloo, 4, 3, timeout=60)) < 1e-5


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_sends_2_n_minus_1_over_n_of_the_tensor_and_naive_loads_the_root(world_size):
    numel = 6 * 4                                     # divisible by 2 and 3: exact formula
    nbytes = numel * 4
    results = launch.run(_traffic, world_size, numel, timeout=30)
    for rank, (ring, naive) in enumerate(results):
        assert ring.sent_bytes == ring.received_bytes == \
            collectives.ring_bytes_per_rank(nbytes, world_size)
        assert ring.messages == 2 * (world_size - 1)
        expected_naive = collectives.naive_root_bytes(nbytes, world_size) if rank == 0 else nbytes
        assert naive.sent_bytes == naive.received_bytes == expected_naive


def test_works_inside_a_subgroup():
    results = launch.run(_subgroup, 3, timeout=30)
    assert results[0] == ([0.0] * 4, [0.0] * 5)
    assert results[1] == results[2] == ([3.0] * 4, [3.0] * 5)


def test_formulas():
    assert collectives.ring_bytes_per_rank(1000, 4) == 1500
    assert collectives.naive_root_bytes(1000, 4) == 3000


def _scatter_gather(rank, world_size, shard):
    """Ring reduce-scatter and all-gather against gloo's, out of place and in place, with bytes."""
    full = _inputs(rank, world_size * shard, torch.float32, 5)
    kept = full.clone()
    ours, theirs = torch.empty(shard), torch.empty(shard)
    rs = Traffic()
    collectives.ring_reduce_scatter(ours, full, stats=rs)
    reduce_scatter_tensor(theirs, full.clone())
    in_place = full.clone()
    collectives.ring_reduce_scatter(in_place.view(world_size, -1)[rank], in_place)
    gathered, expected, ag = torch.empty(world_size * shard), torch.empty(world_size * shard), \
        Traffic()
    collectives.ring_all_gather(gathered, ours, stats=ag)
    all_gather_tensor(expected, ours)
    buffer = torch.zeros(world_size * shard)
    buffer.view(world_size, -1)[rank].copy_(ours)
    collectives.ring_all_gather(buffer, buffer.view(world_size, -1)[rank])
    return (torch.equal(full, kept), (ours - theirs).abs().max().item(),
            (in_place.view(world_size, -1)[rank] - theirs).abs().max().item(),
            torch.equal(gathered, expected), torch.equal(buffer, expected), rs, ag)


@pytest.mark.parametrize("world_size, shard", [(2, 5), (3, 4)])
def test_ring_reduce_scatter_and_all_gather_match_gloo_and_send_n_minus_1_over_n(world_size,
                                                                                shard):
    for kept, rs_diff, in_place_diff, gathered, gathered_in_place, rs, ag in launch.run(
            _scatter_gather, world_size, shard, timeout=30):
        assert kept and rs_diff < 1e-5 and in_place_diff < 1e-5
        assert gathered and gathered_in_place
        full_bytes = world_size * shard * 4
        for traffic in (rs, ag):
            assert traffic.sent_bytes == traffic.received_bytes == \
                collectives.shard_bytes_per_rank(full_bytes, world_size)
            assert traffic.messages == world_size - 1


def _uneven(rank, world_size):
    try:
        collectives.ring_reduce_scatter(torch.empty(2), torch.empty(5))
    except ValueError as e:
        return str(e)


def test_reduce_scatter_asks_for_padding_when_sizes_do_not_fit():
    assert all("pad it to a multiple" in m for m in launch.run(_uneven, 2, timeout=30))


def _ring_without_lone_receives(rank, world_size):
    """NCCL runs one stream's point-to-point operations in order: a send posted alone, then a
    blocking receive, deadlocks when every rank does it. Emulated here: a blocking recv raises,
    and every exchange must be posted as one batch."""
    batches = []

    def lone_recv(*args, **kwargs):
        raise AssertionError("a blocking recv: NCCL would deadlock on a ring of sends")

    def batch(ops):
        batches.append(sorted(op.op.__name__ for op in ops))
        return real_batch(ops)
    real_batch = dist.batch_isend_irecv
    dist.recv, real_recv = lone_recv, dist.recv
    dist.batch_isend_irecv = batch
    try:
        x = torch.arange(10.0) * (rank + 1)
        expected = x.clone()
        dist.all_reduce(expected)
        collectives.ring_all_reduce(x)
        full = torch.arange(4.0 * world_size) + rank
        shard, gathered = torch.empty(4), torch.empty(4 * world_size)
        collectives.ring_reduce_scatter(shard, full)
        collectives.ring_all_gather(gathered, shard)
        want = full.clone()
        dist.all_reduce(want)
        return torch.equal(x, expected) and torch.equal(gathered, want), batches
    finally:
        dist.recv, dist.batch_isend_irecv = real_recv, real_batch


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_ring_step_posts_its_send_and_receive_together(world_size):
    for ok, batches in launch.run(_ring_without_lone_receives, world_size, timeout=60):
        assert ok
        steps = 2 * (world_size - 1) + 2 * (world_size - 1)     # all-reduce, then RS + AG
        assert batches == [["irecv", "isend"]] * steps
