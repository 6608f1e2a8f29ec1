"""Workers for one rank alone, its collectives on a group of one: what one GPU records of
chapter 13 (`companion.record.parallelisms`), where NCCL cannot run two ranks on one device.

`block_shard_alone` (a t-way tensor-parallel share of a block), `ring_shard_alone` (one
context-parallel rank's shard through ring attention) and `attention_step_seconds` (interleaved
step times of split and full attention, on every rank) run under `companion.launch.run` like
`companion.parallel_runs`' workers.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from companion import context_parallel as cp, launch, memory, tensor_parallel as tp
from companion.parallel_runs import _warm_up

__all__ = ["block_shard_alone", "ring_shard_alone", "attention_step_seconds"]


def block_shard_alone(rank: int, world: int, block: nn.Module, x: torch.Tensor,
                      grad_out: torch.Tensor, ts) -> dict[int, dict[int, int]]:
    """A worker for a group of one rank (`world` 1: one GPU, where NCCL cannot run two ranks):
    for each t in `ts`, rank 0's share of a t-way split of `block` (a/t heads, 4h/t MLP columns,
    no sequence parallelism) forward and backward on `launch.rank_device()`. Its collectives run
    on the group of one, so they send nothing and its outputs are rank 0's partial sums, not the
    block's: what it measures is memory, the same as a rank of t allocates (the all-reduces'
    copies included). Returns {t: {"weights", "kept", "peak"}}: bytes of the shard's weights,
    kept for backward (input included, output not), and at the peak of forward + backward."""
    device = launch.rank_device()
    out = {}
    _warm_up(device)
    for t in ts:
        template = tp.TensorParallelBlock(block, 0, t)
        template.world = world              # the split is t-way; its collectives, a group of one
        with memory.track(device) as held:
            split = copy.deepcopy(template).to(device)
        xd = x.to(device).clone().requires_grad_()
        gd = grad_out.to(device)
        with memory.track(device) as tracker:
            y = split(xd)
            kept = (tracker.current - y.untyped_storage().nbytes()
                    + xd.untyped_storage().nbytes())
            y.backward(gd)
        out[t] = {"weights": held.current, "kept": kept, "peak": tracker.peak}
        del split, xd, gd, y
    return out


def ring_shard_alone(rank: int, world: int, tensors, ks, causal: bool = True
                     ) -> dict[int, dict[str, int]]:
    """A worker for a group of one rank: for each k in `ks`, the first of k contiguous shards of
    q, k, v (B, H, T/k, d) through `ring_attention` on the group of one (its own diagonal block,
    nothing passed round), forward and backward on `launch.rank_device()`; and, as k = 0, full
    attention (`F.scaled_dot_product_attention`) over the whole T. What one rank of k keeps for
    backward is the same (output and log-sum-exp); at its peak a real rank also holds the two k, v
    blocks in flight, and it computes up to k blocks, one after another. Returns
    {k: {"kept", "peak"}}: bytes live after forward (output included), and at the peak."""
    device = launch.rank_device()
    out = {}
    _warm_up(device)
    for k in (0, *ks):
        parts = [t if k == 0 else cp.shard_sequence(t, 0, k) for t in tensors]
        q, kk, v = (t.to(device).clone().requires_grad_() for t in parts[:3])
        do = parts[3].to(device)
        with memory.track(device) as tracker:
            o = (F.scaled_dot_product_attention(q, kk, v, is_causal=causal) if k == 0 else
                 cp.ring_attention(q, kk, v, causal=causal))
            kept = tracker.current
            o.backward(do)
        out[k] = {"kept": kept, "peak": tracker.peak}
        del q, kk, v, do, o
    return out


def attention_step_seconds(rank: int, world: int, method: str, tensors, causal: bool,
                           layout: str, rounds: int) -> dict[str, list[float]]:
    """A worker: seconds of forward + backward of full attention over the whole T (each rank on
    its own device, no communication) and of `method` ("ring" or "ulysses") on this rank's T/k
    tokens, in interleaved rounds (`cost.stats.interleave`; every rank draws the same order, so
    their collectives meet)."""
    from companion.cost.clock import now
    from companion.cost.stats import interleave
    device = launch.rank_device()
    whole = [t.to(device).clone().requires_grad_() for t in tensors[:3]]
    shards = [cp.shard_sequence(t, rank, world, layout=layout).to(device).clone()
              .requires_grad_() for t in tensors[:3]]
    do_whole = tensors[3].to(device)
    do_shard = cp.shard_sequence(tensors[3], rank, world, layout=layout).to(device)
    attend = cp.ring_attention if method == "ring" else cp.ulysses_attention
    extra = {"layout": layout} if method == "ring" else {}

    def full():
        F.scaled_dot_product_attention(*whole, is_causal=causal).backward(do_whole)

    def split():
        attend(*shards, causal=causal, **extra).backward(do_shard)        # collectives
    return interleave({"full": full, method: split}, rounds=rounds, clock=lambda: now(device))
