"""The rules chapter 07's planning exercise uses: what a ZeRO plan costs in bytes and in seconds.

A plan is (stage, k, prefetch): the ZeRO stage (0 is DDP), k micro-batches per optimizer step and,
under ZeRO-3, how many units are gathered ahead. `plan_bytes` counts bf16 mixed-precision AdamW
(16 bytes per parameter, sharded as the stage says, `companion.estimate.model_states`), one
micro-batch's bf16 activations (`estimate.gpt_activations`) and ZeRO-3's gathered blocks;
`plan_seconds` schedules the step with `companion.cost` on a GPU of its cited table.
`companion.checks.ch07.choose_zero.check_choose_zero` judges a learner's choice with them.

Simplified vs a real run: the gathered blocks counted are the weights and their gradient of one
transformer block each, bf16; temporaries, the loss's logits and the allocator's rounding are left
out (chapter 09's planner counts them).
"""
from __future__ import annotations

from companion import cost, estimate

__all__ = ["plans", "plan_bytes", "plan_seconds"]


def plans(batch: int):
    """Every (stage, k, prefetch) for `batch` sequences per rank: stages 0 (DDP) to 3, k dividing
    batch, prefetch 0 to 2 under ZeRO-3 only."""
    for stage in (0, 1, 2, 3):
        for k in (k for k in range(1, batch + 1) if batch % k == 0):
            for prefetch in ((0, 1, 2) if stage == 3 else (0,)):
                yield stage, k, prefetch


def plan_bytes(shape: dict, batch: int, world_size: int, stage: int, k: int,
               prefetch: int) -> int:
    """Bytes per GPU of a plan, as chapter 07 counts them: bf16 mixed-precision AdamW model states
    (16 B per parameter, ZeRO-sharded), one micro-batch's bf16 activations, and under ZeRO-3 the
    gathered blocks in flight (the current one and `prefetch` ahead: bf16 weights and gradient)."""
    C, L, T, V, h = (shape[x] for x in ("width", "depth", "seq_len", "vocab", "heads"))
    n = estimate.gpt_params(V, T, C, L)
    states = estimate.model_states(n, optimizer="adam", precision="mixed", zero_stage=stage,
                                   world_size=world_size).total
    acts = estimate.gpt_activations(batch // k, T, C, L, h, V, precision="bf16")
    block = 12 * C * C + 13 * C
    return int(states + acts + (4 * block * (1 + prefetch) if stage == 3 else 0))


def plan_seconds(shape: dict, batch: int, gpu: str, world_size: int, stage: int, k: int,
                 prefetch: int) -> float:
    """Seconds of an optimizer step of a plan, by `companion.cost` on the GPU's table speeds."""
    C, L, T, V = (shape[x] for x in ("width", "depth", "seq_len", "vocab"))
    layers = cost.gpt_layers(C, L, T, V, batch // k * T, dtype_bytes=2)
    speeds = cost.Speeds.for_gpu(gpu)
    if stage == 0:
        return cost.ddp_step(layers, speeds, world_size, k=k, optimizer="adamw").total
    return cost.zero_step(layers, speeds, world_size, stage, k=k, prefetch=prefetch,
                          optimizer="adamw", gather_bytes_per_param=2).total
