"""Checks for chapter 09, the capstone: train a GPT that does not fit its memory budget, under it,
with the same effective batch and the same losses as the unconstrained run."""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, harness, require
from companion.device import Sizes, pick_device, sizes
from companion.memory import format_bytes, memory_budget, track
from companion.models import GPT
from companion.plan import Candidate, build, capstone_model, token_batches, train_step

__all__ = ["check_train_within_budget"]

LR = 3e-3          # AdamW's learning rate in the capstone (its other options: PyTorch's defaults)
# How close each step's loss, and the trained model's loss on one more batch (in fp32 from its
# logits), stay to a reference run in the answer's own precision (fp32; bf16 autocast; bf16
# weights), relative. Measured on the CPU (25 seeds, 4 and 6 steps, 1 and 2 threads):
# correct fp32 plans drift by up to 2e-7, correct autocast ones by up to 4e-5; correct bf16-weight
# ones by up to 8e-5 in their trained model's loss and 7.3e-3 in their losses, which are bf16
# numbers themselves (8 bits of mantissa: 0.03 apart near 5), summed over micro-batches whose
# gradients add up in bf16. Known-wrong answers start at 1.2e-5 in fp32 (Adam for AdamW, no
# weight decay) and ~4e-3 in autocast (the last micro-batch's loss for the mean); in bf16 weights
# they hide in that rounding (half the lr: 2e-3..1.1e-2 in the losses, 6e-5..5e-3 in the final
# loss), so how far the weights moved judges them: the norm of (trained - initial) over all
# parameters is the reference's to 1e-4 for every correct plan, 0.75 of it with half the lr (bf16
# weights round each step to their own grid; 0.5 in fp32 and autocast), 0.85-0.92 with the last
# step skipped. The tolerances keep >10x margin over correct answers, 2.7x for bf16-weight losses
# (CUDA's kernels round differently from the CPU's, e.g. matmul sums split per micro-batch size;
# TF32 is off by default) and stay below every known-wrong answer they judge. AdamW hardly
# notices gradients scaled by k (a forgotten 1/k), so the check compares the first step's
# gradient norm too.
MOVED_RTOL = 0.02
RTOL = {"fp32": (2e-6, 2e-6), "autocast": (1e-3, 1e-3), "mixed": (2e-2, 1e-3)}   # losses, model
HOST_BYTES_PER_PARAM = 18   # offloaded AdamW: fp32 master, gradient, two moments (16 B) + 16-bit
                            # copies of bf16 weights (2 B); more host memory is not the states'


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
        if isinstance(v, bool) or not isinstance(v, numbers.Real):   # numpy floats are Real
            return f"a list holding a {type(v).__name__}"
        out.append(float(v))
    return out


def _precision(model: torch.nn.Module, autocast: bool) -> str:
    """The answer's precision, as the planner names it: "mixed" (16-bit weights), "autocast"."""
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        return "mixed"
    return "autocast" if autocast else "fp32"


class _Watch:
    """What the check sees of a training run: every forward of a GPT (not the recomputes inside
    backward), every optimizer step, and the gradient norm each step begins with. Allocates
    nothing per forward (version counters, no copies), so the budget measures the answer."""

    def __init__(self, device: torch.device):
        self.device, self.model, self.steps = device, None, 0
        self.seen: list[tuple] = []        # (sequences, weights' fingerprint, autocast on)
        self.norms: list[float] = []       # gradient norm at each optimizer step, when any

    def forward(self, module, inputs) -> None:
        if not isinstance(module, GPT) or not inputs:
            return
        if torch._C._current_graph_task_id() != -1:
            return                         # a checkpoint's recompute, inside backward
        if self.model is None:
            self.model = module            # held until the check has read its weights
        # 1. A change of either number means the weights changed: optimizer steps (fused AdamW
        #    writes without bumping version counters) or in-place writes.
        version = self.steps, sum(p._version for p in module.parameters())
        autocast = torch.is_autocast_enabled(self.device.type)
        self.seen.append((int(inputs[0].shape[0]), version, autocast))

    def before_step(self, optimizer, *args) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        if grads:                          # one scalar per gradient; a host-device sync
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
            self.norms.append(float(torch.stack(norms).norm()))

    def after_step(self, optimizer, *args) -> None:
        self.steps += 1

    def hooks(self) -> list:
        return [register_module_forward_pre_hook(self.forward),
                register_optimizer_step_pre_hook(self.before_step),
                register_optimizer_step_post_hook(self.after_step)]


def _subsequence(short: list[str], long: list[str]) -> bool:
    rest = iter(long)
    return all(part in rest for part in short)       # `in` consumes the iterator up to a match


def _pairs(model: torch.nn.Module, initial: torch.nn.Module) -> list[tuple]:
    """(name, trained parameter, its initial value) for every parameter of `initial`, found in
    `model` under wrappers too: blocks.0.fc.weight is blocks.blocks.0.fc.weight once the blocks
    are checkpointed (the longest initial name whose parts the trained name holds, in order)."""
    before = {tuple(n.split(".")): p for n, p in initial.named_parameters()}
    pairs = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        found = [q for q in before if q[-1] == parts[-1] and _subsequence(list(q), parts)]
        if found:
            q = max(found, key=len)
            pairs.append((".".join(q), p, before.pop(q)))
    return pairs


