"""companion.allocator: reading the CUDA caching allocator's snapshots, on a small snapshot written
as `torch.cuda.memory._snapshot`'s documentation describes it, and on real ones on a GPU."""
import gc
import pickle

import pytest
import torch

from companion.allocator import growing_batches, snapshot_report, snapshot_timeline

_FRAMES = [{"filename": "/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
           {"filename": "/home/me/train.py", "line": 42, "name": "step"}]
# Two segments: the first has a live 6 MiB tensor, a free 2 MiB block and a live 4 MiB tensor;
# the second (12 MiB) is wholly free.
_SNAPSHOT = {
    "segments": [
        {"address": 0, "total_size": 12 << 20, "allocated_size": 10 << 20, "active_size": 10 << 20,
         "stream": 0, "segment_type": "large",
         "blocks": [{"size": 6 << 20, "requested_size": 6 << 20, "address": 0,
                     "state": "active_allocated", "frames": _FRAMES},
                    {"size": 2 << 20, "requested_size": 2 << 20, "address": 6 << 20,
                     "state": "inactive", "frames": []},
                    {"size": 4 << 20, "requested_size": 4 << 20, "address": 8 << 20,
                     "state": "active_allocated", "frames": []}]},
        {"address": 1 << 30, "total_size": 12 << 20, "allocated_size": 0, "active_size": 0,
         "stream": 0, "segment_type": "large",
         "blocks": [{"size": 12 << 20, "requested_size": 12 << 20, "address": 1 << 30,
                     "state": "inactive", "frames": []}]}],
    "device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 12 << 20, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 0, "size": 6 << 20, "stream": 0, "frames": _FRAMES},
        {"action": "alloc", "addr": 6 << 20, "size": 2 << 20, "stream": 0, "frames": []},
        {"action": "free_requested", "addr": 6 << 20, "size": 2 << 20, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 6 << 20, "size": 2 << 20, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 8 << 20, "size": 4 << 20, "stream": 0, "frames": []}]],
}


def test_report_reads_segments_and_blocks():
    report = snapshot_report(_SNAPSHOT)
    assert report["segments"] == 2 and report["reserved"] == 24 << 20
    assert report["allocated"] == 10 << 20 and report["cached_free"] == 14 << 20
    assert report["largest_free_block"] == 12 << 20
    assert report["fragmentation"] == pytest.approx(1 - 12 / 14)
    assert report["largest"][0] == (6 << 20, "train.py:42 in step")     # no folders shown
    assert report["largest"][1] == (4 << 20, "(no Python frame recorded)")
    other_gpu = {"segments": [dict(seg, device=1) for seg in _SNAPSHOT["segments"]]}
    assert snapshot_report(other_gpu, device=0)["segments"] == 0
    assert snapshot_report(other_gpu, device=1)["reserved"] == 24 << 20


def test_timeline_replays_allocations_and_frees():
    line = snapshot_timeline(_SNAPSHOT)
    mib = [a >> 20 for a in line["allocated"]]
    assert mib == [0, 6, 8, 8, 6, 10] and line["reserved"][-1] == 12 << 20
    assert line["action"][3] == "free_requested"            # requested is not yet free
    assert snapshot_timeline({"segments": []}) == {"action": [], "allocated": [], "reserved": []}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_growing_batches_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        growing_batches(expandable=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_snapshot_agrees_with_the_counters(tmp_path):
    gc.collect()                        # earlier tests' tensors: freed now, not during the record
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        keep = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (3, 5, 7)]
        del keep[1]
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    report = snapshot_report(snapshot, device=torch.cuda.current_device())
    assert report["reserved"] == torch.cuda.memory_reserved()
    assert report["allocated"] == torch.cuda.memory_allocated()
    assert any(where.startswith("test_allocator.py") for _, where in report["largest"])
    line = snapshot_timeline(snapshot, device=torch.cuda.current_device())
    assert line["allocated"][-1] == (3 + 7) << 20            # what the recording saw live
    assert torch.cuda.memory_allocated() - before == (3 + 7) << 20   # whatever ran before
    with open(tmp_path / "snapshot.pickle", "rb") as f:
        assert set(pickle.load(f)) >= {"segments", "device_traces"}
    del keep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_growing_batches_runs_with_and_without_expandable_segments():
    for expandable in (False, True):
        figures = growing_batches(expandable=expandable, width=1024, depth=2, start=256, steps=4)
        assert figures["max_reserved"] >= figures["max_allocated"] > 0


# ---------------------------------------------------------------- the allocator's sizes, modelled

MiB = 2**20


def test_requests_round_to_512_byte_blocks():
    from companion.allocator import block_bytes
    assert [block_bytes(n) for n in (0, 1, 512, 513, 4000)] == [0, 512, 512, 1024, 4096]


def test_segments_follow_the_pools_sizes():
    from companion.allocator import segment_bytes
    assert segment_bytes(MiB) == 2 * MiB                      # small pool
    assert segment_bytes(MiB + 512) == 20 * MiB               # large pool, under 10 MiB
    assert segment_bytes(10 * MiB) == 10 * MiB                # its own segment
    assert segment_bytes(11 * MiB - 512) == 12 * MiB          # rounded up to 2 MiB


