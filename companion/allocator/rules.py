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

The settings of PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.8), modelled by
`AllocatorConfig` from the same source file and the "CUDA semantics" notes:
- `expandable_segments:True`: each pool holds one segment that grows in place, mapped in pages of
  2 MiB (small pool) or 20 MiB (large pool), so a request that fits nowhere extends the free block
  at the end instead of asking for a new segment; every block is split when 512 bytes or more
  remain;
- `max_split_size_mb:N`: blocks of N MiB or more ("oversize") are never split, are not handed to
  a request under N MiB, and go to a larger request only if they exceed it by less than 20 MiB;
- `roundup_power2_divisions:D`: a request is rounded up to the next of D equal steps between two
  powers of two (not to 512 bytes) once it exceeds 512·D bytes;
- `garbage_collection_threshold:t` (with a cap): before asking for a new segment when more than
  t of the cap is reserved, the wholly free large segments at least as old as their average age
  (counted in requests to the large pool since each was freed) are released, in passes, until
  the reserve is under t of the cap; a pass is never stopped halfway.
`backend:cudaMallocAsync` replaces this allocator with CUDA's own stream-ordered pool: not modelled.

Simplified vs PyTorch: one stream (a block freed while another stream still uses it waits for
`record_stream`'s event: the plan adds that backlog as its own line); a cudaMalloc that fails
(passes the cap) first releases oversize free segments when `max_split_size_mb` is set, then
every wholly free segment, counting one retry, as PyTorch does; an expandable segment only unmaps
pages at its end (PyTorch also unmaps whole pages inside
free blocks); the allocation order is the simulated step's, which matches eager PyTorch's for one
step; blocks are placed at the lowest free address of their segment, as the allocator's splitting
does. The counters follow `torch.cuda.memory_stats()`'s names (`Stats`).
"""
from __future__ import annotations

import bisect
import dataclasses
import math

from companion.placement import DEVICE

__all__ = ["BLOCK", "SMALL_REQUEST", "SMALL_SEGMENT", "LARGE_SEGMENT", "LARGE_REQUEST",
           "LARGE_ROUNDING", "CUBLAS_DEFAULT", "CUBLAS_LARGE", "block_bytes", "segment_bytes",
           "reserved_bytes", "headroom", "cublas_workspace", "AllocatorConfig",
           "CachingAllocator", "OutOfMemory", "Replay", "replay"]

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


CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8       # ":4096:2:16:8": 8,519,680 bytes
CUBLAS_LARGE = 4096 * 8 * 1024                           # 32 MiB


def cublas_workspace(capability: tuple[int, int], *, config: str | None = None,
                     since: str = "2026-07") -> int:
    """The bytes of cuBLAS's workspace that PyTorch allocates through the caching allocator:
    `parseChosenWorkspaceSize` in aten/src/ATen/cuda/CublasHandlePool.cpp. `capability`: the
    card's (major, minor) compute capability. Its lifetime changed: until August 2026 one was
    allocated per (handle, stream) on that stream's first matmul and kept (the cuBLASLt workspace
    unified into it); from pytorch/pytorch#194311 on, each matmul allocates it and frees it back to
    the cache when done, unless TORCH_CUBLAS_WORKSPACE_CACHE=1. Either way a matmul at a step's
    peak holds it.

    By default ":4096:2:16:8", two 4,096 KiB pieces and eight 16 KiB ones: 8,519,680 bytes
    (8.125 MiB; NVIDIA's cuBLAS guide recommends at least 4 MiB, cublasSetWorkspace), and 32 MiB
    on the cards the source names, which changed over time (`since`, the source's date, any
    "YYYY-MM" from 2022-11 on):
    "2022-11" only compute capability 9.0 (pytorch/pytorch#89027, PyTorch 2.0 on); "2026-02"
    majors 9, 10 and 12 (#175344, Hopper and Blackwell); "2026-07" majors 9 to 12 (#189312,
    adding Thor's 11.0). `config`: the CUBLAS_WORKSPACE_CONFIG environment variable, whose
    ":SIZE_KIB:COUNT" pairs add up as PyTorch adds them (`:4096:8` is 32 MiB)."""
    if (not isinstance(capability, (tuple, list)) or len(capability) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                       for x in capability)):
        raise ValueError(f"capability is (major, minor) as two integers, as "
                         f"torch.cuda.get_device_capability() returns it; got {capability!r}")
    if config is not None:
        import re
        pairs = re.findall(r":([0-9]+):([0-9]+)", str(config))
        if pairs:
            total = sum(int(size) * 1024 * int(count) for size, count in pairs)
            if any(int(x) >= 2**64 for pair in pairs for x in pair) or total >= 2**64:
                raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {config!r} asks for more bytes than "
                                 "PyTorch can read (its sizes are 64-bit)")
            return total
    large = {"2022-11": lambda major, minor: (major, minor) == (9, 0),
             "2026-02": lambda major, minor: major in (9, 10, 12),
             "2026-07": lambda major, minor: 9 <= major <= 12}
    import re
    if not isinstance(since, str) or not re.fullmatch(r"\d{4}-\d{2}", since) or since < "2022-11":
        raise ValueError(f"since is the source's date as 'YYYY-MM', from 2022-11 (PyTorch 2.0) on, "
                         f"got {since!r}")
    era = max(date for date in large if date <= since)
    return CUBLAS_LARGE if large[era](*capability) else CUBLAS_DEFAULT


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class OutOfMemory(Exception):
    """The modelled allocator could not find `size` bytes under its cap."""


_SETTINGS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
             "garbage_collection_threshold")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings the model follows (module docstring), as PYTORCH_ALLOC_CONF spells
    them; `AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:128")` reads that
    string. None: the setting left at PyTorch's default."""

    expandable_segments: bool = False
    max_split_size_mb: int | None = None
    roundup_power2_divisions: int | None = None
    garbage_collection_threshold: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.expandable_segments, bool):
            raise ValueError(f"expandable_segments is True or False, got "
                             f"{self.expandable_segments!r}")
        m = self.max_split_size_mb
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m <= 20):
            raise ValueError(f"max_split_size_mb is a whole number of MiB above 20 (PyTorch "
                             f"refuses smaller ones), got {m!r}")
        d = self.roundup_power2_divisions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1
                              or d & (d - 1)):
            raise ValueError(f"roundup_power2_divisions is a power of two (1, 2, 4, 8, ...), "
                             f"got {d!r}")
        t = self.garbage_collection_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0.0 < t < 1.0):
            raise ValueError(f"garbage_collection_threshold is a fraction of the cap between "
                             f"0 and 1 (exclusive), got {t!r}")

    @classmethod
    def parse(cls, text: str) -> "AllocatorConfig":
        """Read a PYTORCH_ALLOC_CONF string: comma-separated `key:value` pairs."""
        if not isinstance(text, str):
            raise ValueError(f"the settings are a string like 'expandable_segments:True', got "
                             f"{type(text).__name__}")
        found: dict = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "backend":
                if value == "native":
                    continue
                raise ValueError(f"backend:{value} replaces PyTorch's caching allocator (with "
                                 "cudaMallocAsync, CUDA's own stream-ordered pool): not modelled")
            try:
                if key == "expandable_segments":
                    if value not in ("True", "False"):
                        raise ValueError
                    found[key] = value == "True"
                elif key == "roundup_power2_divisions" and value.startswith("["):
                    raise ValueError(f"roundup_power2_divisions as a list per size, {value}..., "
                                     "is PyTorch's too, but the model takes one number for all "
                                     "sizes")
                elif key in ("max_split_size_mb", "roundup_power2_divisions"):
                    found[key] = int(value)
                elif key == "garbage_collection_threshold":
                    found[key] = float(value)
                else:
                    raise KeyError(key)
            except KeyError:
                raise ValueError(f"{key!r} is not a setting the model follows; it knows "
                                 f"{', '.join(_SETTINGS)} and backend") from None
            except ValueError as e:
                if "model takes one number" in str(e):
                    raise
                raise ValueError(f"cannot read {item!r}: expected {key}:<value>") from None
        return cls(**found)


