"""Chapter 09's recorded experiment: the capstone GPT that does not fit its device budget, trained
unconstrained and with the planner's plan under the budget, as the notebook does it."""
from __future__ import annotations

import statistics

import torch

from companion.plan import Candidate, GPTShape, capstone_model, plan, predict_memory, run_plan

__all__ = ["capstone", "capstone_figures", "plans_on_gpu"]


def capstone(S, device: torch.device, *, repeats: int = 3, lr: float = 3e-3) -> dict:
    """The unconstrained run of the capstone GPT (`S.cap_*`), and the planner's plan for
    `S.cap_budget` bytes trained for real under that budget (`memory_budget`: on CUDA the
    allocator's cap): peaks, step times and the largest loss difference. Each run trains
    `2 * S.steps` steps `repeats` times; its step time is the median of the runs' medians, its
    losses and peak the first run's."""
    steps, model_fn = 2 * S.steps, capstone_model(S)
    reference = _repeated(lambda: run_plan(model_fn, Candidate(S.cap_batch), S.cap_batch, steps,
                                           device=device, lr=lr), repeats)
    # the budget is memory_budget's: the allocator's cap above what the process holds, so the
    # CUDA context (held before) is not in it; the workspaces and the allocator's rounding are
    chosen = plan(model_fn, S.cap_batch, budget=S.cap_budget, device=device, lr=lr,
                  context_bytes=0)
    planned = _repeated(lambda: chosen.run(steps), repeats)
    shape = GPTShape.of(model_fn)
    gpu_plans = plans_on_gpu(S, device) if device.type == "cuda" else []
    return {"experiment": "the capstone: the planner's plan under the budget "
                          f"({chosen.chosen.describe()}) against the unconstrained run",
            "measured": capstone_figures(reference, planned, S.cap_budget),
            "predicted": {"plan_gpu_bytes": chosen.chosen_row.fit.total,
                          "unconstrained_peak_bytes": predict_memory(
                              shape, Candidate(S.cap_batch), device_type=device.type).peak,
                          "plan_peak_bytes": chosen.chosen_row.predicted.peak,
                          "plan_simulated_peak_bytes": chosen.chosen_row.simulated},
            **({"plans_on_gpu": gpu_plans} if gpu_plans else {})}


def plans_on_gpu(S, device: torch.device, *, fractions=(0.6, 0.8, 1.0), steps: int = 4,
                 lr: float = 3e-3) -> list[dict]:
    """Three plans of the capstone GPT, for budgets of `fractions` of `S.cap_budget`, each
    trained under its budget (the allocator capped by `memory_budget`, context outside as there):
    predicted GPU bytes (the step's tensors and the plan's lines) against the allocator's
    measured peak reserve and peak allocated, and the cost model's step time against the
    measured median. A plan that runs out of memory is recorded as such."""
    model_fn, out = capstone_model(S), []
    for fraction in fractions:
        budget = int(S.cap_budget * fraction)
        row = {"budget_bytes": budget}
        try:
            chosen = plan(model_fn, S.cap_batch, budget=budget, device=device, lr=lr,
                          context_bytes=0)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            run = chosen.run(steps)
            r = chosen.chosen_row
            row.update(plan=chosen.chosen.describe(), predicted_tensor_bytes=r.predicted.peak,
                       predicted_reserved_bytes=r.fit.reserved,
                       predicted_lines={o.name: o.bytes for o in r.fit.lines},
                       measured_allocated_bytes=run.peak, measured_reserved_bytes=run.reserved,
                       predicted_step_seconds=r.seconds["total"], measured_step_seconds=run.seconds)
        except (torch.OutOfMemoryError, ValueError) as e:
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
    return out


def _repeated(run, repeats: int):
    """The first of `repeats` runs, with the median of all their step times."""
    reports = [run() for _ in range(max(1, repeats))]
    seconds = statistics.median(r.seconds for r in reports)
    first = reports[0]
    return type(first)(first.losses, first.peak, first.host_peak, seconds, first.budget)


def capstone_figures(reference, planned, budget: int) -> dict:
    """Chapter 09's measurements under the recorded names: the unconstrained run and the plan's
    run (`plan.RunReport`s), and the device budget in bytes."""
    return {"unconstrained_peak_bytes": reference.peak, "plan_peak_bytes": planned.peak,
            "budget_bytes": budget, "plan_step_seconds": planned.seconds,
            "unconstrained_step_seconds": reference.seconds,
            "largest_loss_difference": max(abs(a - b) for a, b in
                                           zip(planned.losses, reference.losses))}
