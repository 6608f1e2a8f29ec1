"""ZeRO: shard optimizer state, gradients and parameters over data-parallel ranks (stages 1-3).

Data parallelism (`companion.ddp`) keeps a full copy of the model states on every rank. ZeRO
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020)
removes the copies: with Ψ parameters, N ranks and K bytes of optimizer state per parameter, fp32
training holds per rank

    stage 0 (DDP)        4Ψ + 4Ψ + KΨ
    stage 1 (P_os)       4Ψ + 4Ψ + KΨ/N      `ShardedOptimizer(..., stage=1)`
    stage 2 (P_os+g)     4Ψ + 4Ψ/N + KΨ/N    `ShardedOptimizer(..., stage=2)`
    stage 3 (P_os+g+p)   (4 + 4 + K)Ψ/N      `FSDP(module)`

and sends per rank per step 2Ψ, 2Ψ, 2Ψ and 3Ψ elements (a ring sends (N-1)/N of each); with k
micro-batches per step 2Ψ, 2Ψ, (k+1)Ψ and 3kΨ (`traffic.predicted_traffic`).

Modules: `partition` (the balanced flat partition), `comm` (collectives with byte counters),
`optimizer` (stages 1 and 2), `fsdp` (stage 3), `gather` (two ways to free gathered weights),
`prefetch` (gathering the next units early), `clip` (the global gradient norm over shards),
`traffic` (bytes per step, predicted), `state` (shards consolidated into one state dict),
`experiments` (workers that measure them).
"""
from companion.zero.clip import clip_grad_norm_
from companion.zero.comm import Comm
from companion.zero.fsdp import FSDP
from companion.zero.gather import (alloc_storage, free_storage, gather_into, register_gather_hooks,
                                   shard_by_resize)
from companion.zero.optimizer import ShardedOptimizer
from companion.zero.partition import FlatLayout, flat_partition, per_rank_state_bytes, shard_size
from companion.zero.prefetch import predicted_gathered_peak, run_with_prefetch
from companion.zero.traffic import predicted_traffic

__all__ = ["ShardedOptimizer", "FSDP", "Comm", "FlatLayout", "flat_partition", "shard_size",
           "per_rank_state_bytes", "register_gather_hooks", "free_storage", "alloc_storage",
           "gather_into", "shard_by_resize", "run_with_prefetch", "predicted_gathered_peak",
           "clip_grad_norm_", "predicted_traffic"]
