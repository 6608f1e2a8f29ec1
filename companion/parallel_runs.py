"""Chapter 13's experiments: each parallelism run on gloo ranks beside its one-process reference.

Every function here starts its ranks with `companion.launch.run` (so a notebook can call it: a
spawned worker cannot run a function defined in a notebook) and returns what the chapter prints:
the largest difference from the reference, the bytes each rank sent and kept, and the formula
that predicts them.

- `compare_block`: a transformer block split by tensor parallelism (and sequence parallelism)
  over t ranks (`companion.tensor_parallel`).
- `compare_attention`: one attention layer's sequence split over k ranks, ring or Ulysses
  (`companion.context_parallel`).
- `compare_pipeline`: an MLP cut into p stages, run by a schedule (`companion.pipeline`).
- `block_shard_alone`, `ring_shard_alone`: one rank's share on a process group of one (one GPU,
  where NCCL cannot run two ranks): the memory a rank holds, nothing sent.
- `attention_step_seconds`: full attention's step beside a split one's, in interleaved rounds.

The workers run on `launch.rank_device()` (each rank's GPU under NCCL) and return CPU tensors;
the one-process references run on the CPU.

Example:
    >>> block = models.Block(64, 4)
    >>> run = compare_block(block, torch.randn(2, 16, 64), torch.randn(2, 16, 64), world=2)
    >>> run.error < 1e-5, run.sent == run.sent_formula            # (True, True)
"""
from __future__ import annotations

import dataclasses
import statistics
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from companion import context_parallel as cp, experts, launch, memory, tensor_parallel as tp
from companion.pipeline import runtime, schedules

__all__ = ["BlockRun", "AttentionRun", "PipelineRun", "split_block_run", "compare_block",
           "attention_shard_run", "compare_attention", "compare_pipeline", "ExpertRun",
           "expert_rank_run", "compare_experts"]


def _warm_up(device: torch.device) -> None:
    """One small matmul, so that cuBLAS's workspace (kept by the caching allocator from a GPU's
    first matmul on) exists before a tracker starts counting."""
    torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)


def _largest(got, want) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want, strict=True))


# ---------------------------------------------------------------- tensor (and sequence) parallel

def split_block_run(rank: int, world: int, block: nn.Module, x: torch.Tensor,
                    grad_out: torch.Tensor, sequence_parallel: bool):
    """A worker: this rank's share of `block` on x (its s/t tokens with sequence parallelism);
    returns its output, input gradient, parameter gradients, bytes kept for backward, and bytes
    sent forward and backward. It runs on `launch.rank_device()` (its GPU under NCCL) and returns
    CPU tensors."""
    device = launch.rank_device()
    comm = tp.TPComm()
    split = tp.TensorParallelBlock(block, rank, world, comm=comm,
                                   sequence_parallel=sequence_parallel).to(device)
    if sequence_parallel:
        x, grad_out = (tp.sequence_shard(t, rank, world) for t in (x, grad_out))
    x, grad_out = x.to(device).clone().requires_grad_(), grad_out.to(device)
    _warm_up(device)
    with memory.track(device) as tracker:
        y = split(x)
        kept = tracker.current - y.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    forward = comm.traffic.sent_bytes
    y.backward(grad_out)
    backward = comm.traffic.sent_bytes - forward
    if sequence_parallel:
        tp.all_reduce_sequence_parallel_grads(split, comm)
    grads = {name: p.grad.cpu() for name, p in split.named_parameters()}
    return y.detach().cpu(), x.grad.cpu(), grads, kept, forward, backward


def _block_shard(name: str, grads: dict, rank: int, world: int) -> torch.Tensor:
    """The whole block's gradient of the parameter `name` of a `TensorParallelBlock` on `rank`."""
    layer = {"qkv": "qkv", "proj": "proj", "mlp.0": "fc", "mlp.2": "out"}
    prefix, kind = name.rsplit(".", 1)
    if prefix not in layer:                                   # LayerNorms: whole on every rank
        return grads[name]
    full = grads[f"{layer[prefix]}.{kind}"]
    if prefix in ("qkv", "mlp.0"):                            # column-parallel: output rows
        return tp.column_shard(full, rank, world, parts=3 if prefix == "qkv" else 1)
    return tp.row_shard(full, rank, world) if kind == "weight" else full


