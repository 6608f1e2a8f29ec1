"""Out of Memory: the course's companion package.

Readable reference implementations of memory-saving techniques, tools that measure and predict
memory on any device, widgets, and the checks that grade the course's exercises. Import the module
you need (``from companion import memory``); this file only lists them.

Measure and predict: `memory` (track, measure, memory_budget; `memory_plot`), `allocator` (the
CUDA caching allocator's snapshots and settings), `placement` (device, host or disk), `estimate`
(with `estimate_offload`), `device`, `models`, `cost` (time: the machine measured, a cited GPU
table, the α–β model of communication, step-time models, statistics for timings).
Techniques: `gd`, `optim` (Adam from scratch, the step fused into backward), `floats`,
`accumulation`, `chunked_loss` (cross-entropy without the whole logits), `checkpointing`, `amp`
(GradScaler, MasterWeights, autocast_dtypes), `collectives`, `dp`, `ddp`, `launch`, `lora`, `zero`
(ZeRO stages 1-3), `offload` (ZeRO-Offload, activation offload), `nvme` (the NVMe tier),
`tensor_parallel` (Megatron's column- and row-parallel layers, sequence parallelism), `pipeline`
(GPipe, 1F1B and interleaved schedules, simulated and run), `context_parallel` (ring attention,
Ulysses), `experts` (a mixture of experts, expert parallelism by all-to-all), `train`
(the `python -m companion train` launcher), `plan` (the techniques that fit a memory budget,
chosen, proved by a simulated step, and run).
The course itself: `session` (the one call that starts a chapter: threads, seed, device, plot
style; progress for long cells), `widgets`, `results`, `record` (`python -m companion record`:
GPU runs for `results`), `checks`, `notebooks`, `grading` (its parts in `grader`).
"""
__all__ = [
    "accumulation",
    "allocator",
    "amp",
    "checkpointing",
    "chunked_loss",
    "checks",
    "collectives",
    "context_parallel",
    "cost",
    "ddp",
    "device",
    "dp",
    "estimate",
    "estimate_offload",
    "experts",
    "floats",
    "gd",
    "grading",
    "launch",
    "lora",
    "memory",
    "memory_plot",
    "models",
    "notebooks",
    "nvme",
    "offload",
    "optim",
    "pipeline",
    "placement",
    "plan",
    "record",
    "results",
    "session",
    "tensor_parallel",
    "train",
    "widgets",
    "zero",
]
__version__ = "0.1.0"
