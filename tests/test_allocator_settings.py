"""companion.allocator's settings: PyTorch's cuBLAS workspace read from its source, and the
PYTORCH_ALLOC_CONF settings (`AllocatorConfig`) followed by the modelled caching allocator, each
on requests worked out by hand from the rules in `allocator.rules`' docstring."""
import pytest
import torch

from companion.allocator import (CUBLAS_DEFAULT, AllocatorConfig, CachingAllocator, OutOfMemory,
                                 cublas_workspace, replay)
from companion.memory import track

MiB = 2**20


def test_the_cublas_workspace_is_pytorchs_default_by_compute_capability():
    assert CUBLAS_DEFAULT == 8_519_680 == 2 * 4096 * 1024 + 8 * 16 * 1024
    for before_hopper in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9)):
        assert cublas_workspace(before_hopper) == 8_519_680
    for large in ((9, 0), (10, 0), (11, 0), (12, 0)):
        assert cublas_workspace(large) == 32 * MiB
    assert cublas_workspace((10, 0), since="2022-11") == 8_519_680      # 9.0 alone then
    assert cublas_workspace((9, 0), since="2022-11") == 32 * MiB
    assert cublas_workspace((11, 0), since="2026-02") == 8_519_680
    assert cublas_workspace((12, 1), since="2026-02") == 32 * MiB
    assert cublas_workspace((13, 0)) == 8_519_680
    assert cublas_workspace((10, 0), since="2026-01") == 8_519_680      # any date: its era
    assert cublas_workspace((11, 0), since="2026-09") == 32 * MiB


def test_the_cublas_workspace_config_adds_its_pairs():
    assert cublas_workspace((8, 0), config=":4096:8") == 32 * MiB
    assert cublas_workspace((9, 0), config=":16:8") == 16 * 1024 * 8
    assert cublas_workspace((8, 0), config=":4096:2:16:8") == 8_519_680
    assert cublas_workspace((9, 0), config="nonsense") == 32 * MiB      # PyTorch: the default
    with pytest.raises(ValueError, match="64-bit"):
        cublas_workspace((9, 0), config=":99999999999999999999:1")


@pytest.mark.parametrize("bad", [(9,), "9.0", (9.0, 0), (True, 0), (9, -1), None, 9])
def test_the_cublas_workspace_refuses_what_is_not_a_capability(bad):
    with pytest.raises(ValueError, match="major, minor"):
        cublas_workspace(bad)
    for since in ("2025", "2022-10", 2026, "July 2026"):
        with pytest.raises(ValueError, match="since"):
            cublas_workspace((9, 0), since=since)


def test_settings_are_read_as_pytorch_spells_them():
    config = AllocatorConfig.parse("expandable_segments:True, max_split_size_mb:128,"
                                   "roundup_power2_divisions:4,garbage_collection_threshold:0.6")
    assert config == AllocatorConfig(True, 128, 4, 0.6)
    assert AllocatorConfig.parse("") == AllocatorConfig() == AllocatorConfig.parse("backend:native")


@pytest.mark.parametrize("text, message", [
    ("max_split_size_mb:10", "above 20"), ("roundup_power2_divisions:3", "power of two"),
    ("garbage_collection_threshold:1.5", "between 0 and 1"), ("expandable_segments:yes", "cannot"),
    ("pinned_num_register_threads:8", "not a setting"), ("backend:cudaMallocAsync", "not modelled"),
    ("max_split_size_mb:lots", "cannot read"),
    ("roundup_power2_divisions:[256:1,512:2]", "one number for all sizes")])
def test_settings_that_pytorch_or_the_model_refuses_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        AllocatorConfig.parse(text)


def test_bad_arguments_to_the_allocator_say_why():
    with pytest.raises(ValueError, match="give the cap"):
        CachingAllocator(config="garbage_collection_threshold:0.5")
    with pytest.raises(ValueError, match="AllocatorConfig"):
        CachingAllocator(config={"expandable_segments": True})
    with pytest.raises(ValueError, match="a string"):
        AllocatorConfig.parse(None)


def test_roundup_power2_divisions_by_hand():
    four = CachingAllocator(config="roundup_power2_divisions:4")
    assert four.round(1_300_000) == 1_310_720          # 1 MiB + 1/4 MiB: the next of 4 steps
    assert four.round(2 * MiB) == 2 * MiB               # a power of two stays
    assert four.round(2048) == 2048 and four.round(1000) == 1024   # up to 512 * 4: 512-B blocks
    assert four.round(3000) == 3072                     # (2048, 4096) in steps of 512
    assert CachingAllocator().round(1_300_000) == 1_300_480          # default: 512-B blocks
    assert CachingAllocator(config="roundup_power2_divisions:1").round(1_300_000) == 1_300_480


