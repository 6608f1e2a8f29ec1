"""The CUDA caching allocator's behaviour, the one place the course models it.

`rules`: its rounding and segments, and a replay of a step's allocations through them (what a
step reserves, fragmentation included, predicted from a simulated step). `overheads`: what a GPU
holds beyond the tensors a step makes (the CUDA context, cuBLAS's and attention's workspaces,
NCCL's memory, a conversion's temporary, `record_stream`'s backlog), each with its source.
`snapshot`: reading a real run's memory snapshot (`torch.cuda.memory._snapshot`). `validate`:
that snapshot's trace replayed through `rules`, each cudaMalloc set beside PyTorch's.
"""
from companion.allocator.overheads import (CONTEXT_BYTES, NCCL_BUFFSIZE,
                                           NCCL_COMMUNICATOR_BYTES, Overhead, context,
                                           conversion_temporary, measure_context,
                                           flash_backward_workspace, nccl_buffers,
                                           record_stream_backlog, step_overheads)
from companion.allocator.rules import (BLOCK, CUBLAS_DEFAULT, CUBLAS_LARGE, LARGE_REQUEST,
                                       LARGE_ROUNDING, LARGE_SEGMENT, AllocatorConfig,
                                       SMALL_REQUEST, SMALL_SEGMENT, CachingAllocator, OutOfMemory,
                                       Replay, block_bytes, cublas_workspace, headroom, replay,
                                       reserved_bytes, segment_bytes)
from companion.allocator.snapshot import (growing_batches, growing_batches_trace, snapshot_report,
                                          snapshot_timeline)
from companion.allocator.validate import (SegmentEvent, SnapshotReplay, format_replay,
                                          replay_snapshot)

__all__ = ["snapshot_report", "snapshot_timeline", "growing_batches", "growing_batches_trace",
           "replay_snapshot",
           "format_replay", "SnapshotReplay", "SegmentEvent", "block_bytes", "segment_bytes",
           "reserved_bytes", "headroom", "cublas_workspace", "CUBLAS_DEFAULT", "CUBLAS_LARGE",
           "AllocatorConfig", "CachingAllocator", "OutOfMemory",
           "Replay", "replay", "Overhead", "CONTEXT_BYTES", "context", "conversion_temporary",
           "flash_backward_workspace", "nccl_buffers", "record_stream_backlog", "step_overheads",
           "measure_context", "NCCL_BUFFSIZE", "NCCL_COMMUNICATOR_BYTES", "BLOCK", "SMALL_REQUEST", "SMALL_SEGMENT",
           "LARGE_SEGMENT", "LARGE_REQUEST", "LARGE_ROUNDING"]
