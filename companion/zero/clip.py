"""Clip the global gradient norm when the gradients are sharded over ranks (ZeRO-2 and 3).

`torch.nn.utils.clip_grad_norm_` scales every gradient by min(1, max_norm / ‖g‖) where ‖g‖ is
the norm of *all* gradients as one vector. After a reduce-scatter each rank holds only its shard
of g, so no rank can compute ‖g‖ alone; clipping each shard by its own norm would scale the ranks
differently and change the update. The p-norm splits into a sum over disjoint shards:

    ‖g‖_p^p = Σ_r ‖g_r‖_p^p            (one all-reduce, SUM, of one number per rank)
    ‖g‖_∞   = max_r ‖g_r‖_∞            (all-reduce, MAX)

Parameters kept whole on every rank (our FSDP's 1-D ones) are added once, after the all-reduce,
not N times. Cost: one all-reduce of a scalar (two for the ∞-norm, folded into one tensor); no
memory. DeepSpeed does the same inside its ZeRO optimizers (`gradient_clipping` in the config);
torch's FSDP2 gradients are DTensors, whose norm torch.nn.utils.clip_grad_norm_ all-reduces.

Example (inside a rank, after backward and the gradient reduce-scatter, before step):
    >>> norm = clip_grad_norm_(model.shards, 1.0, replicated=model.replicated)  # doctest: +SKIP

Simplified vs PyTorch: one device; no `foreach` option.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_"]


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Σ |g|^p over `grads` for a finite p; (max |g|, 1 if any NaN else 0) for the ∞-norm."""
    if math.isinf(norm_type):
        peak = max((g.detach().abs().max().float() for g in grads if g.numel()),
                   default=torch.tensor(0.0))
        nan = any(bool(torch.isnan(g).any()) for g in grads)
        return torch.stack([peak.to(device), torch.tensor(float(nan), device=device)])
    return sum((g.detach().float().abs().pow(norm_type).sum() for g in grads),
               torch.tensor(0.0)).to(device).reshape(1)


@torch.no_grad()
def clip_grad_norm_(sharded: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                    replicated: Iterable[torch.Tensor] = (), group=None,
                    error_if_nonfinite: bool = False,
                    device: torch.device | None = None) -> torch.Tensor:
    """Scale the gradients of `sharded` and `replicated` by min(1, max_norm / (‖g‖ + 1e-6)),
    ‖g‖ the norm of the whole model's gradient; return ‖g‖, the same on every rank.

    Equal to `torch.nn.utils.clip_grad_norm_` on the unsharded model. Collective: every rank of
    `group` must call it.

    Args:
        sharded: parameters whose gradients are this rank's shard (ShardedOptimizer's flat
            shards, FSDP's shards); every element of the model is in one rank's shard.
        max_norm: the largest norm allowed.
        norm_type: p of the p-norm (p > 0), or float("inf").
        replicated: parameters whose whole gradient every rank holds (FSDP's 1-D ones).
        group: the data-parallel process group (default: the whole world).
        error_if_nonfinite: raise if ‖g‖ is NaN or inf (as torch does) instead of scaling by it.
        device: where to all-reduce (default: the gradients' device); NCCL needs the GPU.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (2.0 for the Euclidean norm, float('inf') for "
                         f"the largest entry), got {norm_type}")
    mine = [p.grad for p in sharded if p.grad is not None]
    whole = [p.grad for p in replicated if p.grad is not None]
    device = device or next((g.device for g in mine + whole), torch.device("cpu"))
    local = _local(mine, norm_type, device)                           # 1. this rank's shard
    infinite = math.isinf(norm_type)
    dist.all_reduce(local, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM,
                    group=group)                                      # 2. collective
    rest = _local(whole, norm_type, device)                           # 3. once, not N times
    if infinite:
        total = torch.maximum(local[0], rest[0])
        total = torch.where((local[1] + rest[1]) > 0, torch.tensor(float("nan"), device=device),
                            total)
    else:
        total = (local[0] + rest[0]) ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):        # host-device sync
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from the shards "
                           "is non-finite, so it cannot be clipped (a NaN or inf gradient on some "
                           "rank). Skip this step, or set error_if_nonfinite=False to scale the "
                           "gradients by the non-finite norm anyway, as torch does.")
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)            # 4. the same everywhere
    for g in mine + whole:
        g.mul_(scale.to(g.dtype))
    return total
