"""Choose a plan that fits a memory budget, check it by a simulated step, then run it.

One path for every model. `plan` asks what is known of the model (`known.describe`: formulas
for the course's GPT and Llama, which published configs build; a traced step for any other
`nn.Module`), lists every candidate (`candidates`), predicts each one's peak and step time
(`predict`), adds the lines a GPU holds beyond the tensors (`budget.fit_predicted`), keeps those
that fit, and walks them fastest first, simulating each on fake tensors (no memory allocated)
until one's simulated step fits too (`budget.fit_simulated`). The `Plan` it returns prints one
table and says why it chose what it chose; `Plan.run(steps)` trains the chosen plan for real
under `memory_budget` (the course's models), `Plan.check()` runs a traced model's chosen step.

Example:
    >>> p = plan(partial(GPT, 128, 64, 64, 4, 4), 16, budget="6 MiB", device="cpu")
    >>> print(p)                   # the table, then the choice explained
    >>> report = p.run(10)         # losses, measured peak (under the budget)

Simplified vs real planners (DeepSpeed's autotuner, Colossal-AI's): two model families with
formulas (other models are traced, with fewer levers), one optimizer (AdamW) for the formulas,
a cost model with assumed speeds (`CostModel`) instead of timed trial steps, and ranks that run
the course's own ZeRO on one machine.
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
from companion.plan.budget import Fit
from companion.plan.known import GENERIC, Formulas, Traced, describe
from companion.plan.report import NothingFits, nothing_fits, plot_waterfall, waterfall
from companion.plan.predict import CostModel, Prediction
from companion.plan.ranks import run_ranks
from companion.plan.run import RunReport, run_plan
from companion.plan.space import EXACT, Candidate, GPTShape, lora_target_names, technique_name

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
    largest: int = 0                     # bytes of the step's largest request (logits, a weight)
    kinds_simulated: dict[str, int] | None = None   # bytes by kind at the simulated peak
    phase_simulated: str | None = None

    @property
    def peak(self) -> int:
        """The step's tensors at their peak: simulated when it was, else predicted."""
        return self.simulated if self.simulated is not None else self.predicted.peak

    @property
    def phase(self) -> str:
        return self.phase_simulated or self.predicted.phase

    @property
    def kinds(self) -> dict[str, int]:
        return self.kinds_simulated or self.predicted.kinds()

    def note(self, tracker) -> None:
        """Keep what a simulated step measured."""
        self.simulated, self.simulated_host = tracker.peak, tracker.host_peak
        self.kinds_simulated, self.phase_simulated = tracker.breakdown(), tracker.peak_phase

    def to_dict(self) -> dict:
        return {"plan": self.candidate.describe(), **dataclasses.asdict(self.candidate),
                "levers": self.candidate.techniques(), "peak": self.peak, "phase": self.phase,
                "kinds": self.kinds, "predicted": self.predicted.peak,
                "simulated": self.simulated is not None, "seconds": self.seconds,
                "gpu_bytes": self.fit.total if self.fit else self.peak,
                "checked": self.fit.how if self.fit else "predicted"}


