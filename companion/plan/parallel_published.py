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
3. torchtitan's measured memory (docs/performance.md at eaea6f6; the same tables in
   benchmarks/llama3_h100_202412_torchtitan.md, which published_runs.json cites for its 8B rows),
   run at torchtitan 9dec370 on H100 96GB HBM2e, torch.compile and Float8, full activation
   checkpointing, "Memory(GiB)" the largest `max_reserved_gib` over all GPUs (train.py). Table 4:
   Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16 (global 512), 71.9 GiB (67.6 with
   AsyncTP). Table 5: 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32: 1F1B 82.5 GiB,
   interleaved 72.7. Table 6: 405B, TP 8, PP 8, local batch 8, CP 1/2/4/8 with FSDP 8/4/2/1 at
   32,768 to 262,144 tokens: 75.3, 75.9, 77.1, 84.9 GiB. train_configs/llama3_70b.toml at
   9dec370: seq_len 8192, tensor_parallel_degree 8, mode 'full'; config_manager.py: mixed
   precision param bfloat16, reduce float32, loss parallel on (disable_loss_parallel unset), the
   pipeline's micro-batches as many as its stages. Stored here, not in published_runs.json:
   that corpus's bench checks global_batch == micro_batch x accumulation x gpus (the tensor
   parallel ranks share a batch here) and knows no tensor or pipeline parallel lever.
   `TORCHTITAN_70B` is the row the planner is held to (tests/test_plan_parallel.py); the 405B
   rows (`TORCHTITAN_405B`) are reported, with what the model misses (see `torchtitan_error`).
"""
from __future__ import annotations

import dataclasses

from companion.plan.parallel import Layout, Shape

__all__ = ["LLAMA3_405B", "LLAMA3_405B_LAYOUTS", "published", "megatron_bytes",
           "MeasuredRun", "TORCHTITAN_70B", "TORCHTITAN_405B", "torchtitan_error"]

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


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """A run's measured memory per GPU (GiB, max reserved), its layout and sequence length."""

    source: str
    quote: str
    model: str                 # a config of companion.plan.configs, or "405b" (LLAMA3_405B)
    layout: Layout
    seq_len: int
    peak_gib: float


_TITAN = ("torchtitan docs/performance.md at eaea6f6 (pytorch/torchtitan; run at 9dec370 on H100 "
          "96GB HBM2e, torch.compile + Float8, full activation checkpointing)")
TORCHTITAN_70B = MeasuredRun(
    f"{_TITAN}, Table 4: Llama 3.1 70B, 256 GPUs (FSDP 32, TP 8), local batch 16, global 512",
    "| 2D | 829 | 71.9 |", "llama-3-70b",      # Llama 3.1 70B: Llama 3 70B's shapes
    Layout(t=8, p=1, c=1, d=32, zero=3, micro_batch=16, micro_batches=1, checkpointing="full"),
    8192, 71.9)
TORCHTITAN_405B = (
    MeasuredRun(f"{_TITAN}, Table 5: 405B, FSDP 8, TP 8, PP 8, AsyncTP, local batch 32, "
                "global 256, 1F1B",
                "| 1F1B | 100 | 82.5 |", "405b",
                Layout(8, 8, 1, 8, 3, 4, 8, "full"), 8192, 82.5),
    *(MeasuredRun(f"{_TITAN}, Table 6: 405B, TP 8, PP 8, FSDP {8 // c}, CP {c}, AsyncTP, "
                  "1F1B, local batch 8",
                  f"| FSDP {8 // c}, CP {c} | {seq} |", "405b",
                  Layout(8, 8, c, 8 // c, 3, 1, 8, "full"), seq, gib)
      for c, seq, gib in ((1, 32768, 75.3), (2, 65536, 75.9), (4, 131072, 77.1),
                          (8, 262144, 84.9))),
)


def torchtitan_error(run: MeasuredRun, *, gpu="H100 SXM") -> tuple[float, object]:
    """(predicted / measured - 1, the estimate) for a measured run: the tensors by formula and
    the single-axis planner's lines (`Estimate.fit`), against the GiB the run reserved.

    Left out, each making the prediction low: Float8's casts (fp8 copies of a recomputed layer's
    inputs and weights, its scales; an fp8 all-gather would instead halve the gathered norm
    outputs, priced in bf16); torch.compile's buffers; the recomputed layer's gradients in
    backward; the reserve's fragmentation beyond one segment (the figure is max reserved);
    with pipelining, FSDP's unsharded gradients if they accumulate over micro-batches, the
    stages' uneven split (126 layers; priced as 128) and the schedule's own buffers. The one
    recomputed layer and the loss's peak are summed, though they do not coincide: high."""
    from companion.plan import parallel
    from companion.plan.configs import load_config
    shape = (LLAMA3_405B if run.model == "405b"
             else parallel.Shape.from_config(load_config(run.model)))
    found = parallel.estimate(shape, run.layout, run.seq_len, gpu=gpu,
                              gpus_per_node=run.layout.t)
    return found.fit(2 ** 50).total / (run.peak_gib * 2 ** 30) - 1, found
