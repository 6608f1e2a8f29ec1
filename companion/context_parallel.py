"""Context parallelism: one attention layer's sequence split over k ranks, exact against full
attention.

A 128k-token context does not fit one GPU's activations even with FlashAttention: q, k, v and the
output alone grow with T. Split the sequence: rank r holds T/k tokens of q, k and v (B, H, T/k, d).
Attention still needs every key for every query, so the ranks must exchange something:

- Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889):
  keep the queries, pass the keys and values round the ring k - 1 times (send to r + 1, receive
  from r - 1, the next block in flight while this one is computed). Each block's partial softmax
  merges into the running one with chapter 10's online softmax (`companion.attention.online`), so
  the result is exact. Per rank per layer forward: 2·(k-1)·B·H·(T/k)·d elements sent; the scores
  in memory at once are one (T/k, T/k) block, not (T, T). Causal: blocks wholly in the future are
  skipped, so with contiguous chunks rank r computes r + 1 blocks and the last rank k of them; the
  zigzag split (rank r holds chunks r and 2k-1-r of 2k) gives every rank 2k + 1 half-size blocks.
- Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509): an all-to-all turns
  sequence-sharded q, k, v into head-sharded ones (B, H/k, T, d), each rank runs full attention on
  its heads, and a second all-to-all brings the output back to sequence shards. Per rank per layer
  forward: 4 tensors x (k-1)/k of the local shard sent, falling with k; needs H divisible by k.

Example (inside a rank started by `companion.launch.run`):
    >>> q, k, v = (shard_sequence(t, rank, world, layout="zigzag") for t in (Q, K, V))
    >>> traffic = RingStats()
    >>> out = ring_attention(q, k, v, causal=True, layout="zigzag", stats=traffic)  # doctest: +SKIP
    >>> traffic.sent_bytes == ring_bytes_per_rank(q.shape, world, q.dtype)            # True

Backward of ring attention is a custom autograd.Function: it saves q, k, v, the output and one
log-sum-exp per query (linear in T/k, as FlashAttention does), passes k, v round the ring again and
sends each block's accumulated dk, dv along with it until they reach their owner: 4·(k-1) shards
sent per rank. Autograd through the forward's ops would instead keep every step's (T/k, T/k)
probabilities: k of them, the whole (T/k, T) row band.

Simplified vs PyTorch (torch.distributed.tensor.experimental.context_parallel) / the papers: each
block is computed with its scores written out (PyTorch calls the fused SDPA kernels per block);
one message carries k and v together; no Llama-3-style all-gather variant; Ulysses takes q, k, v
with one head count (no grouped-query heads) and only contiguous chunks; the all-to-all is k - 1
paired send/recv steps, counted as sent (torch 2.13's gloo has `all_to_all_single` too), which
moves exactly the bytes NCCL's would.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from companion.attention.online import merge
from companion.collectives import Traffic

__all__ = ["LAYOUTS", "RingStats", "chunk_ids", "shard_sequence", "unshard_sequence",
           "ring_attention", "ulysses_attention", "all_to_all", "ring_bytes_per_rank",
           "ulysses_bytes_per_rank", "ring_blocks", "ring_kept_bytes", "attention_memory"]

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass
class RingStats(Traffic):
    """Bytes sent and received, plus the attention blocks computed (pairs of q and kv chunks) and
    the score entries they wrote (per batch and head), in forward."""

    blocks: int = 0
    scores: int = 0
    backward: "RingStats | None" = None       # ring_attention's backward counts here


# ---------------------------------------------------------------- who holds which tokens

def chunk_ids(rank: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """The chunks of the sequence rank r holds, in order: [r] of k ("contiguous"), or
    [r, 2k-1-r] of 2k ("zigzag": an early chunk with few keys to see, a late one with many)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def _chunks_per_rank(layout: str) -> int:
    return len(chunk_ids(0, 1, layout))


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *,
                   layout: str = "contiguous") -> torch.Tensor:
    """Rank r's part of a full (B, H, T, d) tensor: (B, H, T/k, d), chunks in `chunk_ids` order."""
    n = world_size * _chunks_per_rank(layout)
    if x.ndim != 4 or x.shape[-2] % n:
        raise ValueError(f"the sequence must be (B, H, T, d) with T divisible by {n} "
                         f"({world_size} ranks x {n // world_size} chunks, layout {layout!r}); "
                         f"got shape {tuple(x.shape)}: pad T to a multiple of {n}")
    chunks = x.chunk(n, dim=-2)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world_size, layout)], dim=-2)


