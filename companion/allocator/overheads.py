"""What a GPU holds beyond the tensors a training step makes, each term with its source.

A simulated step (`companion.plan.simulate`) counts every tensor an operator returns. A GPU also
holds:
- the CUDA context (driver, loaded kernels), outside PyTorch's allocator: 287,047,680 bytes with
  lazy module loading, PyTorch's default since 1.13, against 666,632,192 without (the measurement
  in pytorch/pytorch#86509); "around 400MB" (pytorch/pytorch#109888, PyTorch's CUDA maintainer);
  426 MiB on an RTX 6000 Ada with torch 2.10 and CUDA 13 (unslothai/unsloth-zoo#1053). The plan
  counts `CONTEXT_BYTES` = 512 MiB, above all three, until a GPU measures its own (`context`);
- cuBLAS's workspace, through the allocator: 8,519,680 bytes, or 32 MiB on compute capabilities
  9 to 12 (`rules.cublas_workspace`, read from PyTorch's CublasHandlePool.cpp);
- FlashAttention-2's backward scratch, through the allocator: an fp32 dq accumulator
  (B, T rounded up to 128, heads, head size rounded up to 32) and the fp32 softmax_d (B, heads,
  T rounded), and under grouped-query attention (fewer key/value heads than heads) dk_expanded
  and dv_expanded, (B, T, heads, head size) each in q's dtype, summed over each group into dk
  and dv afterwards: mha_bwd in flash_api.cpp (Dao-AILab/flash-attention, vendored by PyTorch in
  aten/src/ATen/native/transformers/cuda/flash_attn; PyTorch sends `enable_gqa=True` to it);
- NCCL's memory, outside the allocator: one communicator's buffers for all channels and peers,
  its proxies and its kernels' state. NCCL_BUFFSIZE is 4 MiB per channel and peer (NCCL's
  documentation, "Environment Variables"), but the channels go up to 32 and NVLS adds its own,
  so what is measured is far larger: "about 1.6GB" for one communicator after an all-reduce
  (NVIDIA/nccl#864), 544 MB (2 GPUs) and 688 MB (4 GPUs) per process group on 4 A100s with
  PyTorch (NVIDIA/nccl#964), 1.06 GB per GPU on 8 H100s before any all-to-all
  (NVIDIA/nccl#1685; 4.34 GB after one). NCCL's maintainer: memory grows linearly with the
  channels, more communicators use more (NVIDIA/nccl#986). The plan counts
  `NCCL_COMMUNICATOR_BYTES` = 1.6 GB, the largest of them, per communicator (a ZeRO or DDP
  step uses one: the default process group);
- the rests of `record_stream`: a block freed on the compute stream while a side stream copies
  it (offload) is not reused until that copy ends;
- a conversion's temporary when 16-bit weights are loaded: one fp32 tensor on its way to bf16
  (0.77 GiB for the course 7B GPT's 50257 x 4096 embedding).
Rounding and fragmentation are the allocator's own: `rules.replay` predicts them from the trace.

Example:
    >>> [str(o) for o in step_overheads(gpus.gpu("H100 SXM"), world_size=8)]
"""
from __future__ import annotations

import dataclasses

from companion.allocator.rules import cublas_workspace

__all__ = ["CONTEXT_BYTES", "NCCL_BUFFSIZE", "NCCL_COMMUNICATOR_BYTES", "Overhead", "context", "conversion_temporary",
           "flash_backward_workspace", "nccl_buffers", "record_stream_backlog", "step_overheads",
           "measure_context"]

CONTEXT_BYTES = 512 * 2**20
NCCL_BUFFSIZE = 4 * 2**20
NCCL_COMMUNICATOR_BYTES = 1_600_000_000
_NCCL_SOURCE = ("measured per communicator: about 1.6 GB (NVIDIA/nccl#864), 0.54-0.69 GB on "
                "A100s (#964), 1.06 GB on 8 H100s (#1685); the largest counted")
_CONTEXT_SOURCE = ("the CUDA context with lazy loading: 274-426 MiB measured in pytorch/pytorch"
                   "#86509, #109888 and unslothai/unsloth-zoo#1053; 512 MiB counted")


@dataclasses.dataclass(frozen=True)
class Overhead:
    """One line of a plan's memory beyond its tensors: a name, bytes, and where the number comes
    from; `in_allocator`: whether PyTorch's caching allocator holds it (and a per-process cap
    counts it) or it sits outside (the context, NCCL); `alive`: when it is held: through the
    "step", only while the model is loaded ("load"), or a predicted "bound" on what a replay of
    the step measures (rounding, fragmentation), which the replay's own lines replace."""

    name: str
    bytes: int
    source: str
    in_allocator: bool = True
    alive: str = "step"

    def __post_init__(self) -> None:
        if self.alive not in ("step", "load", "bound"):
            raise ValueError(f"alive is 'step', 'load' or 'bound', got {self.alive!r}")

    def __str__(self) -> str:
        from companion.memory import format_bytes
        return f"{self.name}: {format_bytes(self.bytes)} ({self.source})"


