"""Choose a plan that fits a memory budget, check it by a simulated step, then run it.

`plan` lists every candidate (`space.candidates`), predicts each one's peak and step time
(`predict`), keeps those predicted to fit, and walks them fastest first, simulating each
(`simulation.simulate`, FakeTensorMode, no memory allocated) until one's simulated peak fits too.
The `Plan` it returns prints a table of candidates and says why it chose what it chose;
`Plan.run(steps)` trains the chosen plan for real under `memory_budget`.

Example:
    >>> p = plan(partial(GPT, 128, 64, 64, 4, 4), 16, budget="6 MiB", device="cpu")
    >>> print(p)                   # the table, then the choice explained
    >>> report = p.run(10)         # losses, measured peak (under the budget)

Simplified vs real planners (DeepSpeed's autotuner, Colossal-AI's): two model families with
formulas (the course GPT and the Llama shape; others take `anymodel`'s slower path), one
optimizer (AdamW), a cost model with assumed speeds (`CostModel`) instead of timed trial steps,
and ranks that run the course's own ZeRO on one machine.
"""
from __future__ import annotations

import dataclasses
import functools
import textwrap
from typing import Callable, Iterable

import torch
from torch import nn

from companion.memory import format_bytes, parse_bytes
from companion.plan import budget as budgets
from companion.plan.anymodel import GENERIC, ModelPlan, plan_model
from companion.plan.budget import Fit
from companion.plan.report import NothingFits, nothing_fits, plot_waterfall, waterfall
from companion.plan.predict import CostModel, Prediction, predict_memory, predict_seconds
from companion.plan.ranks import run_ranks
from companion.plan.run import RunReport, run_plan
from companion.plan.space import EXACT, Candidate, GPTShape, candidates
from companion.plan.simulation import simulate

__all__ = ["NothingFits", "Row", "Plan", "plan"]


@dataclasses.dataclass
class Row:
    """One candidate in the table."""

    candidate: Candidate
    predicted: Prediction
    seconds: dict[str, float]
    simulated: int | None = None         # peak bytes of the simulated step, when simulated
    simulated_host: int | None = None
    fit: Fit | None = None               # the budget's lines: predicted, then replayed


class Plan:
    """The planner's answer: `chosen`, the `rows` it weighed, and how to run it."""

    def __init__(self, *, model_fn: Callable[..., nn.Module], batch: int, budget: int,
                 usable: int, device: torch.device, world_size: int, shape: GPTShape,
                 rows: list[Row], chosen: Row, plain: Row, lr: float, host_budget: int | None,
                 gpu=None, cost: CostModel | None = None):
        self.model_fn, self.batch, self.budget, self.usable = model_fn, batch, budget, usable
        self.device, self.world_size, self.shape, self.lr = device, world_size, shape, lr
        self.rows, self.plain, self.host_budget, self.gpu = rows, plain, host_budget, gpu
        self.cost = cost or CostModel.for_device(device.type)
        self.chosen_row: Row = chosen
        self.chosen: Candidate = chosen.candidate

    def table(self, limit: int = 8) -> str:
        """The plain run, then up to `limit` candidates that fit by prediction, fastest first."""
        head = (f"{'':2}{'plan':<64}{'predicted':>11}{'simulated':>11}{'host':>11}"
                f"{'time/step':>11}")
        lines = [head, "-" * len(head)]
        shown = [self.plain] + [r for r in self.rows if r is not self.plain][:limit]
        for r in shown:
            mark = "->" if r is self.chosen_row else "  "
            sim = format_bytes(r.simulated) if r.simulated is not None else "-"
            host = format_bytes(r.predicted.host) if r.predicted.host else "-"
            name, *more = textwrap.wrap(r.candidate.describe(), 63)   # whole words per line
            lines.append(f"{mark}{name:<64}"
                         f"{format_bytes(r.predicted.peak):>11}{sim:>11}{host:>11}"
                         f"{_time(r.seconds['total']):>11}")
            lines += [f"{'':4}{line}" for line in more]
        return "\n".join(lines)

    def explain(self) -> str:
        """Why this plan: what the plain run needs, what the chosen one needs and costs."""
        r, p = self.chosen_row, self.plain
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                          for k, v in r.predicted.kinds().items() if v)
        faster = [x for x in self.rows if x.seconds["total"] < r.seconds["total"]
                  and x.simulated is not None]
        text = [f"Budget {format_bytes(self.budget)} per device"
                + (f" ({format_bytes(self.usable)} usable)" if self.usable < self.budget else "")
                + f"; the plain run needs {format_bytes(p.predicted.peak)} (predicted)"
                + (f", {format_bytes(p.simulated)} simulated." if p.simulated else "."),
                f"Chosen: {self.chosen.describe()}.",
                f"  predicted peak {format_bytes(r.predicted.peak)} in the {r.predicted.phase} "
                f"phase ({parts})"
                + (f"; simulated {format_bytes(r.simulated)}." if r.simulated else "."),
                f"  predicted step {_time(r.seconds['total'])}: "
                + ", ".join(f"{k} {_time(v)}" for k, v in r.seconds.items()
                            if k != "total" and v > 0) + "."]
        if r.fit is not None and r.fit.lines:
            text.append(f"  on the GPU, {format_bytes(r.fit.total)} of "
                        f"{format_bytes(self.budget)} at the peak ({r.fit.how}): the step's "
                        f"tensors and")
            text += [f"    {o}" for o in r.fit.lines]
        if r.predicted.host:
            text.append(f"  host memory: {format_bytes(r.predicted.host)} predicted"
                        + (f", {format_bytes(r.simulated_host)} simulated"
                           if r.simulated_host is not None else "") + ".")
        for x in faster:
            text.append(f"  Faster, but its simulated step needs {format_bytes(x.simulated)}: "
                        f"{x.candidate.describe()}.")
        return "\n".join(text)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.explain()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def waterfall(self) -> list:
        """The levers one at a time from the plain run (`report.waterfall`)."""
        return waterfall(self)

    def plot_waterfall(self, ax=None):
        """The waterfall as bars (`report.plot_waterfall`)."""
        return plot_waterfall(self, ax)

    def bars(self) -> dict[str, dict[str, int]]:
        """Bytes by kind for `companion.widgets.memory_bars`: plain and chosen, predicted."""
        return {"plain run (predicted)": self.plain.predicted.kinds(),
                "chosen plan (predicted)": self.chosen_row.predicted.kinds()}

    def run(self, steps: int, *, seed: int = 0) -> RunReport:
        """Train the chosen plan for `steps` steps under `memory_budget(budget)` on one
        process (the device's own cap on CUDA); measured with `track`. Several ranks: see
        `companion.plan.run_ranks`."""
        if self.world_size != 1:
            return run_ranks(self, steps, seed=seed)
        # on CUDA the allocator's cap: the budget less the context and NCCL's buffers
        cap = budgets.usable(self.usable, list(self.chosen_row.fit.lines))
        return run_plan(self.model_fn, self.chosen, self.batch, steps, budget=cap,
                        device=self.device, lr=self.lr, seed=seed, world_size=1, rank=0)


