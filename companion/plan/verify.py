"""Does the cost model rank plans as this machine does? Time several plans' steps and compare.

The planner keeps the fastest plan that fits, so what its cost model must get right is the
*order* of the candidates' step times, not their seconds. `rank_check` builds each plan once
(`training.build`), times one optimizer step of each (`training.train_step`) in interleaved
rounds (`companion.cost.stats.interleave`: each round in a new random order, so a slow minute of
a shared machine lands on every plan and no plan always follows the same one), and sets the median of each plan's steps beside
`predict_seconds(...)["total"]`. Two figures sum it up:

  Spearman's ρ   the rank correlation of predicted and measured (1: the same order; one swap of
                 neighbours among 10 plans costs 0.012, one plan 5 places off about 0.18);
  median error   median over plans of |predicted / measured - 1|: how far the seconds are off.
                 A cost model with assumed speeds is often off by one factor for every plan (the
                 machine is slower than assumed): `scale` is the median of predicted / measured
                 and `scaled_error` the median error once that factor is taken out.

`RankCheck.interval` is a bootstrap interval of ρ from the timings' own spread (each plan's
steps resampled, its median taken again): how far the scatter within this run moves ρ. It does not
see what changes from one run to the next (another load on a shared machine, other builds): for
that, time the plans again in an independent check and rank one run's medians against the other's
(`RankCheck.agreement`). `shuffle=seed` draws other round orders (a second run). `default_plans`
picks ten plans that pull different levers (on the course's CPU their steps take 1x to 7.5x the
plain step's); `with_cost` ranks the same timings by another cost model, `subset` some of the
plans (the fp32 ones, say).

Steps run without `companion.memory.track`, whose ledger slows every operator, so that the times
are the plan's own. Every plan's model and optimizer live at once (one build each, reused).

Example:
    >>> check = rank_check(model_fn, 16, default_plans(GPTShape.of(model_fn), 16), rounds=7)
    >>> print(check)            # each plan predicted and measured, then ρ and the errors
    >>> check.spearman, check.median_error

Simplified vs real autotuners (DeepSpeed's autotuner runs short trials of the configurations it
explores and keeps the fastest measured): one process, so no ZeRO plan; one batch reused for
every step; medians of a few steps, not of a whole run.
"""
from __future__ import annotations

import dataclasses
import random
import statistics
from typing import Callable, Sequence

import torch
from torch import nn

from companion.cost import stats
from companion.cost.clock import now
from companion.plan.costmodel import CostModel
from companion.plan.predict import predict_seconds
from companion.plan.run import token_batches
from companion.plan.space import Candidate, GPTShape
from companion.plan.training import build, train_step

__all__ = ["PlanTiming", "RankCheck", "rank_check", "default_plans", "difference_interval"]


@dataclasses.dataclass(frozen=True)
class PlanTiming:
    """One plan: predicted seconds per step, and the measured ones (median, quartiles, all)."""

    candidate: Candidate
    predicted: float
    measured: float
    low: float
    high: float
    samples: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """predicted / measured."""
        return self.predicted / self.measured