def test_reserved_bytes_pack_requests_into_segments_by_hand():
    from companion.allocator import reserved_bytes
    assert reserved_bytes([MiB, MiB]) == 2 * MiB              # one small segment holds both
    assert reserved_bytes([MiB] * 3) == 4 * MiB
    assert reserved_bytes([3 * MiB] * 7) == 40 * MiB          # six fit in 20 MiB, then another
    assert reserved_bytes([12 * MiB, 512, 3 * MiB]) == 12 * MiB + 2 * MiB + 20 * MiB
    assert reserved_bytes([]) == 0


def test_headroom_and_the_cublas_workspace():
    from companion.allocator import cublas_workspace, headroom
    assert headroom(512) == 2 * MiB and headroom(4 * MiB) == 22 * MiB
    assert headroom(64 * MiB) == 4 * MiB
    assert cublas_workspace((9, 0)) == 32 * MiB and cublas_workspace((8, 0)) == 8_519_680


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reserved_bytes_match_the_real_allocator_from_an_empty_cache():
    from companion.allocator import reserved_bytes
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    requests = [MiB, MiB, 3 * MiB, 512, 12 * MiB, 3 * MiB]
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in requests]
    assert torch.cuda.memory_reserved() - before == reserved_bytes(requests)
    del keep


# ---------------------------------------------------------------- the allocator replayed
MiB = 2**20


def test_small_requests_share_a_two_mib_segment_by_hand():
    from companion.allocator import CachingAllocator
    a = CachingAllocator()
    a.malloc(100)                                   # 512 B block in a new 2 MiB segment
    assert (a.allocated, a.reserved) == (512, 2 * MiB)
    for _ in range(3):
        a.malloc(600 * 1024)                        # 3 x 600 KiB = 1.76 MiB: the same segment
    assert a.reserved == 2 * MiB
    a.malloc(600 * 1024)                            # 0.24 MiB left: a second segment
    assert a.reserved == 4 * MiB and a.allocated == 512 + 4 * 600 * 1024


def test_a_freed_hole_too_small_opens_a_new_segment_by_hand():
    from companion.allocator import CachingAllocator
    a = CachingAllocator()
    x, y, z = (a.malloc(6 * MiB) for _ in range(3))  # one 20 MiB segment, split three times
    assert a.reserved == 20 * MiB
    a.free(y)                                       # a 6 MiB hole between x and z, 2 MiB at the end
    a.malloc(7 * MiB)                               # fits neither: a second 20 MiB segment
    assert (a.allocated, a.reserved) == (19 * MiB, 40 * MiB)
    a.malloc(6 * MiB)                               # best fit: the hole, not the 13 MiB rest
    assert a.reserved == 40 * MiB and a.allocated == 25 * MiB


def test_freed_neighbours_merge_and_a_large_request_gets_its_own_rounded_segment():
    from companion.allocator import CachingAllocator
    a = CachingAllocator()
    x, y = a.malloc(6 * MiB), a.malloc(6 * MiB)
    a.free(x), a.free(y)                            # one free 20 MiB block again
    a.malloc(19 * MiB)                              # rest 1 MiB: not split off (needs > 1 MiB)
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    a.malloc(11 * MiB + 1)                          # >= 10 MiB: rounded up to 2 MiB, 12 MiB
    assert a.reserved == 32 * MiB


def test_a_cap_releases_free_segments_then_fails():
    from companion.allocator import CachingAllocator, OutOfMemory
    a = CachingAllocator(cap=40 * MiB)
    h = a.malloc(12 * MiB)
    a.free(h)                                       # a cached 12 MiB segment, wholly free
    a.malloc(30 * MiB)                              # 12 + 30 > 40: the free segment goes first
    assert a.reserved == 30 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(12 * MiB)                          # 30 + 12 > 40, nothing free to release


def test_replay_of_a_tracked_step_counts_rounding_and_matches_the_ledger():
    import torch
    from companion.allocator import replay, reserved_bytes
    from companion.memory import track
    with track("cpu") as t:
        a = torch.ones(1000)                        # 4000 B -> 4096 B block
        b = torch.ones(3, 3)                        # 36 B -> 512 B
        del a
        c = torch.ones(2000)                        # 8000 B -> 8192 B
    r = replay(t)
    assert r.peak_tensors == t.peak == 36 + 8000
    assert r.peak_allocated == 512 + 8192 and r.rounding == r.peak_allocated - t.peak
    assert r.peak_reserved == 2 * MiB and r.fits
    assert reserved_bytes([4000, 36]) == 2 * MiB
    assert not replay(t, cap=MiB).fits
    del b, c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_replay_of_a_real_cuda_step_matches_the_allocators_reserve():
    """A GPT step on CUDA, tracked: its trace replayed through the modelled allocator against
    the real allocator's peak reserve, cuBLAS's workspace added (a fresh cache: empty_cache
    before). Not yet run on a GPU: no device was lent when it was written."""
    import torch
    from companion.allocator import replay
    from companion.memory import track
    from companion.models import GPT
    torch.cuda.empty_cache()
    with track("cuda") as t:
        model = GPT(4096, 256, 512, 4, 8, device="cuda", fused_attention=True)
        x = torch.randint(4096, (8, 256), device="cuda")
        model.loss(x, x).backward()
        torch.optim.AdamW(model.parameters()).step()
        del model, x
    real = torch.cuda.max_memory_reserved()
    from companion.allocator import cublas_workspace
    modelled = replay(t).peak_reserved + cublas_workspace(torch.cuda.get_device_capability())
    assert abs(modelled / real - 1) < 0.15, (modelled, real)