@dataclasses.dataclass
class BlockRun:
    """A block split over `world` ranks against the whole block in one process."""
    world: int
    sequence_parallel: bool
    error: float                  # largest |difference| over outputs, input and weight gradients
    sent: list[tuple[int, int]]   # per rank: bytes sent in forward, in backward
    kept: list[int]               # per rank: bytes saved for backward
    sent_formula: tuple[float, float]
    kept_formula: int
    whole_kept: int               # the unsplit block's saved bytes (one process)


def compare_block(block: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, world: int, *,
                  sequence_parallel: bool = False, timeout: float = 60.0,
                  backend: str | None = None) -> BlockRun:
    """Run `block` (a `companion.models.Block`) whole here, on the CPU, then split over `world`
    ranks (gloo, or `backend`: "nccl" puts each rank on its own GPU)."""
    xw = x.clone().requires_grad_()
    with memory.track("cpu") as tracker:
        y = block(xw)
        whole_kept = tracker.current - y.untyped_storage().nbytes()
    y.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    results = launch.run(split_block_run, world, block, x, grad_out, sequence_parallel,
                         timeout=timeout, backend=backend)
    error = 0.0
    for rank, (y_r, xg_r, grads_r, *_) in enumerate(results):
        mine = (lambda t: tp.sequence_shard(t, rank, world)) if sequence_parallel else (lambda t: t)
        names = sorted(grads_r)
        error = max(error, _largest([y_r, xg_r, *(grads_r[n] for n in names)],
                                    [mine(y.detach()), mine(xw.grad),
                                     *(_block_shard(n, grads, rank, world) for n in names)]))
    b, s, h = x.shape
    formula = tp.tp_bytes_per_layer(b, s, h, world, sequence_parallel=sequence_parallel,
                                    dtype=x.dtype)
    return BlockRun(world, sequence_parallel, error, [(r[4], r[5]) for r in results],
                    [r[3] for r in results], (formula["forward"], formula["backward"]),
                    tp.tp_activation_bytes(b, s, h, block.heads, world,
                                           sequence_parallel=sequence_parallel, dtype=x.dtype),
                    whole_kept)


# ---------------------------------------------------------------- context parallel

def attention_shard_run(rank: int, world: int, method: str, tensors, causal: bool, layout: str):
    """A worker: this rank's shards of q, k, v (and the output's gradient), forward and backward
    by `method` ("ring" or "ulysses"); returns output, q/k/v gradients, the traffic, and the
    bytes live after forward (what backward needs). It runs on `launch.rank_device()` and returns
    CPU tensors."""
    device = launch.rank_device()
    shards = [cp.shard_sequence(t, rank, world, layout=layout).to(device) for t in tensors]
    q, k, v = (t.clone().requires_grad_() for t in shards[:3])
    stats = cp.RingStats()
    attend = cp.ring_attention if method == "ring" else cp.ulysses_attention
    extra = {"layout": layout} if method == "ring" else {}
    _warm_up(device)
    with memory.track(device) as tracker:
        out = attend(q, k, v, causal=causal, stats=stats, **extra)
        kept = tracker.current
    out.backward(shards[3])
    return (out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu(), stats, kept)


@dataclasses.dataclass
class AttentionRun:
    """Attention over a sequence split on `world` ranks against full attention in one process."""
    method: str
    world: int
    layout: str
    error: float                  # largest |difference|, output and q, k, v gradients
    sent: list[tuple[int, int]]   # per rank: bytes sent in forward, in backward
    sent_formula: tuple[int, int]
    kept: list[int]               # per rank: bytes live after forward (output included)
    kept_formula: int | None = None  # ring: output and log-sum-exp (`ring_kept_bytes`)


