"""Run a `budget.RematPlan` with PyTorch's selective checkpointing, measure it, fit it.

`plan_policy(plan)` is a policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts`
that makes MUST_SAVE exactly the operators the plan keeps, counted in run order (torch 2.13 asks
only in forward and replays the answers by index; older versions ask again in the recompute, so
the two are counted apart, as `selective.alternate_matmuls` counts). `checkpoint_with_plan` runs a region
under it, offload included; `held_bytes` measures what the region holds between forward and
backward; `fit` solves, measures, and solves again for less until the measurement fits.

Offload, and why not through SAC alone: torch 2.13's `CheckpointPolicy` lists MUST_CPU_OFFLOAD,
but eager SAC either keeps an output on the device (MUST_SAVE and PREFER_SAVE) or drops it
(anything else, that one included: `_CachingTorchDispatchMode` in torch/utils/checkpoint.py), and
its cache cannot be swapped from outside. So
an offloaded operator is PREFER_RECOMPUTE to SAC, and two pieces of our own do the offload,
through SAC's public hooks: the policy, which sees each output in forward (`ctx.op_output`),
copies it to the host, strides kept; and a dispatch mode entered beneath SAC's recompute mode,
which receives exactly the operators SAC runs again, in run order, and answers an offloaded one
with its host copy brought back instead of running it.

Example:
    >>> plan = solve(region_ops(block, x), budget, seconds_per_flop=1 / 26e9,
    ...              seconds_per_byte=1 / 15e9, host_seconds_per_byte=1 / 2.9e9)
    >>> y = checkpoint_with_plan(block, x, plan=plan)     # same output and gradients
    >>> fitted = fit(block, (x,), budget)                 # measured until it fits

Simplified vs PyTorch: one region solved and run at a time (a model of equal blocks would solve
once and reuse the plan; a plan is tied to its input shapes); offload copies on the current
stream, none overlapped with compute (torch.compile has an offload pass of its own that can
copy asynchronously: functorch's `enable_activation_offloading`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (SAC_IGNORED_OPS, CheckpointPolicy,
                                    create_selective_checkpoint_contexts)

from companion.activation_offload import can_pin
from companion.checkpointing.budget import RematPlan, region_ops, solve
from companion.memory import track
from companion.placement import on_host

__all__ = ["plan_policy", "checkpoint_with_plan", "held_bytes", "Fitted", "fit"]


def _down(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` with its strides (pinned on a GPU machine). `activation_offload.to_host`
    would make it contiguous, and the operators after it would then run otherwise: a transpose
    that was a view of SDPA's output would need a copy, which SAC's replay does not expect."""
    with on_host():
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu",
                                   pin_memory=t.is_cuda and can_pin())
        return host.copy_(t, non_blocking=host.is_pinned())     # device -> host


