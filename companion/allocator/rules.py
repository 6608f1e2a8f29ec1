"""The CUDA caching allocator's rules, modelled: what it rounds, which segment it asks the driver
for, and a replay of a step's allocations and frees through those rules (`CachingAllocator`,
`replay`), which predicts the bytes it *reserves* (live blocks, the rounding inside them, and the
free pieces it cannot hand to a larger request: fragmentation) from a step simulated on fake
tensors, before any GPU is touched.

The rules, from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x; the pools are described in the
"CUDA semantics" notes, "Memory management"):
1. every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
2. a request of at most 1 MiB (kSmallSize) is served from the small pool, a larger one from the
   large pool;
3. a free cached block of the pool is reused if one is large enough: the smallest such (best fit),
   of equal ones the lowest address (`BlockComparatorSize` orders by stream, size, then pointer);
   it is split when the rest is worth keeping (small pool: at least 512 bytes; large pool: more
   than 1 MiB), else the whole block is handed out, rest included;
4. otherwise a new segment is asked from the driver (cudaMalloc): 2 MiB for the small pool
   (kSmallBuffer), 20 MiB for a large request under 10 MiB (kLargeBuffer, kMinLargeAlloc), the
   request rounded up to 2 MiB from 10 MiB on (kRoundLarge);
5. a freed block goes back to its pool, merged with free neighbours of the same segment; segments
   are never returned to the driver, except when a cudaMalloc fails (or would pass a cap set by
   `torch.cuda.set_per_process_memory_fraction`): then every segment that is wholly free is
   released and the request tried once more; if it still fails, "CUDA out of memory".

Example:
    >>> with track("cpu") as t:                # a step simulated on fake tensors (plan.simulate)
    ...     step()
    >>> replay(t).peak_reserved                # what the allocator would hold at its peak
    >>> replay(t, cap=8 * 2**30).fits          # does the step run under a cap of 8 GiB?

`validate.replay_snapshot` replays a recorded CUDA trace through these rules: on a real training
step it makes PyTorch's 7 cudaMallocs and places all 1,935 requests at PyTorch's addresses (see
there what that trace does and does not exercise).

PyTorch's own `torch.distributed._tools.mem_tracker.MemTracker` rounds each tensor to 512 bytes
and stops there: no pools, no segments, no fragmentation.

Simplified vs PyTorch: one stream (a block freed while another stream still uses it waits for
`record_stream`'s event: the plan adds that backlog as its own line); no
`max_split_size_mb`, `roundup_power2_divisions` or `expandable_segments` (with expandable
segments the large pool grows one segment in place, and fragmentation across segments is gone);
the allocation order is the simulated step's, which matches eager PyTorch's for one step; blocks
are placed at the lowest free address of their segment, as the allocator's splitting does.
"""
from __future__ import annotations

import bisect
import dataclasses

from companion.placement import DEVICE

__all__ = ["BLOCK", "SMALL_REQUEST", "SMALL_SEGMENT", "LARGE_SEGMENT", "LARGE_REQUEST",
           "LARGE_ROUNDING", "block_bytes", "segment_bytes", "reserved_bytes", "headroom",
           "cublas_workspace", "CachingAllocator", "OutOfMemory", "Replay", "replay"]

BLOCK = 512
SMALL_REQUEST = 2**20
SMALL_SEGMENT = 2 * 2**20
LARGE_SEGMENT = 20 * 2**20
LARGE_REQUEST = 10 * 2**20
LARGE_ROUNDING = 2 * 2**20


