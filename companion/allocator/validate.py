"""The modelled allocator (`rules.CachingAllocator`) checked against a real one: a recorded CUDA
memory snapshot's trace replayed request by request, and what the model does set beside what
PyTorch did.

A snapshot (`torch.cuda.memory._record_memory_history()`, then `_snapshot()` or
`_dump_snapshot(path)`) holds the allocator's segments at the end and, per device, a trace of
events: "alloc" (addr, size: the bytes asked for), "free_requested" and "free_completed" (the
block is back in the cache), "segment_alloc" and "segment_free" (a cudaMalloc and a cudaFree,
size: the segment's bytes). `replay_snapshot` feeds each "alloc" to the model and each
"free_completed" as a free of the block at that address, and compares three things:
1. every cudaMalloc: a recorded "segment_alloc" is matched when the model makes a segment of the
   same size for the same request (the "alloc" that follows it in the trace);
2. the bytes reserved after every event but a "segment_alloc" (PyTorch records it just before the
   request it serves; the model makes its segment within that request): the model's against the
   recorded ones (the segments when the trace began, plus each "segment_alloc", less each
   "segment_free");
3. the end: the model's segments (sizes) against `snapshot["segments"]`.
It also counts the requests the model places at the address PyTorch gave them: the best-fit and
splitting rules followed block by block, not only in total.

A trace starts after the run did (recording was switched on late, or the ring buffer of
`max_entries` dropped its head), so the model is first given the state the allocator was in when
the trace began, worked out backwards from the end: the segments at the end less those the trace
makes, plus those it frees without making; in them, as live blocks, those live at the end that no
event touches (their size read from the end) and those whose first event is a free (their size
the request rounded to 512 B: a block handed out whole, with its unsplit rest, is not seen). The
gaps between them are free. The model's own segments get the recorded segment's address when it
makes the same one, else one above every recorded address.

Checked on a recorded training step (github.com/JasperSolt/EoR_NN, file snapshot.pickle, made with
`_record_memory_history` and `_dump_snapshot`; not shipped here): 5,803 events on one stream,
1,935 requests of 32 sizes from 1 B to 8.1 MiB, 3 segments (24 MiB, 31 live blocks) before the
trace began, 7 made in it, none freed. The model makes the 7 recorded segments (5 of 20 MiB, 2 of
2 MiB), each for the same request, and no other; it places 1,935 of 1,935 requests at PyTorch's
address; reserved is the same after every request and free (peak 128 MiB both); the 10 segments
at the end match by size, with the same live blocks. What that trace tests: the 20 MiB segments
of 1 to 10 MiB requests (giving each its own 2 MiB-rounded segment matches 2 of 7), merging
(without it 42 of 1,935 are placed alike), best fit (first fit: 18) and its ties by address (by
segment age, as the model had them: 1,773, since the driver handed the second segment a lower
address). Started empty instead of from the recovered state, 2 of 7 match. What it does not
test: no request reaches 10 MiB (rounding to 2 MiB), the large pool's split threshold changes
no placement (splitting every rest places all alike too), nothing is released, one stream.

Example:
    >>> import pickle
    >>> found = replay_snapshot(pickle.load(open("snapshot.pickle", "rb")))
    >>> print(format_replay(found))

Simplified vs PyTorch: one stream (PyTorch caches a freed block for its own stream only: a trace
on several streams is replayed as if it had one, and `streams` says how many it had); no
`max_split_size_mb`, `roundup_power2_divisions`, `garbage_collection_threshold` or expandable
segments (their "segment_map" events are counted in reserved, not modelled); a run of
"segment_free" events is replayed as `release_cached` (what `empty_cache` and a failed cudaMalloc
do), since the model knows neither the call nor the cap.
"""
from __future__ import annotations

import dataclasses

from companion.allocator.rules import SMALL_SEGMENT, CachingAllocator, block_bytes

__all__ = ["SegmentEvent", "SnapshotReplay", "replay_snapshot", "format_replay"]

_FREE_ACTIONS = ("free_requested", "free_completed")
_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclasses.dataclass(frozen=True)
class SegmentEvent:
    """A request for which PyTorch or the model (or both) made a segment."""

    event: int                    # the request's index in the trace
    request: int                  # bytes asked for
    recorded: int | None          # the segment PyTorch made for it (None: none)
    modelled: int | None          # the segment the model made for it

    @property
    def matched(self) -> bool:
        return self.recorded == self.modelled


