"""Chapter 12, exercise 1: a selective checkpointing policy that holds a region within a byte
budget with the least recompute FLOPs."""
from __future__ import annotations

import functools
import random

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from companion import models
from companion.checkpointing.budget import region_ops, solve
from companion.checks.core import (CheckFailed, call, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)
from companion.memory import format_bytes, track

__all__ = ["check_budget_policy"]


def _build(spec: tuple) -> tuple[torch.nn.Module, torch.Tensor]:
    """The region a case names, and its input (requires grad), the same wherever it is built.
    ("mlp", seed, rows, m): Linear layers of 5m -> 12m -> 10m -> 9m -> 8m -> 3m features with
    Tanh between: at a budget of the inputs and the 9m and 8m outputs, those two are the best
    set, not outputs taken by FLOPs per byte (12m first), nor the set a budget without the inputs
    allows (12m and 10m), nor one that counts the region's output (3m, costing nothing).
    ("small cells", seed, rows, m): 2m -> m -> 3m -> m -> m -> m: at the inputs and two m
    outputs' bytes (two cells), a table read or filled from a cell off by one, or holding each
    item's FLOPs without the best of the cells before it, keeps a worse set.
    ("norm", seed, rows, width): LayerNorm, GELU, LayerNorm: no operator with FLOPs.
    ("relu", seed, rows, width): Linear layers with in-place ReLUs between, which change two
    matmuls' outputs after they are made."""
    kind, seed, rows, *sizes = spec
    torch.manual_seed(seed)
    if kind in ("mlp", "small cells"):
        m = sizes[0]
        widths = ([5 * m, 12 * m, 10 * m, 9 * m, 8 * m, 3 * m] if kind == "mlp"
                  else [2 * m, m, 3 * m, m, m, m])
        layers = [torch.nn.Linear(widths[0], widths[1])]
        for a, b in zip(widths[1:-1], widths[2:]):
            layers += [torch.nn.Tanh(), torch.nn.Linear(a, b)]
        block, shape = torch.nn.Sequential(*layers), (rows, widths[0])
    elif kind == "relu":                       # in-place ReLUs change the matmuls' outputs
        width = sizes[0]
        block = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(inplace=True),
                                    torch.nn.Linear(2 * width, width), torch.nn.ReLU(inplace=True),
                                    torch.nn.Linear(width, width))
        shape = (rows, width)
    elif kind == "norm":                       # no operator with FLOPs: nothing worth keeping
        block, shape = torch.nn.Sequential(torch.nn.LayerNorm(sizes[0]), torch.nn.GELU(),
                                           torch.nn.LayerNorm(sizes[0])), (rows, sizes[0])
    elif kind == "gpt":
        T, width, heads = sizes
        block, shape = models.Block(width, heads), (rows, T, width)
    else:
        T, width, heads, kv_heads, intermediate = sizes
        block = models.Llama(8, T, width, 1, heads, kv_heads=kv_heads, intermediate=intermediate,
                             seed=seed).blocks[0]
        shape = (rows, T, width)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return block, x


def _grads(block, x, out) -> list[torch.Tensor]:
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return list(torch.autograd.grad(out, [x, *block.parameters()], weights))


def _run(block, x, policy) -> dict:
    """One checkpointed forward and backward under the learner's policy: what it kept (forward
    calls, in run order), the bytes held between forward and backward (inputs counted, the
    output not, as `budget_run.held_bytes` measures), the gradients or backward's error."""
    names, keep = [], []

    def watched(ctx, op, *args, **kwargs):
        choice = call_inplace(policy, ctx, op, *args, **kwargs)
        if not isinstance(choice, CheckpointPolicy):
            raise CheckFailed(f"your policy returned {choice!r} for operator {len(names)} "
                              f"({op}); expected a CheckpointPolicy",
                              hint="return CheckpointPolicy.MUST_SAVE or PREFER_RECOMPUTE.")
        if not ctx.is_recompute:
            names.append(str(op))
            keep.append(choice in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE))
        return choice

    context = functools.partial(create_selective_checkpoint_contexts, watched)
    with track(x.device) as tracker:
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                                context_fn=context)
        held = tracker.current - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    try:
        grads, error = _grads(block, x, out), None
    except CheckFailed:
        raise
    except Exception as e:
        grads, error = None, f"{type(e).__name__}: {e}"
    return {"names": names, "keep": keep, "held": held, "grads": grads, "error": error}


@harness
def _runs(answer, spec: tuple, budgets: list[int]) -> list[dict]:
    """For each budget: a policy from answer(region, budget), run once; `same`: it is a policy
    object an earlier call returned."""
    block, x = _build(spec)
    region, made, runs = region_ops(block, x), [], []
    for budget in budgets:
        policy = call(answer, region, budget)
        require(callable(policy), f"budget_policy returned {type(policy).__name__}, not a "
                                  "policy function", hint="return the function that "
                "create_selective_checkpoint_contexts calls as policy(ctx, op, *args, **kwargs).")
        runs.append(_run(block, x, policy) | {"same": any(policy is p for p in made)})
        made.append(policy)
    return runs


