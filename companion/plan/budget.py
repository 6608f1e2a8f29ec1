"""What a plan must fit: the whole budget the learner gives, with what a GPU holds beyond the
step's tensors counted line by line (`companion.allocator`), each with its source.

On the CPU the budget is `memory_budget`'s: tensor bytes, counted exactly, so a plan fits when
its peak does. On CUDA the same budget is the GPU memory the run may take:
  budget = CUDA context + NCCL's buffers (outside PyTorch's allocator)
           + what the caching allocator reserves: the step's tensors rounded to 512-byte blocks,
             the free pieces of its segments (fragmentation), cuBLAS's workspace, attention's
             backward scratch and the `record_stream` backlog of offload.
The budget defaults to the card's usable bytes, what CUDA reports as its total
(`cost.gpus.GPU.usable_bytes`), never its nominal size. A prediction (formulas, `predict`) adds
one segment of headroom (`allocator.headroom`) to the peak and the workspaces: a first sieve,
not a promise, since replays of the same steps find GiBs of fragmentation; a simulated step
replays its allocations through the allocator's rules (`allocator.replay`), which gives rounding
and fragmentation for that step, and only replayed plans are listed as fitting (`planner.plan`).
A line alive only while the model loads (the fp32 conversion temporary) is not part of the
step's total: `Fit.load` holds the load's bytes beside it.

What neither sees: kernels' scratch beyond the lines here (cuDNN, NCCL's own streams), other
processes on the GPU, and allocation orders that differ from eager PyTorch's (CUDA graphs,
torch.compile). `Plan.run` on CUDA caps the allocator at `usable` (`set_per_process_memory_
fraction`), so what the model misses shows up as an out-of-memory error, not as a silent overrun.
"""
from __future__ import annotations

import dataclasses

from companion import allocator
from companion.plan.space import Candidate, GPTShape