def compare_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                      world: int, *, method: str = "ring", causal: bool = True,
                      layout: str = "contiguous", timeout: float = 60.0,
                      backend: str | None = None) -> AttentionRun:
    """q, k, v, grad_out: (B, H, T, d), the whole sequence. Full attention here (on the CPU), then
    `method` over `world` ranks (gloo, or `backend`), each holding T/world tokens."""
    if method not in ("ring", "ulysses"):
        raise ValueError(f"method is 'ring' or 'ulysses', got {method!r}")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad_out)
    want = [out.detach(), *(t.grad for t in leaves)]
    results = launch.run(attention_shard_run, world, method, (q, k, v, grad_out), causal, layout,
                         timeout=timeout, backend=backend)
    got = [cp.unshard_sequence([r[i] for r in results], layout=layout) for i in range(4)]
    shard = (q.shape[0], q.shape[1], q.shape[2] // world, q.shape[3])
    if method == "ring":
        formula = (cp.ring_bytes_per_rank(shard, world, q.dtype),
                   cp.ring_bytes_per_rank(shard, world, q.dtype, backward=True))
    else:
        formula = (cp.ulysses_bytes_per_rank(shard, world, q.dtype),) * 2
    return AttentionRun(method, world, layout, _largest(got, want),
                        [(r[4].sent_bytes, r[4].backward.sent_bytes) for r in results], formula,
                        [r[5] for r in results],
                        cp.ring_kept_bytes(shard, q.dtype) if method == "ring" else None)


# ---------------------------------------------------------------- pipeline parallel

class _WithLoss(nn.Module):
    """The last stage and its loss: what that stage saves for one micro-batch's backward."""

    def __init__(self, stage: nn.Module, target: torch.Tensor, m: int):
        super().__init__()
        self.stage, self.target, self.m = stage, target, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.stage(x), self.target) / self.m


@dataclasses.dataclass
class PipelineRun:
    """A schedule run for real on p gloo ranks against accumulation in one process."""
    name: str
    stages: int
    micro_batches: int
    error: float                  # largest |difference| of the weight gradients
    peak_activation_bytes: list[int]     # per stage, measured
    predicted_peak: list[int]            # per stage: peak in flight (simulated) x bytes per one
    timeline: list[list[tuple]]          # per stage: (action, start s, end s)
    bubble: float                        # measured: idle share of p x makespan
    bubble_formula: float                # the simulator's, on unit times (backward = 2 forwards)
    forward_s: float                     # median seconds of one forward on one stage, measured
    backward_s: float                    # the same for one backward
    bubble_at_measured: float            # the simulator's, on those two measured times


def compare_pipeline(model: nn.Sequential, xs, ys, schedule, *, name: str = "",
                     timeout: float = 120.0, backend: str | None = None) -> PipelineRun:
    """Cut `model` (an `nn.Sequential`) into one stage per stage of `schedule` (a plain,
    non-interleaved schedule), run it on gloo ranks (or `backend`) on micro-batches `xs` with
    targets `ys`, and compare with gradient accumulation over the same micro-batches in one
    process (here, on the CPU)."""
    p, m = len(schedule), len(xs)
    model.zero_grad(set_to_none=True)
    for x, y in zip(xs, ys):
        (F.cross_entropy(model(x), y) / m).backward()
    expected = [param.grad.clone() for param in model.parameters()]
    model.zero_grad(set_to_none=True)
    stages = runtime.split(model, p)
    results = launch.run(runtime.run_pipeline, p, stages, schedule, list(xs), list(ys),
                         timeout=timeout, backend=backend)
    by_name = {key: g.cpu() for out in results for key, g in out["gradients"].items()}
    got = [by_name[f"{k}.{n}"] for k, stage in enumerate(stages) for n, _ in stage.named_parameters()]
    inputs, x = [], xs[0]
    with torch.no_grad():
        for stage in stages:
            inputs.append(x)
            x = stage(x)
    simulated = schedules.simulate(schedule)
    per_one = [runtime.saved_bytes(stage, inputs[s], received=s > 0)
               for s, stage in enumerate(stages[:-1])]
    per_one.append(runtime.saved_bytes(_WithLoss(stages[-1], ys[0], m), inputs[-1],
                                       received=p > 1))
    rows = [out["timeline"] for out in results]
    start = min(r[0][1] for r in rows)
    makespan = max(r[-1][2] for r in rows) - start
    busy = sum(e - s for r in rows for _, s, e in r)
    durations = {op: statistics.median(e - s for r in rows for a, s, e in r if a[0] == op)
                 for op in ("F", "B")}
    at_measured = schedules.simulate(schedule, forward=Fraction(durations["F"]),
                                     backward=Fraction(durations["B"]))
    return PipelineRun(name, p, m, _largest(got, expected),
                       [out["peak_activation_bytes"] for out in results],
                       [n * b for n, b in zip(simulated.peak_in_flight, per_one)], rows,
                       1 - busy / (p * makespan), float(simulated.bubble), durations["F"],
                       durations["B"], float(at_measured.bubble))


