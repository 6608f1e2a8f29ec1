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
what the simulation cannot see (CUDA's context, workspaces, the allocator's rounding) is the
budget's margin, as for `plan`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import warnings
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from companion import lora, lowbit
from companion.checkpointing import checkpoint_sequential
from companion.memory import MemoryTracker, format_bytes, parse_bytes, track
from companion.plan.costmodel import CostModel
from companion.plan.predict import ADAM8BIT_BYTES
from companion.plan.space import Candidate
from companion.plan.training import _fake_addresses

__all__ = ["GENERIC", "ModelPlan", "ModelRow", "plan_model", "simulate_model", "next_token_step",
           "build_model"]

GENERIC = ("accumulation", "checkpointing", "autocast", "lora", "adam8bit")
_WHAT = ("the planner builds your model on fake tensors (shapes only, nothing allocated): pass a "
         "function of no arguments that returns the model on the CPU in fp32 (sizes bound with "
         "functools.partial); it may not load weights from files, call .cuda() or .to(device)")


def build_model(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """model_fn(), with an error that names the cause when it cannot run on fake tensors."""
    if isinstance(model_fn, nn.Module) or not callable(model_fn):
        raise TypeError(f"model_fn is a {type(model_fn).__name__}, not a function that builds the "
                        f"model: {_WHAT}")
    try:
        model = model_fn()
    except TypeError as e:
        raise TypeError(f"model_fn() raised TypeError: {e}. {_WHAT}") from e
    except Exception as e:
        raise RuntimeError(f"model_fn() raised {type(e).__name__} while building the model on "
                           f"fake tensors (FakeTensorMode): {e}. {_WHAT}") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn() returned a {type(model).__name__}, not an nn.Module")
    return model


def next_token_step(seq_len: int, vocab: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """The default step of a language model: `batch` random sequences of `seq_len` token ids in,
    logits (batch, seq_len, vocab) out, cross-entropy against the next token."""
    def step(model: nn.Module, batch: int) -> torch.Tensor:
        device = next(model.parameters()).device
        x = torch.randint(vocab, (batch, seq_len), device=device)
        logits = model(x)
        logits = getattr(logits, "logits", logits)             # Hugging Face's output objects
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    return step


def _blocks(model: nn.Module) -> nn.Module | None:
    """The container of repeated blocks: the nn.ModuleList or nn.Sequential of at least two
    children that holds the most parameters."""
    found = [(sum(p.numel() for p in m.parameters()), i, m)
             for i, m in enumerate(model.modules())
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2]
    return max(found, key=lambda f: (f[0], -f[1]))[2] if found else None


def _checkpoint(container: nn.Module) -> None:
    """Recompute in backward: each block of a ModuleList but the last keeps only its input
    (non-reentrant `torch.utils.checkpoint`; the last block's tensors are used at once by
    backward, as `checkpoint_sequential` runs its last segment); a Sequential runs as round(√n)
    segments (`checkpoint_sequential`)."""
    if isinstance(container, nn.Sequential):
        children, segments = list(container), max(2, round(math.sqrt(len(container))))
        container.forward = lambda x: checkpoint_sequential(children, segments, x,
                                                            use_reentrant=False)
        return
    for block in list(container)[:-1]:
        inner = block.forward
        block.forward = (lambda inner: lambda *a, **k: torch.utils.checkpoint.checkpoint(
            inner, *a, use_reentrant=False, **k))(inner)


@dataclasses.dataclass
class _Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    blocks: int                      # blocks the fixed per-block cost is counted for


def _build(model_fn, cand: Candidate, optimizer) -> _Setup:
    model = build_model(model_fn)
    if cand.lora_rank:                         # first: checkpointing captures the blocks
        with warnings.catch_warnings():        # plan_model warns once, not at every simulation
            warnings.simplefilter("ignore")
            lora.apply_lora(model, cand.lora_rank)
    container = _blocks(model)
    if cand.segments > 1:
        if container is None:
            raise ValueError("checkpointing needs an nn.ModuleList or nn.Sequential of blocks")
        _checkpoint(container)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (lowbit.Adam8bit(trainable, lr=1e-3, decoupled_weight_decay=True)
           if cand.state_bits == 8 else optimizer(trainable))
    return _Setup(model, opt, len(container) if container is not None else 1)


@contextlib.contextmanager
def _collector_paused():
    """No garbage collection inside the block (garbage from before it is not in its ledger)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate_model(model_fn: Callable[[], nn.Module], cand: Candidate,
                   step: Callable[[nn.Module, int], torch.Tensor], *,
                   optimizer: Callable = torch.optim.AdamW, fake: bool = True
                   ) -> tuple[MemoryTracker, int, int]:
    """(tracker, FLOPs of one micro-batch's forward and backward, blocks) of a step of the plan,
    simulated as every step after the first: optimizer state made, gradients of the earlier
    micro-batches there (zeros, when accumulating), the last micro-batch, the optimizer step.
    `fake=False` runs the same step for real on the CPU (what the simulation is tested against).

    Python's garbage collector is paused during the step. Some bytes sit in reference cycles
    that only the collector frees (`torch.utils.checkpoint`'s non-reentrant holders), and when it
    runs depends on everything the process did before: the same checkpointed step of
    `examples.models.mha_lm` peaked at 20.34, 20.60 or 21.13 MiB by its history, real or fake
    alike. Paused, the step is the same every time, at the upper end (21.13 MiB)."""
    k = cand.accumulation
    with _collector_paused(), \
            (FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()), \
            (_fake_addresses() if fake else contextlib.nullcontext()):
        with track("cpu") as tracker:
            setup = _build(model_fn, cand, optimizer)
            trainable = [p for p in setup.model.parameters() if p.requires_grad]
            for p in trainable:                               # 1. the optimizer's state
                p.grad = torch.zeros_like(p)
            setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)
            for p in trainable if k > 1 else ():              # 2. earlier micro-batches' grads
                p.grad = torch.zeros_like(p)
            with FlopCounterMode(display=False) as counter:   # 3. the last micro-batch
                with torch.autocast("cpu", torch.bfloat16, enabled=cand.precision == "autocast"):
                    loss = step(setup.model, cand.micro_batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"step(model, batch) must return the loss (a one-element "
                                    f"tensor), got {type(loss).__name__}")
                (loss.float() / k).backward()
            del loss
            setup.optimizer.step()
            blocks = setup.blocks
            del setup, trainable
    return tracker, counter.get_total_flops(), blocks


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
        fits = sorted((r for r in self.rows if r.peak <= self.usable),
                      key=lambda r: r.seconds["total"])[:limit]
        lines = [f"{'plan':<64}{'peak':>12}{'step':>10}  checked"]
        for r in [self.plain] + [r for r in fits if r is not self.plain]:
            mark = "<- chosen" if r is self.chosen_row else ""
            lines.append(f"{r.candidate.describe()[:63]:<64}{format_bytes(r.peak):>12}"
                         f"{r.seconds['total'] * 1e3:>8.1f}ms  "
                         f"{'simulated' if r.simulated else 'interpolated'} {mark}".rstrip())
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
                    "seconds": r.seconds, "simulated": r.simulated}
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
    container = _blocks(model)
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
               margin: float | None = None, cost: CostModel | None = None) -> ModelPlan:
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
    margin = (0.1 if device.type == "cuda" else 0.0) if margin is None else margin
    budget_bytes = parse_bytes(budget)
    usable = int(budget_bytes * (1 - margin))
    cost = cost or CostModel.for_device(device.type)
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
        if not row.simulated:
            tracker = simulate_model(model_fn, row.candidate, step, optimizer=optimizer)[0]
            row.peak, row.kinds, row.phase = tracker.peak, tracker.breakdown(), tracker.peak_phase
            row.simulated = True
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
