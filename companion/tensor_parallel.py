"""Tensor parallelism (Megatron-LM) and sequence parallelism: one layer split over t ranks.

Data parallelism and ZeRO divide the model states, never a layer's compute or its activations.
Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, §3) splits the layer itself. A Linear split
by output columns (`ColumnParallelLinear`) needs the whole input and gives each rank a slice of the
output; one split by input rows (`RowParallelLinear`) takes that slice and gives each rank a partial
sum of the whole output. Column then row needs one all-reduce at the end and none between:

- attention: qkv column-parallel by heads (each rank owns a/t heads), proj row-parallel;
- MLP: fc column-parallel, out row-parallel, GELU on each rank's own 4h/t columns.

The communication comes in conjugate pairs (the paper's f and g): `copy_to_tp` is the identity
forward and an all-reduce of the input's gradient backward; `reduce_from_tp` all-reduces forward
and is the identity backward. Per layer: two all-reduces of (b, s, h) forward, two backward.

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2) notices that LayerNorm,
the residual adds (and dropout) still run on the whole (b, s, h) on every rank, and shard them
along the sequence instead: `gather_from_sp` (all-gather forward, reduce-scatter backward) in place
of f, `scatter_to_sp` (reduce-scatter forward, all-gather backward) in place of g. An all-reduce is
a reduce-scatter then an all-gather, so the bytes are the same; the activations shrink from
sbh(10 + 24/t + 5as/(ht)) to sbh(34/t + 5as/(ht)) (their 16-bit count) because each rank keeps the
LayerNorm's inputs and the column layers' inputs for its s/t tokens only; the column layer gathers
its input again in backward (`tp_bytes_per_layer` counts that gather).

Example (inside each rank started by `companion.launch.run`):
    >>> comm = TPComm()
    >>> tp = TensorParallelBlock(block, rank, world, comm=comm, sequence_parallel=True)
    >>> y = tp(sequence_shard(x, rank, world))       # this rank's s/t tokens in and out
    >>> comm.traffic.sent_bytes                      # tp_bytes_per_layer(...)["forward"]

Simplified vs PyTorch/Megatron: the collectives are `companion.collectives`' rings (whole chunks,
one send and one receive per step, every byte counted as it is sent; torch 2.13's gloo has
its own reduce-scatter too, which would not count them)
where Megatron calls NCCL and overlaps the backward's gather with the weight-gradient product;
activations are (b, s, h), not Megatron's (s, b, h), so gathers along the sequence copy; no
dropout, no vocabulary-parallel embedding or loss, no fused kernels. PyTorch's own
`torch.distributed.tensor.parallel` (ColwiseParallel, RowwiseParallel, SequenceParallel) does the
same on DTensors.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from companion.checkpointing.selective import attention_core
from companion.collectives import Traffic, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from companion.models.gpt import Block

__all__ = ["TPComm", "copy_to_tp", "reduce_from_tp", "gather_from_sp", "scatter_to_sp",
           "column_shard", "row_shard", "sequence_shard", "ColumnParallelLinear",
           "RowParallelLinear", "tp_mlp", "TensorParallelBlock",
           "all_reduce_sequence_parallel_grads", "tp_bytes_per_layer", "tp_activation_bytes"]


@dataclasses.dataclass
class TPComm:
    """The tensor-parallel process group (None: the default group) and the bytes this rank sent."""

    group: object = None
    traffic: Traffic = dataclasses.field(default_factory=Traffic)


# ---------------------------------------------------------------- the collectives, on (B, T, C)

def _all_reduce(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    out = x.contiguous().clone()
    ring_all_reduce(out, comm.group, stats=comm.traffic)            # collective: 2(t-1)/t · S
    return out


def _all_gather_seq(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """(B, T/t, C) on each rank -> (B, T, C), rank r's tokens at r·T/t."""
    world = dist.get_world_size(comm.group)
    B, Ts, C = x.shape
    flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    ring_all_gather(flat, x.contiguous().view(-1), comm.group, stats=comm.traffic)  # (t-1)/t · S
    return flat.view(world, B, Ts, C).transpose(0, 1).reshape(B, world * Ts, C)