@torch.no_grad()
def _final(model: torch.nn.Module, initial: torch.nn.Module, batch, device) -> tuple:
    """(the trained model's loss on one more batch, names of parameters it never changed, how far
    its weights moved from the initial ones: the norm of the change, all parameters, in fp32)."""
    x, y = batch
    model.eval()
    logits = model(x.to(device)).flatten(0, 1).float()                 # bf16 weights: fp32 loss
    loss = float(F.cross_entropy(logits, y.to(device).flatten()))       # host-device sync
    pairs = _pairs(model, initial)
    unchanged = [n for n, p, p0 in pairs if torch.equal(p.float(), p0.float())]
    moved = [torch.linalg.vector_norm(p.float() - p0.float()) for _, p, p0 in pairs]
    return loss, unchanged, float(torch.stack(moved).norm()) if moved else 0.0


@harness
def _train_under_budget(answer, seed: int, steps: int, device_name: str) -> dict:
    """Run the answer on fresh batches under the chapter's budget, watching every forward and
    optimizer step; then read the trained model (outside the budget)."""
    device = torch.device(device_name)
    S = sizes(device)
    watch = _Watch(device)
    batches = capstone_batches(S, steps + 1, seed=seed)  # the data, like a loader's: not counted
    handles = watch.hooks()
    try:
        with memory_budget(S.cap_budget, device), track(device) as tracker:
            losses = call(answer, capstone_model(S, seed=seed), batches[:steps], LR)
    finally:
        for handle in handles:
            handle.remove()
    out = {"losses": _as_floats(losses), "peak": tracker.peak, "host_peak": tracker.host_peak,
           "seen": [(rows, hash(version), low) for rows, version, low in watch.seen],
           "norms": watch.norms, "weights_on_device": 0, "params": 0, "precision": "fp32"}
    model, watch.model = watch.model, None
    if model is not None:
        kinds = tracker.breakdown(at="current")
        out["weights_on_device"] = kinds["parameters"]
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        out["params"] = sum(p.numel() for p in model.parameters())
        out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out["precision"] = _precision(model, any(s[2] for s in watch.seen))
        initial = capstone_model(S, seed=seed)(dtype=torch.float32, device=device)
        out["final_loss"], out["unchanged"], out["moved"] = _final(model, initial, batches[-1],
                                                                  device)
    return out


def _reference(S: Sizes, seed: int, steps: int, device: torch.device, precision: str) -> dict:
    """The unconstrained run in the answer's precision: the whole batch at once, AdamW(LR), as
    `run_plan` trains it (chapter's cell "The run to match"); its losses, peak, first gradient
    norm and its trained model's loss on one more batch."""
    batches = capstone_batches(S, steps + 1, seed=seed)
    watch = _Watch(device)
    handles = watch.hooks()
    try:
        with track(device) as tracker:
            setup = build(capstone_model(S, seed=seed), Candidate(S.cap_batch, precision=precision),
                          device=device, lr=LR)
            losses = [float(train_step(setup, x.to(device), y.to(device)))   # host-device sync
                      for x, y in batches[:steps]]
    finally:
        for handle in handles:
            handle.remove()
    initial = capstone_model(S, seed=seed)(dtype=torch.float32, device=device)
    final, _, moved = _final(setup.model, initial, batches[-1], device)
    return {"losses": losses, "peak": tracker.peak, "norm": watch.norms[0], "final": final,
            "moved": moved}


def _steps(seen: list) -> list[int]:
    """Sequences the GPT ran forward on between two updates of its weights: one per step."""
    groups: list[int] = []
    last = None
    for rows, version, _ in seen:
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


def _check_losses_shape(losses, steps: int) -> None:
    require(isinstance(losses, list), f"expected a list of {steps} losses, got {losses}",
            hint="return one float per step: the mean loss of that step's whole batch.")
    require(len(losses) == steps, f"expected {steps} losses (one per batch), got {len(losses)}")
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    require(not bad, f"the losses of steps {bad} are not finite numbers (NaN or inf): "
            f"{[round(v, 4) for v in losses]}",
            hint="return each step's loss as a number: float(loss) of the micro-batches' losses "
                 "(each divided by their number) added up; a NaN means the training diverged "
                 "or a value was never set.")


def _check_memory(got: dict, S: Sizes) -> None:
    """The budget saw the training: the weights on the device, the peak under the budget, and on
    the host no more than offloading the model states needs."""
    weights, budget = got["weight_bytes"], S.cap_budget
    require(got["peak"] >= weights and got["weights_on_device"] >= weights,
            f"the device held {format_bytes(got['peak'])} at its peak, less than the model's own "
            f"weights ({format_bytes(weights)}): the check's budget did not see the training",
            hint="train the model on the device, in the function's own thread, where the "
                 "budget measures it: no threads, no on_host() around the model or the "
                 "activations, no switching off the memory tracking.")
    require(got["peak"] <= budget, f"the peak {format_bytes(got['peak'])} is over the "
            f"{format_bytes(budget)} budget", hint="leave the memory limit as the check sets it.")
    host_limit = HOST_BYTES_PER_PARAM * got["params"] + 2**20
    require(got["host_peak"] <= host_limit,
            f"the host held {format_bytes(got['host_peak'])} at its peak, more than offloading "
            f"the model states needs ({format_bytes(host_limit)}: about 16 bytes per parameter)",
            hint="offload moves the optimizer's state, master weights and gradients to the host; "
                 "activations and the forward stay on the device (micro-batches and "
                 "checkpointing cut them).")