class Plan:
    """The planner's answer: `chosen`, the `rows` it weighed, and how to run it."""

    def __init__(self, *, model_fn: Callable[..., nn.Module], batch: int, budget: int,
                 usable: int, device: torch.device, world_size: int, model: Formulas | Traced,
                 rows: list[Row], chosen: Row, plain: Row, lr: float, host_budget: int | None,
                 gpu=None, cost: CostModel | None = None, shown: list[Row] | None = None):
        self.model_fn, self.batch, self.budget, self.usable = model_fn, batch, budget, usable
        self.device, self.world_size, self.lr = device, world_size, lr
        self.model = model                   # what the planner knows of it (`known`)
        self.shape: GPTShape | None = model.shape        # None for a traced model
        self.n_params, self.step = model.n_params, model.step
        self.rows, self.plain, self.host_budget, self.gpu = rows, plain, host_budget, gpu
        self.cost = cost or CostModel.for_device(device.type)
        self.chosen_row: Row = chosen
        self.chosen: Candidate = chosen.candidate
        self.shown: list[Row] = shown if shown is not None else [chosen]

    @property
    def failed(self) -> list[Row]:
        """Plans predicted to fit whose simulated step did not when replayed."""
        return [r for r in self.rows if r.fit.how in ("replayed", "simulated")
                and not r.fit.fits]

    def table(self, limit: int = 8) -> str:
        """The plain run, then up to `limit` of the plans listed (`shown`), fastest first: each
        replayed through the allocator unless the planner simulated none (verify=0)."""
        head = (f"{'':2}{'plan':<64}{'predicted':>11}{'simulated':>11}{'host':>11}"
                f"{'time/step':>11}")
        lines = [head, "-" * len(head)]
        shown = [self.plain] + [r for r in self.shown if r is not self.plain][:limit]
        for r in shown:
            mark = "->" if r is self.chosen_row else "  "
            sim = format_bytes(r.simulated) if r.simulated is not None else "-"
            host = format_bytes(r.predicted.host) if r.predicted.host else "-"
            name, *more = textwrap.wrap(r.candidate.describe(), 63)   # whole words per line
            lines.append(f"{mark}{name:<64}"
                         f"{format_bytes(r.predicted.peak):>11}{sim:>11}{host:>11}"
                         f"{_time(r.seconds['total']):>11}")
            lines += [f"{'':4}{line}" for line in more]
        lines += [line for note in self.model.notes for line in textwrap.wrap(note, 100)]
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
            text += [f"    {o}" for o in r.fit.lines if o.alive != "load"]
            text += [f"  at load, before the step: {format_bytes(r.fit.load)}, with the {o}"
                     for o in r.fit.lines if o.alive == "load"]
        if r.predicted.host:
            text.append(f"  host memory: {format_bytes(r.predicted.host)} predicted"
                        + (f", {format_bytes(r.simulated_host)} simulated"
                           if r.simulated_host is not None else "") + ".")
        if self.model.note:                    # e.g. a traced model that checkpoints itself
            text.append(f"  Note: {self.model.note}.")
        for x in faster:
            text.append(f"  Faster, but its simulated step needs {format_bytes(x.simulated)}: "
                        f"{x.candidate.describe()}.")
        return "\n".join(text)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.explain()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def waterfall(self) -> list:
        """The levers one at a time from the plain run (`report.waterfall`): the formulas'."""
        if self.shape is None:
            raise ValueError("the waterfall prices each lever by the formulas, which a traced "
                             "model has none of: compare its rows (`rows`) instead")
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
        if self.shape is None:
            raise ValueError("Plan.run trains the course's GPT and Llama; for a model of your own, "
                             "check() runs the chosen step for real and measures it, and the "
                             "chosen levers go into your own training loop")
        if self.world_size != 1:
            return run_ranks(self, steps, seed=seed)
        # on CUDA the allocator's cap: the budget less the context and NCCL's buffers
        cap = budgets.usable(self.usable, list(self.chosen_row.fit.lines))
        return run_plan(self.model_fn, self.chosen, self.batch, steps, budget=cap,
                        device=self.device, lr=self.lr, seed=seed, world_size=1, rank=0)

    def check(self):
        """A traced model's chosen step run for real on this CPU, measured by `track` (its
        `peak` against `chosen_row.peak`, the simulated one). The course's models: `run`."""
        if not isinstance(self.model, Traced):
            raise ValueError("check() runs a traced model's step; the course's models train "
                             "with run(steps)")
        return self.model.check(self.chosen)

    def to_dict(self) -> dict:
        """The plan as JSON-ready data: the plain run, the chosen plan and every candidate."""
        return {"batch": self.batch, "budget": self.budget, "usable": self.usable,
                "device": str(self.device), "n_params": self.n_params,
                "known_by": self.model.how, "note": self.model.note,
                "notes": list(self.model.notes),
                "plain": self.plain.to_dict(),
                "chosen": self.chosen_row.to_dict(),
                "candidates": [r.to_dict() for r in self.rows]}


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _rows(model: Formulas | Traced, cands: list[Candidate], world_size: int,
          device_type: str, cost: CostModel, budget: int, gpu, context_bytes: int | None
          ) -> list[Row]:
    """Every candidate with its predicted peak, step time and fit against the budget."""
    rows = []
    for c in cands:
        p, seconds = model.predict(c, world_size=world_size, device_type=device_type, cost=cost)
        found = model.lines(c, device_type=device_type, gpu=gpu, world_size=world_size,
                            context_bytes=context_bytes)
        largest = model.largest_request(c)
        row = Row(c, p, seconds, fit=budgets.fit_predicted(
            p.peak, p.parameters, largest, budget, found, device_type), largest=largest)
        traced = model.traced(c)
        if traced is not None:                     # its own trace: simulated already
            row.note(traced)
        rows.append(row)
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
         allow: Iterable[str] = EXACT, lora_rank: int = 8, lora_targets: Iterable[str] = (),
         host_budget: int | str | None = None,
         margin: float | None = None, cost: CostModel | None = None, lr: float = 1e-3,
         verify: int = 4, simulate_plain: bool = True, step: Callable | None = None,
         seq_len: int | None = None, vocab: int | None = None,
         optimizer: Callable = torch.optim.AdamW, gpu: str | None = None,
         context_bytes: int | None = None, show: int | None = None) -> Plan:
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
            "paged_adam8bit" (in FEWER_BITS); issue 59's: "fused_loss" and
            "offload_checkpoints" (exact); hyphens ("pure-bf16") are accepted. A single
            name may be passed alone.
        host_budget: bytes of host memory for offload (None: no limit).
        verify: at most this many candidates are simulated before giving up; 0 simulates
            none and takes the fastest predicted to fit (fast, for exploring: unchecked).
        show: on CUDA (default 5), the plans the table lists (`Plan.shown`): the `show`
            fastest whose simulated step, replayed through the allocator, fits (at most
            verify + show simulated), so that no plan is listed as fitting on its prediction
            alone; a plan predicted to fit that does not when replayed is dropped
            (`Plan.failed`). Once one plan fits, a plan whose predicted total plus its largest
            request times the largest ratio found so far of (replay - prediction) to a plan's
            largest request passes the budget is not simulated, nor listed: a sieve that saves
            time (fragmentation grows with the large transient requests, the logits), never a
            reason to list a plan. With verify=0 the `show` fastest predicted to fit,
            unchecked. On the CPU, whose budget counts tensor bytes exactly (no allocator), the
            default lists every plan predicted to fit and simulates only until one fits.
        simulate_plain: also simulate the plain run, for the table.
        step, seq_len, vocab, optimizer: for any other model, or with a step of your own,
            `model_fn()` builds it and its step is traced instead of predicted by formulas
            (`known.Traced`): `step(model, batch) -> loss` (default: the next-token loss at
            `seq_len` over `vocab`), `optimizer(params)` (default AdamW), the levers of `allow`
            that `known.GENERIC` names. The same search and report follow either way.
    Raises NothingFits (a ValueError) when no candidate fits, saying by how much.
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    allow = (allow,) if isinstance(allow, str) else tuple(allow)   # "offload" alone is fine
    model = describe(model_fn, step=step, seq_len=seq_len, vocab=vocab, optimizer=optimizer)
    return _plan(model, batch, budget=budget, device=device, world_size=world_size,
                 allow=model.allowed(allow), lora_rank=lora_rank,
                 lora_targets=lora_targets, host_budget=host_budget,
                 margin=margin, cost=cost, lr=lr, verify=verify, simulate_plain=simulate_plain,
                 gpu=gpu, context_bytes=context_bytes, show=show)