def _grow_then_free(config):
    a = CachingAllocator(config=config)
    a.free(a.malloc(30 * MiB))
    a.malloc(50 * MiB)
    return a


def test_expandable_segments_extend_the_free_end_instead_of_a_new_segment():
    plain = _grow_then_free(None)                       # 30 MiB, freed; 50 MiB fits not in it
    assert plain.reserved == 80 * MiB and len(plain.segments()) == 2
    grown = _grow_then_free("expandable_segments:True")  # 40 MiB mapped (two 20-MiB pages),
    assert grown.reserved == 60 * MiB                     # then one page more: 60
    assert len(grown.segments()) == 1
    assert grown.memory_stats()["num_device_alloc"] == 2
    small = CachingAllocator(config="expandable_segments:True")
    small.malloc(3000)
    assert small.reserved == 2 * MiB                      # the small pool maps 2-MiB pages


def test_max_split_size_keeps_oversize_blocks_whole_by_hand():
    plain, capped = CachingAllocator(), CachingAllocator(config="max_split_size_mb:64")
    for a in (plain, capped):
        a.free(a.malloc(100 * MiB))
        a.malloc(10 * MiB)
    assert plain.reserved == 100 * MiB                   # the 100 MiB block split
    assert capped.reserved == 110 * MiB                  # oversize: not for a 10 MiB request
    capped = CachingAllocator(config="max_split_size_mb:64")
    capped.free(capped.malloc(100 * MiB))
    capped.malloc(70 * MiB)                              # 100 >= 70 + 20: refused
    assert capped.reserved == 170 * MiB
    capped = CachingAllocator(config="max_split_size_mb:64")
    capped.free(capped.malloc(80 * MiB))
    capped.malloc(70 * MiB)                              # 80 < 70 + 20: taken whole, unsplit
    assert capped.reserved == 80 * MiB and capped.allocated == 80 * MiB


def test_garbage_collection_releases_segments_older_than_the_mean_by_hand():
    def run(config, cap):
        a = CachingAllocator(cap=cap, config=config)
        first, second = a.malloc(30 * MiB), a.malloc(40 * MiB)
        a.free(first)                                    # freed at large request 2
        third = a.malloc(50 * MiB)                       # request 3: fits in no free block
        a.free(second), a.free(third)                    # freed at request 3
        a.malloc(60 * MiB)                               # request 4: ages 2, 1, 1; mean 4/3
        return a
    collected = run("garbage_collection_threshold:0.5", 200 * MiB)
    # 120 MiB reserved > 100: only the 30 MiB segment is as old as the mean; 30 >= the 20 asked
    assert collected.reserved == 150 * MiB
    assert sorted(n for seg in collected.segments().values() for _, n, _ in seg) == \
        [40 * MiB, 50 * MiB, 60 * MiB]
    assert collected.memory_stats()["num_alloc_retries"] == 0
    assert run(None, 200 * MiB).reserved == 180 * MiB   # under the cap: nothing released
    tight = run(None, 150 * MiB)                          # over it: all released, one retry
    assert tight.reserved == 60 * MiB and tight.memory_stats()["num_alloc_retries"] == 1
    same_age = CachingAllocator(cap=100 * MiB, config="garbage_collection_threshold:0.5")
    blocks = [same_age.malloc(20 * MiB) for _ in range(3)]
    for b in blocks:
        same_age.free(b)
    same_age.malloc(30 * MiB)                            # a pass frees all three, not one
    assert same_age.reserved == 30 * MiB


def test_a_small_request_releases_no_oversize_segment_first():
    a = CachingAllocator(cap=61 * MiB, config="max_split_size_mb:32")
    big = a.malloc(40 * MiB)
    a.malloc(20 * MiB)
    a.free(big)
    a.malloc(1000)                  # a new 2 MiB small segment: 62 > 61, release all, one retry
    assert a.memory_stats()["num_alloc_retries"] == 1


def test_max_split_releases_an_oversize_segment_without_a_retry():
    a = CachingAllocator(cap=100 * MiB, config="max_split_size_mb:32")
    a.free(a.malloc(64 * MiB))                           # an oversize block, cached
    a.malloc(40 * MiB)                                   # 64 + 40 > 100: the 64 MiB one goes
    stats = a.memory_stats()
    assert a.reserved == 40 * MiB and stats["num_alloc_retries"] == 0
    assert stats["num_device_free"] == 1