@dataclasses.dataclass(frozen=True)
class RankCheck:
    """What `rank_check` found: each plan's times, and how well prediction ranks them."""

    rows: tuple[PlanTiming, ...]
    shape: GPTShape
    cost: CostModel
    rounds: int

    def with_cost(self, cost: CostModel) -> "RankCheck":
        """The same timings, predicted by another cost model (nothing is timed again)."""
        return RankCheck(tuple(dataclasses.replace(
            r, predicted=predict_seconds(self.shape, r.candidate, cost)["total"])
            for r in self.rows), self.shape, cost, self.rounds)

    def subset(self, keep: Callable[[Candidate], bool]) -> "RankCheck":
        """The plans for which `keep(candidate)` is true, e.g. the fp32 ones."""
        rows = tuple(r for r in self.rows if keep(r.candidate))
        if len(rows) < 2:
            raise ValueError(f"keep leaves {len(rows)} plan(s): a ranking needs at least 2")
        return dataclasses.replace(self, rows=rows)

    @property
    def spearman(self) -> float:
        """Spearman's rank correlation of predicted and measured median step times."""
        return stats.spearman([r.predicted for r in self.rows], [r.measured for r in self.rows])

    @property
    def median_error(self) -> float:
        """Median over plans of |predicted / measured - 1| (0.25: a typical plan 25% off)."""
        return statistics.median(abs(r.ratio - 1) for r in self.rows)

    @property
    def scale(self) -> float:
        """Median over plans of predicted / measured: the factor common to every plan."""
        return statistics.median(r.ratio for r in self.rows)

    @property
    def scaled_error(self) -> float:
        """Median of |predicted / (scale · measured) - 1|: the error that a faster or slower
        machine (one factor for every plan) does not explain, the one that can misrank."""
        return statistics.median(abs(r.ratio / self.scale - 1) for r in self.rows)

    def timing(self, cand: Candidate) -> PlanTiming:
        """The row of plan `cand` (ValueError when it was not timed)."""
        for r in self.rows:
            if r.candidate == cand:
                return r
        raise ValueError(f"plan '{cand.describe()}' was not timed in this check")

    def agreement(self, other: "RankCheck") -> float:
        """Spearman's ρ of this check's measured medians against `other`'s, over the same plans:
        how well one run's measured order predicts another's (1: the same order)."""
        if {r.candidate for r in self.rows} != {r.candidate for r in other.rows}:
            raise ValueError("agreement compares two checks of the same plans; these timed "
                             "different ones")
        return stats.spearman([r.measured for r in self.rows],
                              [other.timing(r.candidate).measured for r in self.rows])

    def interval(self, *, confidence: float = 0.95, resamples: int = 1000,
                 seed: int = 0) -> tuple[float, float]:
        """A percentile-bootstrap interval of ρ: each plan's timed steps resampled with
        replacement, their medians ranked against the predictions again. It says how far the
        scatter of this run's timings moves ρ (with a few steps a plan, one per round, each
        resampled median takes only a few values), not how far another run could (`agreement`);
        an order already right can
        mostly only lose swaps, so the interval often ends at ρ itself, and with so few steps
        it need not even hold ρ (two close plans' resampled medians may mostly fall in the
        other order than the observed ones)."""
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
        rng = random.Random(seed)
        predicted = [r.predicted for r in self.rows]
        rhos = []
        for _ in range(resamples):
            medians = [statistics.median(rng.choices(r.samples, k=len(r.samples)))
                       for r in self.rows]
            if len(set(medians)) > 1:                  # all tied: no order, no ρ
                rhos.append(stats.spearman(predicted, medians))
        if not rhos:
            raise ValueError("every resample timed every plan the same: no order to rank")
        rhos.sort()
        tail = (1 - confidence) / 2
        return rhos[int(tail * (len(rhos) - 1))], rhos[int(round((1 - tail) * (len(rhos) - 1)))]

    def table(self) -> str:
        """A Markdown table, fastest measured first: predicted and measured ms, their ratio and
        each plan's rank by either."""
        pred = stats.rankdata([r.predicted for r in self.rows])
        meas = stats.rankdata([r.measured for r in self.rows])
        lines = ["| plan | predicted ms | measured ms (quartiles) | pred / meas | rank pred | "
                 "rank meas |", "|---|---|---|---|---|---|"]
        for i in sorted(range(len(self.rows)), key=lambda i: meas[i]):
            r = self.rows[i]
            lines.append(f"| {r.candidate.describe()} | {r.predicted * 1e3:.1f} | "
                         f"{r.measured * 1e3:.1f} ({r.low * 1e3:.1f}-{r.high * 1e3:.1f}) | "
                         f"{r.ratio:.2f} | {pred[i]:g} | {meas[i]:g} |")
        return "\n".join(lines)

    def summary(self) -> str:
        """ρ with its interval, the median error, and the scale and error beyond it."""
        low, high = self.interval()
        return (f"Spearman {self.spearman:.2f} (95% bootstrap interval {low:.2f}-{high:.2f}) "
                f"over {len(self.rows)} plans, {self.rounds} interleaved rounds; median error "
                f"{self.median_error:.0%} (|predicted / measured - 1|); predicted / measured "
                f"{self.scale:.2f} in the median, {self.scaled_error:.0%} off beyond that")

    def __str__(self) -> str:
        return f"{self.table()}\n{self.summary()}"