def context(*, measured: int | None = None) -> Overhead:
    """The CUDA context: `measured` bytes (`measure_context` on a GPU), else `CONTEXT_BYTES`."""
    if measured is not None:
        return Overhead("CUDA context", int(measured), "measured on this GPU", False)
    return Overhead("CUDA context", CONTEXT_BYTES, _CONTEXT_SOURCE, False)


def measure_context(device=None) -> int:
    """Bytes this process holds on the GPU outside PyTorch's allocator: the driver's used memory
    (cudaMemGetInfo) less the allocator's reserve. Other processes on the GPU count too: measure
    on a GPU of one's own."""
    import torch
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def flash_backward_workspace(batch: int, seq_len: int, heads: int, head_dim: int, *,
                             kv_heads: int | None = None, itemsize: int = 2) -> Overhead:
    """FlashAttention-2's backward scratch (see the module docstring): fp32 dq_accum and
    softmax_d, with T rounded up to 128 and the head size to 32; with `kv_heads` fewer than
    `heads` (grouped-query attention) also dk_expanded and dv_expanded, (B, T, heads, head_dim)
    in q's dtype (`itemsize` bytes)."""
    t = -(-seq_len // 128) * 128
    d = -(-head_dim // 32) * 32
    nbytes = 4 * batch * t * heads * d + 4 * batch * heads * t
    source = "fp32 dq_accum and softmax_d of mha_bwd, flash_api.cpp"
    if kv_heads is not None and kv_heads != heads:
        nbytes += 2 * itemsize * batch * seq_len * heads * head_dim    # dk_expanded, dv_expanded
        source += f"; dk_expanded and dv_expanded ({kv_heads} key/value heads of {heads})"
    return Overhead("FlashAttention backward scratch", nbytes, source)


def nccl_buffers(world_size: int, *, communicators: int = 1) -> Overhead:
    """NCCL's memory on each GPU: `NCCL_COMMUNICATOR_BYTES` per communicator (see the module
    docstring); none on one GPU."""
    nbytes = 0 if world_size < 2 else communicators * NCCL_COMMUNICATOR_BYTES
    return Overhead("NCCL buffers", nbytes, f"{communicators} communicator(s), " + _NCCL_SOURCE,
                    False)


def record_stream_backlog(nbytes: int, what: str) -> Overhead:
    """Bytes freed on the compute stream but still read by a copy on a side stream."""
    return Overhead("record_stream backlog", int(nbytes), f"{what}, held until its copy ends")


def conversion_temporary(largest_numel: int) -> Overhead:
    """Loading 16-bit weights from fp32: the largest tensor's fp32 copy, before its cast."""
    return Overhead("fp32 conversion temporary (load)", 4 * int(largest_numel),
                    "the largest tensor in fp32 on its way to bf16", alive="load")


def step_overheads(gpu=None, *, world_size: int = 1, attention: tuple[int, ...] | None
                   = None, backlog: Overhead | None = None,
                   context_bytes: int | None = None) -> list[Overhead]:
    """The lines a CUDA step adds to its tensors: the context, cuBLAS's workspace (by the GPU's
    compute capability; Hopper's when `gpu` is None), FlashAttention's backward scratch for
    `attention` = (batch, seq_len, heads, head_dim[, kv_heads, itemsize]), NCCL's memory with
    several ranks, and a `record_stream` backlog."""
    capability = (tuple(int(x) for x in gpu.compute_capability.split(".")) if gpu is not None
                  else (9, 0))
    lines = [context(measured=context_bytes),
             Overhead("cuBLAS workspace", cublas_workspace(capability),
                      "PyTorch's default for compute capability "
                      f"{capability[0]}.{capability[1]} (CublasHandlePool.cpp)")]
    if attention is not None:
        batch, seq_len, heads, head_dim, *gqa = attention
        kv_heads, itemsize = (gqa + [None, 2])[:2] if gqa else (None, 2)
        lines.append(flash_backward_workspace(batch, seq_len, heads, head_dim,
                                              kv_heads=kv_heads, itemsize=itemsize))
    if world_size > 1:
        lines.append(nccl_buffers(world_size))
    if backlog is not None and backlog.bytes:
        lines.append(backlog)
    return lines
