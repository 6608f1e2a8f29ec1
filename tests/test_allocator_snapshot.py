"""companion.allocator.validate: a recorded CUDA trace replayed through the modelled allocator, on
hand-made snapshots in the format `torch.cuda.memory._snapshot()` records (one that starts
mid-run, one the model must not match), on traces the model itself records and then loses the
head of, and on a real one on a GPU."""
import gc

import pytest
import torch
from hypothesis import given, settings, strategies as st

from companion.allocator import CachingAllocator, format_replay, replay_snapshot

MiB = 2**20


def _entry(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}


def _segment(address, total, blocks):
    """A segment of a snapshot: `blocks` as (address, bytes, live)."""
    return {"device": 0, "address": address, "total_size": total, "stream": 0,
            "segment_type": "small" if total <= 2 * MiB else "large",
            "blocks": [{"address": a, "size": n, "requested_size": n,
                        "state": "active_allocated" if live else "inactive"}
                       for a, n, live in blocks]}


def _free(addr, size):
    return [_entry("free_requested", addr, size), _entry("free_completed", addr, size)]


A, B, C = 1 << 40, 1 << 41, 1 << 42                  # where the driver put three segments


def test_a_trace_from_an_empty_cache_is_made_again_request_by_request():
    trace = [_entry("segment_alloc", A, 20 * MiB), _entry("alloc", A, 3 * MiB),
             _entry("alloc", A + 3 * MiB, 3 * MiB),          # the same 20 MiB segment, split
             _entry("segment_alloc", B, 2 * MiB), _entry("alloc", B, 100_000),
             _entry("segment_alloc", C, 16 * MiB), _entry("alloc", C, 15 * MiB + 1),
             *_free(A + 3 * MiB, 3 * MiB)]
    end = [_segment(A, 20 * MiB, [(A, 3 * MiB, True), (A + 3 * MiB, 17 * MiB, False)]),
           _segment(B, 2 * MiB, [(B, 100_352, True), (B + 100_352, 2 * MiB - 100_352, False)]),
           _segment(C, 16 * MiB, [(C, 16 * MiB, True)])]    # 15 MiB + 1: 16 MiB, rest not split
    found = replay_snapshot({"segments": end, "device_traces": [trace]})
    assert found.agrees and found.end_blocks_same
    assert (found.matched, found.segment_allocs, found.placed_same) == (3, 3, 4)
    assert [e.event for e in found.segment_events] == [1, 4, 6]   # each with its own request
    assert found.start_segments == [] and found.streams == 1
    assert max(found.reserved_modelled) == max(found.reserved_recorded) == 38 * MiB
    assert "3 of 3 recorded made by the model" in format_replay(found)


def test_a_trace_that_starts_mid_run_is_replayed_from_the_state_before_it():
    # Before the recording: segment A held a 4 MiB block at A (freed in the trace) and a 2 MiB
    # block at A + 10 MiB (live to the end, untouched). The first request fits the 6 MiB gap
    # between them: no cudaMalloc, as in the trace; the 8 MiB one fits only A's 8 MiB tail.
    trace = [_entry("alloc", A + 4 * MiB, 5 * MiB),            # best fit: the 6 MiB gap
             *_free(A, 4 * MiB),                               # allocated before the trace
             _entry("alloc", A + 12 * MiB, 8 * MiB),
             _entry("segment_alloc", B, 20 * MiB), _entry("alloc", B, 5 * MiB)]
    end = [_segment(A, 20 * MiB, [(A, 4 * MiB, False), (A + 4 * MiB, 6 * MiB, True),
                                  (A + 10 * MiB, 2 * MiB, True), (A + 12 * MiB, 8 * MiB, True)]),
           _segment(B, 20 * MiB, [(B, 5 * MiB, True), (B + 5 * MiB, 15 * MiB, False)])]
    found = replay_snapshot({"segments": end, "device_traces": [trace]})
    assert found.start_segments == [20 * MiB] and found.start_live == 2
    assert found.agrees and found.placed_same == 3 and found.unmatched_frees == 0
    assert found.reserved_recorded[0] == found.reserved_modelled[0] == 20 * MiB
    assert found.end_blocks_same       # the 5 MiB request got the whole gap: a 1 MiB rest stays


def test_of_two_equal_free_blocks_the_lower_address_is_taken_not_the_older_segment():
    # The driver puts the second segment below the first (the real trace's second 20 MiB segment
    # lies below its first); two free 7 MiB blocks, one in each: PyTorch's BlockComparatorSize
    # orders equal sizes by pointer, so the request goes to the lower one, in the newer segment.
    high, low = 1 << 41, 1 << 40
    trace = [_entry("segment_alloc", high, 20 * MiB), _entry("alloc", high, 7 * MiB),
             _entry("alloc", high + 7 * MiB, 13 * MiB),
             _entry("segment_alloc", low, 20 * MiB), _entry("alloc", low, 7 * MiB),
             _entry("alloc", low + 7 * MiB, 13 * MiB), *_free(high, 7 * MiB),
             *_free(low, 7 * MiB), _entry("alloc", low, 7 * MiB)]
    found = replay_snapshot({"segments": [], "device_traces": [trace]})
    assert found.placed_same == found.requests == 5 and found.matched == 2