@dataclasses.dataclass(frozen=True)
class SnapshotReplay:
    """A recorded trace replayed through the model: `replay_snapshot`'s answer."""

    requests: int                 # "alloc" events replayed
    streams: int                  # streams in the trace (the model has one)
    start_segments: list[int]     # sizes of the segments that existed when the trace began
    start_live: int               # blocks live when the trace began, given to the model
    segment_events: list[SegmentEvent]
    placed_same: int              # requests the model put at PyTorch's address
    reserved_at: list[int]        # the events after which reserved is compared: all but
    reserved_recorded: list[int]  # cudaMallocs (the model's comes with the request that follows)
    reserved_modelled: list[int]  # bytes of segments after each of those events
    end_recorded: list[int]       # segment sizes at the end, sorted
    end_modelled: list[int]
    end_blocks_same: bool         # the same live blocks (address, bytes) at the end
    unmatched_frees: int = 0      # frees of a block neither the trace nor the start state holds
    expandable: bool = False      # the trace maps expandable segments: not modelled

    @property
    def segment_allocs(self) -> int:
        """cudaMallocs in the trace."""
        return sum(e.recorded is not None for e in self.segment_events)

    @property
    def matched(self) -> int:
        """Recorded cudaMallocs the model makes too: same size, same request."""
        return sum(e.matched for e in self.segment_events)

    @property
    def disagreements(self) -> list[SegmentEvent]:
        return [e for e in self.segment_events if not e.matched]

    @property
    def first_reserved_difference(self) -> int | None:
        """The first event after which the model reserves other bytes than PyTorch did."""
        pairs = zip(self.reserved_at, self.reserved_recorded, self.reserved_modelled)
        return next((i for i, r, m in pairs if r != m), None)

    @property
    def agrees(self) -> bool:
        """Every cudaMalloc matched, none extra, reserved the same throughout and at the end."""
        return (not self.disagreements and self.first_reserved_difference is None
                and self.end_recorded == self.end_modelled)


class _Following(CachingAllocator):
    """The model, placing a new segment where PyTorch put its one when both make the same."""

    def __init__(self, top: int):
        super().__init__()
        self._end = top                     # made-up addresses: above every recorded one
        self.recorded: list[tuple[int, int]] = []   # (address, bytes) made before this request
        self.made: list[int] = []

    def _segment_address(self, nbytes: int) -> int:
        self.made.append(nbytes)
        same = [addr for addr, size in self.recorded if size == nbytes]
        return same[0] if same else self._end


def _start_state(snapshot: dict, trace: list[dict], device: int):
    """(segments as (address, bytes, small), live blocks as (address, bytes)) when the trace
    began, worked out backwards from the end (module docstring)."""
    seen_segments: dict[int, tuple[str, int]] = {}      # address -> its first event, bytes
    seen_blocks: set[int] = set()
    live: dict[int, int] = {}
    for e in trace:
        if e["action"] in _RESERVE:
            seen_segments.setdefault(e["addr"], (e["action"], e["size"]))
        elif e["action"] == "alloc" or e["action"] in _FREE_ACTIONS:
            if e["addr"] not in seen_blocks and e["action"] != "alloc":
                live[e["addr"]] = block_bytes(e["size"])     # allocated before the trace
            seen_blocks.add(e["addr"])
    end = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    segments = [(s["address"], s["total_size"], s.get("segment_type", "small" if
                 s["total_size"] <= SMALL_SEGMENT else "large") == "small") for s in end
                if seen_segments.get(s["address"], ("",))[0] != "segment_alloc"]
    segments += [(addr, size, size <= SMALL_SEGMENT) for addr, (first, size)
                 in seen_segments.items() if first == "segment_free"]
    live.update((b["address"], b["size"]) for s in end for b in s.get("blocks", [])
                if b["state"] == "active_allocated" and b["address"] not in seen_blocks)
    return segments, live


def _seed(model: CachingAllocator, segments, live: dict[int, int]) -> dict[int, int]:
    """Give the model the start state; recorded address -> the model's block, for frees."""
    handles = {}
    for address, nbytes, small in segments:
        inside = [(a, n) for a, n in live.items() if address <= a < address + nbytes]
        handles.update((a, a) for a in model.adopt_segment(address, nbytes, small=small,
                                                           live=inside))
    return handles


