"""Chapter 09, exercise 1: decide a plan and train a GPT that does not fit its memory budget
under it, with the same effective batch and the same losses as the unconstrained run, on GPTs
and budgets the notebook does not show, pulling no lever further than the budget needs."""
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

from companion.checks.core import (CheckFailed, call_inplace, exercise, fresh_seeds, harness,
                                   require)
from companion.device import Sizes, pick_device, sizes
from companion.memory import format_bytes, memory_budget, track
from companion.models import GPT
from companion.models.gpt import Block
from companion.plan import (LOW_PRECISION, Candidate, GPTShape, build, candidates,
                            capstone_model, predict_memory, token_batches, train_step)

__all__ = ["check_train_within_budget", "training_case", "capstone_model", "PARTS"]

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


def _run_answer(answer, seed: int, S: Sizes, device: torch.device, steps: int = STEPS) -> dict:
    case = (S.cap_width, S.cap_depth, S.cap_batch, S.cap_budget)
    try:
        return _train_under_budget(answer, seed, steps, str(device), case)
    except CheckFailed as failure:
        if "OutOfMemoryError" in failure.summary:
            failure.summary = "your training went over the budget"
            failure.hint = ("choose the plan from the model and the budget you are given: "
                            "predict_memory(GPTShape.of(model_fn), Candidate(...)) of the plan "
                            "you build must fit `budget`, and the plan you train must be the one "
                            "you predicted (micro-batch, segments, offload, precision).")
        raise


def _check_one_batch(answer, seed: int, S: Sizes, device: torch.device, want: dict) -> None:
    """The statement allows a list of any number of batches: given one, the answer returns one
    loss, the reference run's first (the loss before any step). One step of the answer on the
    last case: about 0.8 s of the check's 22 s on the CPU (its 4 steps there: 2.4 s)."""
    got = _run_answer(answer, seed, S, device, steps=1)
    losses = got["losses"]
    require(isinstance(losses, list) and len(losses) == 1,
            f"given a list of one batch, expected 1 loss, got {losses}",
            hint="take the batch size and the number of steps from `batches` itself: it may hold "
                 "a single (x, y).")
    rtol = RTOL[got["precision"]][0]
    require(math.isclose(losses[0], want["losses"][0], rel_tol=rtol),
            f"given a list of one batch, your loss is {losses[0]:.6f}; the unconstrained run's "
            f"first is {want['losses'][0]:.6f}")


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
            if i == len(seeds) - 1:
                _check_one_batch(answer, seed, case, device, want)
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
