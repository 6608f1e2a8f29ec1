"""Checks for chapter 09, the capstone: decide a plan and train a GPT that does not fit its memory
budget under it, with the same effective batch and the same losses as the unconstrained run
(exercise 1), on GPTs and budgets the notebook does not show, pulling no lever further than the
budget needs; and search the levers for the fastest plan that fits
without predicting the peaks the promise already decides (exercise 2)."""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import random

import torch
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from companion.checkpointing.segments import predicted_activation_bytes
from companion.checks.core import (CheckFailed, call, call_inplace, exercise, fresh_seeds, harness,
                                   require)
from companion.device import Sizes, pick_device, sizes
from companion.memory import format_bytes, memory_budget, track
from companion.models import GPT
from companion.models.gpt import Block
from companion.plan import (LOW_PRECISION, Candidate, CostModel, GPTShape, build, candidates,
                            capstone_model, predict_memory, predict_seconds, token_batches,
                            train_step)
from companion.plan import search

__all__ = ["check_train_within_budget", "check_fastest_fitting"]

STEPS = 4          # optimizer steps each training case runs (enough for every behaviour checked)

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
# parameters is the reference's to 1e-4 for every correct plan, 0.52-0.77 of it with half the lr
# (bf16 weights round each step to their own grid; 0.5 in fp32 and autocast), 0.85-0.92 with the
# last step skipped (4 steps; the check's cases, 4 draws each). The tolerances keep >10x margin over correct answers, 2.7x for bf16-weight losses
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


# The levers the chapter hands the learner (its parts), whose plans the budgets stay clear of
PARTS = ("accumulation", "checkpointing", "offload") + LOW_PRECISION
CLEAR = 1.04       # no plan of PARTS is predicted within 4% under a case's budget: on the CPU a
                   # step measured from 3.9% under its prediction to 1.3% over (CPU, 20 plans)