def _cases(rng: random.Random) -> list[tuple[tuple, list[int]]]:
    """(spec, budgets): the MLP at the budget where order by FLOPs per byte is not the best
    (twice: a second policy for the same region and budget must keep the same), then drawn
    budgets on it, a GPT block and a Llama block of drawn sizes, and a region with no
    operator that has FLOPs (norms and GELU: nothing is worth keeping), and Linear layers whose
    outputs in-place ReLUs change, with room for every output."""
    # odd rows and m = 1: every output's bytes are 4·rows·(its width), and the tight budget's
    # room, 4·rows·17, is no multiple of 8: a grid coarser than 4 bytes loses the best set
    mlp = ("mlp", rng.randrange(2**31), rng.choice([3, 5, 7, 9]), 1)
    heads = rng.choice([2, 4])
    gpt = ("gpt", rng.randrange(2**31), rng.choice([1, 2]), rng.randrange(5, 12),
           heads * rng.choice([5, 7, 9]), heads)
    llama = ("llama", rng.randrange(2**31), rng.choice([1, 2]), rng.randrange(5, 12),
             rng.choice([24, 32]), 4, 2, rng.choice([40, 56]))
    norm = ("norm", rng.randrange(2**31), rng.randrange(2, 6), rng.choice([12, 20]))
    relu = ("relu", rng.randrange(2**31), rng.randrange(2, 6), rng.choice([8, 12]))
    small = ("small cells", rng.randrange(2**31), rng.randrange(2, 6), rng.choice([3, 5]))
    cases = []
    for spec in (mlp, gpt, llama, norm, relu, small):
        region = region_ops(*_build(spec))
        room = sum(op.nbytes for op in region.ops if not op.output)
        budgets = [region.input_bytes + int(room * rng.uniform(lo, hi))
                   for lo, hi in ((0.1, 0.45), (0.45, 0.9))]
        if spec is mlp:
            m, rows = spec[3], spec[2]
            tight = region.input_bytes + 4 * rows * (9 + 8) * m   # the 9m and 8m outputs
            exact = region.input_bytes + 4 * rows * 10 * m        # the 10m output, to the byte
            budgets = [tight, tight, exact, budgets[1]]
        if spec is relu:                                      # room for every output
            budgets = [region.input_bytes + room]
        if spec is small:                                     # two cells of m outputs
            budgets = [region.input_bytes + 2 * spec[2] * 4 * spec[3]]
        cases.append((spec, budgets))
    return cases


@exercise(points=3, timeout=30.0, reference=("companion.checkpointing.budget.solve",
                                             "companion.checkpointing.budget._knapsack",
                                             "companion.checkpointing.solve",
                                             "companion.checkpointing.budget_run.plan_policy",
                                             "companion.checkpointing.plan_policy",
                                             "companion.checkpointing.budget_run.fit",
                                             "companion.checkpointing.fit",
                                             "companion.checkpointing.budget_run."
                                             "checkpoint_with_plan",
                                             "companion.checkpointing.checkpoint_with_plan"))
def check_budget_policy(answer) -> str:
    """answer(region, budget_bytes) -> a fresh policy for create_selective_checkpoint_contexts
    that holds the region within the budget with the least recompute FLOPs."""
    rng, total = random.Random(fresh_seeds(1)[0]), [0, 0]
    cases = _cases(rng)
    for spec, budgets in cases:
        block, x = _build(spec)
        region = region_ops(block, x)
        plain = _grads(block, x, block(x))
        runs = _runs(answer, spec, budgets)
        name = {"mlp": "an MLP", "gpt": "a GPT block", "llama": "a Llama block",
                "norm": "two LayerNorms and a GELU",
                "relu": "Linear layers with in-place ReLUs",
                "small cells": "an MLP"}[spec[0]]
        what = f"{name} on input {tuple(x.shape)}"
        for i, (budget, run) in enumerate(zip(budgets, runs)):
            label = f"{what}, budget {budget:,} bytes (inputs {region.input_bytes:,})"
            require(not run["same"], f"{label}: budget_policy returned the policy object it "
                    "returned for an earlier call", hint="each call of budget_policy must "
                    "return a new policy: one policy runs one checkpointed region, once.")
            if i == 1 and budget == budgets[0]:
                require(run["keep"] == runs[0]["keep"], f"{label}: a second policy for the same "
                        "region and budget kept other operators than the first",
                        hint="state left over from one policy's run must not carry into the "
                             "next: each new policy starts from the region's first operator.")
            require(run["names"] == [op.name for op in region.ops],
                    f"{label}: your policy was asked about {len(run['names'])} operators, the "
                    f"region runs {len(region.ops)}")
            _verdict(region, budget, run, plain, label)
            total[0] += run["held"]
            total[1] += region.input_bytes + sum(op.nbytes for op in region.ops if not op.output)
    runs = sum(len(budgets) for _, budgets in cases)
    return (f"{runs} budgets on MLPs (one with in-place ReLUs), a GPT block, a Llama block and "
            f"norms without matmuls: "
            f"each met with the least recompute, gradients as plain autograd's; held "
            f"{format_bytes(total[1])} -> {format_bytes(total[0])} in all")