def _reduce_scatter_seq(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> rank r's (B, T/t, C) of the sum."""
    world = dist.get_world_size(comm.group)
    B, T, C = x.shape
    if T % world:
        raise ValueError(f"sequence parallelism needs the sequence ({T}) divisible by t={world}")
    chunks = x.reshape(B, world, T // world, C).transpose(0, 1).contiguous().view(-1)
    out = torch.empty(B, T // world, C, dtype=x.dtype, device=x.device)
    ring_reduce_scatter(out.view(-1), chunks, comm.group, stats=comm.traffic)  # (t-1)/t · S
    return out


# ---------------------------------------------------------------- the conjugate pairs

class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm), None


class _ScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.comm), None


def copy_to_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's f, before a column-parallel layer: x as is; backward sums the ranks' gradients."""
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's g, after a row-parallel layer: the sum of the ranks' partial x; grad as is."""
    return _ReduceFromTP.apply(x, comm)


def gather_from_sp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """(B, T/t, C) shards -> the whole (B, T, C); backward reduce-scatters the gradient."""
    return _GatherFromSP.apply(x, comm)


def scatter_to_sp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """(B, T, C) partial sums -> this rank's (B, T/t, C) of their sum; backward all-gathers."""
    return _ScatterToSP.apply(x, comm)


class _GatherLinear(torch.autograd.Function):
    """linear(gather_from_sp(x)) that keeps x's shard for backward, not the gathered (B, T, C),
    and gathers it again there for the weight's gradient (Korthikanti et al. §4.2.2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)                       # (B, T/t, C): s·b·h/t kept
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(_all_gather_seq(x, comm), weight, bias)   # collective: all-gather

    @staticmethod
    def backward(ctx, grad):                                   # grad: (B, T, out/t)
        x, weight = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.comm)                    # collective: the gather again
        grad_x = _reduce_scatter_seq(grad @ weight, ctx.comm)  # collective: reduce-scatter
        grad_w = grad.flatten(0, 1).T @ full.flatten(0, 1)     # (out/t, C)
        grad_b = grad.sum((0, 1)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


# ---------------------------------------------------------------- the split layers

def _check_split(what: str, size: int, world: int, rank: int) -> None:
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or \
            not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..world-1 and world >= 1, got rank={rank!r}, "
                         f"world={world!r}")
    if size % world:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size t={world}:"
                         f" pick t among its divisors")


def column_shard(t: torch.Tensor, rank: int, world: int, parts: int = 1) -> torch.Tensor:
    """Rank's rows of a weight (out, in) or bias (out,): with `parts` > 1 the output is `parts`
    blocks (qkv: q, k, v) and the rank takes its slice of each, so it owns whole heads."""
    blocks = t.chunk(parts, dim=0)
    return torch.cat([b.chunk(world, dim=0)[rank] for b in blocks]).clone()


def row_shard(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's columns of a weight (out, in): the inputs that rank's column layer produced."""
    return weight.chunk(world, dim=1)[rank].clone()


def sequence_shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's s/t tokens of a (B, T, C) activation: what a sequence-parallel block takes."""
    _check_split("the sequence length", x.shape[1], world, rank)
    return x.chunk(world, dim=1)[rank]


class ColumnParallelLinear(nn.Module):
    """Rank's out/t outputs of `full`: the whole input in, a slice of the output out.

    Weights: out·in/t per rank. Communication: `copy_to_tp` (all-reduce of the input's gradient in
    backward), or with `sequence_parallel` an all-gather of the s/t-token input forward and
    backward and a reduce-scatter of its gradient. `parts`: see `column_shard`."""

    def __init__(self, full: nn.Linear, rank: int, world: int, *, comm: TPComm | None = None,
                 parts: int = 1, sequence_parallel: bool = False):
        super().__init__()
        if full.out_features % parts:
            raise ValueError(f"out_features ({full.out_features}) is not {parts} equal parts")
        _check_split("out_features" if parts == 1 else f"out_features/{parts}",
                     full.out_features // parts, world, rank)
        self.comm, self.sequence_parallel = comm or TPComm(), sequence_parallel
        self.weight = nn.Parameter(column_shard(full.weight.detach(), rank, world, parts))
        self.bias = None if full.bias is None else nn.Parameter(
            column_shard(full.bias.detach(), rank, world, parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _GatherLinear.apply(x, self.weight, self.bias, self.comm)
        return F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`full` fed by rank's in/t inputs: a partial sum of every output, summed across ranks.

    Weights: out·in/t per rank, the bias whole (added once, after the sum). Communication:
    `reduce_from_tp` (all-reduce forward), or with `sequence_parallel` a reduce-scatter forward
    that leaves each rank its s/t tokens and an all-gather of their gradient backward."""

    def __init__(self, full: nn.Linear, rank: int, world: int, *, comm: TPComm | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        _check_split("in_features", full.in_features, world, rank)
        self.comm, self.sequence_parallel = comm or TPComm(), sequence_parallel
        self.weight = nn.Parameter(row_shard(full.weight.detach(), rank, world))
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        if self.bias is not None:          # with SP each rank's gradient covers its tokens only
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)                          # (B, T, out) partial sums
        reduce = scatter_to_sp if self.sequence_parallel else reduce_from_tp
        out = reduce(partial, self.comm)                            # collective
        return out if self.bias is None else out + self.bias


def tp_mlp(fc: nn.Linear, out: nn.Linear, rank: int, world: int, *, comm: TPComm | None = None,
           sequence_parallel: bool = False) -> nn.Sequential:
    """out(gelu(fc(x))) split over t ranks: fc column-parallel, out row-parallel, one collective
    each way (an all-reduce, or with `sequence_parallel` an all-gather and a reduce-scatter)."""
    comm = comm or TPComm()
    return nn.Sequential(
        ColumnParallelLinear(fc, rank, world, comm=comm, sequence_parallel=sequence_parallel),
        nn.GELU(),
        RowParallelLinear(out, rank, world, comm=comm, sequence_parallel=sequence_parallel))


class TensorParallelBlock(nn.Module):
    """Rank's share of a `companion.models.Block`: a/t heads, 4h/t MLP columns, LayerNorms whole.

    Without `sequence_parallel` it takes and returns the whole (B, T, C) (the same on every rank);
    with it, the rank's (B, T/t, C) tokens (`sequence_shard(x, rank, t)`). Call
    `all_reduce_sequence_parallel_grads` after backward in that mode: the LayerNorms' and the row
    layers' bias gradients then cover each rank's tokens only."""

    def __init__(self, block: Block, rank: int, world: int, *, comm: TPComm | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        width = block.qkv.in_features
        _check_split("heads", block.heads, world, rank)
        _check_split("width", width, world, rank)
        self.comm, self.world, self.sequence_parallel = comm or TPComm(), world, sequence_parallel
        self.heads, self.kind = block.heads // world, block.kind              # a/t heads here
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        for p in (*self.ln1.parameters(), *self.ln2.parameters()):
            p.sequence_parallel = sequence_parallel
        split = {"comm": self.comm, "sequence_parallel": sequence_parallel}
        self.qkv = ColumnParallelLinear(block.qkv, rank, world, parts=3, **split)
        self.proj = RowParallelLinear(block.proj, rank, world, **split)
        self.mlp = tp_mlp(block.fc, block.out, rank, world, **split)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                          # (B, T, 3C/t), T whole
        B, T, C3 = qkv.shape
        C = C3 // 3                                                # C/t: this rank's heads
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in qkv.split(C, dim=2))                   # (B, nh/t, T, hs)
        y = attention_core(q, k, v) if self.kind == "written" else Block._fused(self, q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))     # (B, T or T/t, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size(self.comm.group) != self.world:
            raise ValueError(f"the block was split for t={self.world} ranks but its process group"
                             f" has {dist.get_world_size(self.comm.group)}")
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def all_reduce_sequence_parallel_grads(module: nn.Module, comm: TPComm | None = None) -> None:
    """Sum over the tensor-parallel ranks the gradients of parameters that sequence parallelism
    applies to each rank's tokens only (LayerNorms, row layers' biases), as Megatron does."""
    group = comm.group if comm is not None else None
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            ring_all_reduce(p.grad, group)                          # collective, uncounted


# ---------------------------------------------------------------- the formulas

def tp_bytes_per_layer(batch: int, seq: int, width: int, world: int, *,
                       sequence_parallel: bool = False,
                       dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Bytes each rank sends per block, forward and backward, over rings of t ranks.

    S = b·s·h·e, one (b, s, h) activation. A ring all-reduce sends 2(t-1)/t·S per rank, an
    all-gather or a reduce-scatter (t-1)/t·S. Without SP: two all-reduces forward (after proj and
    after out), two backward (before qkv and before fc): 4(t-1)/t·S each way. With SP: forward
    two all-gathers and two reduce-scatters, the same bytes; backward their conjugates plus the
    column layers' second gather of their input: 6(t-1)/t·S."""
    S = batch * seq * width * torch.empty((), dtype=dtype).element_size()
    share = (world - 1) / world * S                 # one all-gather or one reduce-scatter
    return {"forward": 4 * share, "backward": (6 if sequence_parallel else 4) * share}


def tp_activation_bytes(batch: int, seq: int, width: int, heads: int, world: int, *,
                        sequence_parallel: bool = False,
                        dtype: torch.dtype = torch.float32) -> int:
    """Bytes one rank keeps for backward in a `TensorParallelBlock` (written-out attention).

    In elements of e bytes, Korthikanti et al.'s count adapted as
    `checkpointing.block_activation_bytes` adapts it (no dropout, LayerNorm statistics, the mask):
    - split over t on every rank: q, k, v 3·sbh/t, proj's input sbh/t, fc's output 4·sbh/t, GELU's
      output 4·sbh/t (12·sbh/t), and the softmax output a·s²·b/t (a/t heads);
    - whole on every rank without SP, s/t tokens each with SP: the two LayerNorm inputs 2·sbh and
      the qkv and fc inputs 2·sbh (4·sbh, or 4·sbh/t), the LayerNorms' mean and 1/std 4·sb;
    - the (s, s) bool causal mask, s² bytes, built whole by every rank.
    At e = 2, with Megatron's dropouts added (two sbh-byte masks; on the attention weights a mask
    and an output, 3·a·s²·b/t) and the statistics and the mask left out, this is Korthikanti et
    al.'s sbh(10 + 24/t + 5as/(ht)) without SP and sbh(34/t + 5as/(ht)) with it (masks sharded).
    """
    e = torch.empty((), dtype=dtype).element_size()
    s, b, h, a, t = seq, batch, width, heads, world
    for what, n in (("width", h), ("heads", a), ("batch x seq x width", b * s * h)):
        if n % t:
            raise ValueError(f"{what} ({n}) is not divisible by t={t}")
    if sequence_parallel and s % t:
        raise ValueError(f"sequence parallelism needs seq ({s}) divisible by t={t}")
    split = 12 * s * b * h // t + a * s * s * b // t
    whole = 4 * s * b * h + 4 * s * b
    return e * (split + (whole // t if sequence_parallel else whole)) + s * s
