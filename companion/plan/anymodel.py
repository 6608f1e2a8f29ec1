"""Plan for any model: a factory and a step function, each candidate scored by its traced step.

The course's GPT has formulas (`predict`); a practitioner's model has none. `plan_model` is
`planner.plan` with the model's own step: every candidate is scored by the same fake-tensor
simulation that checks the GPT's plans (`known.Traced`): the step runs on tensors that have
shapes and dtypes but no memory (`FakeTensorMode`), measured by `companion.memory.track`;
`torch.utils.flop_counter.FlopCounterMode` counts its matmul and convolution FLOPs for the time
in a fake run of their own (its hooks would change what the step holds).
Memory and FLOPs grow linearly with the micro-batch, so each combination of levers is simulated
at the smallest and the largest micro-batch and the sizes in between are interpolated; the
fastest candidate that fits is then simulated itself before it is chosen. The table, the budget's
lines and the report are the planner's own.

Levers for any model (`GENERIC`): micro-batches with accumulation, checkpointing every block but
the last of the model's largest `nn.ModuleList` (or √n segments of its largest `nn.Sequential`),
bf16 autocast, LoRA (`companion.lora.apply_lora`) and 8-bit Adam states
(`companion.lowbit.Adam8bit`, with AdamW's update: it replaces the optimizer you pass).

Example:
    >>> from examples.models import cnn, cnn_step
    >>> p = plan_model(cnn, 64, budget="48 MiB", step=cnn_step, device="cpu")
    >>> print(p)
    >>> p.check().peak             # the chosen step run for real on this CPU

An op the fake tensors cannot run (a data-dependent shape: `nonzero` in MoE routing; a meta
kernel stricter than the CPU's: grouped_mm in fp32) is named with its module, and the real step
is measured on this CPU at small micro-batches and scaled instead, the plan saying so
(`fallback`; `fallback=False` stops with the error).

Simplified vs the formulas: no ZeRO, offload or QLoRA levers; time from counted FLOPs at the cost
model's rate plus a fixed cost per block and micro-batch (no measured kernel); on CUDA the lines
beyond the tensors are the context and cuBLAS's workspace (no attention kernel is known).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from companion.plan.anysim import build_model, next_token_step, simulate_model
from companion.plan.costmodel import CostModel
from companion.plan.known import GENERIC, Traced
from companion.plan.planner import Plan, Row, _plan

__all__ = ["GENERIC", "ModelPlan", "ModelRow", "plan_model", "simulate_model", "next_token_step",
           "build_model"]

ModelPlan = Plan          # one report for every model (the names of the traced path's answer)
ModelRow = Row


def plan_model(model_fn: Callable[[], nn.Module], batch: int, *, budget: int | str,
               step: Callable[[nn.Module, int], torch.Tensor] | None = None,
               seq_len: int | None = None, vocab: int | None = None,
               optimizer: Callable = torch.optim.AdamW, device: torch.device | str = "cpu",
               allow: Iterable[str] = ("accumulation", "checkpointing"), lora_rank: int = 8,
               lora_targets: Iterable[str] = (),
               margin: float | None = None, cost: CostModel | None = None,
               gpu: str | None = None, verify: int = 8, fallback: bool = True) -> Plan:
    """The fastest plan (by `cost`) whose traced step fits `budget` bytes per device, for any
    model. `step(model, batch)` returns a micro-batch's loss (it makes its own inputs); default
    `next_token_step(seq_len, vocab)`, with vocab read from the model's first nn.Embedding.
    `optimizer(params)` makes the optimizer (default AdamW). `allow`: levers of `GENERIC`
    (default the exact ones: accumulation and checkpointing). `verify`: candidates simulated
    beyond those traced while predicting. `fallback`: when an op of the step cannot run on fake
    tensors, measure the real step on this CPU at small micro-batches and scale it (the plan's
    notes say so); False raises an error naming the op. Raises ValueError when none fits."""
    allow = tuple((allow,) if isinstance(allow, str) else allow)
    if set(allow) - set(GENERIC):
        raise ValueError(f"unknown lever(s) {sorted(set(allow) - set(GENERIC))}: for any model "
                         f"choose from {', '.join(GENERIC)}")
    for name, value in (("batch", batch), ("seq_len", seq_len), ("vocab", vocab)):
        if (value is not None or name == "batch") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    model = Traced(model_fn, step=step, seq_len=seq_len, vocab=vocab, optimizer=optimizer,
                   fallback=fallback)
    return _plan(model, batch, budget=budget, device=torch.device(device), world_size=1,
                 allow=allow, lora_rank=lora_rank, lora_targets=lora_targets,
                 host_budget=None, margin=margin, cost=cost,
                 lr=1e-3, verify=verify, simulate_plain=True, gpu=gpu, context_bytes=None)