def unshard_sequence(shards: list[torch.Tensor], *, layout: str = "contiguous") -> torch.Tensor:
    """The full (B, H, T, d) sequence from every rank's shard, in rank order (inverse of shard)."""
    world, per = len(shards), _chunks_per_rank(layout)
    placed: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        placed.update(zip(chunk_ids(rank, world, layout), shard.chunk(per, dim=-2)))
    return torch.cat([placed[i] for i in range(world * per)], dim=-2)


def ring_blocks(world_size: int, *, layout: str = "contiguous", causal: bool = True) -> list[int]:
    """Blocks (q chunk, kv chunk) each rank computes in forward; a block is (T/k)² score entries
    per batch and head under "contiguous", (T/2k)² under "zigzag"."""
    return [len(_pairs(chunk_ids(r, world_size, layout),
                       [j for s in range(world_size) for j in chunk_ids(s, world_size, layout)],
                       causal)) for r in range(world_size)]


def _pairs(q_ids: list[int], kv_ids: list[int], causal: bool) -> list[tuple[int, int, bool]]:
    """(q position, kv position, diagonal?) of the blocks to compute: causal skips a kv chunk
    later than the q chunk and masks the one equal to it."""
    return [(i, j, causal and a == b) for i, a in enumerate(q_ids) for j, b in enumerate(kv_ids)
            if not causal or b <= a]


# ---------------------------------------------------------------- bytes, by formula

def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()


def ring_bytes_per_rank(shard_shape, world_size: int, dtype: torch.dtype, *,
                        backward: bool = False) -> int:
    """Ring attention's bytes sent per rank for a (B, H, T/k, d) shard: forward, k and v passed
    k - 1 times, 2·(k-1)·shard; backward, k, v again and dk, dv back to their owners,
    4·(k-1)·shard."""
    return (4 if backward else 2) * (world_size - 1) * _nbytes(shard_shape, dtype)


def ring_kept_bytes(shard_shape, dtype: torch.dtype) -> int:
    """Bytes ring attention's forward leaves for backward beyond its inputs: the (B, H, T/k, d)
    output and one log-sum-exp per query, B·H·(T/k)·(d+1) elements; linear in T/k."""
    *rows, d = shard_shape
    return _nbytes(rows, dtype) * (int(d) + 1)


def ulysses_bytes_per_rank(shard_shape, world_size: int, dtype: torch.dtype) -> int:
    """Ulysses' bytes sent per rank in forward (as many in backward): q, k, v to head shards and
    the output back, 4 all-to-alls that each keep 1/k of the shard and send (k-1)/k."""
    return 4 * (world_size - 1) * _nbytes(shard_shape, dtype) // world_size


# ---------------------------------------------------------------- point to point

def _start_pass(t: torch.Tensor, group, stats: Traffic | None):
    """Post the send of `t` to the right neighbour and the receive of the left one's (paired:
    NCCL needs them together); return (buffer, requests). Point-to-point, asynchronous."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    buffer = torch.empty_like(t)
    if stats is not None:
        stats.sent_bytes += t.numel() * t.element_size()
        stats.received_bytes += buffer.numel() * buffer.element_size()
        stats.messages += 1
    ops = [dist.P2POp(dist.isend, t, right, group=group),
           dist.P2POp(dist.irecv, buffer, left, group=group)]
    return buffer, dist.batch_isend_irecv(ops)


def _finish(buffer: torch.Tensor, requests) -> torch.Tensor:
    for request in requests:
        request.wait()
    return buffer


def _peer(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# ---------------------------------------------------------------- ring attention

def _scores(q, k, scale: float, diagonal: bool) -> torch.Tensor:
    """q kᵀ · scale for one block, (B, H, c, c); on the diagonal block, future keys at -inf."""
    s = (q @ k.transpose(-2, -1)) * scale                      # (B, H, c, c): the only c² tensor
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _block_forward(q, k, v, scale, diagonal):
    """One block's partial softmax (m, l, o), chapter 10's form: m, l (B, H, c); o (B, H, c, d)."""
    s = _scores(q, k, scale, diagonal)
    m = s.amax(dim=-1)
    p = torch.exp(s - m[..., None])
    l = p.sum(dim=-1)
    return m, l, (p @ v) / l[..., None]


def _block_backward(q, k, v, do, lse, delta, scale, diagonal):
    """FlashAttention's backward for one block: P recomputed from the saved log-sum-exp."""
    p = torch.exp(_scores(q, k, scale, diagonal) - lse[..., None])   # (B, H, c, c), masked -> 0
    dv = p.transpose(-2, -1) @ do
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])          # softmax's backward
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _ring_forward(q, k, v, group, causal, layout, scale, stats):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q_ids, n = chunk_ids(rank, world, layout), _chunks_per_rank(layout)
    c = q.shape[-2] // n                                        # rows of one chunk
    m = q.new_full(q.shape[:-1], float("-inf"))                 # (B, H, T/k) running max
    l = q.new_zeros(q.shape[:-1])                               # (B, H, T/k) running sum
    o = torch.zeros_like(q)                                     # (B, H, T/k, d)
    kv = torch.stack([k, v])                                    # (2, B, H, T/k, d): one message
    for step in range(world):
        if step < world - 1:                                    # 1. next block in flight
            arriving = _start_pass(kv, group, stats)
        src = (rank - step) % world                             # 2. whose keys we hold
        for i, j, diagonal in _pairs(q_ids, chunk_ids(src, world, layout), causal):
            rows = slice(i * c, (i + 1) * c)
            part = _block_forward(q[..., rows, :], kv[0][..., j * c:(j + 1) * c, :],
                                  kv[1][..., j * c:(j + 1) * c, :], scale, diagonal)
            m[..., rows], l[..., rows], o[..., rows, :] = merge(      # 3. online softmax
                m[..., rows], l[..., rows], o[..., rows, :], *part)
            if stats is not None:
                stats.blocks += 1
                stats.scores += c * c
        if step < world - 1:
            kv = _finish(*arriving)                             # 4. wait: point-to-point
    return o, m + torch.log(l)                                  # lse: (B, H, T/k)


