"""Checks for chapter 09, the capstone: train a GPT that does not fit its memory budget, under it,
with the same effective batch and the same losses as the unconstrained run."""
from __future__ import annotations

import functools
import math

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, harness, require
from companion.device import Sizes, pick_device, sizes
from companion.memory import format_bytes, memory_budget, track
from companion.models import GPT
from companion.plan import Candidate, build, token_batches, train_step

__all__ = ["check_train_within_budget"]

LR = 3e-3          # AdamW's learning rate in the capstone (its other options: PyTorch's defaults)
RTOL = {False: 1e-4, True: 1e-2}   # how close each step's loss stays to the unconstrained run's:
                                   # fp32 plans (rounding only), plans that compute in 16 bits


def capstone_model(S: Sizes, *, seed: int = 0):
    """The capstone's GPT, as a function of dtype= and device= (what the planner takes too)."""
    return functools.partial(GPT, S.vocab, S.seq_len, S.cap_width, S.cap_depth, S.gpt_heads,
                             fused_attention=True, seed=seed)


def capstone_batches(S: Sizes, steps: int, *, seed: int = 0) -> list:
    """`steps` batches (x, y) of S.cap_batch token sequences each, on the CPU."""
    return token_batches(S.cap_batch, S.seq_len, vocab=S.vocab, steps=steps, seed=seed)


def _as_floats(losses) -> list[float] | str:
    """The learner's losses as floats, or what they were instead (plain data either way)."""
    if not isinstance(losses, (list, tuple)):
        return f"a {type(losses).__name__}"
    out = []
    for v in losses:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"a list holding a {type(v).__name__}"
        out.append(float(v))
    return out


@harness
def _train_under_budget(answer, seed: int, steps: int, device_name: str) -> dict:
    """Run the answer on fresh batches under the chapter's budget, watching every forward of the
    GPT: (sequences, a checksum of its trainable weights, trainable and all parameters)."""
    device = torch.device(device_name)
    S = sizes(device)
    seen = []

    def observe(module, inputs):
        if isinstance(module, GPT) and inputs:
            params = list(module.parameters())
            trainable = [p for p in params if p.requires_grad]
            with torch.no_grad():
                version = sum(float(p.detach().double().sum()) for p in trainable)
            low = torch.is_autocast_enabled(device.type) or any(
                p.dtype in (torch.bfloat16, torch.float16) for p in params)
            seen.append((int(inputs[0].shape[0]), version, sum(p.numel() for p in trainable),
                         sum(p.numel() for p in params), bool(low)))

    batches = capstone_batches(S, steps, seed=seed)      # the data, like a loader's: not counted
    handle = register_module_forward_pre_hook(observe)
    try:
        with memory_budget(S.cap_budget, device), track(device) as tracker:
            losses = call(answer, capstone_model(S, seed=seed), batches, LR)
    finally:
        handle.remove()
    return {"losses": _as_floats(losses), "peak": tracker.peak, "seen": seen}


def _reference(S: Sizes, seed: int, steps: int, device: torch.device) -> tuple[list, int]:
    """Losses and peak of the unconstrained run: the whole batch at once, fp32 AdamW(LR)."""
    with track(device) as tracker:
        setup = build(capstone_model(S, seed=seed), Candidate(S.cap_batch), device=device, lr=LR)
        losses = [float(train_step(setup, x.to(device), y.to(device)))
                  for x, y in capstone_batches(S, steps, seed=seed)]
        del setup
    return losses, tracker.peak


def _steps(seen: list) -> list[int]:
    """Sequences the GPT ran forward on between two updates of its weights: one per step."""
    groups: list[int] = []
    last = None
    for rows, version, *_ in seen:
        if version != last or not groups:
            groups.append(0)
            last = version
        groups[-1] += rows
    return groups


