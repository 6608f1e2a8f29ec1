"""Train a plan for real: `run_plan` runs a `Candidate` for some steps under a memory budget and
reports what it measured (`RunReport`); `token_batches` is the data every run of a plan trains on.
Used by `planner.Plan.run` (one process) and `ranks` (each of several)."""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

import torch
from torch import nn

from companion.cost.clock import now
from companion.memory import memory_budget, parse_bytes, track
from companion.models import make_tokens
from companion.plan.space import Candidate, GPTShape
from companion.plan.training import build, train_step

__all__ = ["RunReport", "run_plan", "token_batches"]


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What `Plan.run` measured."""

    losses: list[float]      # the mean loss of each step
    peak: int                # device bytes at the peak (the budget caps these)
    host_peak: int           # host bytes at their peak (offload)
    seconds: float           # median step time
    budget: int
    reserved: int | None = None   # CUDA: the caching allocator's peak reserve (segments)


def token_batches(batch: int, seq_len: int, *, vocab: int, steps: int, seed: int = 0) -> list:
    """`steps` batches (x, y) of `batch` token sequences (the course's Markov chain, on the CPU):
    the data every run of a plan trains on, the same for every plan given the same seed."""
    return [_token_batch(batch, seq_len, vocab, step, seed) for step in range(steps)]


def _token_batch(batch: int, seq_len: int, vocab: int, step: int, seed: int):
    return make_tokens(batch, seq_len, vocab=vocab, seed=seed * 1009 + step)


def run_plan(model_fn: Callable[..., nn.Module], cand: Candidate, batch: int, steps: int, *,
             budget: int | str | None = None, device: torch.device | str = "cpu",
             lr: float = 1e-3, seed: int = 0, world_size: int = 1, rank: int = 0) -> RunReport:
    """Train `cand` for `steps` steps of `batch` sequences (this rank's share of them) under
    `memory_budget(budget)` (None: no budget), measured with `track`; the report. Batches are
    the course's token sequences, the same for every plan given the same seed."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    device = torch.device(device)
    limit = 2**62 if budget is None else parse_bytes(budget)
    shape = GPTShape.of(model_fn)
    mine = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    batches = [_token_batch(batch, shape.seq_len, shape.vocab, step, seed)
               for step in range(steps)]               # the data, like a loader's: not counted
    losses, seconds = [], []
    with memory_budget(limit, device), track(device) as tracker:
        setup = build(model_fn, cand, world_size=world_size, device=device, lr=lr)
        for x, y in batches:
            start = now(device)                                         # host-device sync
            loss = train_step(setup, x[mine].to(device), y[mine].to(device))
            losses.append(float(loss))                                  # host-device sync
            seconds.append(now(device) - start)
        del setup
    return RunReport(losses, tracker.peak, tracker.host_peak,
                     statistics.median(seconds[1:] or seconds), limit, tracker.peak_reserved)