def replay_snapshot(snapshot: dict, *, device: int = 0) -> SnapshotReplay:
    """Replay the trace of `device` in a snapshot (`torch.cuda.memory._snapshot()`, or a pickle
    that `_dump_snapshot` wrote, loaded) through `rules.CachingAllocator`, from the state the
    allocator was in when the trace began, and set what the model does beside what PyTorch did
    (module docstring): each cudaMalloc, the bytes reserved after each event, the segments at
    the end. Frees are matched to allocations by address."""
    trace = (snapshot.get("device_traces") or [[]])[device]
    segments, live = _start_state(snapshot, trace, device)
    top = max([a + n for a, n, _ in segments] + [e["addr"] + e["size"] for e in trace
              if e["action"] in _RESERVE] + [0])
    model = _Following(top)
    handles = _seed(model, segments, live)
    reserved = sum(n for _, n, _ in segments)
    events, placed, unmatched, released = [], 0, 0, False
    at, rec_line, mod_line = [], [], []
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "segment_alloc":
            model.recorded.append((e["addr"], e["size"]))
        elif action == "segment_free" and not released:         # a run of them: one release
            model.release_cached()
        elif action == "alloc":
            model.made.clear()
            handles[e["addr"]] = model.malloc(e["size"])
            placed += handles[e["addr"]] == e["addr"]
            recorded = model.recorded[0][1] if model.recorded else None
            modelled = model.made[0] if model.made else None
            if recorded or modelled:
                events.append(SegmentEvent(i, e["size"], recorded, modelled))
            model.recorded.clear()
        elif action == "free_completed":
            if e["addr"] in handles:
                model.free(handles.pop(e["addr"]))
            else:
                unmatched += 1
        released = action == "segment_free"
        reserved += _RESERVE.get(action, 0) * e.get("size", 0)
        if action not in ("segment_alloc", "segment_map"):    # the model's comes with its request
            at.append(i), rec_line.append(reserved), mod_line.append(model.reserved)
    end = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    blocks = {(b["address"], b["size"]) for s in end for b in s.get("blocks", [])
              if b["state"] == "active_allocated"}
    modelled_blocks = {(a, n) for seg in model.segments().values() for a, n, free in seg
                       if not free}
    return SnapshotReplay(
        requests=sum(e["action"] == "alloc" for e in trace),
        streams=len({e.get("stream", 0) for e in trace}),
        start_segments=sorted(n for _, n, _ in segments), start_live=len(live),
        segment_events=events, placed_same=placed,
        reserved_at=at, reserved_recorded=rec_line, reserved_modelled=mod_line,
        end_recorded=sorted(s["total_size"] for s in end),
        end_modelled=sorted(sum(b[1] for b in seg) for seg in model.segments().values()),
        end_blocks_same=blocks == modelled_blocks, unmatched_frees=unmatched,
        expandable=any(e["action"] == "segment_map" for e in trace))


def _mib(n: int | None) -> str:
    return "none" if n is None else f"{n / 2**20:,.2f} MiB"


def format_replay(found: SnapshotReplay, *, show: int = 10) -> str:
    """The comparison in lines a practitioner reads: cudaMallocs matched, reserved (peak, first
    difference), the segments at the end, and the first `show` disagreements."""
    diff = found.first_reserved_difference
    recorded = dict(zip(found.reserved_at, found.reserved_recorded))
    modelled = dict(zip(found.reserved_at, found.reserved_modelled))
    extra = sum(e.recorded is None for e in found.segment_events)
    lines = [
        f"requests replayed: {found.requests:,} on {found.streams} stream(s)"
        + (" (the model has one: streams merged)" if found.streams > 1 else ""),
        f"when the trace began: {len(found.start_segments)} segments "
        f"({_mib(sum(found.start_segments))}), {found.start_live} live blocks",
        f"cudaMallocs: {found.matched} of {found.segment_allocs} recorded made by the model "
        f"for the same request, {extra} made only by the model",
        f"placed at PyTorch's address: {found.placed_same:,} of {found.requests:,} requests",
        f"reserved peak: model {_mib(max(found.reserved_modelled, default=0))}, recorded "
        f"{_mib(max(found.reserved_recorded, default=0))}; "
        + ("the same after every request and free" if diff is None else
           f"first differs after event {diff} ({_mib(modelled[diff])} against "
           f"{_mib(recorded[diff])})"),
        f"segments at the end: model {len(found.end_modelled)} "
        f"({_mib(sum(found.end_modelled))}), recorded {len(found.end_recorded)} "
        f"({_mib(sum(found.end_recorded))}): "
        + ("the same sizes" if found.end_recorded == found.end_modelled else "sizes differ")
        + ("; the same live blocks" if found.end_blocks_same else "; live blocks differ")]
    if found.unmatched_frees:
        lines.append(f"frees of blocks not seen: {found.unmatched_frees}")
    if found.expandable:
        lines.append("expandable segments in the trace: not modelled")
    lines += [f"  event {e.event}: request {_mib(e.request)}, PyTorch made {_mib(e.recorded)}, "
              f"the model {_mib(e.modelled)}" for e in found.disagreements[:show]]
    return "\n".join(lines)