def _next_division(size: int, divisions: int) -> int:
    """`size` rounded up to the next of `divisions` equal steps between its two powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    lower = size & ~(step - 1)
    return size if lower == size else lower + step


_STAT_NAMES = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
_EXPANDABLE_AT = {"small": 1 << 50, "large": 1 << 51}     # made-up: far from each other


class CachingAllocator:
    """The rules of the module docstring, on numbers: `malloc(nbytes) -> address`, `free(address)`;
    `allocated` (bytes of live blocks, rounded), `reserved` (bytes of segments) and their peaks.
    `cap`: the most bytes of segments it may hold (None: no limit); past it `malloc` raises
    `OutOfMemory` after releasing the wholly free segments, as PyTorch does. `config`: an
    `AllocatorConfig` or a PYTORCH_ALLOC_CONF string (None: PyTorch's defaults). `memory_stats()`
    reads its counters under `torch.cuda.memory_stats()`'s names.

    Addresses are made up (each new segment right after the last one) unless a subclass's
    `_segment_address` says otherwise; equal-sized free blocks go by address, as PyTorch's
    `BlockComparatorSize` orders them. `adopt_segment` takes over a segment that exists already
    (a recorded snapshot's, with its live blocks)."""

    def __init__(self, *, cap: int | None = None, config: AllocatorConfig | str | None = None):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not math.isfinite(cap) or cap < 0):
            raise ValueError(f"cap is a number of bytes, 0 or more (or None: no cap), got "
                             f"{cap!r}")
        self.cap = cap
        if isinstance(config, str):
            config = AllocatorConfig.parse(config)
        if config is not None and not isinstance(config, AllocatorConfig):
            raise ValueError(f"config is an AllocatorConfig or a PYTORCH_ALLOC_CONF string, got "
                             f"{type(config).__name__}")
        self.config = config or AllocatorConfig()
        if self.config.garbage_collection_threshold is not None and cap is None:
            raise ValueError("garbage_collection_threshold is a fraction of a cap "
                             "(set_per_process_memory_fraction): give the cap too")
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.stats = dict.fromkeys(_STAT_NAMES, 0)
        self._free = {"small": [], "large": []}     # sorted (size, segment, offset) per pool
        self._segments: dict[int, list[list]] = {}   # address -> blocks [offset, size, free]
        self._pool: dict[int, str] = {}
        self._live: dict[int, tuple[int, list]] = {}  # block address -> (segment, block)
        self._end = 0                                # the made-up address space's top
        self._unused: dict[int, int] = {}            # wholly free segment -> when it became so
        self._pool_requests = {"small": 0, "large": 0}   # requests per pool: the clock of `_unused`
        self._expandable: dict[str, int] = {}        # pool -> its one growing segment

    @property
    def max_split(self) -> float:
        """Bytes from which a block is "oversize" (never split); infinite by default."""
        m = self.config.max_split_size_mb
        return float("inf") if m is None else m * 2**20

    def round(self, nbytes: int) -> int:
        """The block a request occupies: 512-byte multiples, or `roundup_power2_divisions`."""
        size = max(int(nbytes), 1)
        d = self.config.roundup_power2_divisions
        if d is not None and d > 1 and size > BLOCK * d:
            return _next_division(size, d)
        return block_bytes(size)

    def malloc(self, nbytes: int) -> int:
        """Place a request; its block's address, for `free`."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"a request is a whole number of bytes, 0 or more, got {nbytes!r}")
        size = self.round(nbytes)
        pool = "small" if size <= SMALL_REQUEST else "large"
        self._pool_requests[pool] += 1
        found = self._best_fit(pool, size)
        if found is None:
            if self.config.garbage_collection_threshold is not None:
                self._collect()
            found = (self._grow(pool, size) if self.config.expandable_segments
                     else self._new_segment(pool, size))
        segment, block = found
        rest = block[1] - size
        if self._splits(pool, size, rest):                                   # rule 3
            blocks = self._segments[segment]
            tail = [block[0] + size, rest, True]
            blocks.insert(blocks.index(block) + 1, tail)
            bisect.insort(self._free[pool], (rest, segment, tail[0]))
            block[1] = size
        self._unused.pop(segment, None)
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
        if len(blocks) == 1:
            self._unused[segment] = self._pool_requests[self._pool[segment]]

    def release_cached(self) -> list[int]:
        """Give every wholly free segment back to the driver (what a failed cudaMalloc and
        `torch.cuda.empty_cache` do), and unmap the whole pages at the free end of an expandable
        segment; the addresses of the segments released or shrunk."""
        released = [seg for seg, blocks in self._segments.items()
                    if len(blocks) == 1 and blocks[0][2] and seg not in _EXPANDABLE_AT.values()]
        for segment in released:
            self._release(segment)
        for pool, segment in self._expandable.items():
            if self._unmap_tail(pool, segment):
                released.append(segment)
        return released

    def memory_stats(self) -> dict[str, int]:
        """The counters `torch.cuda.memory_stats()` reports under the same names: bytes allocated
        and reserved (current and peak), `inactive_split_bytes` (free blocks inside segments that
        also hold live ones: fragmentation no release can return), and the counts
        `num_device_alloc` / `num_device_free` (cudaMalloc and cudaFree, or a segment's pages
        mapped and unmapped), `num_alloc_retries` (a failed cudaMalloc: cached segments released
        and tried again) and `num_ooms` (out of memory raised)."""
        split_free = sum(b[1] for blocks in self._segments.values() if len(blocks) > 1
                         for b in blocks if b[2])
        return {"allocated_bytes.all.current": self.allocated,
                "allocated_bytes.all.peak": self.peak_allocated,
                "reserved_bytes.all.current": self.reserved,
                "reserved_bytes.all.peak": self.peak_reserved,
                "inactive_split_bytes.all.current": split_free, **self.stats}

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

    def _splits(self, pool: str, size: int, rest: int) -> bool:
        if pool == "small" or self.config.expandable_segments:
            return rest >= BLOCK
        return size < self.max_split and rest > SMALL_REQUEST

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
        found = free[i][0]
        if size < self.max_split <= found:               # no oversize block for a smaller one
            return None
        if size >= self.max_split and found >= size + LARGE_SEGMENT:
            return None
        _, segment, offset = free.pop(i)
        block = next(b for b in self._segments[segment] if b[0] == offset)
        return segment, block

    def _segment_address(self, nbytes: int) -> int:
        """Where a new segment of `nbytes` lies: right after the highest one so far."""
        return self._end

    def _over_cap(self, nbytes: int, size: int) -> bool:
        """Whether `nbytes` more would pass the cap even after releasing what is cached, as
        PyTorch does when a cudaMalloc fails: with `max_split_size_mb` set, first the smallest
        oversize free segment of at least `size` bytes (or the largest ones until `size` is
        freed), without counting a retry; then every wholly free segment, counted in
        `num_alloc_retries`."""
        if self.cap is None or self.reserved + nbytes <= self.cap:
            return False
        if self._release_oversize(size) and self.reserved + nbytes <= self.cap:
            return False
        self.stats["num_alloc_retries"] += 1
        self.release_cached()
        return self.reserved + nbytes > self.cap

    def _release_oversize(self, size: int) -> bool:
        if self.max_split == float("inf") or size <= SMALL_REQUEST:   # the request's own pool:
            return False                                   # the small one holds no oversize block
        oversize = sorted((blocks[0][1], seg) for seg, blocks in self._segments.items()
                          if len(blocks) == 1 and blocks[0][2] and blocks[0][1] >= self.max_split
                          and self._pool[seg] == "large" and seg not in _EXPANDABLE_AT.values())
        enough = [seg for n, seg in oversize if n >= max(size, self.max_split)]
        if enough:
            self._release(enough[0])
            return True
        freed = 0
        for n, seg in reversed(oversize):
            if freed >= size:
                break
            self._release(seg)
            freed += n
        return freed >= size

    def _oom(self, what: str) -> OutOfMemory:
        self.stats["num_ooms"] += 1
        return OutOfMemory(f"{what} with {_mib(self.reserved)} reserved ({_mib(self.allocated)} "
                           f"allocated) would pass the cap of {_mib(self.cap)}")

    def _new_segment(self, pool: str, size: int):
        nbytes = segment_bytes(size)
        if self._over_cap(nbytes, size):
            raise self._oom(f"a new {_mib(nbytes)} segment")
        segment, block = self._segment_address(nbytes), [0, nbytes, True]
        self._add_segment(segment, nbytes, pool, [block])
        self.stats["num_device_alloc"] += 1
        return segment, block

    def _grow(self, pool: str, size: int):
        """Expandable segments: map pages at the end of the pool's one segment, joined to a free
        block already there, until the request fits."""
        page = SMALL_SEGMENT if pool == "small" else LARGE_SEGMENT
        segment = self._expandable.get(pool)
        if segment is None:
            segment = self._expandable[pool] = _EXPANDABLE_AT[pool]
            self._segments[segment], self._pool[segment] = [], pool
        # PyTorch tests the whole request's segment size against the cap (alloc_block), not the
        # pages still to map
        if self._over_cap(segment_bytes(size), size):
            raise self._oom(f"a request of {_mib(size)}")
        blocks = self._segments[segment]
        have = blocks[-1][1] if blocks and blocks[-1][2] else 0
        need = -(-(size - have) // page) * page
        if have:
            tail = blocks[-1]
            self._free[pool].remove((tail[1], segment, tail[0]))
            tail[1] += need
        else:
            tail = [sum(b[1] for b in blocks), need, True]
            blocks.append(tail)
        self.reserved += need
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.stats["num_device_alloc"] += 1
        return segment, tail

    def _unmap_tail(self, pool: str, segment: int) -> int:
        """Unmap the whole pages inside the free block at an expandable segment's end."""
        blocks = self._segments[segment]
        if not blocks or not blocks[-1][2]:
            return 0
        page = SMALL_SEGMENT if pool == "small" else LARGE_SEGMENT
        tail = blocks[-1]
        first_page = -(-tail[0] // page) * page
        gone = tail[0] + tail[1] - first_page
        if gone <= 0:
            return 0
        self._free[pool].remove((tail[1], segment, tail[0]))
        tail[1] -= gone
        if tail[1]:
            bisect.insort(self._free[pool], (tail[1], segment, tail[0]))
        else:
            blocks.pop()
        self.reserved -= gone
        self.stats["num_device_free"] += 1
        return gone

    def _release(self, segment: int) -> None:
        self._free[self._pool[segment]].remove((self._segments[segment][0][1], segment, 0))
        self.reserved -= self._segments[segment][0][1]
        del self._segments[segment], self._pool[segment]
        self._unused.pop(segment, None)
        self.stats["num_device_free"] += 1

    def _collect(self) -> None:
        """garbage_collection_threshold: past that share of the cap, release the wholly free large
        segments at least as old as their mean age, pass after pass, until the reserve is back
        under it (`garbage_collect_cached_blocks`: a pass is not stopped at the target)."""
        limit = self.config.garbage_collection_threshold * self.cap
        if self.reserved <= limit:
            return
        target, reclaimed = self.reserved - limit, 0
        clock = self._pool_requests["large"]
        while reclaimed < target:
            ages = {seg: clock - at for seg, at in self._unused.items()
                    if self._pool[seg] == "large" and seg not in _EXPANDABLE_AT.values()}
            if not ages:
                return
            mean = sum(ages.values()) / len(ages)
            for segment, age in ages.items():
                if age >= mean:
                    reclaimed += self._segments[segment][0][1]
                    self._release(segment)

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
    stats: dict = dataclasses.field(default_factory=dict, compare=False)  # memory_stats() at the end
    layout: dict = dataclasses.field(default_factory=dict, compare=False)  # segments() at the peak

    @property
    def rounding(self) -> int:
        """Bytes the 512-byte blocks add to the tensors at the peak."""
        return self.peak_allocated - self.peak_tensors

    @property
    def fragmentation(self) -> int:
        """Bytes of segments reserved beyond the live blocks at the peak: free pieces too small
        (or in the wrong pool) for the requests that came, and the unsplit rests of blocks."""
        return self.peak_reserved - self.peak_allocated


def replay(tracker, *, cap: int | None = None,
           config: AllocatorConfig | str | None = None) -> Replay:
    """Replay the device allocations and frees a `companion.memory.track` block recorded (a step
    simulated on fake tensors, or run for real on the CPU) through `CachingAllocator`, in their
    order; `cap` as `set_per_process_memory_fraction` would set it; `config` the allocator's
    settings (`AllocatorConfig`, or a PYTORCH_ALLOC_CONF string). `layout` holds the segments
    and their blocks when the reserve reached its peak."""
    ledger = tracker._ledger
    allocator = CachingAllocator(cap=cap, config=config)
    handles: dict[int, int] = {}                           # storage id -> its block
    sizes: dict[int, int] = {}
    layout, highest = {}, -1
    for sid, delta in zip(ledger.ev_id, ledger.ev_delta):
        if ledger.where[sid] != DEVICE:                    # host memory: not the GPU's
            continue
        try:
            if sid in handles:                             # freed, or resized: free it first
                allocator.free(handles.pop(sid))
            sizes[sid] = sizes.get(sid, 0) + delta
            if sizes[sid] > 0:                             # a new storage, or the resized one
                handles[sid] = allocator.malloc(sizes[sid])
                if allocator.reserved > highest:
                    highest, layout = allocator.reserved, allocator.segments()
        except OutOfMemory as e:
            return Replay(tracker.peak, allocator.peak_allocated, allocator.peak_reserved,
                          False, str(e), allocator.memory_stats(), layout)
    return Replay(tracker.peak, allocator.peak_allocated, allocator.peak_reserved, True, "",
                  allocator.memory_stats(), layout)
