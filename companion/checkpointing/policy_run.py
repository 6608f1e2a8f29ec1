"""Run a selective-checkpointing policy on a region; measure it beside `region_ops`' prediction.

A policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts` answers, for each
operator the region runs, MUST_SAVE / PREFER_SAVE (keep its output) or MUST_RECOMPUTE /
PREFER_RECOMPUTE (run it again in backward). `measure_policy` wraps it to see which operators it
kept in forward, then measures with `companion.memory.track` the bytes the region holds between
forward and backward and counts the FLOPs backward runs beyond a plain backward's; the
predictions come from the operators' list: the inputs plus the kept outputs, and the FLOPs of
the dropped operators up to SAC's early stop (`RegionOp.replayed`).

Example:
    >>> run = measure_policy(block, (x,), lambda: save_matmuls)
    >>> run.held_bytes == run.predicted_bytes, run.recompute_flops == run.predicted_flops

Simplified: FLOPs by torch.utils.flop_counter's formulas (matmuls and attention kernels; the
element-wise operators count 0), counted by a dispatch mode of our own: `FlopCounterMode` in
torch 2.13 hooks modules, which clashes with SAC's replay inside backward.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from companion.checkpointing.budget import _flops, region_ops
from companion.checkpointing.budget_run import grad_inputs
from companion.memory import track

__all__ = ["PolicyRun", "measure_policy", "backward_flops"]

KEEPS = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    """One checkpointed forward and backward under a policy: measured beside predicted."""

    kept: frozenset[int]      # run-order indices of the operators the policy kept
    held_bytes: int           # device bytes between forward and backward, inputs counted
    predicted_bytes: int      # inputs + kept outputs (the region's own output not counted)
    recompute_flops: int      # FLOPs backward ran beyond a plain backward's
    predicted_flops: int      # the dropped operators' FLOPs, up to the early stop


class _CountFlops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.flops += _flops(func, args, kwargs or {}, out)
        return out


def backward_flops(run: Callable[[], torch.Tensor]) -> int:
    """FLOPs of the backward of `run()`'s output (torch.utils.flop_counter's formulas), counted
    as it runs; `.grad` of the parameters is left as it was."""
    out = run()
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    counter = _CountFlops()
    with counter:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    return counter.flops


def measure_policy(fn: Callable, args: tuple, make_policy: Callable[[], Callable]) -> PolicyRun:
    """Checkpoint `fn(*args)` with SAC under `make_policy()` (a fresh policy per run: policies
    that count operators keep state), and measure it against `region_ops`' prediction.

    Cost: one plain forward (the list), one plain step and two checkpointed steps. Gradients
    (`.grad`) of `args` and of `fn`'s parameters are put back as they were.

        >>> measure_policy(block, (x,), alternate_matmuls).recompute_flops"""
    if not isinstance(args, tuple):
        raise TypeError(f"args is the tuple of fn's arguments, e.g. (x,); got "
                        f"{type(args).__name__}")
    wrt = grad_inputs(fn, args)
    saved_grads = [t.grad for t in wrt]
    region = region_ops(fn, *args)
    kept: list[bool] = []

    def context():
        policy = make_policy()

        def watch(ctx, op, *a, **k):
            decision = policy(ctx, op, *a, **k)
            if not isinstance(decision, CheckpointPolicy):
                raise TypeError(f"a policy returns a CheckpointPolicy, got {decision!r} for {op}")
            if not ctx.is_recompute:
                kept.append(decision in KEEPS)
            return decision
        return create_selective_checkpoint_contexts(watch)

    def checkpointed():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 context_fn=context)
    try:
        inputs = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                  for t in tree_leaves(args)
                  if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)}
        with track(wrt[0].device) as tracker:
            out = checkpointed()
            made = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
            held = tracker.current + sum(inputs.values()) - sum(
                n for k, n in made.items() if k not in inputs)
            del out
        ops = region.ops[:len(kept)]
        plain = backward_flops(lambda: fn(*args))
        kept.clear()
        recompute = backward_flops(checkpointed) - plain
    finally:
        for t, grad in zip(wrt, saved_grads):
            t.grad = grad
    keep = frozenset(op.index for op, k in zip(ops, kept) if k)
    return PolicyRun(keep, held,
                     region.input_bytes + sum(op.nbytes for op in ops
                                              if op.index in keep and not op.output),
                     recompute,
                     sum(op.flops for op in ops if op.index not in keep and op.replayed))