# ---------------------------------------------------------------- expert parallel

def expert_rank_run(rank: int, world: int, moe: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """A worker: this rank's n = N/W tokens through its share of `moe` (an `experts.MoE`),
    forward and backward; returns its outputs, input gradient, gradients, traffic and the bytes
    of its experts' weights."""
    n = x.shape[0] // world
    ep = experts.ExpertParallelMoE(moe, rank, world)
    x, grad_out = x[rank * n:(rank + 1) * n].clone().requires_grad_(), grad_out[rank * n:(rank + 1) * n]
    stats = experts.EPStats()
    y = ep(x, stats=stats)
    y.backward(grad_out)
    experts.all_reduce_router_grads(ep)
    weights = sum(p.numel() * p.element_size() for p in ep.experts.parameters())
    return y.detach(), x.grad, {k: p.grad for k, p in ep.named_parameters()}, stats, weights


@dataclasses.dataclass
class ExpertRun:
    """A mixture of experts over `world` ranks, E/W experts each, against one process."""
    world: int
    top_k: int
    capacity_factor: float | None
    error: float                 # largest |difference|: outputs, input and weight gradients
    sent: list[dict]             # per rank: bytes sent per all-to-all (counts, dispatch, combine)
    sent_formula: list[dict]     # `experts.ep_bytes_per_rank` from the ranks' routing counts
    weights: list[int]           # per rank: bytes of its experts' parameters
    weights_formula: int
    whole_weights: int           # every expert in one process
    activations: list[int]       # per rank: bytes its experts saved for backward
    activations_formula: list[int]
    received: list[int]          # per rank: token rows its experts ran
    imbalance: dict              # max / mean tokens per expert and per rank, before capacity
    dropped: int                 # assignments over capacity, all ranks


def compare_experts(moe: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, world: int, *,
                    timeout: float = 60.0) -> ExpertRun:
    """`moe` (an `experts.MoE`) on x (N, d) in this process, each of `world` groups of N/W tokens
    routed alone (as each rank routes its own), then over `world` gloo ranks."""
    xw = x.clone().requires_grad_()
    y = moe(xw, groups=world)
    y.backward(grad_out)
    want = dict(moe.named_parameters())
    grads = {k: p.grad.clone() for k, p in want.items()}
    moe.zero_grad(set_to_none=True)
    results = launch.run(expert_rank_run, world, moe, x, grad_out, timeout=timeout)
    E = len(moe.experts)
    got, ref = [torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])], \
        [y.detach(), xw.grad]
    for rank, r in enumerate(results):
        for name, g in r[2].items():
            if name.startswith("experts."):
                _, j, rest = name.split(".", 2)
                name = f"experts.{rank * E // world + int(j)}.{rest}"
            got.append(g)
            ref.append(grads[name])
    stats = [r[3] for r in results]
    kept = torch.stack([s.kept for s in stats])
    width, hidden = moe.router.in_features, moe.experts[0][0].out_features
    return ExpertRun(
        world, moe.top_k, moe.capacity_factor, _largest(got, ref),
        [{k: s.exchanges[k] for k in ("counts", "dispatch", "combine")} for s in stats],
        experts.ep_bytes_per_rank(kept, width, x.dtype), [r[4] for r in results],
        experts.expert_weight_bytes(width, hidden, E, world, x.dtype),
        sum(p.numel() * p.element_size() for p in moe.experts.parameters()),
        [s.activation_bytes for s in stats],
        [experts.expert_activation_bytes(s.received_tokens, width, hidden, x.dtype) for s in stats],
        [s.received_tokens for s in stats],
        experts.load_imbalance(torch.stack([s.routed for s in stats]), world),
        sum(s.dropped for s in stats))