def block_bytes(nbytes: int) -> int:
    """The block a request of `nbytes` occupies: rounded up to a multiple of 512 bytes."""
    return -(-int(nbytes) // BLOCK) * BLOCK


def segment_bytes(nbytes: int) -> int:
    """The segment the allocator asks the driver for when no cached one holds the request."""
    if nbytes <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if nbytes < LARGE_REQUEST:
        return LARGE_SEGMENT
    return -(-int(nbytes) // LARGE_ROUNDING) * LARGE_ROUNDING


def reserved_bytes(requests: list[int]) -> int:
    """Bytes of segments reserved to hold every request live at once, allocated in this order
    from an empty cache (no frees). A lower bound for a real run, whose frees fragment the cache:
    `replay` follows the frees too."""
    allocator = CachingAllocator()
    for nbytes in requests:
        allocator.malloc(nbytes)
    return allocator.reserved


def headroom(largest_request: int) -> int:
    """Bytes above the live blocks that a cap (`set_per_process_memory_fraction`) must leave: at
    worst one small segment and, when a request lies between 1 and 10 MiB, one large segment,
    each nearly empty when the next request opens it."""
    return SMALL_SEGMENT + (LARGE_SEGMENT if SMALL_REQUEST < largest_request < LARGE_REQUEST
                            else LARGE_ROUNDING if largest_request >= LARGE_REQUEST else 0)


def cublas_workspace(capability: tuple[int, int]) -> int:
    """cuBLAS's workspace, which PyTorch allocates through the caching allocator on a stream's
    first matmul and keeps: NVIDIA's cuBLAS guide (cublasSetWorkspace) recommends 4 MiB before
    Hopper and 32 MiB from Hopper (compute capability 9) on. An estimate of what PyTorch takes
    until a GPU run measures it (`CUBLAS_WORKSPACE_CONFIG` changes it)."""
    return (32 if capability[0] >= 9 else 4) * 2**20


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class OutOfMemory(Exception):
    """The modelled allocator could not find `size` bytes under its cap."""


class CachingAllocator:
    """The rules of the module docstring, on numbers: `malloc(nbytes) -> address`, `free(address)`;
    `allocated` (bytes of live blocks, rounded), `reserved` (bytes of segments) and their peaks.
    `cap`: the most bytes of segments it may hold (None: no limit); past it `malloc` raises
    `OutOfMemory` after releasing the wholly free segments, as PyTorch does.

    Addresses are made up (each new segment right after the last one) unless a subclass's
    `_segment_address` says otherwise; equal-sized free blocks go by address, as PyTorch's
    `BlockComparatorSize` orders them. `adopt_segment` takes over a segment that exists already
    (a recorded snapshot's, with its live blocks)."""

    def __init__(self, *, cap: int | None = None):
        self.cap = cap
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self._free = {"small": [], "large": []}     # sorted (size, segment, offset) per pool
        self._segments: dict[int, list[list]] = {}   # address -> blocks [offset, size, free]
        self._pool: dict[int, str] = {}
        self._live: dict[int, tuple[int, list]] = {}  # block address -> (segment, block)
        self._end = 0                                # the made-up address space's top

    def malloc(self, nbytes: int) -> int:
        """Place a request; its block's address, for `free`."""
        size = block_bytes(max(int(nbytes), 1))
        pool = "small" if size <= SMALL_REQUEST else "large"
        found = self._best_fit(pool, size)
        if found is None:
            found = self._new_segment(pool, size)
        segment, block = found
        rest = block[1] - size
        if rest >= BLOCK if pool == "small" else rest > SMALL_REQUEST:      # split (rule 3)
            blocks = self._segments[segment]
            tail = [block[0] + size, rest, True]
            blocks.insert(blocks.index(block) + 1, tail)
            bisect.insort(self._free[pool], (rest, segment, tail[0]))
            block[1] = size
        return self._hand_out(segment, block)

    def free(self, address: int) -> None:
        """Return a block to its pool, merged with free neighbours (rule 5)."""
        segment, block = self._live.pop(address)
        self.allocated -= block[1]
        blocks, pool = self._segments[segment], self._free[self._pool[segment]]
        i = blocks.index(block)
        for j in (i + 1, i - 1):                            # the next one, then the previous
            if 0 <= j < len(blocks) and blocks[j][2]:
                other = blocks[j]
                pool.remove((other[1], segment, other[0]))
                block[0], block[1] = min(block[0], other[0]), block[1] + other[1]
                blocks.remove(other)
        block[2] = True
        bisect.insort(pool, (block[1], segment, block[0]))

    def release_cached(self) -> list[int]:
        """Give every wholly free segment back to the driver (what a failed cudaMalloc and
        `torch.cuda.empty_cache` do); the addresses of those released."""
        released = [seg for seg, blocks in self._segments.items()
                    if len(blocks) == 1 and blocks[0][2]]
        for segment in released:
            self._free[self._pool[segment]].remove((self._segments[segment][0][1], segment, 0))
            self.reserved -= self._segments[segment][0][1]
            del self._segments[segment], self._pool[segment]
        return released

    def adopt_segment(self, address: int, nbytes: int, *, small: bool,
                      live: list[tuple[int, int]] = ()) -> list[int]:
        """Hold a segment made before this allocator started: `live` blocks as (address, bytes),
        each freed later by its address; the gaps between them are free blocks. Returns the
        live blocks' addresses."""
        pool, blocks, at = "small" if small else "large", [], address
        for start, size in sorted(live) + [(address + nbytes, 0)]:
            if start > at:
                blocks.append([at - address, start - at, True])
                bisect.insort(self._free[pool], (start - at, address, at - address))
            if size:
                blocks.append([start - address, size, False])
            at = start + size
        self._add_segment(address, nbytes, pool, blocks)
        return [self._hand_out(address, block) for block in blocks if not block[2]]

    def segments(self) -> dict[int, list[tuple[int, int, bool]]]:
        """Each segment's address -> its blocks as (address, bytes, free), in address order."""
        return {seg: [(seg + b[0], b[1], b[2]) for b in blocks]
                for seg, blocks in sorted(self._segments.items())}

    def _hand_out(self, segment: int, block: list) -> int:
        block[2] = False
        self._live[segment + block[0]] = (segment, block)
        self.allocated += block[1]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return segment + block[0]

    def _best_fit(self, pool: str, size: int):
        free = self._free[pool]
        i = bisect.bisect_left(free, (size, -1, -1))
        if i == len(free):
            return None
        _, segment, offset = free.pop(i)
        block = next(b for b in self._segments[segment] if b[0] == offset)
        return segment, block

    def _segment_address(self, nbytes: int) -> int:
        """Where a new segment of `nbytes` lies: right after the highest one so far."""
        return self._end

    def _new_segment(self, pool: str, size: int):
        nbytes = segment_bytes(size)
        if self.cap is not None and self.reserved + nbytes > self.cap:
            self.release_cached()
            if self.reserved + nbytes > self.cap:
                raise OutOfMemory(f"a new {_mib(nbytes)} segment with {_mib(self.reserved)} "
                                  f"reserved ({_mib(self.allocated)} allocated) would pass the "
                                  f"cap of {_mib(self.cap)}")
        segment, block = self._segment_address(nbytes), [0, nbytes, True]
        self._add_segment(segment, nbytes, pool, [block])
        return segment, block

    def _add_segment(self, address: int, nbytes: int, pool: str, blocks: list[list]) -> None:
        self._segments[address], self._pool[address] = blocks, pool
        self._end = max(self._end, address + nbytes)
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the modelled allocator made of a step's trace."""

    peak_tensors: int        # the ledger's peak: bytes of live tensors, unrounded
    peak_allocated: int      # bytes of live blocks at their peak (rounded to 512)
    peak_reserved: int       # bytes of segments at their peak: what the step takes from the GPU
    fits: bool               # False: the step ran out of memory under the cap
    failed_at: str = ""      # the failing request, when it did not fit

    @property
    def rounding(self) -> int:
        """Bytes the 512-byte blocks add to the tensors at the peak."""
        return self.peak_allocated - self.peak_tensors

    @property
    def fragmentation(self) -> int:
        """Bytes of segments reserved beyond the live blocks at the peak: free pieces too small
        (or in the wrong pool) for the requests that came, and the unsplit rests of blocks."""
        return self.peak_reserved - self.peak_allocated


def replay(tracker, *, cap: int | None = None) -> Replay:
    """Replay the device allocations and frees a `companion.memory.track` block recorded (a step
    simulated on fake tensors, or run for real on the CPU) through `CachingAllocator`, in their
    order; `cap` as `set_per_process_memory_fraction` would set it."""
    ledger = tracker._ledger
    allocator = CachingAllocator(cap=cap)
    handles: dict[int, int] = {}                           # storage id -> its block
    sizes: dict[int, int] = {}
    for sid, delta in zip(ledger.ev_id, ledger.ev_delta):
        if ledger.where[sid] != DEVICE:                    # host memory: not the GPU's
            continue
        try:
            if sid in handles:                             # freed, or resized: free it first
                allocator.free(handles.pop(sid))
            sizes[sid] = sizes.get(sid, 0) + delta
            if sizes[sid] > 0:                             # a new storage, or the resized one
                handles[sid] = allocator.malloc(sizes[sid])
        except OutOfMemory as e:
            return Replay(tracker.peak, allocator.peak_allocated, allocator.peak_reserved,
                          False, str(e))
    return Replay(tracker.peak, allocator.peak_allocated, allocator.peak_reserved, True)
