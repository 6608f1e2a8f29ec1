"""Activations under a byte budget: keep, recompute or offload, operator by operator.

Selective checkpointing (`selective`) keeps the outputs of a fixed list of operators. Here the
list is chosen for a budget: `region_ops` runs a region (a block) once and lists every aten
operator it runs, with the bytes its output would hold if kept, the FLOPs and bytes moved to
recompute it, and whether backward saves it; `solve` picks, per operator, keep / recompute /
offload so that the bytes kept stay within the budget for the least added time, a knapsack
(`torch.compile`'s partitioner solves one under `activation_memory_budget`:
torch/_functorch/_activation_checkpointing/knapsack.py, `dp_knapsack`; Checkmate, Jain et al.,
MLSys 2020, an integer program over the whole graph); `budget_run` turns the choice into a
policy for PyTorch's selective checkpointing, runs it, and measures it until it fits.

The model of time is SAC's: backward replays the region once, running again every operator that
was not kept, up to the last one whose output backward needs (SAC's early stop, on by default in
torch 2.13: `torch.utils.checkpoint.set_checkpoint_early_stop`); so recomputing operator i costs
its own FLOPs·s/FLOP + bytes moved·s/byte whatever else is chosen, and nothing when it comes after
that last one (a block's final matmul and residual add: `RegionOp.replayed`). Offloading it costs
its bytes crossing the host link twice (down in forward, up in backward), none of it hidden behind
compute. Memory: what the region holds between forward and backward is its inputs (the
checkpoint) plus the kept outputs; the recomputed and offloaded ones hold no device bytes until
backward brings them back.

Example:
    >>> region = region_ops(block, x)                     # one plain forward, ops listed
    >>> plan = solve(region, 2**20, seconds_per_flop=1 / 26e9, seconds_per_byte=1 / 15e9)
    >>> plan.kept_bytes, plan.seconds, plan.recompute_flops

Simplified vs PyTorch: `torch.compile`'s partitioner works on the joint graph and recomputes
only what backward needs; SAC's eager replay runs every operator not kept, so here each operator
is priced alone, and ones that backward does not need are priced too (up to the early stop).
torch's `dp_knapsack` rounds each weight to the
nearest step; here they round up, so a plan never holds more than it was allowed.
"""
from __future__ import annotations

import dataclasses
import math
from functools import reduce
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

__all__ = ["RegionOp", "Region", "RematPlan", "region_ops", "solve", "CHOICES"]

aten = torch.ops.aten
CHOICES = ("keep", "recompute", "offload")
MAX_CELLS = 2**16          # the knapsack's grid: at most this many byte cells


@dataclasses.dataclass(frozen=True)
class RegionOp:
    """One aten operator of a region, in run order (SAC's count: `detach` and the other
    `SAC_IGNORED_OPS` are not counted, as selective checkpointing does not count them)."""

    index: int            # its place in run order
    name: str             # e.g. "aten.addmm.default"
    nbytes: int           # bytes a MUST_SAVE keeps: its new output storages (views, in-place: 0)
    flops: int            # torch.utils.flop_counter's formula (element-wise ops: 0)
    moved_bytes: int      # tensor bytes it reads and writes (views: 0)
    needed: bool          # backward saves a tensor on a storage this operator made
    can_keep: bool        # False for views, in-place ops and outputs changed in place later
    output: bool = False  # it made the region's output, which the caller holds anyway
    replayed: bool = True  # at or before the last operator backward needs: a recompute runs it


@dataclasses.dataclass(frozen=True)
class Region:
    """What `region_ops` saw: the operators, and the bytes of the region's input and output."""

    ops: tuple[RegionOp, ...]
    input_bytes: int      # the tensor arguments' storages (not parameters): the checkpoint
    output_bytes: int     # the output's new storages, held by the caller


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):       # sparse and other storage-less tensors
        return None


def _flops(func, args, kwargs, out) -> int:
    """FLOPs from torch.utils.flop_counter's formulas; CPU SDPA's kernel is counted as CUDA's
    flash kernel (both full (T, T) products: causal masking is not halved)."""
    packet = func.overloadpacket
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        packet = aten._scaled_dot_product_flash_attention
    formula = flop_registry.get(packet)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


