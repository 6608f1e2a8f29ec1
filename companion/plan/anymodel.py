"""Plan for any model: a factory and a step function, each candidate measured by a simulated step.

The course's GPT has formulas (`predict`); a practitioner's model has none. `plan_model` scores
every candidate by the same fake-tensor simulation that checks the GPT's plans: the step runs on
tensors that have shapes and dtypes but no memory (`FakeTensorMode`), measured by
`companion.memory.track`, while `torch.utils.flop_counter.FlopCounterMode` counts its matmul and
convolution FLOPs for the time. Memory and FLOPs grow linearly with the micro-batch, so each
combination of levers is simulated at the smallest and the largest micro-batch and the sizes in
between are interpolated; the fastest candidate that fits is then simulated itself before it is
chosen.

Levers for any model (`GENERIC`): micro-batches with accumulation, checkpointing every block but
the last of the model's largest `nn.ModuleList` (or √n segments of its largest `nn.Sequential`),
bf16 autocast, LoRA (`companion.lora.apply_lora`) and 8-bit Adam states
(`companion.lowbit.Adam8bit`, with AdamW's update: it replaces the optimizer you pass).

Time per step: the counted FLOPs at the cost model's rate (bf16's with autocast), a fixed cost
per block and micro-batch, and the optimizer streaming 32 bytes per trainable parameter (fused
AdamW's count; `predict.ADAM8BIT_BYTES` for 8-bit states) whatever the optimizer is. Only the
ranking uses these seconds.

Example:
    >>> from examples.models import cnn, cnn_step
    >>> p = plan_model(cnn, 64, budget="48 MiB", step=cnn_step, device="cpu")
    >>> print(p)

Simplified vs `plan` for the course GPT: no ZeRO, offload or QLoRA levers; time from counted
FLOPs at the cost model's rate plus a fixed cost per block and micro-batch (no measured kernel);
on CUDA the budget loses the context and cuBLAS's workspace (`allocator.step_overheads`), and
the chosen step is replayed through the allocator under what is left (`allocator.replay`): only
replayed plans are listed there, where `plan` replays each plan it lists (`plan.budget`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from typing import Callable, Iterable

import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from companion import allocator, lora
from companion.cost import gpus
from companion.memory import MemoryTracker, format_bytes, parse_bytes
from companion.plan.anysim import blocks_of, build_model, next_token_step, simulate_model
from companion.plan.costmodel import CostModel
from companion.plan.predict import ADAM8BIT_BYTES
from companion.plan.space import Candidate

__all__ = ["GENERIC", "ModelPlan", "ModelRow", "plan_model", "simulate_model", "next_token_step",
           "build_model"]

GENERIC = ("accumulation", "checkpointing", "autocast", "lora", "adam8bit")
@dataclasses.dataclass
class ModelRow:
    """One candidate: its peak (interpolated, or simulated), its seconds, and at its peak the
    bytes by kind (from the simulation nearest in micro-batch)."""

    candidate: Candidate
    peak: int
    seconds: dict[str, float]
    kinds: dict[str, int]
    phase: str | None
    simulated: bool = False
    replayed: int | None = None   # on CUDA: what the allocator reserves for its step, replayed


def _seconds(cand: Candidate, flops: float, blocks: int, trainable: int, cost: CostModel
             ) -> dict[str, float]:
    rate = cost.flops * (cost.half_speedup if cand.precision == "autocast" else 1.0)
    per_param = ADAM8BIT_BYTES if cand.state_bits == 8 else 32
    parts = {"compute": cand.accumulation * flops / rate,
             "overhead": cand.accumulation * blocks * cost.layer_seconds,
             "optimizer": per_param * trainable / cost.memory_bandwidth}
    return {**parts, "total": sum(parts.values())}


class ModelPlan:
    """`plan_model`'s answer: `chosen` (a `Candidate`), the `rows` it weighed, `plain` (the
    batch in one step, no lever), and what the model holds (`n_params`)."""

    def __init__(self, rows, chosen, plain, *, batch, budget, usable, device, n_params, model_fn,
                 step, optimizer):
        self.rows, self.chosen_row, self.plain = rows, chosen, plain
        self.model_fn, self.step, self.optimizer = model_fn, step, optimizer
        self.chosen: Candidate = chosen.candidate
        self.batch, self.budget, self.usable = batch, budget, usable
        self.device, self.n_params = device, n_params

    def table(self, limit: int = 8) -> str:
        cuda = self.device.type == "cuda"            # there, only replayed steps are listed
        fits = sorted((r for r in self.rows if r.peak <= self.usable
                       and (not cuda or r.replayed is not None)),
                      key=lambda r: r.seconds["total"])[:limit]
        lines = [f"{'plan':<64}{'peak':>12}{'step':>10}  checked"]
        for r in [self.plain] + [r for r in fits if r is not self.plain]:
            mark = "<- chosen" if r is self.chosen_row else ""
            how = ("replayed" if r.replayed is not None else
                   "simulated" if r.simulated else "interpolated")
            lines.append(f"{r.candidate.describe()[:63]:<64}{format_bytes(r.peak):>12}"
                         f"{r.seconds['total'] * 1e3:>8.1f}ms  {how} {mark}".rstrip())
        return "\n".join(lines)

    def check(self) -> MemoryTracker:
        """The chosen step run for real on this CPU (real tensors, measured by `track`): its
        `peak` against `chosen_row.peak`, the simulated one."""
        return simulate_model(self.model_fn, self.chosen, self.step, optimizer=self.optimizer,
                              fake=False)[0]

    def to_dict(self) -> dict:
        def row(r: ModelRow) -> dict:
            return {"plan": r.candidate.describe(), **dataclasses.asdict(r.candidate),
                    "peak": r.peak, "phase": r.phase, "kinds": r.kinds,
                    "seconds": r.seconds, "simulated": r.simulated, "replayed": r.replayed}
        return {"batch": self.batch, "budget": self.budget, "usable": self.usable,
                "device": str(self.device), "n_params": self.n_params,
                "plain": row(self.plain), "chosen": row(self.chosen_row),
                "candidates": [row(r) for r in self.rows]}

    def __str__(self) -> str:
        r = self.chosen_row
        return (f"{self.table()}\nchosen: {self.chosen.describe()}: peak {format_bytes(r.peak)} "
                f"({r.phase}) of {format_bytes(self.usable)} usable, step about "
                f"{r.seconds['total'] * 1e3:.1f} ms by the cost model")

    __repr__ = __str__


def _segments(model: nn.Module) -> int:
    """What `_checkpoint` makes of the model's blocks: one segment per block of a ModuleList,
    round(√n) segments of a Sequential; 1 when there are no blocks to checkpoint."""
    container = blocks_of(model)
    if container is None:
        return 1
    return (max(2, round(math.sqrt(len(container)))) if isinstance(container, nn.Sequential)
            else len(container))


def _combos(allow: frozenset[str], lora_rank: int, segments: int) -> list[dict]:
    return [dict(segments=s, precision=p, lora_rank=r, state_bits=b)
            for s, p, r, b in itertools.product(
                [1, segments] if "checkpointing" in allow and segments > 1 else [1],
                ["fp32", "autocast"] if "autocast" in allow else ["fp32"],
                [0, lora_rank] if "lora" in allow else [0],
                [32, 8] if "adam8bit" in allow else [32])
            if not (r and b == 8)]


def plan_model(model_fn: Callable[[], nn.Module], batch: int, *, budget: int | str,
               step: Callable[[nn.Module, int], torch.Tensor] | None = None,
               seq_len: int | None = None, vocab: int | None = None,
               optimizer: Callable = torch.optim.AdamW, device: torch.device | str = "cpu",
               allow: Iterable[str] = ("accumulation", "checkpointing"), lora_rank: int = 8,
               margin: float | None = None, cost: CostModel | None = None,
               gpu: str | None = None) -> ModelPlan:
    """The fastest plan (by `cost`) whose simulated step fits `budget` bytes per device, for any
    model. `step(model, batch)` returns a micro-batch's loss (it makes its own inputs); default
    `next_token_step(seq_len, vocab)`, with vocab read from the model's first nn.Embedding.
    `optimizer(params)` makes the optimizer (default AdamW). `allow`: levers of `GENERIC`
    (default the exact ones: accumulation and checkpointing). Raises ValueError when none fits."""
    device = torch.device(device)
    allow = frozenset((allow,) if isinstance(allow, str) else allow)
    if allow - set(GENERIC):
        raise ValueError(f"unknown lever(s) {sorted(allow - set(GENERIC))}: for any model choose "
                         f"from {', '.join(GENERIC)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    margin = 0.0 if margin is None else margin
    budget_bytes = parse_bytes(budget)
    usable = int(budget_bytes * (1 - margin))
    card = gpus.gpu(gpu) if gpu is not None else None
    cap = None
    if device.type == "cuda":              # the context and cuBLAS's workspace, and one segment
        lines = sum(o.bytes for o in allocator.step_overheads(card))   # of headroom as a sieve;
        cap = usable - lines               # the chosen step is replayed under the rest (`cap`)
        usable = cap - allocator.headroom(allocator.LARGE_REQUEST)
    cost = cost or (CostModel.for_gpu(card.name) if card is not None
                    else CostModel.for_device(device.type))
    with FakeTensorMode():
        model = build_model(model_fn)
    n_params = sum(p.numel() for p in model.parameters())
    if step is None:
        vocab = vocab or next((m.num_embeddings for m in model.modules()
                               if isinstance(m, nn.Embedding)), None)
        seq_len = seq_len or getattr(model, "seq_len", None)
        if vocab is None or seq_len is None:
            raise ValueError("the default step feeds token ids to a language model: give seq_len "
                             "(and vocab when the model has no nn.Embedding), or pass "
                             "step(model, batch) -> loss")
        step = next_token_step(seq_len, vocab)
    micro = [m for m in range(1, batch + 1) if batch % m == 0] if "accumulation" in allow \
        else [batch]
    rows: list[ModelRow] = []
    for combo in _combos(allow, lora_rank, _segments(model)):
        ends = sorted({micro[0], micro[-1]})
        sims = {m: simulate_model(model_fn, Candidate(m, batch // m, **combo), step,
                                  optimizer=optimizer) for m in ends}
        lo, hi = sims[ends[0]], sims[ends[-1]]
        trainable = (n_params if not combo["lora_rank"] else
                     lora.trainable_params(_fake(model_fn, combo["lora_rank"])))
        for m in micro:
            cand = Candidate(m, batch // m, **combo)
            w = 0.0 if len(ends) == 1 else (m - ends[0]) / (ends[-1] - ends[0])
            peak = round(lo[0].peak + w * (hi[0].peak - lo[0].peak))
            flops = lo[1] + w * (hi[1] - lo[1])
            near = sims[min(ends, key=lambda e: abs(e - m))][0]
            rows.append(ModelRow(cand, near.peak if m in sims else peak,
                                 _seconds(cand, flops, lo[2], trainable, cost),
                                 near.breakdown(), near.peak_phase, m in sims))
    plain = next(r for r in rows if not r.candidate.techniques())
    for row in sorted((r for r in rows if r.peak <= usable), key=lambda r: r.seconds["total"]):
        if not row.simulated or cap is not None:
            tracker = simulate_model(model_fn, row.candidate, step, optimizer=optimizer)[0]
            row.peak, row.kinds, row.phase = tracker.peak, tracker.breakdown(), tracker.peak_phase
            row.simulated = True
            if cap is not None:            # rounding and fragmentation, replayed (`plan.budget`)
                replayed = allocator.replay(tracker, cap=cap)
                row.replayed = replayed.peak_reserved if replayed.fits else None
                if not replayed.fits:
                    continue
        if row.peak <= usable:
            return ModelPlan(rows, row, plain, batch=batch, budget=budget_bytes, usable=usable,
                             device=device, n_params=n_params, model_fn=model_fn, step=step,
                             optimizer=optimizer)
    best = min(rows, key=lambda r: r.peak)
    raise ValueError(f"no plan fits {format_bytes(usable)} usable: the smallest, "
                     f"{best.candidate.describe()}, peaks at {format_bytes(best.peak)}; allow "
                     f"more levers ({', '.join(sorted(set(GENERIC) - allow)) or 'none left'}) "
                     "or a smaller batch")


def _fake(model_fn, lora_rank: int) -> nn.Module:
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lora.apply_lora(build_model(model_fn), lora_rank)