def _formula_shape(model_fn) -> GPTShape | None:
    """The shape of the model `model_fn(dtype=, device=)` builds (on fake tensors) when it is a
    companion.models.GPT or Llama, the models the formulas predict; else None. Something that is
    not a function: GPTShape.of says what is wrong."""
    if isinstance(model_fn, nn.Module) or not callable(model_fn):
        return GPTShape.of(model_fn)                   # raises, saying what to pass
    try:
        return GPTShape.of(model_fn)
    except TypeError:
        return None


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _rows(shape: GPTShape, cands: list[Candidate], world_size: int, device_type: str,
          cost: CostModel, budget: int, gpu, context_bytes: int | None) -> list[Row]:
    """Every candidate with its predicted peak, step time and fit against the budget."""
    rows = []
    for c in cands:
        p = predict_memory(shape, c, world_size=world_size, device_type=device_type)
        found = budgets.lines(shape, c, device_type=device_type, gpu=gpu, world_size=world_size,
                              context_bytes=context_bytes)
        tokens = c.micro_batch * shape.seq_len
        largest = 4 * max(shape.largest, tokens * shape.vocab // max(c.chunked_loss, 1))
        rows.append(Row(c, p, predict_seconds(shape, c, cost, world_size=world_size),
                        fit=budgets.fit_predicted(p.peak, p.parameters, largest, budget, found,
                                                  device_type)))
    return rows


def _gpu(device: torch.device, name: str | None):
    """The GPU of `companion.cost.gpus` whose speeds and lines the plan uses: `name`, else the
    one at hand, else the A100 40GB (said in the plan's report)."""
    from companion.cost import gpus
    if name is not None:
        return gpus.gpu(name)
    if device.type == "cuda" and torch.cuda.is_available():
        found = gpus.gpu_for_device(device)
        if found is not None:
            return found
    return gpus.gpu("A100 40GB") if device.type == "cuda" else None


def plan(model_fn: Callable[..., nn.Module], batch: int, *, budget: int | str,
         device: torch.device | str | None = None, world_size: int = 1,
         allow: Iterable[str] = EXACT, lora_rank: int = 8, host_budget: int | str | None = None,
         margin: float | None = None, cost: CostModel | None = None, lr: float = 1e-3,
         verify: int = 4, simulate_plain: bool = True, step: Callable | None = None,
         seq_len: int | None = None, gpu: str | None = None,
         context_bytes: int | None = None) -> Plan | ModelPlan:
    """The fastest plan (by `cost`) whose step fits `budget` bytes per device, checked by a
    simulated step.

    Args:
        model_fn: builds the model when called as model_fn(dtype=..., device=...): a
            `companion.models.GPT` or `Llama`, e.g. functools.partial(GPT, vocab, seq_len,
            width, depth, heads, fused_attention=True) (`plan.configs` builds published ones).
        batch: sequences per optimizer step, over all ranks (the effective batch: every plan
            keeps it, splitting it into micro-batches when it accumulates).
        budget: bytes per device ("24 GiB"), all of it: on CUDA the plan's lines (`budget`:
            the CUDA context, workspaces, NCCL's buffers, the allocator's rounding and
            fragmentation) are counted inside it. `margin`: a share kept free besides (0).
        device: where `run` trains and whose speeds the cost model assumes ("cpu", "cuda").
        gpu: a GPU of `companion.cost.gpus` ("H100 SXM") for the speeds and workspaces on
            CUDA; default the GPU at hand, else the A100 40GB.
        context_bytes: the CUDA context's bytes, measured (`allocator.measure_context`);
            default `allocator.CONTEXT_BYTES`.
        world_size: data-parallel ranks; above 1 the ZeRO stages are searched.
        allow: techniques to use (`space.TECHNIQUES`); default `EXACT`, those that leave fp32
            training as it is up to rounding. 16-bit compute (`LOW_PRECISION`, which moved the
            capstone's losses by ~5e-5, relative, from fp32's over 6 steps on a CPU), LoRA
            (which trains other parameters) and chapter 11's `FEWER_BITS` ("adam8bit": Adam's
            moments in 8 bits; "qlora": LoRA on a base frozen in NF4) must be asked for:
            allow=EXACT + LOW_PRECISION + ("lora",) + FEWER_BITS. Issue 52's levers:
            "selective_checkpointing" and "optimizer_in_backward" (exact), "pure_bf16" and
            "paged_adam8bit" (in FEWER_BITS); hyphens ("pure-bf16") are accepted. A single
            name may be passed alone.
        host_budget: bytes of host memory for offload (None: no limit).
        verify: at most this many candidates are simulated before giving up; 0 simulates
            none and takes the fastest predicted to fit (fast, for exploring: unchecked).
        simulate_plain: also simulate the plain run, for the table.
        step, seq_len: for a model that is not the course GPT, `model_fn()` builds it and
            `anymodel.plan_model` plans it, with `step(model, batch) -> loss` (default: the
            next-token loss at `seq_len`), levers `anymodel.GENERIC` of `allow`; see there.
    Raises NothingFits (a ValueError) when no candidate fits, saying by how much.
    """
    shape = _formula_shape(model_fn) if step is None else None
    if shape is None:
        if world_size != 1:
            raise ValueError("for a model other than the course GPT the planner plans one device "
                             "(world_size=1)")
        return plan_model(model_fn, batch, budget=budget, step=step, seq_len=seq_len,
                          device=device if device is not None else (
                              "cuda" if torch.cuda.is_available() else "cpu"),
                          allow=[a for a in ((allow,) if isinstance(allow, str) else allow)
                                 if a in GENERIC], lora_rank=lora_rank, margin=margin,
                          cost=cost)
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    allow = (allow,) if isinstance(allow, str) else tuple(allow)   # "offload" alone is fine
    budget_bytes = parse_bytes(budget)
    if budget_bytes <= 0:
        raise ValueError(f"budget must be a positive size, e.g. '8 MiB', got {budget!r}")
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify is how many candidates to simulate (0: none), got {verify!r}")
    margin = 0.0 if margin is None else margin
    if not 0 <= margin < 1:
        raise ValueError(f"margin is the share of the budget kept free, from 0 to 1; got {margin}")
    usable = int(budget_bytes * (1 - margin))
    host = parse_bytes(host_budget) if host_budget is not None else None
    card = _gpu(device, gpu)
    cost = cost or (CostModel.for_gpu(card.name) if card is not None
                    else CostModel.for_device(device.type))
    rows = _rows(shape, candidates(shape, batch, world_size=world_size, allow=allow,
                                   lora_rank=lora_rank),
                 world_size, device.type, cost, usable, card, context_bytes)
    plain = next(r for r in rows if not r.candidate.techniques())   # micro-batch = batch
    fitting = sorted([r for r in rows if r.fit.fits
                      and (host is None or r.predicted.host <= host)],
                     key=lambda r: (r.seconds["total"], len(r.candidate.techniques())))
    if not fitting:
        raise nothing_fits(rows, usable, budget_bytes, allow, world_size, host)
    sim = functools.partial(simulate, model_fn, world_size=world_size, device_type=device.type,
                            shape=shape)
    found = functools.partial(Plan, model_fn=model_fn, batch=batch, budget=budget_bytes,
                              usable=usable, device=device, world_size=world_size, shape=shape,
                              rows=fitting, plain=plain, lr=lr, host_budget=host, gpu=card,
                              cost=cost)
    if simulate_plain and verify:
        plain.simulated = sim(plain.candidate).peak
    if not verify:
        return found(chosen=fitting[0])
    for row in fitting[:verify]:
        tracker = sim(row.candidate)
        row.simulated, row.simulated_host = tracker.peak, tracker.host_peak
        row.fit = budgets.fit_simulated(tracker, row.predicted.parameters, usable,
                                        list(row.fit.lines), device.type)
        if row.fit.fits:
            return found(chosen=row)
    missed = ", ".join(format_bytes(r.fit.total) for r in fitting[:verify])
    raise NothingFits(f"the {min(verify, len(fitting))} fastest plans predicted to fit "
                      f"{format_bytes(usable)} did not fit when simulated ({missed}); pass "
                      "verify= larger to simulate more of them, or a larger budget")