class _Recorder(TorchDispatchMode):
    """Lists each operator as it runs; remembers which operator made each live storage."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] = []
        self.owner: dict[int, int] = {}               # live storage -> the op that made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        seen = {_storage(t) for t in ins}
        index, nbytes = len(self.rows), 0
        for t in outs:                                 # 1. new storages: what MUST_SAVE keeps
            key = _storage(t)
            if key is not None and key not in seen:
                seen.add(key)
                nbytes += t.untyped_storage().nbytes()
                self.owner[key] = index
        for arg, value in zip(func._schema.arguments, args):   # 2. in place: the op that made
            if arg.alias_info is not None and arg.alias_info.is_write:   # it cannot keep it
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor) and _storage(t) in self.owner:
                        self.rows[self.owner[_storage(t)]]["can_keep"] = False
        view = nbytes == 0 and not func._schema.is_mutable
        moved = 0 if view else sum(t.numel() * t.element_size() for t in ins + outs)
        self.rows.append(dict(index=index, name=str(func), nbytes=nbytes,
                              flops=_flops(func, args, kwargs, out), moved_bytes=moved,
                              needed=False, can_keep=nbytes > 0))
        return out


def region_ops(fn: Callable, *args) -> Region:
    """Run `fn(*args)` once, plainly, and list every aten operator it runs, in order.

    Each `RegionOp` counts: `nbytes`, the storages its outputs make (a view or an in-place op
    makes none: 0; a kept view costs nothing beyond the tensor it views); `flops`, by
    torch.utils.flop_counter's formulas (matmuls, convolutions, attention kernels; element-wise
    ops 0 but their `moved_bytes`, the bytes of every tensor read and written); `needed`,
    whether autograd saved a tensor on a storage it made (`saved_tensors_hooks`); `output`,
    whether it made the region's output. Also the bytes of the inputs (distinct storages of the
    tensor arguments that are not parameters) and of the output.

    Example:
        >>> region = region_ops(block, x)                 # a GPT Block, written attention
        >>> [op.name for op in region.ops if op.flops]    # its Linears' addmm, the core's bmm

    Simplified vs torch.utils.flop_counter: one region, no module tree; causal attention
    counted in full as FlopCounterMode does.
    """
    if not torch.is_grad_enabled():
        raise RuntimeError("region_ops records what backward needs: call it with grad enabled "
                           "(not under torch.no_grad())")
    recorder = _Recorder()

    def pack(t: torch.Tensor) -> torch.Tensor:
        index = recorder.owner.get(_storage(t))
        if index is not None:
            recorder.rows[index]["needed"] = True
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        out = fn(*args)
    outputs = {_storage(t): t.untyped_storage().nbytes() for t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and _storage(t) in recorder.owner}
    for key in outputs:
        recorder.rows[recorder.owner[key]]["output"] = True
    inputs = {_storage(t): t.untyped_storage().nbytes() for t in tree_leaves(args)
              if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)}
    last = max((row["index"] for row in recorder.rows if row["needed"]), default=-1)
    for row in recorder.rows:                           # SAC's early stop: the replay ends here
        row["replayed"] = row["index"] <= last
    return Region(tuple(RegionOp(**row) for row in recorder.rows), sum(inputs.values()),
                  sum(outputs.values()))


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """Per operator of a region, "keep", "recompute" or "offload", and what that costs."""

    ops: tuple[RegionOp, ...]
    choices: tuple[str, ...]
    input_bytes: int      # held anyway: the checkpoint
    kept_bytes: int       # input_bytes + the kept outputs (the region's own output not counted)
    seconds: float        # predicted seconds added to the step: recompute and offload
    grid: int             # bytes per knapsack cell (1: exact)

    @property
    def recompute_flops(self) -> int:
        """FLOPs that backward runs again (the recomputed operators up to SAC's early stop)."""
        return sum(op.flops for op, c in zip(self.ops, self.choices)
                   if c == "recompute" and op.replayed)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes sent to the host in forward (and brought back in backward)."""
        return sum(op.nbytes for op, c in zip(self.ops, self.choices) if c == "offload")

    def indices(self, choice: str) -> frozenset[int]:
        """Run-order indices of the operators given `choice`."""
        return frozenset(op.index for op, c in zip(self.ops, self.choices) if c == choice)


def _options(op: RegionOp, spf: float, spb: float, host: float | None) -> list[tuple]:
    """(choice, bytes kept, added seconds) open to one operator: recompute first, so that a
    tie goes to the choice that keeps nothing."""
    options = [("recompute", 0, (op.flops * spf + op.moved_bytes * spb) if op.replayed else 0.0)]
    if host is not None and op.nbytes > 0:
        options.append(("offload", 0, 2 * op.nbytes * host))       # down, then up: exposed
    if op.can_keep:
        options.append(("keep", 0 if op.output else op.nbytes, 0.0))
    return options


def _rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0 (seconds), got {value!r}")
    return float(value)


def solve(ops: Region | Sequence[RegionOp], budget_bytes: int, *, seconds_per_flop: float,
          seconds_per_byte: float, host_seconds_per_byte: float | None = None,
          input_bytes: int | None = None, grid: int | None = None) -> RematPlan:
    """The keep / recompute / offload choice per operator that adds the least predicted time
    while inputs + kept bytes <= `budget_bytes`.

    A multiple-choice knapsack, solved by dynamic programming over bytes: each operator takes
    one of its options (keep: its bytes, no time; recompute: FLOPs·`seconds_per_flop` + bytes
    moved·`seconds_per_byte`; offload, only with `host_seconds_per_byte`: 2·bytes·that), cells of
    `grid` bytes, each operator's bytes rounded UP to whole cells and the budget down, so the
    plan always fits; exact when `grid` divides every operator's bytes (the default, their
    greatest common divisor, unless the budget would need more than 65,536 cells: then a coarser
    grid, and a plan that may cost slightly more than the best).

    Example:
        >>> plan = solve(region_ops(block, x), 3 * 2**20, seconds_per_flop=1 / 26e9,
        ...              seconds_per_byte=1 / 15e9)
        >>> plan.kept_bytes <= 3 * 2**20, plan.indices("keep"), plan.recompute_flops

    Raises ValueError below the least feasible budget, the region's inputs: checkpointing
    keeps them to recompute from, and every operator can be recomputed.
    Simplified vs PyTorch's `dp_knapsack`: no graph (each operator priced alone, as SAC's
    eager replay runs it), and weights rounded up rather than to the nearest step.
    """
    region = ops if isinstance(ops, Region) else None
    ops = tuple(region.ops if region else ops)
    if not all(isinstance(op, RegionOp) for op in ops):
        raise TypeError("ops are what region_ops(fn, *args) returns (a Region, or its .ops)")
    base = (region.input_bytes if region else 0) if input_bytes is None else input_bytes
    spf, spb = _rate("seconds_per_flop", seconds_per_flop), _rate("seconds_per_byte",
                                                                  seconds_per_byte)
    host = None if host_seconds_per_byte is None else _rate("host_seconds_per_byte",
                                                             host_seconds_per_byte)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes is a number of bytes (int), got {budget_bytes!r}")
    if budget_bytes < base:
        raise ValueError(f"a budget of {budget_bytes} bytes cannot hold the region's inputs: the "
                         f"least feasible budget is {base} bytes (the inputs, which "
                         "checkpointing keeps; every operator's output can be recomputed)")
    options = [_options(op, spf, spb, host) for op in ops]
    weights = [w for opts in options for _, w, _ in opts if w > 0]
    room = budget_bytes - base
    if grid is None:
        grid = reduce(math.gcd, weights, 0) or 1
        grid = max(grid, math.ceil(min(room, sum(weights)) / MAX_CELLS))
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid is a positive number of bytes per cell, got {grid!r}")
    items = [[(-(-w // grid), s) for _, w, s in opts] for opts in options]   # cells rounded up
    picks = _knapsack(items, min(room // grid, sum(max(w for w, _ in it) for it in items)))
    choices = tuple(opts[j][0] for opts, j in zip(options, picks))
    kept = sum(opts[j][1] for opts, j in zip(options, picks))
    seconds = sum(opts[j][2] for opts, j in zip(options, picks))
    return RematPlan(ops, choices, base, base + kept, seconds, grid)


def _knapsack(options: list[list[tuple[int, float]]], cells: int) -> list[int]:
    """Which option (cells, seconds) of each item, with at most `cells` cells in all, adds the
    least seconds. best[c]: the least seconds of the items so far within c cells."""
    best = np.zeros(cells + 1)
    chose = np.zeros((len(options), cells + 1), dtype=np.int8)
    for i, opts in enumerate(options):
        # 1. Each cell count c takes the option with the least seconds (the first among equals).
        new = np.full(cells + 1, np.inf)
        for j, (w, s) in enumerate(opts):
            if w > cells:
                continue
            candidate = np.full(cells + 1, np.inf)
            candidate[w:] = best[:cells + 1 - w] + s
            better = candidate < new
            new[better], chose[i, better] = candidate[better], j
        best = new
    # 2. Walk back from the whole budget.
    picks, c = [0] * len(options), cells
    for i in reversed(range(len(options))):
        picks[i] = int(chose[i, c])
        c -= options[i][picks[i]][0]
    return picks