def _ring_backward(do, q, k, v, o, lse, group, causal, layout, scale, stats):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q_ids, n = chunk_ids(rank, world, layout), _chunks_per_rank(layout)
    c = q.shape[-2] // n
    delta = (do * o).sum(dim=-1)                                # (B, H, T/k): rowsum(dO ∘ O)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])                                    # travels round the ring again
    dkv_own = torch.zeros_like(kv)                              # my block's grads from my queries
    dkv = dkv_own                                               # grads of the block held now
    for step in range(world):
        if step < world - 1:
            arriving = _start_pass(kv, group, stats)
        src = (rank - step) % world
        for i, j, diagonal in _pairs(q_ids, chunk_ids(src, world, layout), causal):
            rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
            dq_b, dk_b, dv_b = _block_backward(
                q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], do[..., rows, :],
                lse[..., rows], delta[..., rows], scale, diagonal)
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
        if step == world - 1:
            break
        kv = _finish(*arriving)
        # dk, dv of a block follow it: the accumulated sum goes right with the block it belongs to
        dkv = torch.zeros_like(kv) if step == 0 else _finish(*_start_pass(dkv, group, stats))
    if world > 1:                                               # the last sums go home
        dkv_own = dkv_own + _finish(*_start_pass(dkv, group, stats))
    return dq, dkv_own[0], dkv_own[1]


class _RingAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the log-sum-exp: no (T/k, T/k) tensor outlives a block."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, stats):
        o, lse = _ring_forward(q, k, v, group, causal, layout, scale, stats)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (group, causal, layout, scale, stats)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        group, causal, layout, scale, stats = ctx.options
        grads = _ring_backward(do.contiguous(), q, k, v, o, lse, group, causal, layout, scale,
                               None if stats is None else stats.backward)
        return (*grads, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, layout: str = "contiguous",
                   stats: RingStats | None = None) -> torch.Tensor:
    """softmax(q kᵀ/√d) v for this rank's queries over the whole sequence's keys passed round a
    ring.

    q, k, v: (B, H, T/k, d), this rank's chunks of the sequence as `shard_sequence` cuts them with
    the same `layout` ("contiguous" or "zigzag", which balances causal work). Returns this rank's
    (B, H, T/k, d) output. Memory: one (B, H, T/k, T/k) score block at a time plus two k, v
    buffers. Traffic: `ring_bytes_per_rank`; `stats` (a RingStats) counts the forward's bytes and
    blocks, and `stats.backward` (a RingStats made on first use) the backward's.
    """
    _check(q, k, v, group, causal)
    n = _chunks_per_rank(layout)
    if q.shape[-2] % n:
        raise ValueError(f"layout {layout!r} splits each rank's {q.shape[-2]} tokens into {n} "
                         "equal chunks: make T divisible by 2k (shard with shard_sequence)")
    if stats is not None and stats.backward is None:
        stats.backward = RingStats()
    scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, group, causal, layout, scale, stats)


