"""Run a pipeline schedule for real: one stage per rank, activations forward, gradients back.

Each rank holds its slice of the model (`split` cuts an `nn.Sequential`), takes its action list
from a schedule (`companion.pipeline.schedules`) and runs it: a forward receives the previous
stage's activations (`recv`), runs the slice and sends its output on (`isend`); a backward
receives the gradient of that output, runs autograd through the slice and sends the gradient of
its input back. The last stage computes the loss, divided by m so that the gradients are the
accumulated gradients of the whole batch (chapter 03). Memory: a stage keeps what autograd saved
for every micro-batch whose forward ran and backward did not, which is the number the simulator
counts (`Timeline.peak_in_flight`); each such micro-batch costs `saved_bytes` of it.

Example:
    >>> stages = split(MLP(16, 32, 4, 5).net, 4)
    >>> xs, ys = torch.randn(8, 4, 16).unbind(), torch.randint(5, (8, 4)).unbind()
    >>> out = launch.run(run_pipeline, 4, stages, one_f_one_b(4, 8), xs, ys)   # doctest: +SKIP
    >>> out[0]["peak_activation_bytes"] == 4 * saved_bytes(stages[0], xs[0])

Simplified vs PyTorch (torch.distributed.pipelining) / Megatron: PyTorch can trace a model into
stages, builds each stage on its own rank only, infers the shapes it sends at the first step,
supports several inputs and outputs per stage and zero-bubble schedules; Megatron additionally
scatters activations across tensor-parallel ranks and frees a stage's output data once it is
sent. Here every rank receives the whole model (and uses only its slices and the shapes a
meta-device pass gives), every message is one tensor, sends are asynchronous, receives block.
"""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from companion.cost.clock import now
from companion.launch import rank_device
from companion.memory import track
from companion.pipeline.schedules import _chunks, _parse, validate

__all__ = ["split", "saved_bytes", "run_pipeline"]