def test_a_cudamalloc_the_model_would_not_make_is_a_disagreement():
    # 12 MiB asked for: PyTorch's rule rounds it to a 12 MiB segment (>= 10 MiB: to 2 MiB); a
    # snapshot that says 20 MiB was made is not what the model does, and the replay says so.
    trace = [_entry("segment_alloc", A, 20 * MiB), _entry("alloc", A, 12 * MiB)]
    end = [_segment(A, 20 * MiB, [(A, 12 * MiB, True), (A + 12 * MiB, 8 * MiB, False)])]
    found = replay_snapshot({"segments": end, "device_traces": [trace]})
    assert not found.agrees and found.matched == 0 and found.segment_allocs == 1
    assert [(e.recorded, e.modelled) for e in found.disagreements] == [(20 * MiB, 12 * MiB)]
    assert found.end_recorded == [20 * MiB] and found.end_modelled == [12 * MiB]
    assert "PyTorch made 20.00 MiB, the model 12.00 MiB" in format_replay(found)


def test_a_segment_the_model_has_room_for_is_a_disagreement_too():
    trace = [_entry("segment_alloc", A, 20 * MiB), _entry("alloc", A, 3 * MiB),
             _entry("segment_alloc", B, 20 * MiB), _entry("alloc", B, 3 * MiB)]
    found = replay_snapshot({"segments": [], "device_traces": [trace]})
    assert found.matched == 1 and found.disagreements[0].modelled is None
    assert found.first_reserved_difference == 3              # after the second request


def test_empty_cache_in_the_trace_releases_the_free_segments():
    trace = [_entry("segment_alloc", A, 20 * MiB), _entry("alloc", A, 3 * MiB),
             _entry("segment_alloc", B, 2 * MiB), _entry("alloc", B, 512), *_free(A, 3 * MiB),
             _entry("segment_free", A, 20 * MiB), _entry("alloc", B + 512, 512)]
    end = [_segment(B, 2 * MiB, [(B, 512, True), (B + 512, 512, True),
                                 (B + 1024, 2 * MiB - 1024, False)])]
    found = replay_snapshot({"segments": end, "device_traces": [trace]})
    assert found.agrees and found.reserved_modelled[-1] == 2 * MiB


class _Recorder(CachingAllocator):
    """The model writing its own trace, as `_record_memory_history` would."""

    def __init__(self):
        super().__init__()
        self.trace = []

    def _segment_address(self, nbytes):
        self.trace.append(_entry("segment_alloc", self._end, nbytes))
        return self._end


# requests whose block is never handed out with a rest it cannot split (every large block a
# multiple of 2 MiB): what the trace shows of a block allocated before it began is its request
_SIZES = st.one_of(st.integers(1, MiB), st.sampled_from([2 * MiB, 6 * MiB, 10 * MiB, 14 * MiB]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_SIZES, st.booleans(), st.integers(0, 99)), min_size=1, max_size=60),
       st.floats(0, 1))
def test_a_trace_the_model_recorded_replays_exactly_even_without_its_head(steps, cut):
    recorder, live = _Recorder(), []
    for nbytes, free, which in steps:
        if live and free:                                  # free one of the live blocks
            addr, size = live.pop(which % len(live))
            recorder.free(addr)
            recorder.trace += _free(addr, size)
        else:
            addr = recorder.malloc(nbytes)
            recorder.trace.append(_entry("alloc", addr, nbytes))
            live.append((addr, nbytes))
    end = [_segment(seg, sum(n for _, n, _ in blocks), [(a, n, not free) for a, n, free in blocks])
           for seg, blocks in recorder.segments().items()]
    trace = recorder.trace[int(cut * len(recorder.trace)):]   # the ring buffer lost its head
    found = replay_snapshot({"segments": end, "device_traces": [trace]})
    assert found.agrees and found.end_blocks_same, format_replay(found)
    assert found.placed_same == found.requests


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_recorded_step_is_made_again_by_the_model():
    """A small MLP step on CUDA recorded with a short ring buffer (its head is lost), replayed:
    every cudaMalloc PyTorch made the model makes for the same request. Not yet run on a GPU:
    no device was lent when it was written."""
    from companion.models import MLP
    gc.collect()
    torch.cuda.synchronize()
    model = MLP(1024, 1024, 4, 10, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=200)
    try:
        for batch in (64, 3000, 700):
            x = torch.randn(batch, 1024, device="cuda")
            model.loss(x, torch.zeros(batch, dtype=torch.long, device="cuda")).backward()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    found = replay_snapshot(snapshot, device=torch.cuda.current_device())
    assert found.requests > 0 and found.agrees, format_replay(found)


def test_the_command_prints_the_comparison_and_fails_on_a_disagreement(tmp_path, capsys):
    import pickle
    import runpy
    main = runpy.run_path("benchmarks/bench_allocator.py")["main"]
    good = [_entry("segment_alloc", A, 20 * MiB), _entry("alloc", A, 3 * MiB)]
    bad = [_entry("segment_alloc", A, 20 * MiB), _entry("alloc", A, 12 * MiB)]
    for name, trace, size in (("good", good, 3 * MiB), ("bad", bad, 12 * MiB)):
        end = [_segment(A, 20 * MiB, [(A, size, True), (A + size, 20 * MiB - size, False)])]
        (tmp_path / name).write_bytes(pickle.dumps({"segments": end, "device_traces": [trace]}))
    assert main([str(tmp_path / "good")]) == 0
    assert "1 of 1 recorded made by the model" in capsys.readouterr().out
    assert main([str(tmp_path / "bad")]) == 1
    assert "the model 12.00 MiB" in capsys.readouterr().out
    assert main([str(tmp_path / "good"), "--device", "1"]) == 2
    assert "no trace for device 1" in capsys.readouterr().err
