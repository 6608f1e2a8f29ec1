"""companion.context_parallel: ring attention and Ulysses on gloo ranks equal full attention, their
bytes equal the formulas, causal work is balanced by the zigzag split, and bad input is refused."""
import pytest
import torch
import torch.nn.functional as F

from companion import context_parallel as cp, launch
from companion.memory import track

B, H, D = 2, 4, 8


def _full(T, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, do


def _reference(T, seed, causal):
    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(_full(T, seed)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _shard_run(rank, world, method, T, seed, causal, layout):
    """One rank: its shards of the seeded q, k, v, forward and backward; outputs, grads, stats."""
    shards = [cp.shard_sequence(t, rank, world, layout=layout) for t in _full(T, seed)]
    q, k, v = (t.clone().requires_grad_() for t in shards[:3])
    stats = cp.RingStats()
    if method == "ring":
        out = cp.ring_attention(q, k, v, causal=causal, layout=layout, stats=stats)
    else:
        out = cp.ulysses_attention(q, k, v, causal=causal, stats=stats)
    out.backward(shards[3])
    return out.detach(), q.grad, k.grad, v.grad, stats


def _gathered(results, layout):
    return [cp.unshard_sequence([r[i] for r in results], layout=layout) for i in range(4)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method,causal,layout", [
    ("ring", False, "contiguous"), ("ring", True, "contiguous"), ("ring", False, "zigzag"),
    ("ring", True, "zigzag"),
    ("ulysses", False, "contiguous"), ("ulysses", True, "contiguous")])
def test_equals_full_attention_and_bytes_equal_formulas(world, method, causal, layout):
    T = 8 * world
    results = launch.run(_shard_run, world, method, T, 7, causal, layout, timeout=60)
    for got, want in zip(_gathered(results, layout), _reference(T, 7, causal)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    shard = (B, H, T // world, D)
    if method == "ring":
        forward = cp.ring_bytes_per_rank(shard, world, torch.float64)
        backward = cp.ring_bytes_per_rank(shard, world, torch.float64, backward=True)
        assert forward == 2 * (world - 1) * B * H * (T // world) * D * 8
    else:
        forward = backward = cp.ulysses_bytes_per_rank(shard, world, torch.float64)
        assert forward == 4 * (world - 1) * B * H * (T // world) * D * 8 // world
    for *_, stats in results:
        assert (stats.sent_bytes, stats.received_bytes) == (forward, forward)
        assert (stats.backward.sent_bytes, stats.backward.received_bytes) == (backward, backward)


def _blocks(rank, world, T, causal, layout):
    q, k, v = (cp.shard_sequence(t, rank, world, layout=layout) for t in _full(T, 3)[:3])
    stats = cp.RingStats()
    cp.ring_attention(q, k, v, causal=causal, layout=layout, stats=stats)
    return stats.blocks, stats.scores


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_balances_causal_blocks(world):
    T = 8 * world
    assert cp.ring_blocks(world, layout="contiguous", causal=False) == [world] * world
    assert cp.ring_blocks(world, layout="contiguous") == list(range(1, world + 1))
    assert cp.ring_blocks(world, layout="zigzag") == [2 * world + 1] * world
    for layout, chunk in (("contiguous", T // world), ("zigzag", T // (2 * world))):
        counted = launch.run(_blocks, world, T, True, layout, timeout=60)
        assert [b for b, _ in counted] == cp.ring_blocks(world, layout=layout)
        assert [s for _, s in counted] == [b * chunk ** 2 for b in cp.ring_blocks(world,
                                                                                   layout=layout)]


def test_memory_per_rank_kept_linear_peak_one_block():
    T, world, d = 256, 4, 16                              # attention_memory's B = 1, H = 4
    for layout, chunk in (("contiguous", T // world), ("zigzag", T // (2 * world))):
        shard = (1, 4, T // world, d)
        shard_bytes, block = 4 * 4 * (T // world) * d, 4 * 4 * chunk ** 2
        for got in launch.run(cp.attention_memory, world, T, layout, timeout=60):
            assert got["ring_kept"] == cp.ring_kept_bytes(shard, torch.float32)
            assert got["full_kept"] == 4 * 4 * T * T + 4 * 4 * T * d + T * T   # P, out, mask
            assert block <= got["ring_peak"] - shard_bytes <= 8 * shard_bytes + 4 * block
            assert got["ring_peak"] < got["full_peak"] / 2


def _wrong(rank, world, mutant, T, seed):
    """A ring that forgets the rescale of the online softmax, or the causal mask on the diagonal."""
    if mutant == "no rescale":
        cp.merge = lambda m1, l1, o1, m2, l2, o2: (torch.maximum(m1, m2), l1 + l2, o1 + o2)
    else:
        pairs = cp._pairs
        cp._pairs = lambda q_ids, kv_ids, causal: [(i, j, False) for i, j, _ in
                                                   pairs(q_ids, kv_ids, causal)]
    return _shard_run(rank, world, "ring", T, seed, True, "contiguous")


@pytest.mark.parametrize("mutant", ["no rescale", "no diagonal mask"])
def test_a_wrong_ring_is_caught(mutant):
    results = launch.run(_wrong, 2, mutant, 16, 5, timeout=60)
    out = _gathered(results, "contiguous")[0]
    assert (out - _reference(16, 5, True)[0]).abs().max() > 1e-3


def _bad(rank, world, case):
    x = torch.randn(1, 3, 6, 4)
    with pytest.raises(ValueError) as error:
        if case == "T":
            cp.shard_sequence(torch.randn(1, 2, 7, 4), rank, world)
        elif case == "zigzag":
            cp.ring_attention(*(torch.randn(1, 2, 3, 4) for _ in range(3)), layout="zigzag")
        elif case == "heads":
            cp.ulysses_attention(x, x, x)
        else:
            cp.ring_attention(x, x[..., :5, :], x)
    return str(error.value)


@pytest.mark.parametrize("case,words", [("T", "divisible by 2"), ("zigzag", "2k"),
                                        ("heads", "3 heads do not divide by 2"),
                                        ("shapes", "one shape")])
def test_bad_input_is_refused_with_a_clear_message(case, words):
    assert all(words in message for message in launch.run(_bad, 2, case, timeout=30))
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.chunk_ids(0, 2, "striped")