def split(model: nn.Sequential, parts: int) -> list[nn.Sequential]:
    """Cut an `nn.Sequential` into `parts` consecutive slices of (nearly) equal layer counts."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split cuts an nn.Sequential (e.g. MLP(...).net), got {type(model).__name__}")
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= len(model):
        raise ValueError(f"parts must be an int from 1 to the {len(model)} layers, got {parts!r}")
    bounds = [round(k * len(model) / parts) for k in range(parts + 1)]
    return [model[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def saved_bytes(stage: nn.Module, x: torch.Tensor, *, received: bool = False) -> int:
    """Bytes of tensors autograd saves for one forward of `stage` on `x`: what one in-flight
    micro-batch costs the stage. On the first stage x is the caller's and is not counted;
    `received=True` copies x in first, as a later stage receives it (counted when it is saved)."""
    with track(x.device) as tracker:
        if received:
            x = x.detach().clone().requires_grad_()
        out = stage(x)
        held = tracker.breakdown("current")["activations"]
        del out
    return held


def _shapes(stages: Sequence[nn.Module], micro_batches: Sequence[torch.Tensor]) -> list[list]:
    """shapes[i][k]: (shape, dtype) of virtual stage k's output on micro-batch i, from a pass on
    the meta device (no data, no compute): what a receiving rank allocates before `recv`."""
    metas = [copy.deepcopy(stage).to("meta") for stage in stages]
    shapes = []
    for x in micro_batches:
        row, x = [], x.to("meta")
        for stage in metas:
            x = stage(x)
            row.append((x.shape, x.dtype))
        shapes.append(row)
    return shapes


def run_pipeline(rank: int, world_size: int, stages: Sequence[nn.Module], schedule,
                 micro_batches: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                 loss_fn: Callable = F.cross_entropy) -> dict:
    """Worker: run rank `rank`'s actions of `schedule` (start it with `launch.run`).

    `stages` lists the p·v virtual stages in model order (rank s holds s, s + p, ...);
    `micro_batches[i]` and `targets[i]` are micro-batch i. Returns a dict: `timeline`
    [(action, start, end)] in seconds from a common barrier (start: once its input has arrived;
    end: its compute done and its send posted), `peak_activation_bytes` (the most
    bytes saved for backward live at once), `peak_bytes` (everything the run allocated),
    `gradients` {"k.name": grad} of this rank's virtual stages k, and `losses` {i: loss} (last rank).
    """
    p, m, v = world_size, len(micro_batches), _chunks(schedule)
    if len(stages) != p * v:
        raise ValueError(f"the schedule has {v} chunk(s) per stage on {p} ranks: pass p·v = "
                         f"{p * v} stages, got {len(stages)}")
    if len(targets) != m:
        raise ValueError(f"{m} micro-batches but {len(targets)} targets: one target per micro-batch")
    validate(schedule, p, m)
    device = rank_device()
    run = _Rank(rank, p, v, stages, micro_batches, targets, loss_fn, device)
    rows = []
    dist.barrier()                                              # collective: a common start
    t0 = now(device)
    with track(device, external=list(run.chunks.values())) as tracker:
        for action in schedule[rank]:
            op, i, c = _parse(action, rank, m, v)
            start = run.forward(i, c) if op == "F" else run.backward(i, c)
            rows.append((action, start - t0, now(device) - t0))
        for work in run.sent.values():
            work.wait()
        activations = max(tracker.timeline()["activations"], default=0)
    gradients = {f"{c * p + rank}.{name}": param.grad.clone()
                 for c, chunk in run.chunks.items() for name, param in chunk.named_parameters()}
    return {"timeline": rows, "peak_activation_bytes": activations, "peak_bytes": tracker.peak,
            "gradients": gradients, "losses": run.losses}


class _Rank:
    """One rank's chunks and what it holds between a micro-batch's forward and its backward."""

    def __init__(self, rank, p, v, stages, micro_batches, targets, loss_fn, device):
        self.rank, self.p, self.last, self.m = rank, p, p * v - 1, len(micro_batches)
        self.micro_batches, self.targets, self.loss_fn = micro_batches, targets, loss_fn
        self.device = device
        self.chunks = {c: stages[c * p + rank].to(device) for c in range(v)}
        self.shapes = _shapes(stages, micro_batches)
        self.inputs, self.outputs, self.sent, self.losses = {}, {}, {}, {}

    def tag(self, i: int, k: int, backward: bool) -> int:
        """One message slot per (micro-batch, virtual stage, direction)."""
        return 2 * (i * (self.last + 1) + k) + backward

    def forward(self, i: int, c: int) -> float:
        """F of micro-batch i on chunk c; returns the time its compute started."""
        k = c * self.p + self.rank                              # the virtual stage
        if k == 0:
            x = self.micro_batches[i].to(self.device)
        else:                                                   # 1. activations from stage k-1
            shape, dtype = self.shapes[i][k - 1]
            x = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(x, src=(k - 1) % self.p, tag=self.tag(i, k - 1, False))
            x.requires_grad_()
        start = now(self.device)
        out = self.chunks[c](x)                                 # 2. this slice's forward
        if k == self.last:
            out = self.loss_fn(out, self.targets[i].to(self.device)) / self.m
            self.losses[i] = out.item()
        else:                                                   # 3. send on, do not wait
            self.sent["F", i, c] = dist.isend(out.detach(), dst=(k + 1) % self.p,
                                              tag=self.tag(i, k, False))
        self.inputs[i, c], self.outputs[i, c] = x, out          # held until B
        return start

    def backward(self, i: int, c: int) -> float:
        """B of micro-batch i on chunk c; returns the time its compute started."""
        k, grad = c * self.p + self.rank, None
        if k != self.last:                                      # 1. gradient from stage k+1
            self.sent.pop(("F", i, c)).wait()                   # stage k+1 has the output: let go
            shape, dtype = self.shapes[i][k]
            grad = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(grad, src=(k + 1) % self.p, tag=self.tag(i, k, True))
        start = now(self.device)
        torch.autograd.backward(self.outputs.pop((i, c)), grad)  # 2. frees what F saved
        x = self.inputs.pop((i, c))
        if k > 0:                                               # 3. input gradient back
            self.sent["B", i, c] = dist.isend(x.grad, dst=(k - 1) % self.p,
                                              tag=self.tag(i, k - 1, True))
        return start
