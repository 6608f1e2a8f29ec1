"""What others published about a Llama's memory per GPU under t, p, c and d, for
`companion.plan.parallel` to be held against (tests/test_plan_parallel.py).

1. Llama Team 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: Llama 3 405B
   pre-trained on H100 80GB HBM3 GPUs at 8,192 tokens a sequence and 16M tokens a batch with
   TP 8, CP 1, PP 16 and DP 64 (8,192 GPUs, 430 TFLOP/s a GPU, 43% MFU) or DP 128 (16,384 GPUs,
   400 TFLOP/s, 41%). These layouts ran, so they fit 80 GB. The paper's 126 layers do not
   divide into 16 stages (its first and last stages hold one layer fewer, §3.3.2): `LLAMA3_405B`
   prices 16 stages of 8 layers, an upper bound on its stages.
2. Megatron-LM's theoretical memory report (megatron/training/theoretical_memory_usage.py, at
   00caa53): weights and optimizer 18 bytes a parameter of the most loaded shard, or 6 + 12/dp
   with the distributed optimizer (ZeRO-1); with sequence parallelism and selective
   recomputation, sbh·(18 + 4·ffn/h) bytes a layer over t ("Table 2 of arXiv:2205.05198", as
   Korthikanti et al. count a GPT, k and v as wide as q, with dropout masks), times L layers of
   one micro-batch on the first stage (1F1B: L/p layers times p micro-batches), plus the input
   ids 8·s·b·p and the embedding's dropout mask s·b·h·p, over t. `megatron_bytes` is that count,
   written here from its description, for the comparison.
"""
from __future__ import annotations

import dataclasses

from companion.plan.parallel import Layout, Shape

__all__ = ["LLAMA3_405B", "LLAMA3_405B_LAYOUTS", "published", "megatron_bytes"]

LLAMA3_405B = Shape(layers=128, width=16384, heads=128, kv_heads=8, intermediate=53248,
                    vocab=128256)       # 126 layers priced as 16 stages of 8: an upper bound


@dataclasses.dataclass(frozen=True)
class PublishedLayout:
    """A layout a paper ran: its GPUs, degrees, sequence and batch, and the card's bytes."""

    source: str
    gpus: int
    t: int
    c: int
    p: int
    d: int
    seq_len: int
    batch_tokens: int
    card_bytes: int


_TABLE4 = ("Llama Team 2024, 'The Llama 3 Herd of Models', arXiv:2407.21783, Table 4 "
           "(Llama 3 405B pre-training on H100 80GB HBM3)")
LLAMA3_405B_LAYOUTS = (
    PublishedLayout(f"{_TABLE4}: 8,192 GPUs, TP 8, CP 1, PP 16, DP 64, 16M tokens a batch",
                    8192, 8, 1, 16, 64, 8192, 16 * 2 ** 20, 80 * 10 ** 9),
    PublishedLayout(f"{_TABLE4}: 16,384 GPUs, TP 8, CP 1, PP 16, DP 128, 16M tokens a batch",
                    16384, 8, 1, 16, 128, 8192, 16 * 2 ** 20, 80 * 10 ** 9),
)


def published() -> list[PublishedLayout]:
    """The published layouts that must fit their cards."""
    return list(LLAMA3_405B_LAYOUTS)


def megatron_bytes(shape: Shape, layout: Layout, seq_len: int) -> dict[str, float]:
    """Megatron-LM's theoretical memory per GPU of the first stage (sequence parallel, selective
    recomputation, no interleaving), in bytes: {"weights and optimizer", "activations"}."""
    C, I, L, V = shape.width, shape.intermediate, shape.layers, shape.vocab
    t, p, b, s = layout.t, layout.p, layout.micro_batch, seq_len
    layer = 2 * C * (1.5 * I + 1) + 2 * C * C * (1 + shape.kv_heads / shape.heads)
    block = layer * L + C                                  # with the final RMSNorm
    shard = (block / p + V * C) / t + (V * C / t if p == 1 else 0)
    per_param = 6 + 12 / (layout.d * layout.c) if layout.zero else 18
    in_flight = min(1, layout.micro_batches / p) if p > 1 else 1
    sbh = s * b * C
    acts = sbh * (18 + 4 * I / C) * L * in_flight + (8 * s * b + sbh) * p
    if p == 1:
        acts += sbh * 4 * (1 + V / C)                      # output layer and the loss
    return {"weights and optimizer": shard * per_param, "activations": acts / t}
