"""A plan of several data-parallel ranks: run it on gloo/NCCL workers, or as a torchrun command.

`run_ranks` starts `world_size` processes with `companion.launch.run`; each builds the plan
(`ShardedOptimizer`, `FSDP` or `ddp.DDP`), trains its slice of every batch under
`memory_budget`, and reports. `train_command` writes the same plan as a `python -m companion
train` line for torchrun, when that launcher has every lever the plan uses.

Example:
    >>> p = plan(partial(GPT, 128, 64, 64, 4, 4), 16, budget="5 MiB", world_size=2)
    >>> p.run(5)                   # two processes; the largest rank peak
    >>> train_command(p)           # 'torchrun --nproc_per_node=2 -m companion train ...'

Simplified vs a cluster launcher: the ranks run on this machine (gloo on CPU, NCCL with GPUs),
each under its own `memory_budget`; the report keeps the largest peak, not every rank's.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable

from companion import launch
from companion.plan.run import RunReport, run_plan

if TYPE_CHECKING:
    from companion.plan.planner import Plan
    from companion.plan.space import Candidate

__all__ = ["run_ranks", "rank_worker", "train_command"]


def rank_worker(rank: int, world_size: int, model_fn: Callable, cand: "Candidate", batch: int,
                steps: int, budget: int, lr: float, seed: int) -> "RunReport":
    """One rank of `run_ranks` (importable, as `launch.run` needs)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        and torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    return run_plan(model_fn, cand, batch, steps, budget=budget, device=device, lr=lr,
                    seed=seed, world_size=world_size, rank=rank)


def run_ranks(plan: "Plan", steps: int, *, seed: int = 0,
              timeout: float = 600.0) -> "RunReport":
    """Train `plan.chosen` on `plan.world_size` processes; one RunReport for all of them: the
    mean of the ranks' losses per step (each rank's is the mean over its equal slice, so this
    is the batch's), the largest peaks, the slowest median step."""
    reports = launch.run(rank_worker, plan.world_size, plan.model_fn, plan.chosen, plan.batch,
                         steps, plan.usable, plan.lr, seed, timeout=timeout)
    losses = [statistics.fmean(r.losses[i] for r in reports) for i in range(steps)]
    return RunReport(losses, max(r.peak for r in reports), max(r.host_peak for r in reports),
                     max(r.seconds for r in reports), plan.usable)


def train_command(plan: "Plan", *, steps: int = 20) -> str:
    """The torchrun line that trains `plan.chosen` with `python -m companion train`, or a
    sentence saying which lever that launcher lacks."""
    c, s = plan.chosen, plan.shape
    missing = [name for name, used in (("offload", c.offload), ("LoRA", c.lora_rank),
                                       ("8-bit Adam states", c.state_bits == 8),
                                       ("bf16 weights with fp32 masters",
                                        c.precision in ("mixed", "main_grad")),
                                       ("activation offload", c.activation_offload),
                                       ("the chunked loss", c.chunked_loss),
                                       ("the fused loss", c.fused_loss),
                                       ("checkpoint inputs on the host",
                                        c.offload_checkpoints),
                                       ("the NVMe tier", c.nvme),
                                       ("fused attention",
                                        s.fused_attention or c.fused_attention),
                                       ("checkpointing in segments of several blocks",
                                        1 < c.segments < s.depth)) if used]
    if missing:
        return ("python -m companion train has no " + ", ".join(missing)
                + ": run this plan with Plan.run")
    parallel = ("ddp", "zero1", "zero2", "zero3")[c.zero_stage] if plan.world_size > 1 \
        else "none"
    flags = [f"--parallel {parallel}", f"--accumulation {c.accumulation}",
             "--checkpointing" if c.segments > 1 else "",
             f"--precision {'bf16' if c.precision == 'autocast' else 'fp32'}",
             f"--batch {plan.batch // plan.world_size}", f"--seq-len {s.seq_len}",
             f"--width {s.width}", f"--depth {s.depth}", f"--heads {s.heads}",
             f"--vocab {s.vocab}", f"--lr {plan.lr:g}", f"--steps {steps}"]
    return (f"torchrun --nproc_per_node={plan.world_size} -m companion train "
            + " ".join(f for f in flags if f))
