"""companion.memory: the CPU ledger is exact on plain allocations, matches a hand count on a training
step, labels kinds and phases, and memory_budget fails like CUDA and leaves nothing behind."""
import gc
import resource

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from companion import estimate
from companion.memory import (KINDS, format_bytes, measure, memory_budget, on_disk, on_host,
                              parse_bytes, plot_timeline, track)
from companion.models import GPT


def test_plain_allocations_are_counted_to_the_byte():
    with track("cpu") as t:
        a = torch.empty(1000)                              # 4000 B
        b = torch.zeros(3, 5, dtype=torch.float64)         # 120 B
        c = torch.ones(7, dtype=torch.int8)                # 7 B
        assert t.current == 4127
    assert (t.current, t.peak) == (4127, 4127)
    del a, b, c


def test_views_and_shared_storage_count_once():
    with track("cpu") as t:
        a = torch.empty(256, 4)
        views = [a.view(4, 256), a[::2], a.t(), a.detach(), a.reshape(-1), a.expand(1, 256, 4),
                 a.as_strided((10,), (1,)), a[3]]
        a.add_(1).mul_(2)                                  # in place: no new storage
        assert t.current == 256 * 4 * 4
    assert t.peak == 4096
    del views


def test_frees_inside_the_block_are_subtracted():
    with track("cpu") as t:
        keep = torch.empty(100)
        for _ in range(3):
            tmp = torch.empty(1000)
            del tmp
        view = keep[:10]
        del keep                                           # the view still holds the storage
        assert t.current == 400
        del view
        assert t.current == 0
    assert t.peak == 4400


def test_tensors_from_before_the_block_are_not_counted():
    before = torch.empty(10_000)
    with track("cpu") as t:
        y = before + 1
    assert t.current == 40_000 and t.peak == 40_000
    del y


def test_tensors_made_from_python_data_are_counted():
    with track("cpu") as t:
        x = torch.tensor([1.0, 2.0, 3.0])
        y = torch.as_tensor([[1, 2], [3, 4]], dtype=torch.int16)
    assert t.current == 12 + 8
    del x, y


def test_a_resized_out_tensor_is_counted_at_its_new_size():
    out = torch.empty(0)
    with track("cpu") as t:
        torch.add(torch.ones(100), 1, out=out)             # ones: 400 B freed; out grows to 400 B
    assert t.current == 400


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int64]),
       free=st.lists(st.booleans(), min_size=8, max_size=8))
def test_any_sequence_of_allocations_and_frees(sizes, dtype, free):
    item = torch.empty((), dtype=dtype).element_size()
    live, running, peak = [], 0, 0
    with track("cpu") as t:
        for n, drop in zip(sizes, free):
            live.append(torch.empty(n, dtype=dtype))
            running += n * item
            peak = max(peak, running)
            if drop:
                live.pop()
                running -= n * item
            assert t.current == running
    assert (t.current, t.peak) == (running, peak)


def _mlp_step(B, D, H, C):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, C))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, Y = torch.randn(B, D), torch.randn(B, C)
    loss = (model(X) - Y).square().mean()
    loss.backward()
    opt.step()
    return model


@pytest.mark.parametrize("B, D, H, C", [(256, 64, 256, 8), (512, 32, 128, 4)])
def test_mlp_training_step_matches_a_hand_count(B, D, H, C):
    report = measure(_mlp_step, B, D, H, C)
    params = (D * H + H + H * C + C) * 4
    # The peak is in ReluBackward: the saved relu output a, its incoming gradient and the gradient
    # it returns are live at once (3·B·H floats), beside parameters, inputs, layer 2's gradients.
    hand = params + (B * D + B * C) * 4 + 3 * B * H * 4 + (H * C + C) * 4
    assert abs(report.peak - hand) <= 0.01 * hand
    end = report.breakdown("current")
    assert end["parameters"] == params and end["gradients"] == params   # model was returned
    peak = report.breakdown()
    assert sum(peak.values()) == report.peak
    assert peak["parameters"] == params
    assert peak["activations"] >= B * H * 4                   # the relu output saved for backward


def test_breakdown_finds_adam_state_and_phases():
    def step():
        model = torch.nn.Linear(50, 40)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(8, 50)).sum().backward()
        opt.step()
        return model, opt

    report = measure(step)
    n = (50 * 40 + 40) * 4
    end = report.breakdown("current")
    assert end == {"parameters": n, "buffers": 0, "gradients": n,
                   "optimizer_state": 2 * n + 8,                     # + 2 step counters
                   "activations": 0, "temporaries": 0}
    timeline = report.timeline()
    assert set(timeline["phase"]) == {"forward", "backward", "optimizer"}
    assert report.peak_phase in ("backward", "optimizer")
    assert timeline["total"][-1] == report.current and max(timeline["total"]) == report.peak
    assert all(sum(timeline[k][i] for k in KINDS) == timeline["total"][i]
               for i in range(len(timeline["event"])))