def _check_behaviour(got: dict, S: Sizes, steps: int) -> None:
    seen = got["seen"]
    require(bool(seen), "the GPT never ran forward: train the model that model_fn builds")
    _check_memory(got, S)
    require(got["trainable"] == got["params"],
            f"only {got['trainable']:,} of the model's {got['params']:,} parameters train",
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
    require(not got["unchanged"], f"these parameters never changed: {got['unchanged']}",
            hint="give the optimizer every parameter of the model: model.parameters().")


def _check_against(got: dict, want: dict, steps: int) -> tuple[float, float]:
    """The answer's losses, gradients and trained model against the reference run's."""
    precision = got["precision"]
    (rtol, final_rtol), losses = RTOL[precision], got["losses"]
    ratios = [g / w for g, w in zip(losses, want["losses"])]
    k = round(ratios[0])
    require(not (k >= 2 and all(math.isclose(r, k, rel_tol=0.01) for r in ratios)),
            f"each loss is about {k} times the unconstrained run's",
            hint=f"you added up {k} micro-batch losses: the step's loss is their mean (divide "
                 "each by the number of micro-batches).")
    if got["norms"]:               # AdamW hardly notices a scaled gradient, so look at it
        scale = got["norms"][0] / want["norm"]
        require(0.9 <= scale <= 1.1, f"the first step's gradients are {scale:.2f} times the "
                "whole batch's (their norm, before the optimizer step)",
                hint="divide each micro-batch's loss by the number of micro-batches before "
                     "backward: the accumulated gradient must be the whole batch's mean.")
    moved = got["moved"] / want["moved"]
    require(abs(moved - 1) <= MOVED_RTOL,
            f"your model's weights moved {moved:.2f} times as far from their initial values as "
            f"the unconstrained run's in {steps} steps (the norm of the change, all parameters)",
            hint="the same steps must be taken, the last one too: AdamW with lr (not another "
                 "learning rate) and its default options, and one optimizer step at the end of "
                 "every batch.")
    worst = max(abs(g - w) / abs(w) for g, w in zip(losses, want["losses"]))
    where = {"fp32": "in fp32", "autocast": "against a bf16 autocast run",
             "mixed": "against a run with bf16 weights"}[precision]
    require(worst <= rtol,
            f"the losses drift from the unconstrained run's by up to {worst:.1e} (relative; at "
            f"most {rtol:g} {where}): got {[round(g, 4) for g in losses]}, expected "
            f"{[round(w, 4) for w in want['losses']]}",
            hint="the same steps must be taken: AdamW with lr and its default options, every "
                 "micro-batch's loss divided by their number, and the step's loss the sum of "
                 "those (the mean over the whole batch, not one micro-batch's).")
    final = abs(got["final_loss"] - want["final"]) / abs(want["final"])
    require(final <= final_rtol,
            f"after the {steps} steps your model's loss on a new batch is {got['final_loss']:.5f}, "
            f"the unconstrained run's {want['final']:.5f} ({final:.1e} apart, relative)",
            hint="the same steps, the last one too: AdamW with lr and its default options, and "
                 "every batch ending with its optimizer step (the losses you return come before "
                 "each step, so only the trained weights show the last one).")
    return worst, final


@exercise(points=3, timeout=240.0,
          reference=("companion.plan.planner.Plan.run",
          "companion.plan.training.build",
          "companion.plan.training.train_step",
          "companion.plan.training.micro_step",
          "companion.plan.training.optimizer_step",
          "companion.ddp.accumulation_step"))
def check_train_within_budget(answer) -> str:
    """answer(model_fn, batches, lr) -> one loss per batch: build the GPT with model_fn(dtype=...,
    device=...), take one AdamW(lr) step per (x, y) in batches under the chapter's budget, and
    return each step's mean loss over its whole batch."""
    device = pick_device()
    S = sizes(device)
    steps, seed = 2 * S.steps, fresh_seeds(1)[0]
    got = _run_answer(answer, seed, steps, device, S.cap_budget)
    _check_losses_shape(got["losses"], steps)
    _check_behaviour(got, S, steps)
    want = _reference(S, seed, steps, device, got["precision"])
    worst, final = _check_against(got, want, steps)
    return (f"peak {format_bytes(got['peak'])} under the {format_bytes(S.cap_budget)} budget "
            f"(the unconstrained run: {format_bytes(want['peak'])}), host "
            f"{format_bytes(got['host_peak'])}; losses within {worst:.1e} (relative) of it over "
            f"{steps} steps of {S.cap_batch} sequences, the trained model's within {final:.1e}")
