"""The rules chapter 07's planning exercise uses: what a ZeRO plan costs in bytes and in seconds.

A plan is (stage, k, prefetch): the ZeRO stage (0 is DDP), k micro-batches per optimizer step and,
under ZeRO-3, how many units are gathered ahead. `plan_bytes` counts bf16 mixed-precision AdamW
(16 bytes per parameter, sharded as the stage says, `companion.estimate.model_states`), one
micro-batch's bf16 activations (`estimate.gpt_activations`) and ZeRO-3's gathered units, by
chapter 07's rule: shards + the units kept whole + a block x (1 + prefetch). The units are FSDP2's
usual wrapping (torchtitan's): one per transformer block, and the root, the embeddings, final
norm and head, which stays gathered from its forward to its backward (FSDP2's default for the
root, `reshard_after_forward=None`); at small widths it is the largest unit (C = 1024, V = 50,304:
104M parameters against a block's 12.6M). `plan_seconds` schedules the step with
`companion.cost` on a GPU of its cited table, its ring priced for the world size
(`cost.gpus.ring_link`: across servers, the network). `companion.checks.ch07.choose_zero.
check_choose_zero` judges a learner's choice with them.

Simplified vs a real run: a gathered unit counts its bf16 weights and their gradient; temporaries,
the loss's logits and the allocator's rounding are left out (chapter 09's planner counts them).
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
    gathered units (bf16 weights and gradient): the root (all but the blocks), kept, and the
    blocks in flight, the current one and `prefetch` ahead."""
    C, L, T, V, h = (shape[x] for x in ("width", "depth", "seq_len", "vocab", "heads"))
    n = estimate.gpt_params(V, T, C, L)
    states = estimate.model_states(n, optimizer="adam", precision="mixed", zero_stage=stage,
                                   world_size=world_size).total
    acts = estimate.gpt_activations(batch // k, T, C, L, h, V, precision="bf16")
    block = 12 * C * C + 13 * C
    root = n - L * block                        # embeddings, final norm, head
    return int(states + acts + (4 * (root + block * (1 + prefetch)) if stage == 3 else 0))


def plan_seconds(shape: dict, batch: int, gpu: str, world_size: int, stage: int, k: int,
                 prefetch: int) -> float:
    """Seconds of an optimizer step of a plan, by `companion.cost` on the GPU's table speeds."""
    C, L, T, V = (shape[x] for x in ("width", "depth", "seq_len", "vocab"))
    layers = cost.gpt_layers(C, L, T, V, batch // k * T, dtype_bytes=2)
    speeds = cost.Speeds.for_gpu(gpu, world_size=world_size)
    if stage == 0:
        return cost.ddp_step(layers, speeds, world_size, k=k, optimizer="adamw").total
    return cost.zero_step(layers, speeds, world_size, stage, k=k, prefetch=prefetch,
                          optimizer="adamw", gather_bytes_per_param=2).total
