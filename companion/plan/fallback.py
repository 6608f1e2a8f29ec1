"""When a model's step cannot run on fake tensors: say which op, where and why, and measure the
real step at small micro-batches instead, scaled to the plan's.

Fake tensors carry shapes and dtypes, no values, and run each op's meta kernel (its shape
function). Two kinds of op defeat them: one whose output's shape depends on its input's values
(`nonzero`, and so top-1 MoE routing that gathers each expert's tokens), and one whose meta
kernel is stricter than the CPU kernel the real step runs (`aten._grouped_mm` wants bf16 on fake
tensors; transformers' Mixtral trains in fp32 on the CPU with it). `diagnose` reads the failure's
traceback for the op (the innermost dispatched `OpOverload`) and the module it ran in (the
innermost `nn.Module` call), `scaled` runs the real step on this CPU at two small micro-batches
(`anysim.simulate_memory(fake=False)`, measured by `companion.memory.track`, the same levers, a fixed
seed) and extrapolates its live bytes linearly in the micro-batch, allocation by allocation.

Example:
    >>> p = plan_model(moe_lm, 16, budget="64 MiB")       # routes with nonzero
    >>> print(p)           # its notes say what was measured for real, and on what assumption

Simplified: linear in the micro-batch, from two points; a routing decided by values is the one
random inputs give a random router, not the worst case (every token to one expert: on one device
the same bytes when experts take their tokens by index, tests/test_plan_unsimulable.py); the real
step must fit this machine (16 bytes per parameter within half its available memory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import traceback
from typing import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException,
                                           UnsupportedOperatorException)

from companion.memory import KINDS, format_bytes, memory_budget
from companion.plan.space import Candidate

__all__ = ["Unsimulable", "Scaled", "diagnose", "quiet", "scaled", "note", "available_bytes"]

_DATA = "data-dependent"
_WHY = {_DATA: "its output's shape depends on the values of its input, and fake tensors carry "
               "shapes, not values",
        "meta": "the meta kernel that fake tensors run refused it, and meta kernels can be "
                "stricter than the CPU kernels the real step runs",
        "missing": "it has no meta kernel for fake tensors to run"}
_CALLS = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
_META_FILES = ("_meta_registrations.py", "_refs", "_decomp", "_prims")


@dataclasses.dataclass
class Unsimulable:
    """An op the fake-tensor simulation could not run: which, in which module, and why."""

    op: str
    module: str                      # "blocks.0 (Top1MoE)", or where else it ran
    kind: str                        # a key of _WHY
    error: str                       # the exception's type and first line

    def __str__(self) -> str:
        return (f"{self.op} in {self.module} cannot run on fake tensors: {_WHY[self.kind]} "
                f"({self.error})")


def diagnose(error: BaseException) -> Unsimulable | None:
    """What the traceback of a failed fake step says: the op and module, or None when no op
    failed (an error of the step's own code, raised as it is)."""
    frames = [f for f, _ in traceback.walk_tb(error.__traceback__)]
    ops = [f.f_locals["func"] for f in frames
           if isinstance(f.f_locals.get("func"), torch._ops.OpOverload)]
    op = getattr(error, "func", None) or (ops[-1] if ops else None)
    if isinstance(error, (DynamicOutputShapeException, DataDependentOutputException)):
        kind = _DATA
    elif isinstance(error, UnsupportedOperatorException):
        kind = "missing"
    elif op is not None and any(m in f.f_code.co_filename for f in frames for m in _META_FILES):
        kind = "meta"
    else:
        return None
    return Unsimulable(str(op), _module([f.f_locals.get("self") for f in frames
                                         if f.f_code in _CALLS]), kind,
                       f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}")


def _module(calls: list) -> str:
    """The innermost module called, by its name in the outermost (the model)."""
    calls = [m for m in calls if isinstance(m, nn.Module)]
    if not calls:
        return "backward (no module's forward was running)"
    names = {id(m): n for n, m in calls[0].named_modules()}
    name = names.get(id(calls[-1])) or "the model itself"
    return f"{name} ({type(calls[-1]).__name__})"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """FakeTensorMode's logger off: it logs the whole traceback of a failed meta kernel at
    ERROR level before the error is raised ("E... fake_tensor.py:3090] failed while attempting
    to run meta for aten._grouped_mm.default")."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclasses.dataclass
class Scaled:
    """A step measured for real at small micro-batches (and extrapolated): what the planner
    reads of a tracker (`peak`, `host_peak`, `peak_phase`, `breakdown()`); no trace to replay."""

    peak: int
    host_peak: int
    peak_phase: str
    kinds: dict[str, int]
    basis: str                       # what was measured, and how it was scaled

    def breakdown(self, at: str = "peak", *, where: str = "device") -> dict[str, int]:
        if (at, where) != ("peak", "device"):
            raise ValueError("a scaled step keeps bytes by kind at its peak on the device only")
        return dict(self.kinds)


def available_bytes() -> int | None:
    """This machine's memory available to a new process (/proc/meminfo's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def scaled(run: Callable[[Candidate], tuple], cand: Candidate, n_params: int,
           why: Unsimulable) -> tuple[Scaled, float, int]:
    """(tracker-like peak, FLOPs, blocks) of `cand` from its real step at two small micro-batches:
    `run(candidate)` is the real step measured (`known.Traced._simulated`:
    `simulate_memory(fake=False)` and `count_flops(fake=False)`).

    The two are m and m + 1 from m = 2 (a micro-batch of 1 runs other ops: 527 allocations and
    frees against 640 at 2 to 8 for a top-1 MoE, 1106 against 1110 for a small Mixtral): the
    first pair whose steps make the same allocations and frees in the same phases, so that each
    one's live bytes can be extrapolated linearly in the micro-batch, event by event, and the
    largest taken. No pair up to 5 agreeing (routing that changes which ops run), each phase's
    peak is extrapolated instead, a lower bound where the constant bytes set a phase's peak at the
    small sizes. A `cand.micro_batch` no larger than the pair is measured as it is.

    Refused when 16 bytes per parameter (fp32 weights, gradients, Adam's two moments) exceed
    half of this machine's available memory; each real step runs under `memory_budget` of that
    half, so that a larger one stops with an error, not the machine."""
    free = available_bytes()
    if free is not None and 16 * n_params > free // 2:
        raise RuntimeError(f"{why}. Measuring the real step instead needs its model here: "
                           f"{n_params:,} parameters x 16 B = {format_bytes(16 * n_params)}, more "
                           f"than half of this machine's {format_bytes(free)} available; plan on "
                           f"a machine with more memory, or pass a step that avoids the op")
    runs: dict[int, tuple] = {}

    def at(m: int) -> tuple:
        if m not in runs:
            try:
                with memory_budget(free // 2 if free else 2**62), \
                        torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)           # the same inputs (and routing) each time
                    tracker, flops, blocks = run(dataclasses.replace(cand, micro_batch=m))
            except torch.OutOfMemoryError as e:
                raise RuntimeError(f"{why}. Its real step at micro-batch {m} does not fit half "
                                   f"of this machine's available memory ({e})") from None
            except Exception as e:
                raise RuntimeError(f"{why}. The real step fails too, at micro-batch {m}, so the "
                                   f"step itself is wrong: {type(e).__name__}: {e}") from e
            runs[m] = (tracker.timeline(), tracker.host_peak, flops, blocks)
        return runs[m]

    m = cand.micro_batch
    for lo in (2, 3, 4):
        if m <= lo + 1:
            line, host, flops, blocks = at(m)
            i = max(range(len(line["total"])), key=line["total"].__getitem__)
            return (Scaled(line["total"][i], host, line["phase"][i],
                           {k: line[k][i] for k in KINDS}, f"micro-batch {m} measured as it is"),
                    flops, blocks)
        (a, host_a, flops_a, blocks), (b, host_b, flops_b, _) = at(lo), at(lo + 1)

        def grow(x: float, y: float) -> int:
            return max(0, round(x + (y - x) * (m - lo)))

        if a["phase"] == b["phase"]:                       # the same events: one by one
            totals = [grow(x, y) for x, y in zip(a["total"], b["total"])]
            i = max(range(len(totals)), key=totals.__getitem__)
            return (Scaled(totals[i], grow(host_a, host_b), a["phase"][i],
                           {k: grow(a[k][i], b[k][i]) for k in KINDS},
                           f"micro-batches {lo} and {lo + 1}, event by event"),
                    grow(flops_a, flops_b), blocks)
    one, two = _phases(a), _phases(b)
    grown = {p: (grow(one[p][0], two[p][0]),
                 {k: grow(one[p][1][k], two[p][1][k]) for k in KINDS}) for p in one if p in two}
    phase = max(grown, key=lambda p: grown[p][0])
    return (Scaled(grown[phase][0], grow(host_a, host_b), phase, grown[phase][1],
                   f"micro-batches {lo} and {lo + 1}, phase by phase (a lower bound)"),
            grow(flops_a, flops_b), blocks)


def _phases(line: dict) -> dict[str, tuple[int, dict[str, int]]]:
    """Each phase's peak live bytes and the bytes by kind then, from a tracker's timeline."""
    best: dict[str, int] = {}
    for i, (phase, total) in enumerate(zip(line["phase"], line["total"])):
        if phase not in best or total > line["total"][best[phase]]:
            best[phase] = i
    return {p: (line["total"][i], {k: line[k][i] for k in KINDS}) for p, i in best.items()}


def note(why: Unsimulable, bases: set[str]) -> list[str]:
    """What the plan prints when its rows were measured for real (and scaled)."""
    lines = [f"Not simulated: {why}.",
             "Each 'simulated' peak it could not give was measured instead: the real step run "
             "on this CPU (companion.memory.track, the row's levers) at the row's micro-batch "
             "when it is small, else at two small ones and its live bytes and FLOPs "
             "extrapolated linearly to the row's (here: " + "; ".join(sorted(bases)) + "). "
             "Assumed: every allocation of the step grows linearly with the micro-batch."]
    if why.kind == _DATA:
        lines.append("The routing measured is the one random token ids give a randomly "
                     "initialised model, not the worst case. On one device that changes "
                     "nothing when the experts take their tokens by index (each token goes to k "
                     "experts whatever the router decides: a top-1 MoE peaked at the same byte "
                     "with random routing and with every token sent to one expert); an MoE that "
                     "pads each expert to a capacity, or splits experts over GPUs, is not "
                     "planned here.")
    return lines