def _plan(model: Formulas | Traced, batch: int, *, budget, device: torch.device,
          world_size: int, allow: tuple[str, ...], lora_rank: int, host_budget, margin,
          lora_targets: tuple[str, ...] = (),
          cost: CostModel | None, lr: float, verify: int, simulate_plain: bool,
          gpu: str | None, context_bytes: int | None, show: int | None = None) -> Plan:
    """The one path: candidates, predicted rows against the budget's lines, the fastest
    simulated until one fits, whatever `model` knows (formulas or a traced step)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    budget_bytes = parse_bytes(budget)
    if budget_bytes <= 0:
        raise ValueError(f"budget must be a positive size, e.g. '8 MiB', got {budget!r}")
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify is how many candidates to simulate (0: none), got {verify!r}")
    if show is not None and (isinstance(show, bool) or not isinstance(show, int) or show < 1):
        raise ValueError(f"show is how many plans to list (at least 1), got {show!r}")
    margin = 0.0 if margin is None else margin
    if not 0 <= margin < 1:
        raise ValueError(f"margin is the share of the budget kept free, from 0 to 1; got {margin}")
    usable = int(budget_bytes * (1 - margin))
    host = parse_bytes(host_budget) if host_budget is not None else None
    card = _gpu(device, gpu)
    cost = cost or (CostModel.for_gpu(card.name, world_size=world_size) if card is not None
                    else CostModel.for_device(device.type))
    lora_targets = lora_target_names(lora_targets)
    if lora_targets and not {"lora", "qlora"} & {technique_name(a) for a in allow}:
        raise ValueError("lora_targets (--lora-targets) names the Linears LoRA adapts: allow "
                         "lora or qlora too")
    cands = model.candidates(batch, world_size=world_size, allow=allow, lora_rank=lora_rank,
                             lora_targets=lora_targets)
    rows = _rows(model, cands, world_size, device.type, cost, usable, card, context_bytes)
    plain = next(r for r in rows if not r.candidate.techniques())   # micro-batch = batch
    fitting = sorted([r for r in rows if r.fit.fits
                      and (host is None or r.predicted.host <= host)],
                     key=lambda r: (r.seconds["total"], len(r.candidate.techniques())))
    if not fitting:
        raise nothing_fits(rows, usable, budget_bytes, allow, world_size, host,
                           levers=GENERIC if isinstance(model, Traced) else None)
    found = functools.partial(Plan, model_fn=model.model_fn, batch=batch, budget=budget_bytes,
                              usable=usable, device=device, world_size=world_size, model=model,
                              rows=fitting, plain=plain, lr=lr, host_budget=host, gpu=card,
                              cost=cost)

    def simulated(row: Row) -> None:
        tracker = model.simulate(row.candidate, world_size=world_size, device_type=device.type)
        row.note(tracker)
        row.fit = budgets.fit_simulated(tracker, row.predicted.parameters, usable,
                                        list(row.fit.lines), device.type)

    if simulate_plain and verify and plain.simulated is None:
        plain.note(model.simulate(plain.candidate, world_size=world_size,
                                  device_type=device.type))
    if show is None and device.type != "cuda":       # exact bytes: simulate until one fits
        if not verify:
            return found(chosen=fitting[0], shown=fitting)
        tried = 0
        for row in fitting:
            if model.traced(row.candidate) is None:    # not traced while predicting
                if tried == verify:
                    break
                tried += 1
            simulated(row)
            if row.fit.fits:                       # listed: all but those that failed
                return found(chosen=row, shown=[r for r in fitting if r.fit.fits])
        raise _missed([r for r in fitting if r.simulated is not None], usable)
    show = 5 if show is None else show
    if not verify:
        return found(chosen=fitting[0], shown=fitting[:show])
    shown, tried, gap = [], [], 0
    for row in fitting:                        # fastest first: each row shown is replayed
        if len(shown) >= show or (not shown and len(tried) >= verify) or (
                len(tried) >= verify + show):
            break
        predicted = row.fit.total
        if shown and predicted + gap * row.largest > usable:   # a sieve (see show=)
            continue
        simulated(row)
        tried.append(row)
        missed = row.fit.total - predicted if row.fit.fits else usable - predicted + 1
        gap = max(gap, missed / max(row.largest, 1))
        if row.fit.fits:
            shown.append(row)
    if shown:
        return found(chosen=shown[0], shown=shown)
    raise _missed(tried, usable)


def _missed(tried: list[Row], usable: int) -> NothingFits:
    missed = ", ".join(format_bytes(r.fit.total) for r in tried)
    return NothingFits(f"the {len(tried)} fastest plans predicted to fit "
                       f"{format_bytes(usable)} did not fit when simulated ({missed}); pass "
                       "verify= larger to simulate more of them, or a larger budget")