def test_cpu_has_no_allocator_reserve():
    with track("cpu") as t:
        pass
    assert (t.current, t.peak, t.reserved, t.peak_reserved, t.peak_phase) == (0, 0, None, None, None)


def test_figures_are_frozen_after_the_block():
    with track("cpu") as t:
        x = torch.empty(100)
    del x
    gc.collect()
    assert t.current == 400 and "peak" in str(t)


def test_measure_returns_the_result():
    report = measure(torch.zeros, 10, dtype=torch.float64)
    assert report.peak == 80 and report.result.shape == (10,)


def test_plot_timeline_draws_every_kind():
    import matplotlib
    matplotlib.use("Agg")
    report = measure(_mlp_step, 16, 8, 16, 2)
    ax = plot_timeline(report)
    assert ax.get_ylabel().startswith("live") and len(ax.collections) >= len(KINDS)


@pytest.mark.parametrize("text, expected", [("512 MiB", 512 * 2**20), ("2 GB", 2 * 10**9),
                                            ("1.5GiB", int(1.5 * 2**30)), ("100", 100), (64, 64)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", -1, None, True])
def test_parse_bytes_rejects_nonsense(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(12) == "12 B"


def test_budget_raises_out_of_memory_shaped_like_cuda():
    with pytest.raises(torch.OutOfMemoryError) as info:
        with memory_budget("1 MiB"):
            small = torch.empty(1000)                        # 3.91 KiB: fits
            torch.empty(2**20)                               # 4 MiB: does not
    message = str(info.value)
    assert "Tried to allocate 4.00 MiB" in message
    assert "3.91 KiB already allocated" in message and "budget 1.00 MiB" in message
    del small


def test_budget_can_be_caught_inside_and_the_run_goes_on():
    with memory_budget(10_000):
        keep = torch.empty(1000)                             # 4000 B
        try:
            torch.empty(2000)                                # would make 12000 B
        except torch.OutOfMemoryError:
            pass
        more = torch.empty(1000)                             # the failed 8000 B were given back
    assert more.shape == (1000,) and keep.shape == (1000,)


def test_budget_fires_in_backward_and_leaves_nothing_hooked():
    model = torch.nn.Linear(100, 100)
    x = torch.randn(64, 100)
    with pytest.raises(torch.OutOfMemoryError):
        with memory_budget("30 KiB"):
            model(x).sum().backward()                        # forward fits; dW (40 kB) does not
    assert _get_current_dispatch_mode() is None
    torch.empty(2**22)                                       # 16 MiB, no budget any more
    with memory_budget("1 GiB"):
        model(x).sum().backward()


def test_track_leaves_no_hook_behind():
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod
    hooks = (len(module_mod._global_forward_pre_hooks), len(optimizer_mod._global_optimizer_pre_hooks),
             len(optimizer_mod._global_optimizer_post_hooks))
    with pytest.raises(KeyError):
        with track("cpu"):
            raise KeyError("boom")
    assert _get_current_dispatch_mode() is None
    assert hooks == (len(module_mod._global_forward_pre_hooks),
                     len(optimizer_mod._global_optimizer_pre_hooks),
                     len(optimizer_mod._global_optimizer_post_hooks))


def test_budget_and_track_nest():
    with track("cpu") as t:
        with pytest.raises(torch.OutOfMemoryError):
            with memory_budget(1000):
                small = torch.empty(100)
                torch.empty(1000)
    assert t.peak == 4400 and t.current == 400
    del small


def test_host_storages_are_counted_apart_from_the_device():
    with track("cpu") as t:
        a = torch.empty(1000)                              # device: 4000 B
        with on_host():
            b = torch.empty(500)                           # host: 2000 B
            view = b[::2]                                  # a view: nothing new
            c = a.clone()                                  # host: 4000 B, made from a device tensor
        d = b * 2                                          # outside the scope: device, 2000 B
        assert (t.current, t.host_current) == (6000, 6000)
        del c
    assert (t.peak, t.host_peak, t.host_current) == (6000, 6000, 2000)
    assert sum(t.breakdown("current", where="host").values()) == 2000
    assert "host: peak 5.86 KiB" in str(t)
    del a, b, d, view


def test_a_budget_caps_the_device_and_not_the_host():
    with memory_budget("1 MiB"), on_host():
        master = torch.zeros(2**20)                        # 4 MiB on the host: allowed
    with pytest.raises(torch.OutOfMemoryError):
        with memory_budget("1 MiB"):
            torch.zeros(2**20)                             # 4 MiB on the device: refused
    del master


def test_disk_storages_are_counted_nowhere_and_scopes_unwind():
    with track("cpu") as t:
        with on_disk():
            mapped = torch.tensor([1.0, 2.0])
        with pytest.raises(KeyError):
            with on_host():
                raise KeyError("boom")
        after = torch.empty(10)                            # the host scope ended with the error
    assert (t.current, t.host_current) == (40, 0)
    del mapped, after


def test_the_host_scope_belongs_to_one_thread():
    import threading
    seen = {}

    def other():
        with track("cpu") as t:
            x = torch.empty(100)
        seen["device"], seen["host"] = t.current, t.host_current
        del x

    with on_host():
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen == {"device": 400, "host": 0}


def test_host_optimizer_state_is_labelled_on_the_host():
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    with track("cpu") as t:
        model(torch.randn(4, 16)).sum().backward()
        with on_host():
            opt.step()                                     # Adam's moments made on the host
    n = sum(p.numel() for p in model.parameters())
    assert t.breakdown("current", where="host")["optimizer_state"] == 2 * 4 * n + 4 * 2
    assert t.breakdown("current")["optimizer_state"] == 0


@pytest.mark.parametrize("bad", ["disk", None])
def test_breakdown_rejects_an_unknown_place(bad):
    with track("cpu") as t:
        pass
    with pytest.raises(ValueError, match="where must be"):
        t.breakdown(where=bad)


def _gpt_steps(shape: dict, batch: int, steps: int = 2):
    """`steps` AdamW steps of a course GPT built inside the tracked block; the tracker."""
    x = torch.randint(shape["vocab"], (batch, shape["seq_len"]))
    with track("cpu") as t:
        model = GPT(**shape, seed=0)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model.loss(x, x).backward()
            opt.step()
    return t


def test_fake_tensors_are_counted_like_real_ones():
    shape = dict(vocab=50, seq_len=16, width=32, depth=2, heads=4)
    real = _gpt_steps(shape, 3)
    with FakeTensorMode():
        fake = _gpt_steps(shape, 3)
    assert real.peak > 0 and (fake.peak, fake.current) == (real.peak, real.current)
    assert fake.breakdown() == real.breakdown() and fake.peak_phase == real.peak_phase


def test_a_simulated_1b_parameter_step_allocates_nothing_and_matches_the_estimate():
    shape = dict(vocab=50257, seq_len=1024, width=2048, depth=16, heads=16)
    B, N = 4, 4 * 1024
    n = estimate.gpt_params(shape["vocab"], shape["seq_len"], shape["width"], shape["depth"])
    assert n > 10**9
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    with FakeTensorMode():
        t = _gpt_steps(shape, B)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before < 2 * 2**30
    states = estimate.model_states(n, optimizer="adamw")
    acts = estimate.gpt_activations(B, shape["seq_len"], shape["width"], shape["depth"],
                                    shape["heads"], shape["vocab"])
    at_peak = t.breakdown()
    assert t.peak_phase == "backward"        # second step: states live, every activation saved
    assert at_peak["parameters"] == states.params
    assert abs(at_peak["optimizer_state"] - states.optimizer) <= 4 * 200   # + a step counter each
    assert abs(at_peak["activations"] - acts) <= 0.01 * acts
    # the estimator's peak: weights, Adam state, activations, and the two fp32 (N, vocab) tensors
    # of the loss's backward (its incoming gradient and log-softmax's); gradients come later
    predicted = states.params + states.optimizer + acts + 2 * N * shape["vocab"] * 4
    assert t.peak > 24 * 2**30 and abs(t.peak - predicted) <= 0.05 * predicted   # none of it real


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_the_caching_allocator():
    with track("cuda") as t:
        x = torch.empty(2**20, device="cuda")
    assert t.peak >= 4 * 2**20 and t.reserved >= t.current and t.peak_reserved >= t.reserved
    with pytest.raises(torch.OutOfMemoryError):
        with memory_budget("64 MiB", device="cuda"):
            torch.empty(2**30, device="cuda")
    torch.empty(2**28, device="cuda")                        # the cap is gone
    del x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tracker_counts_cpu_storages_as_host():
    with track("cuda") as t:
        x = torch.empty(1000, device="cuda")
        y = torch.empty(100)                                 # CPU memory: the host
        z = torch.empty(50, pin_memory=True)
    assert t.host_current == 400 + 200 and t.breakdown("current")["temporaries"] == 4000
    del x, y, z


_MIB = 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_track_counts_from_its_start_and_resets_the_peak():
    before = torch.empty(64 * _MIB, dtype=torch.uint8, device="cuda")   # live before: not counted
    spike = torch.empty(256 * _MIB, dtype=torch.uint8, device="cuda")
    del spike                                           # an older, higher peak: reset on entry
    with track("cuda") as t:
        a = torch.empty(8 * _MIB, dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(4 * _MIB, dtype=torch.uint8, device="cuda")
        assert t.current == 4 * _MIB
    assert (t.current, t.peak) == (4 * _MIB, 8 * _MIB)  # max_memory_allocated - the start
    assert t.reserved >= t.current + 64 * _MIB          # the cache holds at least what lives
    assert t.breakdown("current")["temporaries"] == 4 * _MIB      # the ledger agrees
    del before, b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_step_breakdown_matches_the_allocator():
    model = GPT(vocab=512, seq_len=64, width=128, depth=2, heads=4, device="cuda")
    x = torch.randint(512, (8, 64), device="cuda")
    model.loss(x, x).backward()             # first matmuls: cuBLAS takes its workspace, for good
    model.zero_grad(set_to_none=True)
    with track("cuda") as t:
        opt = torch.optim.Adam(model.parameters())
        model.loss(x, x).backward()
        opt.step()
    end = t.breakdown("current")
    n = sum(p.numel() for p in model.parameters())
    assert end["gradients"] == 4 * n and end["optimizer_state"] >= 8 * n
    ledger = sum(end.values())                          # tensor storages, to the byte
    assert ledger <= t.current <= ledger + 512 * 4 * len(list(model.parameters()))  # 512 B blocks
    assert t.peak_phase in ("forward", "backward", "optimizer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_caps_the_allocator_and_lifts_the_cap_after_an_error():
    fraction = torch.cuda.get_per_process_memory_fraction()
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        with memory_budget("256 MiB", device="cuda"):
            ok = torch.empty(128 * _MIB, dtype=torch.uint8, device="cuda")   # fits
            del ok
            torch.empty(512 * _MIB, dtype=torch.uint8, device="cuda")        # does not
    assert torch.cuda.get_per_process_memory_fraction() == fraction
    big = torch.empty(1024 * _MIB, dtype=torch.uint8, device="cuda")         # the cap is gone
    del big


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_is_what_find_max_batch_size_runs_into():
    from companion.accumulation import find_max_batch_size

    def step(b):                                        # b MiB for one "step", then freed
        torch.empty(b * _MIB, dtype=torch.uint8, device="cuda")

    with memory_budget("200 MiB", device="cuda"):
        largest = find_max_batch_size(step, start=1, device="cuda")
    assert 150 <= largest <= 200                        # the allocator rounds to 2 MiB pages


class _FakeAllocator:
    """The caching allocator's counters, emulated: what `track` reads on CUDA."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.allocated))


def test_a_nested_cuda_tracker_leaves_the_outer_peak_whole(monkeypatch):
    """On CUDA every tracker resets the allocator's peak on entry: the open ones keep theirs."""
    fake = _FakeAllocator()
    fake.install(monkeypatch)
    fake.alloc(100)                                   # live before tracking: not counted
    with track("cuda:0") as outer:
        fake.alloc(1000)
        fake.alloc(-1000)                             # the outer block's peak: 1000 above base
        with track("cuda:0") as inner:
            fake.alloc(300)
            fake.alloc(-300)
        fake.alloc(200)
    assert (inner.peak, outer.peak, outer.current) == (300, 1000, 200)
    with track("cuda:0") as again:                    # a later tracker starts afresh
        fake.alloc(50)
    assert again.peak == 50


def test_a_leaf_that_requires_grad_is_not_a_parameter():
    """Saved for backward, a leaf that requires grad (what Hugging Face's
    enable_input_require_grads makes of a frozen embedding's output) is an activation; only
    nn.Parameters are parameters."""
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x * self.w                        # saves x and w

    with track() as t:
        model, x = Scale(), torch.randn(64, 16).requires_grad_()
        loss = model(x).sum()
        kinds = t.breakdown("current")
    assert kinds["parameters"] == 16 * 4
    assert kinds["activations"] == 64 * 16 * 4
    del loss