def training_case(S: Sizes, seed: int, device_type: str, *, offload_needed: bool) -> Sizes:
    """A GPT and budget the notebook does not show: S with other cap_width, cap_depth (3 to 5),
    cap_batch and a cap_budget clear of every plan's predicted peak (`CLEAR`), so that a plan
    chosen by `predict_memory` fits when measured. Two kinds, so that no fixed plan passes both:
    `offload_needed`: below the model states' 16 B per parameter, the plain run at least twice
    over it (by a quarter on CUDA, where a small GPU's batch is 2 sequences), and the plan with
    every lever (offload, micro-batches of 1, every block checkpointed, fp32) fitting with 15% to
    spare (40% on CUDA, whose allocator reserves more than the tensors) and, on the CPU, no fp32
    plan without checkpointing fitting (an answer that never checkpoints finds no plan; on CUDA
    the logits outweigh what checkpointing saves, so some plan always does); else the plain run a
    quarter over it, and a plan with the states on the device, at most 4 micro-batches and no
    checkpointing (on CUDA: any fp32 plan on the device) fitting with that spare: any plan that
    offloads and runs as many micro-batches pulls a lever the budget does not need. On CUDA the
    GPT has GPT-2's vocabulary: its states outweigh the logits from 1x the notebook's width on
    (the first kind), and fit on the device below it (the second); on a 16 GB GPU (2 sequences
    of 1024 tokens) no budget lets a plan on the device fit with room while the plain step does
    not, so both cases need offload there."""
    rng = random.Random(seed)
    for _ in range(20):
        depth = rng.choice((3, 5))                 # checkpointing's recompute grows with its
        if device_type == "cpu":                   # segments up to 5 blocks (see _recomputed)
            width, batch = rng.choice((96, 112)), rng.choice((12, 18) if offload_needed else
                                                             (12, 18, 24))
        else:                                      # at most 5 blocks, so smaller than the
            batch = rng.choice(sorted({max(2, S.cap_batch // 2), S.cap_batch}))  # notebook's;
            if offload_needed:                     # GPT-2's vocabulary: the states outweigh
                width, depth = S.cap_width * rng.choice((4, 5)) // 4, rng.choice((4, 5))  # the
            else:                                  # logits only from this width on, and fit
                width = S.cap_width // rng.choice((2, 4))   # on the device only below it
        case = dataclasses.replace(S, cap_width=width, cap_depth=depth, cap_batch=batch)
        budget = _clear_budget(GPTShape.of(capstone_model(case)), case, rng, device_type,
                               offload_needed)
        if budget is not None:
            return dataclasses.replace(case, cap_budget=budget)
    if device_type == "cuda" and not offload_needed:   # a 16 GB GPU's 2 sequences of 1024
        return training_case(S, seed, device_type, offload_needed=True)   # tokens: the logits
    raise RuntimeError(f"no budget clear of the plans' peaks for {case}")   # leave no room


def _clear_budget(shape: GPTShape, S: Sizes, rng: random.Random, device_type: str,
                  offload_needed: bool) -> int | None:
    """A budget for `training_case`, or None when this GPT leaves no room for one."""
    def peak(c: Candidate) -> int:
        return predict_memory(shape, c, device_type=device_type).peak

    peaks = [peak(c) for c in candidates(shape, S.cap_batch, allow=PARTS)]
    fp32 = [(c, p) for c, p in zip(candidates(shape, S.cap_batch, allow=PARTS), peaks)
            if c.precision == "fp32"]
    spare = 1.15 if device_type == "cpu" else 1.4      # CUDA: the allocator reserves beyond
    if offload_needed:                                 # the tensors
        low = spare * peak(Candidate(1, S.cap_batch, shape.depth, offload=True))
        high = peak(Candidate(S.cap_batch)) / (2 if device_type == "cpu" else 1.25)
        high = min(high, 16 * shape.n_params / 1.1)
        if device_type == "cpu":                       # and no fp32 plan without checkpointing
            high = min(high, min(p for c, p in fp32 if c.segments == 1))   # fits
    elif device_type == "cpu":
        low = spare * min(peak(Candidate(S.cap_batch // k, k)) for k in range(2, 5)
                          if S.cap_batch % k == 0)
        high = peak(Candidate(S.cap_batch)) / 1.25
    else:                                              # some fp32 plan on the device fits
        low = spare * min(peak(c) for c in candidates(shape, S.cap_batch, allow=PARTS)
                          if not c.offload and c.precision == "fp32")
        high = peak(Candidate(S.cap_batch)) / 1.25
    if device_type == "cuda":
        high = min(high, S.cap_budget)
    for _ in range(100 if low < high else 0):
        budget = int(low * (high / low) ** rng.random())
        if (not any(budget / CLEAR <= p <= budget for p in peaks)
                and (offload_needed or device_type != "cpu"
                     or _decides(shape, [c for c, p in fp32 if p <= budget]))):
            return budget
    return None


def _levers(depth: int, c: Candidate) -> tuple:
    """What `_check_decision` compares: (offloaded, micro-batches, blocks recomputed)."""
    return c.offload, c.accumulation, _recomputed(depth, c.segments)


def _beaten(depth: int, c: Candidate, fits: list[Candidate]) -> bool:
    """Whether some plan of `fits` pulls one lever less than `c` and no other one more."""
    mine = _levers(depth, c)
    return any(all(t <= m for t, m in zip(_levers(depth, d), mine)) and _levers(depth, d) != mine
               for d in fits)


def _decides(shape: GPTShape, fits: list[Candidate]) -> bool:
    """Whether a budget whose fp32 plans predicted to fit are `fits` grades the decision: the
    fewest levers with the states offloaded, and the fewest with power-of-two micro-batches only,
    both pull a lever further than it needs (on the CPU the cost model prices a small GPT's
    offload at a few ms, so only levers, not predicted time, tell those plans apart)."""
    offloaded = [c for c in fits if c.offload]
    pow2 = [c for c in fits if c.micro_batch & (c.micro_batch - 1) == 0]
    fewest = lambda c: (c.offload, c.accumulation, c.segments)
    return all(not group or _beaten(shape.depth, min(group, key=fewest), fits)
               for group in (offloaded, pow2))


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
    backward), the blocks recomputed inside backward, every optimizer step, whether it updates
    the model's own parameters (not masters elsewhere), and the gradient norm each step begins
    with. Allocates nothing per forward (version counters, no copies), so the budget measures the
    answer."""

    def __init__(self, device: torch.device):
        self.device, self.model, self.steps = device, None, 0
        self.seen: list[tuple] = []        # (sequences, weights' fingerprint, autocast on)
        self.norms: list[float] = []       # gradient norm at each optimizer step, when any
        self.recomputed = 0                # blocks run forward again inside backward
        self.own_params = True             # every step updated the model's parameters

    def forward(self, module, inputs) -> None:
        if isinstance(module, Block) and torch._C._current_graph_task_id() != -1:
            self.recomputed += 1           # a checkpoint's recompute, inside backward
            return
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
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.model is not None:         # masters elsewhere (offload) are not the model's
            mine = {id(p) for p in self.model.parameters()}
            self.own_params &= all(id(p) in mine for p in params)
        grads = [p.grad for p in params if p.grad is not None]
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
def _train_under_budget(answer, seed: int, steps: int, device_name: str, case: tuple) -> dict:
    """Run the answer on fresh batches under the case's budget, watching every forward and
    optimizer step; then read the trained model (outside the budget). `case`: (width, depth,
    batch, budget) of the GPT and its budget, as `training_case` drew them."""
    device = torch.device(device_name)
    S = _sized(sizes(device), case)
    watch = _Watch(device)
    batches = capstone_batches(S, steps + 1, seed=seed)  # the data, like a loader's: not counted
    handles = watch.hooks()
    try:
        with memory_budget(S.cap_budget, device), track(device) as tracker:
            # the answer's own objects, not copied: a copy made here would count in the budget
            losses = call_inplace(answer, capstone_model(S, seed=seed), batches[:steps], LR,
                                  S.cap_budget)
    finally:
        for handle in handles:
            handle.remove()
    out = {"losses": _as_floats(losses), "peak": tracker.peak, "host_peak": tracker.host_peak,
           "seen": [(rows, hash(version), low) for rows, version, low in watch.seen],
           "norms": watch.norms, "weights_on_device": 0, "params": 0, "precision": "fp32",
           "recomputed": watch.recomputed, "own_params": watch.own_params}
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


def _sized(S: Sizes, case: tuple) -> Sizes:
    width, depth, batch, budget = case
    return dataclasses.replace(S, cap_width=width, cap_depth=depth, cap_batch=batch,
                               cap_budget=budget)


def _reference(S: Sizes, seed: int, steps: int, device: torch.device, precision: str) -> dict:
    """The unconstrained run in the answer's precision: the whole batch at once, AdamW(LR), as
    `run_plan` trains it (chapter's cell "The run to match"); its losses, peak, first gradient
    norm and its trained model's loss on one more batch. The same arguments train the same run,
    so it is kept for the next call that asks for it (the mutation benchmark checks every mutant
    under the same seeds; a learner's fresh seeds never ask twice)."""
    return dict(_reference_run(S, seed, steps, str(device), precision))


@functools.lru_cache(maxsize=8)
def _reference_run(S: Sizes, seed: int, steps: int, device_name: str, precision: str) -> dict:
    device = torch.device(device_name)
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


def _run_answer(answer, seed: int, S: Sizes, device: torch.device) -> dict:
    case = (S.cap_width, S.cap_depth, S.cap_batch, S.cap_budget)
    try:
        return _train_under_budget(answer, seed, STEPS, str(device), case)
    except CheckFailed as failure:
        if "OutOfMemoryError" in failure.summary:
            failure.summary = "your training went over the budget"
            failure.hint = ("choose the plan from the model and the budget you are given: "
                            "predict_memory(GPTShape.of(model_fn), Candidate(...)) of the plan "
                            "you build must fit `budget`, and the plan you train must be the one "
                            "you predicted (micro-batch, segments, offload, precision).")
        raise


def _described(S: Sizes) -> str:
    return (f"a GPT of {S.cap_depth} blocks of width {S.cap_width}, {S.cap_batch} sequences "
            f"per step")


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
    # the states' bytes, and the saved activations of the whole batch (activation offload with
    # saved-tensor hooks, where that is what fits): the most any plan of the course puts there
    saved = predict_memory(GPTShape.of(capstone_model(S)),
                           Candidate(S.cap_batch, activation_offload=True)).host
    host_limit = HOST_BYTES_PER_PARAM * got["params"] + saved + 2**20
    require(got["host_peak"] <= host_limit,
            f"the host held {format_bytes(got['host_peak'])} at its peak, more than offloading "
            f"the model states and the batch's saved activations needs "
            f"({format_bytes(host_limit)})",
            hint="offload moves the optimizer's state, master weights and gradients to the host, "
                 "and saved-tensor hooks the activations backward needs; the forward itself "
                 "stays on the device.")


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
    require(not (got["precision"] == "mixed" and got["own_params"]),
            "the optimizer updated the bf16 weights themselves: no fp32 master copy kept them",
            hint="16-bit weights train with an fp32 master copy that the optimizer updates "
                 "(chapter 05; CPUOffloadOptimizer keeps one on the host): updates smaller than "
                 "a bf16 weight's spacing are lost without it.")


def _recomputed(depth: int, segments: int) -> int:
    """Blocks checkpoint_sequential runs again per micro-batch: every segment's but the last's
    (depth // segments each). Never fewer for more segments up to 5 blocks (training_case's)."""
    return depth // segments * (segments - 1)


def _observed(got: dict) -> tuple[bool, int, float]:
    """(states offloaded, micro-batches per step, blocks recomputed per micro-batch) of the run:
    offloaded when the optimizer updated other tensors than the model's parameters (masters)
    and the host held at least AdamW's two moments (8 B per parameter)."""
    offloaded = not got["own_params"] and got["host_peak"] >= 8 * got["params"]
    forwards = len(got["seen"])
    return offloaded, round(forwards / len(_steps(got["seen"]))), got["recomputed"] / forwards


def _check_decision(got: dict, S: Sizes, device_type: str) -> None:
    """The plan trained pulls no lever further than the budget needs: no plan of the chapter's
    parts in the answer's precision is predicted to fit with less of one lever (offload, micro-
    batches, blocks recomputed) and no more of the others."""
    offloaded, micro, recomputed = _observed(got)
    shape = GPTShape.of(capstone_model(S))
    mine = (offloaded, micro, recomputed)
    for c in candidates(shape, S.cap_batch, allow=PARTS):
        if c.precision != got["precision"]:
            continue
        theirs = (c.offload, c.accumulation, _recomputed(shape.depth, c.segments))
        if (all(t <= m + 1e-9 for t, m in zip(theirs, mine)) and theirs != mine
                and predict_memory(shape, c, device_type=device_type).peak <= S.cap_budget):
            what = ("the model states on the device" if offloaded and not c.offload else
                    f"{c.accumulation} micro-batch{'es' if c.accumulation > 1 else ''}"
                    if c.accumulation < micro else
                    f"{theirs[2]} block{'s' if theirs[2] != 1 else ''} recomputed")
            raise CheckFailed(
                f"your plan ({'optimizer offload' if offloaded else 'states on the device'}, "
                f"{micro} micro-batch{'es' if micro > 1 else ''}, {recomputed:g} blocks "
                f"recomputed per micro-batch) pulls a lever further than this budget needs: a "
                f"plan with {what} and no more of the others is predicted to fit "
                f"({c.describe()})",
                hint="decide from the model and the budget you are given: predict_memory says "
                     "which plans fit this budget, and every lever costs time (offload: the "
                     "host's AdamW and the copies; a micro-batch: fixed costs per layer; "
                     "checkpointing: blocks run forward again). A plan that fits with less of "
                     "one lever and no more of the others is the better choice.")


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


@exercise(points=3, timeout=60.0,
          reference=("companion.plan.decide.rule_plan",
          "companion.plan.planner.plan",
          "companion.plan.planner.Plan.run",
          "companion.plan.training.build",
          "companion.plan.training.train_step",
          "companion.plan.training.micro_step",
          "companion.plan.training.optimizer_step",
          "companion.ddp.accumulation_step"))
def check_train_within_budget(answer, *, cases: int = 2) -> str:
    """answer(model_fn, batches, lr, budget) -> one loss per batch: build the GPT with
    model_fn(dtype=..., device=...), take one AdamW(lr) step per (x, y) in batches within
    `budget` bytes of device memory, and return each step's mean loss over its whole batch.
    Tried on `cases` GPTs and budgets the notebook does not show (the first needs offload, the
    second does not); the plan it trains must pull no lever further than the budget needs
    (`_check_decision`), so that no plan fixed in advance passes both."""
    device = pick_device()
    S = sizes(device)
    seeds, lines = fresh_seeds(cases), []
    for i, seed in enumerate(seeds):
        case = training_case(S, seed, device.type, offload_needed=i == 0)
        try:
            got = _run_answer(answer, seed, case, device)
            _check_losses_shape(got["losses"], STEPS)
            _check_behaviour(got, case, STEPS)
            want = _reference(case, seed, STEPS, device, got["precision"])
            worst, final = _check_against(got, want, STEPS)
            _check_decision(got, case, device.type)     # the training right first, then the plan
        except CheckFailed as failure:
            failure.summary = (f"{_described(case)}, budget {format_bytes(case.cap_budget)}: "
                               f"{failure.summary}")
            raise
        lines.append(f"{_described(case)}: peak {format_bytes(got['peak'])} under "
                     f"{format_bytes(case.cap_budget)} (unconstrained {format_bytes(want['peak'])}"
                     f"), host {format_bytes(got['host_peak'])}, losses within {worst:.1e} and "
                     f"the trained model's within {final:.1e} of it")
    return f"{STEPS} steps on each of {cases} GPTs and budgets the notebook does not show: " + \
        "; ".join(lines)


# ---------------------------------------------------------------- exercise 2: the search

MONOTONE = "micro_batch"      # the lever whose peak the exercise promises never falls as it grows


def _divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def _accumulating(batch: int) -> list[int]:
    """The exercise's micro-batch sizes: those that split `batch` into two or more micro-batches.
    The whole batch at once is the one exception to the promise in the planner's predictions (it
    keeps no gradients between micro-batches: 10 of the 64 grids of `_planner_case`'s sizes
    have a setting where it needs less than the largest size below it), so it is left out."""
    return _divisors(batch)[:-1]


def _table_case(seed: int, at_boundary: bool, largest: bool = False) -> dict:
    """Levers the notebook does not show, with peaks that follow the course's formulas (states,
    then activations per sequence times the micro-batch, checkpoint_sequential's uneven segments)
    and step times that wobble as measured ones do (±25%, so the fastest plan of a setting of
    the other levers need not be its largest micro-batch). The budget is, `at_boundary`, exactly
    the peak of the fastest plan that fits (whose peak is the budget's), else between peaks.
    Drawn until the fastest plan that fits is missed by a search that reads the promise the
    wrong way round (its setting's largest micro-batch does not fit) and differs from the
    fastest of each setting's largest fitting micro-batch; `largest`: drawn until the fastest
    plan that fits is the largest micro-batch of its setting instead (a search that never asks
    for the last size misses it) and a scan of each setting's sizes from the smallest up asks
    more peaks than a binary search per setting can (`_judge_asking`)."""
    rng = random.Random(seed)
    while True:
        batch, depth = rng.choice((24, 36, 48)), rng.choice((5, 6, 7))
        levers = {MONOTONE: _accumulating(batch), "segments": list(range(1, depth + 1)),
                  "offload": [False, True]}
        if rng.random() < 0.5:
            levers["precision"] = ["fp32", "bf16"]
        names = list(levers)
        rng.shuffle(names)
        levers = {name: levers[name] for name in names}
        block, kept, outside = (rng.randrange(30_000, 90_000), rng.randrange(2_000, 6_000),
                                rng.randrange(20_000, 60_000))
        params = rng.randrange(200_000, 2_000_000)
        peaks, times = {}, {}
        for plan in search.all_plans(levers):
            low = plan.get("precision") == "bf16"
            states = (4 if plan["offload"] else 16) * params
            per_sequence = outside + predicted_activation_bytes(depth, plan["segments"], block, kept)
            peaks[_key(levers, plan)] = states + plan[MONOTONE] * per_sequence // (2 if low else 1)
            compute = (1 + (plan["segments"] > 1) / 3) * (0.6 if low else 1.0)
            overhead = 0.02 * batch / plan[MONOTONE] + (0.3 if plan["offload"] else 0.0)
            times[_key(levers, plan)] = (compute + overhead) * rng.uniform(0.8, 1.25)
        budget = _table_budget(peaks, times, rng, at_boundary)
        case = {"levers": levers, "peaks": peaks, "times": times, "budget": budget}
        if budget is not None and (_largest_is_best(case) and _scan_asks(case) > _asks_at_most(case)
                                   if largest else _telling(case, at_boundary)):
            return case


def _table_budget(peaks: dict, times: dict, rng: random.Random, at_boundary: bool):
    """A budget leaving between 15% and 70% of the plans out of it (see `_table_case`)."""
    ordered = sorted(peaks.values())
    low, high = ordered[int(0.3 * len(ordered))], ordered[int(0.85 * len(ordered))]
    if not at_boundary:
        return rng.uniform(low, high) // 1 + 0.5            # between integer peaks
    qualifying = []
    best_peak = math.inf                                    # the smallest peak of faster plans
    for key in sorted(times, key=times.get):
        if low <= peaks[key] <= high and peaks[key] < best_peak:
            qualifying.append(peaks[key])
        best_peak = min(best_peak, peaks[key])
    return rng.choice(qualifying) if qualifying else None


def _planner_case(seed: int) -> dict:
    """The course GPT at sizes the notebook does not show, its peaks and times from the planner's
    own `predict_memory` and `predict_seconds` (the CPU's cost model), over the micro-batches that
    accumulate, segments, offload and precision, taken as drawn: over those micro-batches the
    promise holds on every grid of these sizes (a test checks all 64)."""
    rng = random.Random(seed)
    width, depth = rng.choice((80, 96, 144, 176)), rng.choice((3, 5, 6, 7))
    batch = rng.choice((12, 18, 24, 30))
    shape = GPTShape.of(functools.partial(GPT, 128, 64, width, depth, 4, fused_attention=True))
    levers = {MONOTONE: _accumulating(batch), "segments": list(range(1, depth + 1)),
              "offload": [False, True], "precision": ["fp32", "autocast", "mixed"]}
    cost = CostModel.for_device("cpu")
    peaks, times = {}, {}
    for plan in search.all_plans(levers):
        c = Candidate(plan[MONOTONE], batch // plan[MONOTONE], plan["segments"],
                      plan["precision"], offload=plan["offload"])
        peaks[_key(levers, plan)] = predict_memory(shape, c).peak
        times[_key(levers, plan)] = predict_seconds(shape, c, cost)["total"]
    ordered = sorted(peaks.values())
    budget = rng.uniform(ordered[len(ordered) // 4], ordered[3 * len(ordered) // 4]) // 1
    return {"levers": levers, "peaks": peaks, "times": times, "budget": budget + 0.5}


def _promise_holds(case: dict) -> bool:
    """Whether each setting's peaks never fall as the micro-batch grows."""
    levers, peaks = case["levers"], case["peaks"]
    for plans in _settings(levers).values():
        got = [peaks[_key(levers, p)] for p in plans]
        if any(a > b for a, b in zip(got, got[1:])):
            return False
    return True


def _settings(levers: dict) -> dict:
    """{the other levers' values: that setting's plans, micro-batch ascending}."""
    out: dict = {}
    for plan in search.all_plans(levers):
        out.setdefault(tuple(v for k, v in plan.items() if k != MONOTONE), []).append(plan)
    for plans in out.values():
        plans.sort(key=lambda p: p[MONOTONE])
    return out


def _segments_pruned(case: dict) -> tuple | None:
    """The fastest plan that fits by a search that reads more checkpoint segments as never
    needing more memory: a setting whose smallest micro-batch does not fit rules out the
    settings of the same other levers with fewer segments."""
    levers, budget = case["levers"], case["budget"]
    where = list(levers).index(MONOTONE)
    plans = _settings(levers)
    names = [k for k in levers if k != MONOTONE]
    seg = names.index("segments")
    dead = {key for key, setting in plans.items()
            if case["peaks"][_key(levers, setting[0])] > budget}

    def ruled_out(key: tuple) -> bool:
        other = key[:where] + key[where + 1:]
        return any(d[:seg] + d[seg + 1:] == other[:seg] + other[seg + 1:] and d[seg] > other[seg]
                   for d in dead)

    keys = [k for k in _fitting(case) if not ruled_out(k)]
    return _fastest(case, keys)


def _largest_pruned(case: dict, order: list) -> tuple | None:
    """The fastest plan that fits by a search that, visiting the settings in `order`, skips one
    whose largest micro-batch is no faster than the best plan so far (it reads the largest
    micro-batch as its setting's fastest)."""
    levers, best = case["levers"], None
    for setting in order:
        keys = [_key(levers, p) for p in setting]
        if best is not None and case["times"][keys[-1]] >= case["times"][best]:
            continue
        for key in keys:
            if case["peaks"][key] <= case["budget"] and (best is None or
                                                         case["times"][key] < case["times"][best]):
                best = key
    return best


def _fixed_budget_case(seed: int, *wrong) -> dict:
    """A table case (`_table_case`) whose budget sits where each rule of `wrong` misses the
    fastest plan that fits: drawn, from the seed, among the budgets between two peaks where
    they all do."""
    rng = random.Random(seed)
    while True:
        case = _table_case(rng.randrange(2**32), at_boundary=False)
        ordered = sorted(set(case["peaks"].values()))
        budgets = [p + 0.5 for p in ordered[:-1]]     # uneven segments tell only low ones
        telling = [b for b in budgets if all(_misses(dict(case, budget=b), rule)
                                             for rule in wrong)]
        if telling:
            return dict(case, budget=rng.choice(telling))


def _misses(case: dict, wrong) -> bool:
    best = _fastest(case, _fitting(case))
    return best is not None and case["times"].get(wrong(case), math.inf) > case["times"][best]


def _case(seed: int, kind: str) -> dict:
    """One of the check's cases, the same from the same seed in any process."""
    if kind == "planner":
        return _planner_case(seed)
    if kind == "uneven segments":
        return _fixed_budget_case(seed, _segments_pruned)
    if kind == "largest not fastest":
        return _fixed_budget_case(   # the settings visited in the levers' order or reversed
            seed, lambda case: _largest_pruned(case, list(_settings(case["levers"]).values())),
            lambda case: _largest_pruned(case, list(_settings(case["levers"]).values())[::-1]))
    case = _table_case(seed, at_boundary=kind == "boundary", largest=kind == "largest fits")
    if kind == "nothing fits":
        case["budget"] = min(case["peaks"].values()) - 1
    return case


def _key(levers: dict, plan) -> tuple:
    """A plan's values in the levers' order; ValueError (to the learner) unless it is a plan."""
    if not isinstance(plan, dict) or set(plan) != set(levers):
        raise ValueError(f"a plan is a dict with one value for each lever {list(levers)}, e.g. "
                         f"{ {k: v[0] for k, v in levers.items()} }; got {plan!r}")
    for name, values in levers.items():
        if not any(type(v) is type(plan[name]) and v == plan[name] for v in values):
            raise ValueError(f"{plan[name]!r} is not a value of the lever {name!r}: {values}")
    return tuple(plan[name] for name in levers)


@harness
def _search(answer, seed: int, kind: str) -> dict:
    """The answer on one case, with counting predictors: what it returned (plain data) and which
    plans it asked the peak of, in order."""
    case = _case(seed, kind)
    levers, asked, timed = case["levers"], [], [0]

    def predict_peak(plan: dict) -> int:
        key = _key(levers, plan)
        asked.append(key)
        return case["peaks"][key]

    def predict_time(plan: dict) -> float:
        timed[0] += 1
        return case["times"][_key(levers, plan)]

    got = call(answer, {k: list(v) for k, v in levers.items()}, predict_peak, predict_time,
               case["budget"])
    if isinstance(got, dict):
        got = {str(k): v if isinstance(v, (bool, int, float, str)) else repr(v)
               for k, v in got.items()}
    elif got is not None:
        got = f"a {type(got).__name__}: {got!r}"[:200]
    return {"got": got, "asked": asked, "timed": timed[0]}


def _fastest(case: dict, keys) -> tuple | None:
    return min(keys, key=case["times"].get, default=None)


def _fitting(case: dict, strict: bool = False) -> list[tuple]:
    b = case["budget"]
    return [k for k, p in case["peaks"].items() if (p < b if strict else p <= b)]


def _telling(case: dict, at_boundary: bool) -> bool:
    """Whether the case tells the right search from the wrong ones of `_WRONG` that it can (at
    the boundary `<` for `<=`, between peaks the largest micro-batch for the fastest) and from one
    that reads the promise the wrong way round (skipping a setting whose largest micro-batch does
    not fit)."""
    best = _fastest(case, _fitting(case))
    levers = case["levers"]
    if best is None:
        return False
    setting = _settings(levers)[tuple(v for k, v in zip(levers, best) if k != MONOTONE)]
    rules = list(_WRONG.values())
    rules = [rules[0], rules[1]] if at_boundary else [rules[0], rules[2]]
    return (case["peaks"][_key(levers, setting[-1])] > case["budget"]
            and all(rule(case) != best for rule in rules))


def _largest_is_best(case: dict) -> bool:
    """Whether the fastest plan that fits is the largest micro-batch of its setting."""
    best, levers = _fastest(case, _fitting(case)), case["levers"]
    where = list(levers).index(MONOTONE)
    return best is not None and best[where] == levers[MONOTONE][-1]


def _asks_at_most(case: dict) -> int:
    """The most peaks a binary search per setting of the other levers asks: ceil(log2(n + 1))
    per setting for n micro-batch sizes."""
    n = len(case["levers"][MONOTONE])
    return len(_settings(case["levers"])) * math.ceil(math.log2(n + 1))


def _scan_asks(case: dict) -> int:
    """The peaks a scan of each setting's sizes from the smallest up asks: those that fit, and
    the first that does not."""
    levers, asks = case["levers"], 0
    for plans in _settings(levers).values():
        fit = sum(case["peaks"][_key(levers, p)] <= case["budget"] for p in plans)
        asks += fit + (fit < len(plans))
    return asks


# The cases whose budget most plans fit, where asking each size that fits costs more peaks than a
# binary search per setting can ask (where few fit, a search that asks the fastest plans first
# may ask more than that and still few: it is not held to it there)
FEW_ASKS = ("boundary", "between peaks", "largest fits")


def _largest_per_setting(case: dict) -> tuple | None:
    levers, budget, keys = case["levers"], case["budget"], []
    for plans in _settings(levers).values():
        fits = [_key(levers, p) for p in plans if case["peaks"][_key(levers, p)] <= budget]
        keys += fits[-1:]
    return _fastest(case, keys)


_WRONG = {
    "you returned the plan with the smallest peak among those that fit; the task asks for the "
    "fastest one that fits: compare predict_time among the plans whose peak fits.":
        lambda case: min(_fitting(case), key=lambda k: (case["peaks"][k], case["times"][k]),
                         default=None),
    "a plan whose peak equals the budget fits too: keep plans with predict_peak(plan) <= budget, "
    "not <.": lambda case: _fastest(case, _fitting(case, strict=True)),
    "the largest micro-batch that fits is not always the fastest: nothing promises an order of "
    "the times (here they wobble, as measured ones do), so time every plan that fits.": _largest_per_setting,
}


def _plan_of(case: dict, key: tuple | None) -> str:
    if key is None:
        return "None"
    return (f"{dict(zip(case['levers'], key))} (peak {case['peaks'][key]:,.0f}, "
            f"{case['times'][key]:.4g} s)")


def _as_key(case: dict, got, label: str) -> tuple | None:
    """The answer's plan as the grid's key, None for None; CheckFailed for anything else."""
    if got is None:
        return None
    try:
        return _key(case["levers"], got)
    except ValueError as bad:
        raise CheckFailed(f"{label}: expected a plan (a dict with one value of each lever) or "
                          f"None, got {got!r}: {bad}",
                          hint="return the plan you chose as predict_peak takes it, or None when "
                               "no plan fits.") from None


def _judge_answer(case: dict, got: tuple | None, label: str, mistake: str | None) -> None:
    """Pass when `got` is the fastest plan that fits (any of them, on a tie), else CheckFailed;
    `mistake`: the hint of the wrong rule that gives every answer the learner gave."""
    budget, best = case["budget"], _fastest(case, _fitting(case))
    if best is None:
        require(got is None, f"{label}: no plan fits the budget {budget:,.0f} (the smallest peak "
                f"is {min(case['peaks'].values()):,}); you returned {_plan_of(case, got)}",
                hint="return None when no plan's peak is at most the budget.")
        return
    if got is not None and case["peaks"][got] > budget:
        raise CheckFailed(f"{label}: your plan {_plan_of(case, got)} is over the budget "
                          f"{budget:,.0f}", expected=_plan_of(case, best),
                          hint="only a plan with predict_peak(plan) <= budget fits: look at the "
                               "end of your search (a binary search's last step is easy to be "
                               "off by one in).")
    if got is None or case["times"][got] > case["times"][best]:
        raise CheckFailed(
            f"{label}: a faster plan fits: {_plan_of(case, best)}; you returned "
            f"{_plan_of(case, got)}", expected=_plan_of(case, best), got=_plan_of(case, got),
            hint=mistake or "only the micro-batch promises an order: with the other levers fixed, "
            "the peak never falls as micro_batch grows, so the micro-batch sizes that fit are a "
            "prefix of the ascending list. Nothing is promised for the other levers "
            "(checkpoint_sequential's segments are uneven), so no setting of them may be skipped.")


def _judge_asking(case: dict, asked: list, label: str, kind: str) -> None:
    """No peak asked twice, nor one that earlier answers decide by the promise; on the cases
    `FEW_ASKS`, no more peaks than a binary search per setting can ask."""
    levers, budget = case["levers"], case["budget"]
    where = [i for i, k in enumerate(levers) if k == MONOTONE][0]
    known: dict = {}                                # setting -> (largest fitting, smallest not)
    for n, key in enumerate(asked):
        setting, size = key[:where] + key[where + 1:], key[where]
        fits_up_to, fails_from = known.get(setting, (-math.inf, math.inf))
        require(asked.index(key) == n, f"{label}: you predicted the peak of "
                f"{dict(zip(levers, key))} twice",
                hint="each predicted peak is a simulated step: keep what you learned instead of "
                     "asking again.")
        decided = "fits" if size <= fits_up_to else "does not fit" if size >= fails_from else ""
        require(not decided, f"{label}: you predicted the peak of {dict(zip(levers, key))}, "
                f"which an earlier prediction had decided: it {decided} (call {n + 1} of "
                f"{len(asked)}; the grid has {len(case['peaks'])} plans)",
                hint="with the other levers fixed, the peak never falls as micro_batch grows: a "
                     "plan with a smaller micro-batch than one that fits fits too, one with a "
                     "larger micro-batch than one that does not fit does not fit either. Ask "
                     "only what you cannot tell yet (a binary search per setting asks about "
                     "log2 of the sizes).")
        if case["peaks"][key] <= budget:
            known[setting] = (max(fits_up_to, size), fails_from)
        else:
            known[setting] = (fits_up_to, min(fails_from, size))
    if kind in FEW_ASKS:
        most = _asks_at_most(case)
        require(len(asked) <= most,
                f"{label}: you predicted {len(asked)} peaks; a binary search in each of the "
                f"{len(_settings(levers))} settings of the other levers asks at most "
                f"{most // len(_settings(levers))} of its {len(levers[MONOTONE])} micro-batch "
                f"sizes, {most} in all",
                hint="the sizes that fit are a prefix of the ascending list: under a budget that "
                     "most plans fit, asking the sizes one by one asks nearly all of them. Find "
                     "where each prefix ends with as few predictions as the promise allows.")


@exercise(points=2, timeout=30.0, reference=("companion.plan.search.fastest_fitting",))
def check_fastest_fitting(answer) -> str:
    """answer(levers, predict_peak, predict_time, budget) -> the fastest plan whose peak is at
    most budget, or None: tried on grids, models and budgets the notebook does not show, its
    calls of predict_peak counted."""
    kinds = ("boundary", "between peaks", "largest fits", "uneven segments",
             "largest not fastest", "planner", "nothing fits")
    runs = []
    for seed, kind in zip(fresh_seeds(len(kinds)), kinds):
        case = _case(seed, kind)
        label = (f"{len(case['peaks'])} plans over {list(case['levers'])}, budget "
                 f"{case['budget']:,.1f} ({kind})")
        seen = _search(answer, seed, kind)
        runs.append((case, _as_key(case, seen["got"], label), seen["asked"], label, kind))
    # One wrong rule that gives every answer the learner gave names the mistake.
    mistakes = [hint for hint, rule in _WRONG.items()
                if all(rule(case) == got for case, got, _, _, _ in runs)]
    for case, got, _, label, _ in runs:
        _judge_answer(case, got, label, mistakes[0] if mistakes else None)
    for case, _, asked, label, kind in runs:
        _judge_asking(case, asked, label, kind)
    asked = sum(len(run[2]) for run in runs)
    total = sum(len(run[0]["peaks"]) for run in runs)
    return (f"the fastest plan that fits on {len(kinds)} grids the notebook does not show, "
            f"{asked} peaks predicted where predicting every plan takes {total}")