def _run_answer(answer, seed: int, steps: int, device: torch.device, budget: int) -> dict:
    try:
        return _train_under_budget(answer, seed, steps, str(device))
    except CheckFailed as failure:
        if "OutOfMemoryError" in failure.summary:
            failure.summary = f"your training went over the {format_bytes(budget)} budget"
            failure.hint = ("combine the levers: the model states alone (16 bytes per parameter "
                            "with AdamW) fill the budget, so move the optimizer to the host "
                            "(CPUOffloadOptimizer), and cut the activations with micro-batches "
                            "(accumulation) and/or checkpointing.")
        raise


def _check_behaviour(got: dict, S: Sizes, steps: int) -> None:
    losses, seen = got["losses"], got["seen"]
    require(isinstance(losses, list), f"expected a list of {steps} losses, got {losses}",
            hint="return one float per step: the mean loss of that step's whole batch.")
    require(len(losses) == steps, f"expected {steps} losses (one per batch), got {len(losses)}")
    require(bool(seen), "the GPT never ran forward: train the model that model_fn builds")
    trainable, total = seen[0][2], seen[0][3]
    require(trainable == total, f"only {trainable:,} of the model's {total:,} parameters train",
            hint="freezing and LoRA change what is learned; this exercise keeps the training "
                 "itself (every parameter, AdamW) and changes only how it is laid out in memory.")
    groups = _steps(seen)
    require(len(groups) == steps,
            f"the weights changed {len(groups) - 1} times over {steps} batches (expected "
            f"{steps - 1} times between the first and the last step)",
            hint="take exactly one optimizer step per batch: accumulate the micro-batches' "
                 "gradients (loss / k each), then step once.")
    require(all(g == S.cap_batch for g in groups),
            f"the model saw {groups} sequences per step; the effective batch is {S.cap_batch}",
            hint=f"every step uses all {S.cap_batch} sequences of its batch, split into "
                 "micro-batches; no extra forward passes (the loss comes from the micro-batches).")


@exercise(points=3, timeout=240.0,
          reference=("companion.plan.planner.Plan.run", "companion.plan.training.train_step"))
def check_train_within_budget(answer) -> str:
    """answer(model_fn, batches, lr) -> one loss per batch: build the GPT with model_fn(dtype=...,
    device=...), take one AdamW(lr) step per (x, y) in batches under the chapter's budget, and
    return each step's mean loss over its whole batch."""
    device = pick_device()
    S = sizes(device)
    steps, seed = 2 * S.steps, fresh_seeds(1)[0]
    got = _run_answer(answer, seed, steps, device, S.cap_budget)
    _check_behaviour(got, S, steps)
    want, plain_peak = _reference(S, seed, steps, device)
    low = any(s[4] for s in got["seen"])
    rtol = RTOL[low]
    ratios = [g / w for g, w in zip(got["losses"], want)]
    k = round(ratios[0]) if math.isfinite(ratios[0]) else 0
    require(not (k >= 2 and all(math.isclose(r, k, rel_tol=RTOL[True]) for r in ratios)),
            f"each loss is about {k} times the unconstrained run's",
            hint=f"you added up {k} micro-batch losses: the step's loss is their mean (divide "
                 "each by the number of micro-batches).")
    worst = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want))
    require(all(math.isfinite(g) for g in got["losses"]) and worst <= rtol,
            f"the losses drift from the unconstrained run's by up to {100 * worst:.2g}% (at "
            f"most {100 * rtol:g}% {'computing in 16 bits' if low else 'in fp32'}): got "
            f"{[round(g, 4) for g in got['losses']]}, expected {[round(w, 4) for w in want]}",
            hint="the same steps must be taken: AdamW with lr and its default options, every "
                 "micro-batch's loss divided by their number, and the step's loss the sum of "
                 "those (the mean over the whole batch, not one micro-batch's).")
    return (f"peak {format_bytes(got['peak'])} under the {format_bytes(S.cap_budget)} budget "
            f"(the unconstrained run: {format_bytes(plain_peak)}); losses within {worst:.1e} "
            f"(relative) of it over {steps} steps of {S.cap_batch} sequences")