def test_an_oom_counts_one_retry_and_one_oom():
    a = CachingAllocator(cap=50 * MiB)
    a.malloc(30 * MiB)
    with pytest.raises(OutOfMemory, match="segment"):
        a.malloc(30 * MiB)
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 1
    assert stats["num_device_alloc"] == 1 and stats["reserved_bytes.all.peak"] == 30 * MiB
    e = CachingAllocator(cap=50 * MiB, config="expandable_segments:True")
    e.malloc(30 * MiB)                                   # 40 MiB mapped
    with pytest.raises(OutOfMemory, match="a request of 30"):
        e.malloc(30 * MiB)                               # 40 + the request's 30 > 50
    assert e.memory_stats()["num_ooms"] == 1


def test_expandable_segments_under_a_cap_test_the_whole_request():
    a = CachingAllocator(cap=100 * MiB, config="expandable_segments:True")
    a.free(a.malloc(60 * MiB))                           # 60 mapped, free
    a.malloc(70 * MiB)                                   # 60 + 70 > 100: a retry unmaps, 80 mapped
    assert a.reserved == 80 * MiB and a.memory_stats()["num_alloc_retries"] == 1
    b = CachingAllocator(cap=75 * MiB, config="expandable_segments:True")
    b.free(b.malloc(60 * MiB))
    b.malloc(70 * MiB)              # once crashed after the unmap; PyTorch tests the request's
    assert b.reserved == 80 * MiB   # 70 MiB against the cap, then maps whole 20 MiB pages
    assert b.memory_stats()["num_alloc_retries"] == 1


@pytest.mark.parametrize("bad", [-5, 2.7, True, None, "1G"])
def test_a_request_is_a_whole_number_of_bytes(bad):
    with pytest.raises(ValueError, match="whole number of bytes"):
        CachingAllocator().malloc(bad)


@pytest.mark.parametrize("cap", [float("nan"), -1, "1G", True, float("inf")])
def test_a_cap_is_a_number_of_bytes(cap):
    with pytest.raises(ValueError, match="cap is a number of bytes"):
        CachingAllocator(cap=cap)


def test_inactive_split_bytes_are_free_pieces_beside_live_blocks():
    a = CachingAllocator()
    first = a.malloc(3 * MiB)                            # a 20 MiB segment: 3 live, 17 free
    a.malloc(3 * MiB)                                    # 3, 3 live, 14 free
    a.free(first)
    assert a.memory_stats()["inactive_split_bytes.all.current"] == 17 * MiB
    assert a.release_cached() == []                      # nothing wholly free to give back


def test_a_release_unmaps_the_free_end_of_an_expandable_segment():
    a = CachingAllocator(config="expandable_segments:True")
    keep = a.malloc(30 * MiB)
    a.free(a.malloc(50 * MiB))                           # 30 + 50 in 80 MiB mapped (4 pages)
    assert a.reserved == 80 * MiB
    a.release_cached()                                   # pages from 40 MiB on are free
    assert a.reserved == 40 * MiB and a.memory_stats()["num_device_free"] == 1
    a.free(keep)
    a.release_cached()
    assert a.reserved == 0


def test_replay_with_settings_on_a_tracked_run_of_growing_batches():
    with track("cpu") as t:
        w = torch.randn(1024, 1024)                      # 4 MiB
        for rows in range(4096, 4096 + 6 * 512, 512):    # activations that grow each step:
            x = torch.randn(rows, 1024)                  # 16 to 26 MiB
            h = x @ w
            del x, h
    plain, grown = replay(t), replay(t, config="expandable_segments:True")
    assert plain == replay(t, config=None) and plain.fits and grown.fits
    assert grown.peak_reserved < plain.peak_reserved
    assert plain.stats["num_device_alloc"] > grown.stats["num_device_alloc"]
    for r in (plain, grown):
        assert sum(n for seg in r.layout.values() for _, n, _ in seg) == r.peak_reserved
        assert r.stats["reserved_bytes.all.peak"] == r.peak_reserved


def test_the_growing_batches_trace_replays_without_a_gpu():
    from companion.allocator import growing_batches_trace
    trace = growing_batches_trace(width=256, depth=2, start=3000, steps=4)
    # weights and gradients 2 x (256 x 256 + 256 + 10 x 256 + 10) fp32 at least, and the largest
    # batch's (3003, 256) activations
    assert trace.peak >= 2 * 4 * (256 * 256 + 256 + 2570) + 4 * 3003 * 256
    plain, grown = replay(trace), replay(trace, config="expandable_segments:True")
    assert plain.peak_allocated == grown.peak_allocated
    assert grown.peak_reserved <= plain.peak_reserved
    with pytest.raises(ValueError, match="positive whole number"):
        growing_batches_trace(steps=0)