def difference_interval(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                        resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap interval of median(a) - median(b): each sample resampled with
    replacement on its own (e.g. a plan's timed steps and its base plan's)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"each side needs at least 2 samples, got {len(a)} and {len(b)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(a, k=len(a)))
                   - statistics.median(rng.choices(b, k=len(b))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return diffs[int(tail * (resamples - 1))], diffs[int(round((1 - tail) * (resamples - 1)))]


def _check_plans(cands: Sequence[Candidate], batch: int) -> list[Candidate]:
    cands = list(cands)
    if len(cands) < 3 or not all(isinstance(c, Candidate) for c in cands):
        raise ValueError(f"rank_check ranks at least 3 Candidates (default_plans(shape, batch) "
                         f"chooses ten), got {len(cands)}")
    if len(set(cands)) < len(cands):
        raise ValueError("a plan appears twice in cands: each is timed once per round")
    for c in cands:
        if c.micro_batch * c.accumulation != batch:
            raise ValueError(f"plan '{c.describe()}' trains {c.micro_batch} x {c.accumulation} "
                             f"sequences per step, not the batch of {batch}: give every plan "
                             "the same batch (micro_batch x accumulation)")
        if c.zero_stage:
            raise ValueError(f"plan '{c.describe()}' needs several processes; rank_check times "
                             "plans on one (leave zero_stage at 0)")
    return cands


def rank_check(model_fn: Callable[..., nn.Module], batch: int, cands: Sequence[Candidate], *,
               cost: CostModel | None = None, rounds: int = 5, warmup: int = 1,
               device: torch.device | str = "cpu", lr: float = 1e-3,
               progress: bool | None = None, shuffle: int | None = None,
               clock: Callable[[], float] | None = None) -> RankCheck:
    """Time one optimizer step of each plan in `cands` (each training `batch` sequences of the
    course's tokens) in `rounds` interleaved rounds after `warmup` untimed ones, and compare
    their medians with `predict_seconds(shape, cand, cost)["total"]` (`cost`: default
    `CostModel.for_device(device.type)`). Each round runs every plan once, in the order
    `stats.round_order(len(cands), r, shuffle)` (seed 0 when `shuffle` is None).
    `progress=True` draws a tqdm bar; `clock`: seconds now (default `clock.now(device)`, which
    waits for the device; a test passes a fake one)."""
    cands = _check_plans(cands, batch)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds must be an int of at least 2 (a median of one step is one "
                         f"step's noise), got {rounds!r}")
    if shuffle is not None and (isinstance(shuffle, bool) or not isinstance(shuffle, int)):
        raise ValueError(f"shuffle is a seed (an int) for each round's random order, or None for "
                         f"seed 0, got {shuffle!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int (untimed rounds), got {warmup!r}")
    device = torch.device(device)
    cost = CostModel.for_device(device.type) if cost is None else cost
    shape = GPTShape.of(model_fn)
    clock = (lambda: now(device)) if clock is None else clock      # host-device sync
    x, y = (t.to(device) for t in token_batches(batch, shape.seq_len, vocab=shape.vocab,
                                                steps=1)[0])
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=(warmup + rounds) * len(cands), desc="timing plans")
    steps = {}
    for i, cand in enumerate(cands):                   # built once each, stepped every round
        setup = build(model_fn, cand, device=device, lr=lr)

        def step(setup=setup):
            train_step(setup, x, y)
            if bar is not None:
                bar.update()
        steps[i] = step
    try:
        times = stats.interleave(steps, rounds=rounds, warmup=warmup, clock=clock,
                                 seed=0 if shuffle is None else shuffle)
    finally:
        if bar is not None:
            bar.close()
    rows = []
    for i, cand in enumerate(cands):
        median, low, high = stats.spread(times[i])
        rows.append(PlanTiming(cand, predict_seconds(shape, cand, cost)["total"], median, low,
                               high, tuple(times[i])))
    return RankCheck(tuple(rows), shape, cost, rounds)


def default_plans(shape: GPTShape, batch: int, *, lora_rank: int = 8) -> list[Candidate]:
    """Ten plans of `batch` sequences a step, one or more levers each, whose step times differ:
    the plain step; 4 micro-batches and one sequence at a time (the fixed cost per micro-batch);
    every block but the last recomputed; optimizer offload; activation offload; LoRA; 8-bit Adam
    states; bf16 autocast; and one sequence at a time with recompute and offload (the slowest
    exact plan). Fewer where the batch or the depth leaves no room (batch 1: no micro-batches)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int (sequences per step), got {batch!r}")
    deep = shape.depth > 1
    plans = [Candidate(batch),
             *([Candidate(batch // 4, 4)] if batch % 4 == 0 and batch > 4 else []),
             *([Candidate(1, batch)] if batch > 1 else []),
             *([Candidate(batch, segments=shape.depth)] if deep else []),
             Candidate(batch, offload=True),
             Candidate(batch, activation_offload=True),
             Candidate(batch, lora_rank=min(lora_rank, shape.width)),
             Candidate(batch, state_bits=8),
             Candidate(batch, precision="autocast"),
             Candidate(1, batch, segments=shape.depth, offload=True)]
    return list(dict.fromkeys(plans))                  # depth 1: no recompute to add