def _up(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` back on `device`, a new tensor with its strides."""
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    return out.copy_(host, non_blocking=host.is_pinned())       # host -> device


def _check(plan: RematPlan, i: int, op) -> None:
    if i >= len(plan.ops) or plan.ops[i].name != str(op):
        found = plan.ops[i].name if i < len(plan.ops) else "nothing (the plan ended)"
        raise RuntimeError(f"the region ran {op} as its operator {i}, where the plan has "
                           f"{found}: a plan fits the function and input shapes region_ops saw. "
                           "Make it again with region_ops(fn, *args) for these inputs.")


def plan_policy(plan: RematPlan, *, stash: dict | None = None) -> Callable:
    """A fresh policy for `create_selective_checkpoint_contexts`: MUST_SAVE for the operators
    `plan` keeps, PREFER_RECOMPUTE for the rest, by their place in run order. An offloaded
    operator's output is copied to the host into `stash` (run-order index -> (device, copy))
    for `checkpoint_with_plan`'s recompute to bring back; a plan that offloads needs a stash.

    Memory: the kept outputs stay on the device from forward to backward (`plan.kept_bytes`
    with the inputs). Cost: the rest runs again in backward. One policy per region and call:
    its count runs on from one call into the next.

        >>> context = functools.partial(create_selective_checkpoint_contexts, plan_policy(plan))
        >>> y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
        ...                                       context_fn=context)

    Raises RuntimeError when the region runs another operator than the plan lists there."""
    keep, offload = plan.indices("keep"), plan.indices("offload")
    if offload and stash is None:
        raise ValueError(f"this plan offloads {len(offload)} operators' outputs: run it with "
                         "checkpoint_with_plan(fn, *args, plan=plan), which brings them back")
    counts = {False: 0, True: 0}                   # forward, recompute: counted apart

    def choose(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        i = counts[ctx.is_recompute]
        counts[ctx.is_recompute] += 1
        _check(plan, i, op)
        if i in offload and not ctx.is_recompute:   # device -> host, on the current stream
            device = next(t.device for t in tree_leaves(ctx.op_output)
                          if isinstance(t, torch.Tensor))
            stash[i] = device, tree_map(lambda t: _down(t) if isinstance(t, torch.Tensor) else t,
                                        ctx.op_output)
        return CheckpointPolicy.MUST_SAVE if i in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return choose


class _Reload(TorchDispatchMode):
    """Beneath SAC's recompute mode: sees the operators SAC runs again, in run order, and
    answers an offloaded one with its host copy, brought back to its device."""

    def __init__(self, plan: RematPlan, stash: dict):
        super().__init__()
        self.plan, self.stash = plan, stash
        self.order = sorted(plan.indices("recompute") | plan.indices("offload"))
        self.seen = 0

    def __enter__(self):
        self.seen = 0                               # each recompute starts from the top
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SAC_IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        i = self.order[self.seen] if self.seen < len(self.order) else len(self.plan.ops)
        self.seen += 1
        _check(self.plan, i, func)
        if i not in self.stash:
            return func(*args, **(kwargs or {}))
        device, host = self.stash.pop(i)            # host -> device; the host copy let go
        return tree_map(lambda t: _up(t, device) if isinstance(t, torch.Tensor) else t, host)


class _Stacked:
    """Enter several context managers in order, leave them in reverse; reusable."""

    def __init__(self, *contexts):
        self.contexts, self.stack = contexts, None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for context in self.contexts:
            self.stack.enter_context(context)

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def checkpoint_with_plan(fn: Callable, *args, plan: RematPlan):
    """`fn(*args)` through `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, with the
    plan's choices: kept outputs cached by SAC, offloaded ones copied to the host in forward and
    back in backward, the rest recomputed. Same output and gradients as `fn(*args)`.

    Memory between forward and backward: the inputs and kept outputs on the device
    (`plan.kept_bytes`), `plan.offloaded_bytes` on the host. Cost: `plan.recompute_flops` again
    in backward, the offloaded bytes over the host link twice (`plan.seconds` predicts both).

        >>> y = checkpoint_with_plan(block, x, plan=plan)
        >>> y.sum().backward()

    Simplified vs PyTorch's `save_on_cpu`: the same copies (current stream, no side stream, no
    prefetch), but only of the operators the plan offloads, not every saved tensor."""
    if not isinstance(plan, RematPlan):
        raise TypeError(f"plan must be a RematPlan (from solve or fit), got {type(plan).__name__}")

    def context():
        stash: dict = {}
        forward, recompute = create_selective_checkpoint_contexts(plan_policy(plan, stash=stash))
        return forward, _Stacked(_Reload(plan, stash), recompute)   # _Reload beneath SAC's

    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context)


def _storages(value) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_leaves(value)
            if isinstance(t, torch.Tensor)}


def grad_inputs(fn: Callable, args: tuple) -> list[torch.Tensor]:
    """The tensors among `args` and `fn`'s parameters (a module's) that require grad: what a
    backward of `fn(*args)` differentiates. Raises ValueError when there are none."""
    wrt = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(fn, torch.nn.Module):
        wrt += [p for p in fn.parameters() if p.requires_grad]
    if not wrt:
        raise ValueError("nothing here requires grad, so nothing is saved for backward: pass "
                         "an input with requires_grad=True or a module with parameters")
    return wrt


def held_bytes(fn: Callable, args: tuple, plan: RematPlan) -> tuple[int, int, int]:
    """(device bytes, host bytes, step peak) of one forward and backward of the plan, measured
    by `companion.memory.track`. Device bytes: what stays alive after forward, the inputs
    counted (the checkpoint) and the output not (the caller holds it), as `plan.kept_bytes`
    predicts (on CUDA the caching allocator's count, blocks rounded up to 512 bytes, so a little
    more); host bytes: the offloaded copies; step peak: the most bytes the step allocated.
    Backward runs through `torch.autograd.grad`, so no `.grad` is changed."""
    wrt = grad_inputs(fn, args)
    inputs = _storages([t for t in tree_leaves(args) if not isinstance(t, torch.nn.Parameter)])
    with track(wrt[0].device) as tracker:
        out = checkpoint_with_plan(fn, *args, plan=plan)
        made = {k: n for k, n in _storages(out).items() if k not in inputs}
        device = tracker.current - sum(made.values()) + sum(inputs.values())
        host = tracker.host_current
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    return device, host, tracker.peak


@dataclasses.dataclass(frozen=True)
class Fitted:
    """`fit`'s answer: the plan, what it was measured to hold, and each try's (budget, bytes)."""

    plan: RematPlan
    measured_bytes: int       # device bytes held between forward and backward, inputs counted
    host_bytes: int           # offloaded bytes on the host
    peak_bytes: int           # the whole step's peak (recompute brings the dropped ones back)
    tries: tuple[tuple[int, int], ...]


def fit(fn: Callable, args: tuple, budget_bytes: int, *, seconds_per_flop: float | None = None,
        seconds_per_byte: float | None = None, host_seconds_per_byte: float | None = None,
        rounds: int = 4) -> Fitted:
    """`solve` for `budget_bytes`, run the plan under `track`, and while the measured bytes
    exceed the budget, solve again for a budget lower by the excess (at most `rounds` tries).

    The rates default to `companion.plan.CostModel.for_device`'s for the inputs' device (1/FLOP/s,
    1/memory bandwidth); offload is considered only with `host_seconds_per_byte`. Memory: the
    measured device bytes (inputs + kept outputs) <= `budget_bytes`. Cost: one plain forward
    (`region_ops`) and one checkpointed step per try.

        >>> fitted = fit(block, (x,), 3 * 2**20)
        >>> fitted.measured_bytes <= 3 * 2**20, fitted.plan.recompute_flops

    Raises ValueError when no try fits: the message gives the tightest bytes measured.
    Simplified: the adjustment is the measured excess, with no model of where it came from
    (bytes held outside what SAC caches, or a grid coarser than the operators' bytes)."""
    if not isinstance(args, tuple):
        raise TypeError("args is the tuple of fn's arguments, e.g. (x,); got "
                        f"{type(args).__name__}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds is how many plans to try, an int >= 1; got {rounds!r}")
    if seconds_per_flop is None or seconds_per_byte is None:
        from companion.plan.costmodel import CostModel
        device = next((t.device.type for t in tree_leaves(args) if isinstance(t, torch.Tensor)),
                      "cpu")
        cost = CostModel.for_device("cuda" if device == "cuda" else "cpu")
        seconds_per_flop = seconds_per_flop if seconds_per_flop is not None else 1 / cost.flops
        seconds_per_byte = (seconds_per_byte if seconds_per_byte is not None
                            else 1 / cost.memory_bandwidth)
    region, target, tries = region_ops(fn, *args), budget_bytes, []
    for _ in range(rounds):
        if tries and target < region.input_bytes:
            break                                   # lowering further cannot fit
        plan = solve(region, target, seconds_per_flop=seconds_per_flop,
                     seconds_per_byte=seconds_per_byte, host_seconds_per_byte=host_seconds_per_byte)
        device, host, peak = held_bytes(fn, args, plan)
        tries.append((target, device))
        if device <= budget_bytes:
            return Fitted(plan, device, host, peak, tuple(tries))
        target -= device - budget_bytes             # ask for less by what it ran over
    tightest = min(measured for _, measured in tries)
    raise ValueError(f"no plan fits {budget_bytes} bytes: the tightest measured held "
                     f"{tightest} bytes after {len(tries)} tries (budget asked, bytes measured: "
                     f"{tries}). Raise the budget to at least {tightest} bytes.")