def _verdict(region, budget: int, run: dict, plain: list, label: str) -> None:
    kept = {i for i, k in enumerate(run["keep"]) if k}
    kept_bytes = sum(op.nbytes for op in region.ops if op.index in kept and not op.output)
    if run["error"] is not None:
        raise CheckFailed(f"{label}: backward through your policy failed: {run['error'][:300]}",
                          hint="an output that a later operator changes in place cannot be "
                               "kept: see RegionOp.can_keep." if "mutated" in run["error"] else
                               "keep only what region_ops says can be kept.")
    if run["held"] > budget:
        raise CheckFailed(f"{label}: the region held {run['held']:,} bytes between forward and "
                          f"backward, over the budget", expected=budget, got=run["held"],
                          hint=_bytes_hint(region, kept, kept_bytes, budget))
    compare(run["grads"], plain, name=f"{label}: gradients (input, then parameters)")
    flops = _replayed_flops(region, kept)
    best = solve(region, budget, seconds_per_flop=1.0, seconds_per_byte=0.0, grid=1)
    if flops != best.recompute_flops:
        raise CheckFailed(f"{label}: your policy recomputes {flops:,} FLOPs; another choice "
                          f"within the budget recomputes {best.recompute_flops:,}",
                          expected=best.recompute_flops, got=flops,
                          hint=_flops_hint(region, kept, flops, budget))


def _bytes_hint(region, kept: set, kept_bytes: int, budget: int) -> str:
    keepable = {op.index for op in region.ops if op.can_keep and not op.output}
    if keepable <= kept:
        return "your policy keeps every output it can: that holds what plain autograd holds."
    if {op.index for op in region.ops if op.flops} <= kept:
        return ("your policy keeps every operator that has FLOPs whatever the budget: choose "
                "by the budget.")
    if kept_bytes <= budget:
        return (f"the outputs you keep take {kept_bytes:,} bytes, within the budget alone: what "
                "else does a checkpointed region hold between forward and backward?")
    return ("add up op.nbytes of the outputs you keep (the region's own output aside) and "
            "compare with the budget.")


def _replayed_flops(region, kept: set) -> int:
    """FLOPs backward runs again: the dropped operators' up to the replay's early stop."""
    return sum(op.flops for op in region.ops if op.index not in kept and op.replayed)


def _greedy(region, budget: int, *, stop: bool) -> set[int]:
    """The outputs taken by FLOPs per byte while they fit (`stop`: until the first that does
    not)."""
    room, kept = budget - region.input_bytes, set()
    for op in sorted((op for op in region.ops if op.can_keep and op.flops and op.replayed
                      and not op.output), key=lambda op: -op.flops / op.nbytes):
        if op.nbytes <= room:
            room, kept = room - op.nbytes, kept | {op.index}
        elif stop:
            break
    return kept


def _flops_hint(region, kept: set, flops: int, budget: int) -> str:
    if not any(region.ops[i].flops for i in kept):
        return ("your policy keeps no output that costs FLOPs to recompute, though some fit "
                "within the budget (if it counts operators: is its count at 0 when the region "
                "starts?).")
    costly = {i for i in kept if region.ops[i].flops and region.ops[i].replayed}
    greedy = costly in (_greedy(region, budget, stop=True), _greedy(region, budget, stop=False))
    output = sum(op.nbytes for op in region.ops if op.output)
    counted = output and budget >= region.input_bytes + output and solve(
        region.ops, budget, seconds_per_flop=1.0, seconds_per_byte=0.0, grid=1,
        input_bytes=region.input_bytes + output).recompute_flops == flops
    hints = []
    if greedy:
        hints.append("taking outputs in order of FLOPs per byte is not the least recompute here: "
                     "another set of outputs fits the budget and saves more")
    if counted:
        hints.append("if you counted the region's output against the budget: the caller holds "
                     "that tensor anyway, and the budget is for what the checkpoint holds")
    if hints:
        return "; or, ".join(hints) + "."
    return ("weigh what each output holds in bytes against the FLOPs it saves, over the "
            "choices that fit the budget, not one order of preference.")