__all__ = ["Fit", "lines", "fit_predicted", "fit_simulated", "usable", "math_attention_bytes"]


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether a plan fits, and the GPU bytes it would take at its peak (`total`), by line."""

    fits: bool
    total: int                   # tensors + every line: what the GPU gives the process
    reserved: int                # of it, the caching allocator's segments
    lines: tuple[allocator.Overhead, ...]
    how: str                     # "predicted" (a bound) or "replayed" (the simulated trace)
    load: int = 0                # GPU bytes while the model loads (weights, a load-time line)


def lines(shape: GPTShape, cand: Candidate, *, device_type: str, gpu=None, world_size: int = 1,
          context_bytes: int | None = None) -> list[allocator.Overhead]:
    """The lines beyond the tensors for `cand` on `gpu` (none on the CPU)."""
    if device_type != "cuda":
        return []
    fused = shape.fused_attention or cand.fused_attention
    heads = shape.heads
    kv_heads = shape.kv_heads if shape.llama and shape.kv_heads else heads
    itemsize = 4 if cand.precision == "fp32" else 2                 # q's dtype
    math = math_attention_bytes(shape, cand)          # GQA in fp32: no FlashAttention
    attention = ((cand.micro_batch, shape.seq_len, heads, shape.width // heads, kv_heads,
                  itemsize) if fused and not math else None)
    backlog = None
    if cand.offload:                                   # a 16-bit gradient still going down
        backlog = allocator.record_stream_backlog((2 if cand.precision != "fp32" else 4)
                                                  * shape.largest, "the largest gradient")
    out = allocator.step_overheads(gpu, world_size=world_size, attention=attention,
                                   backlog=backlog, context_bytes=context_bytes)
    if cand.precision in ("mixed", "main_grad") or cand.nf4_base:
        out.append(allocator.conversion_temporary(shape.largest))
    if math:
        out.append(allocator.Overhead(
            "SDPA's math kernel: saved attention weights and expanded keys and values", math,
            "grouped-query attention in fp32 runs on no fused kernel on CUDA (PyTorch's SDPA "
            "sends enable_gqa to FlashAttention, fp16/bf16 only, or to the math path; "
            "sdp_utils.cpp), which saves each block's softmax (B, H, T, T) and k, v expanded to "
            "every head; counted for the blocks alive at the peak, not in the simulated step"))
    return out


def math_attention_bytes(shape: GPTShape, cand: Candidate) -> int:
    """Bytes a Llama with grouped-query attention saves beyond the fused kernel's when it runs
    in fp32 on CUDA, where SDPA has no fused kernel for it: per block alive at the peak (every
    block, or one segment's and the checkpoints' when checkpointing), the fp32 attention
    weights (B·H·T² values) and the keys and values expanded to every head (2·B·T·(C - kv·d));
    0 when the plan computes in 16 bits or the model has no GQA."""
    if not (shape.llama and shape.kv_heads and shape.kv_heads != shape.heads
            and cand.precision == "fp32"):
        return 0
    B, T, C, H = cand.micro_batch, shape.seq_len, shape.width, shape.heads
    kv = shape.kv_heads * (C // H)
    blocks = shape.depth if cand.segments == 1 else -(-shape.depth // cand.segments)
    return blocks * 4 * (B * H * T * T + 2 * B * T * (C - kv))


def _outside(found: list[allocator.Overhead]) -> int:
    return sum(o.bytes for o in found if not o.in_allocator)


def _inside(found: list[allocator.Overhead]) -> int:
    """Allocator lines alive during the step (the load's temporary is gone by then)."""
    return sum(o.bytes for o in found if o.in_allocator and o.alive == "step")


def usable(budget: int, found: list[allocator.Overhead]) -> int:
    """Bytes the caching allocator may reserve: the budget less what sits outside it."""
    return budget - _outside(found)


def _load(weights: int, found: list[allocator.Overhead]) -> int:
    """The load's peak: the weights and the conversion temporary, if any."""
    return weights + sum(o.bytes for o in found if o.alive == "load")


def fit_predicted(peak: int, weights: int, largest_request: int, budget: int,
                  found: list[allocator.Overhead], device_type: str) -> Fit:
    """A predicted peak against the budget: tensors + allocator lines + one segment of headroom
    (rounding and the last segment's free part) within what the allocator may reserve."""
    if device_type != "cuda":
        return Fit(peak <= budget, peak, peak, (), "predicted")
    headroom = allocator.Overhead("headroom (one segment: rounding, a segment's free part)",
                                  allocator.headroom(largest_request),
                                  "allocator.headroom; the simulated step replays the real "
                                  "rounding and fragmentation", alive="bound")
    reserved = max(peak + _inside(found) + headroom.bytes, _load(weights, found))
    total = reserved + _outside(found)
    return Fit(total <= budget, total, reserved, tuple(found) + (headroom,), "predicted",
               _load(weights, found) + _outside(found))


def fit_simulated(tracker, weights: int, budget: int, found: list[allocator.Overhead],
                  device_type: str) -> Fit:
    """A simulated step's trace replayed through the caching allocator under the cap the budget
    leaves it (the workspaces taken first)."""
    if device_type != "cuda":
        return Fit(tracker.peak <= budget, tracker.peak, tracker.peak, (), "simulated")
    if not hasattr(tracker, "_ledger"):           # measured at small sizes, scaled: no trace
        return fit_predicted(tracker.peak, weights, allocator.LARGE_REQUEST, budget, found,
                             device_type)
    found = [o for o in found if o.alive != "bound"]
    cap = usable(budget, found) - _inside(found)
    replayed = allocator.replay(tracker, cap=cap)
    reserved = max(replayed.peak_reserved + _inside(found), _load(weights, found))
    if not replayed.fits:                          # stopped at the failing request
        extra = (allocator.Overhead("out of memory when replayed", 0, replayed.failed_at),)
        total = max(budget + 1, reserved + _outside(found))
        return Fit(False, total, reserved, tuple(found) + extra, "replayed",
                   _load(weights, found) + _outside(found))
    extra = (allocator.Overhead("rounding (512-byte blocks, unsplit rests under 1 MiB)",
                                replayed.rounding,
                                "the step's blocks replayed (allocator.replay)"),
             allocator.Overhead("fragmentation (free pieces of segments)",
                                replayed.fragmentation,
                                "the step's allocations and frees replayed (allocator.replay)"))
    total = reserved + _outside(found)
    return Fit(replayed.fits and total <= budget, total, reserved, tuple(found) + extra,
               "replayed", _load(weights, found) + _outside(found))