def _check(q, k, v, group, causal) -> int:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.ndim != 4:
            raise ValueError(f"{name} must be a floating-point (B, H, T/k, d) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if not q.shape == k.shape == v.shape or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one shape and dtype, got {tuple(q.shape)} "
                         f"{q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    if not dist.is_initialized():
        raise RuntimeError("no process group: call this inside ranks started by "
                           "companion.launch.run (or torchrun with init_process_group)")
    return dist.get_world_size(group)


# ---------------------------------------------------------------- Ulysses

def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None, *,
               stats: Traffic | None = None) -> torch.Tensor:
    """Cut `x` in k pieces along `scatter_dim`, send piece j to rank j, and join the pieces that
    arrive, in rank order, along `gather_dim`. Built from k - 1 paired send/recv steps (step s:
    to r + s, from r - s): (k-1)/k of x sent per rank. Not differentiable (see `_AllToAll`)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pieces = [p.contiguous() for p in x.chunk(world, dim=scatter_dim)]
    arrived = [pieces[rank] if src == rank else torch.empty_like(pieces[rank])
               for src in range(world)]
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        if stats is not None:
            stats.sent_bytes += pieces[dst].numel() * pieces[dst].element_size()
            stats.received_bytes += arrived[src].numel() * arrived[src].element_size()
            stats.messages += 1
        ops = [dist.P2POp(dist.isend, pieces[dst], _peer(group, dst), group=group),
               dist.P2POp(dist.irecv, arrived[src], _peer(group, src), group=group)]
        for request in dist.batch_isend_irecv(ops):             # point-to-point, paired
            request.wait()
    return torch.cat(arrived, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The all-to-all's gradient is the all-to-all back (scatter and gather dims swapped)."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, stats):
        ctx.options = (scatter_dim, gather_dim, group, stats)
        return all_to_all(x, scatter_dim, gather_dim, group, stats=stats)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group, stats = ctx.options
        back = None if stats is None else stats.backward
        return all_to_all(grad, gather_dim, scatter_dim, group, stats=back), None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                      causal: bool = False, stats: RingStats | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to head shards, full attention on H/k heads, all-to-all back.

    q, k, v: (B, H, T/k, d), contiguous chunks of the sequence (`shard_sequence`, layout
    "contiguous"), H divisible by k. Returns this rank's (B, H, T/k, d) output. Memory: full
    attention over T for H/k heads. Traffic: `ulysses_bytes_per_rank`, counted in `stats` (forward)
    and `stats.backward`.
    """
    world = _check(q, k, v, group, causal)
    if q.shape[1] % world:
        raise ValueError(f"Ulysses gives each of the {world} ranks H/k whole heads: {q.shape[1]} "
                         f"heads do not divide by {world}; use ring_attention, or a head count "
                         "that is a multiple of the ranks")
    if stats is not None and stats.backward is None:
        stats.backward = RingStats()
    # 1. sequence shards -> head shards: (B, H, T/k, d) -> (B, H/k, T, d), all-to-all x 3
    qh, kh, vh = (_AllToAll.apply(t, 1, 2, group, stats) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)     # 2. (B, H/k, T, d)
    return _AllToAll.apply(out, 2, 1, group, stats)             # 3. back: (B, H, T/k, d)


# ---------------------------------------------------------------- memory per rank, measured

def attention_memory(rank: int, world_size: int, seq_len: int, layout: str = "contiguous",
                     causal: bool = True, batch: int = 1, heads: int = 4,
                     head_dim: int = 16) -> dict[str, int]:
    """A worker for `launch.run`: bytes one rank's attention allocates (`companion.memory.track`),
    for ring attention on its (B, H, T/k, d) fp32 shard and for full written-out attention
    (`naive_attention`) on the whole (B, H, T, d) sequence in one process. Returns "ring_peak",
    "ring_kept" (live after forward: what backward needs), "full_peak" and "full_kept"."""
    from companion.attention.naive import naive_attention
    from companion.memory import track
    g = torch.Generator().manual_seed(rank)
    full = [torch.randn(batch, heads, seq_len, head_dim, generator=g) for _ in range(3)]
    shards = [shard_sequence(t, rank, world_size, layout=layout).requires_grad_() for t in full]
    with track("cpu") as ring:
        out = ring_attention(*shards, causal=causal, layout=layout)
    with track("cpu") as whole:
        out_full = naive_attention(*(t.requires_grad_() for t in full), is_causal=causal)
    del out, out_full
    return {"ring_peak": ring.peak, "ring_kept": ring.current,
            "full_peak": whole.peak, "full_kept": whole.current}
