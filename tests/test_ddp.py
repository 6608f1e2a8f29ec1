"""companion.ddp: our DDP trains like one process on the full batch and like torch's DDP."""
import pytest
import torch
from torch import nn

from companion import ddp, launch
from companion.ddp.core import _make_buckets

BATCH, STEPS = 12, 3


class Tied(nn.Module):
    """Embedding and output layer share one weight; a frozen scale does not require grad."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.scale = nn.Parameter(torch.full((dim,), 0.5), requires_grad=False)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))) * self.scale)


def _model(kind, seed):
    torch.manual_seed(seed)
    if kind == "tied":
        return Tied()
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _data(kind, step):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        x = torch.randint(0, 11, (BATCH,), generator=g)
        return x, torch.randint(0, 11, (BATCH,), generator=g), nn.functional.cross_entropy
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g), \
        nn.functional.mse_loss


def _single_process(kind):
    model = _model(kind, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for step in range(STEPS):
        x, y, loss_fn = _data(kind, step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train(rank, world_size, kind, wrapper, bucket_cap_mb):
    model = _model(kind, seed=rank)                   # different starts: DDP must broadcast
    if wrapper in ("ours", "ours-view"):
        wrapped = ddp.DDP(model, bucket_cap_mb=bucket_cap_mb,
                          gradient_as_bucket_view=wrapper == "ours-view")
    elif wrapper == "torch":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        ddp.broadcast_parameters(model)
        wrapped = model
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    launched_during_backward = []
    for step in range(STEPS):
        x, y, loss_fn = _data(kind, step)
        mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        loss_fn(wrapped(x[mine]), y[mine]).backward()
        if wrapper.startswith("ours"):
            launched_during_backward.append(wrapped.stats.all_reduces)
            wrapped.finish_gradient_synchronization()
        elif wrapper == "naive":
            ddp.average_gradients(model)
        opt.step()
        opt.zero_grad()
    buckets = len(wrapped.buckets) if wrapper.startswith("ours") else 0
    return [p.detach().clone() for p in model.parameters()], launched_during_backward, buckets


@pytest.mark.parametrize("world_size, kind", [(2, "mlp"), (3, "mlp"), (2, "tied")])
def test_matches_one_process_and_torch_ddp(world_size, kind):
    expected = _single_process(kind)
    for wrapper, cap in [("ours", 0.0002), ("ours", 25.0), ("ours-view", 0.0002), ("torch", None),
                         ("naive", None)]:
        results = launch.run(_train, world_size, kind, wrapper, cap, timeout=60)
        for params, launched, buckets in results:
            for got, want in zip(params, expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if wrapper.startswith("ours"):   # every bucket started during backward: overlap
                assert launched == [buckets * (s + 1) for s in range(STEPS)]
                assert (buckets > 1) == (cap < 0.01)


def _no_sync(rank, world_size):
    model = ddp.DDP(_model("mlp", seed=0))
    x, y, loss_fn = _data("mlp", rank)
    with model.no_sync():
        loss_fn(model(x), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    calls_inside = model.stats.all_reduces
    model.finish_gradient_synchronization()           # nothing pending: a no-op
    unchanged = all(torch.equal(a, p.grad) for a, p in zip(local, model.parameters()))
    loss_fn(model(x), y).backward()                   # outside: syncs the accumulated sum
    try:
        model(x)
        forgot = None
    except RuntimeError as e:
        forgot = str(e)
    model.finish_gradient_synchronization()
    return local, calls_inside, unchanged, [p.grad.clone() for p in model.parameters()], forgot


def test_no_sync_keeps_gradients_local_until_the_next_synced_backward():
    results = launch.run(_no_sync, 2, timeout=30)
    (local0, calls, unchanged, synced0, forgot), (local1, _, _, synced1, _) = results
    assert calls == 0 and unchanged
    assert not torch.allclose(local0[0], local1[0])   # different data, different local grads
    for a, b, l0, l1 in zip(synced0, synced1, local0, local1):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, l0 + l1)        # (2·g0 + 2·g1) / 2
    assert "finish_gradient_synchronization" in forgot


def _accumulate(rank, world_size, k):
    model = ddp.DDP(_model("mlp", seed=0), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y, loss_fn = _data("mlp", 0)
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    xs, ys = x[mine].chunk(k), y[mine].chunk(k)
    ddp.accumulation_step(model, list(zip(xs, ys)), loss_fn, opt)
    return [p.detach() for p in model.parameters()], model.stats.all_reduces, len(model.buckets)


def test_accumulation_with_no_sync_matches_the_full_batch_and_syncs_once():
    model = _model("mlp", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y, loss_fn = _data("mlp", 0)
    loss_fn(model(x), y).backward()
    opt.step()
    for params, calls, buckets in launch.run(_accumulate, 2, 3, timeout=30):
        assert calls == buckets
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach())


def test_buckets_respect_the_cap_and_one_dtype_each():
    params = [nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(100)),
              nn.Parameter(torch.zeros(300)), nn.Parameter(torch.zeros(10, dtype=torch.float64))]
    buckets = _make_buckets(params, cap_bytes=800)
    assert [[p.numel() for p in b.params] for b in buckets] == [[100, 100], [300], [10]]
    assert [b.flat.dtype for b in buckets] == [torch.float32] * 2 + [torch.float64]


def test_step_memory_counts_the_buckets_as_one_more_gradient_copy():
    copy_, view = (launch.run(ddp.step_memory, 2, 32, 3, 4, v)[0] for v in (False, True))
    assert copy_["buckets"] == view["buckets"] == copy_["gradients"]
    assert copy_["held"] - view["held"] == copy_["gradients"]


def test_profile_buckets_reports_every_cap():
    out = launch.run(ddp.profile_buckets, 2, 32, 6, 4, [0.001, 1.0], 2)[0]
    assert out["parameters"] == 6 and out["gradient_bytes"] == 6 * 32 * 32 * 4   # no biases
    assert out["caps"][0.001]["buckets"] == 6 and out["caps"][1.0]["buckets"] == 1
    for cap in out["caps"].values():
        assert len(cap["times"].buckets) == cap["buckets"]
        assert 0 < cap["fastest"] <= cap["seconds"] <= cap["slowest"]
        assert 0 < cap["backward_seconds"] < cap["slowest"]
    assert out["backward_seconds"] > 0


def test_profile_buckets_interleaves_the_caps_and_backward_alone():
    out = launch.run(ddp.profile_buckets, 2, 16, 4, 2, [0.0005, 0.002, 1.0], 3)[0]
    assert [c["buckets"] for c in out["caps"].values()] == [4, 2, 1]
    assert all(len(c["step_times"]) == len(c["backward_times"]) == 3 for c in out["caps"].values())
    assert len(out["backward_alone"]) == 3


def test_concurrent_all_reduces_report_both_sums_and_every_trial():
    for out in launch.run(ddp.concurrent_all_reduces, 2, 2**16, 16, 3):
        assert out["summed"] and out["trials"] == 3 and 0 <= out["overtaken"] <= 3
        assert 0 < out["small_done"] <= out["large_done"]      # it waited for the small first


def test_training_step_without_communication_sends_nothing():
    for out in launch.run(ddp.time_training_step, 2, "none", 8, 2, 4, 2):
        assert out["all_reduce_bytes"] is None and len(out["times"]) == 2
    with pytest.raises(Exception, match="impl must be"):
        launch.run(ddp.time_training_step, 1, "nccl", 8, 2, 4, 2)


def _steps_leave_no_gradient(rank, world_size):
    from companion.ddp.experiments import _timed_steps
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    wrapped = ddp.DDP(model, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    seconds, backward = _timed_steps(wrapped, torch.optim.SGD(model.parameters(), lr=0.0), x, y, 3)
    return [p.grad is None for p in model.parameters()], len(seconds), len(backward)


def test_timed_steps_zero_the_gradients_between_steps():
    for zeroed, steps, backwards in launch.run(_steps_leave_no_gradient, 2):
        assert all(zeroed) and steps == backwards == 3      # no accumulation across timed steps


def _bucket_memory(rank, world_size, as_view):
    from companion.memory import track
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    grads = sum(p.numel() * 4 for p in model.parameters())
    with track("cpu") as t:
        wrapped = ddp.DDP(model, bucket_cap_mb=0.02, gradient_as_bucket_view=as_view)
        x = torch.randn(8, 64)
        for _ in range(2):                    # the second step reuses what the first allocated
            wrapped(x).square().mean().backward()
            wrapped.finish_gradient_synchronization()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            model.zero_grad(set_to_none=False)
    shared = all(p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
                 for b in wrapped.buckets for p in b.params)
    times = wrapped.last_times
    return t.current, grads, shared, len(wrapped.buckets), times


def test_gradient_as_bucket_view_keeps_the_gradients_once():
    (copy_bytes, grads, shared_copy, n, times), _ = launch.run(_bucket_memory, 2, False)
    (view_bytes, _, shared_view, _, _), _ = launch.run(_bucket_memory, 2, True)
    assert shared_view and not shared_copy
    assert copy_bytes - view_bytes == grads           # the second copy of the gradients is gone
    assert n > 3 and len(times.buckets) == n          # one record per bucket, in launch order
    assert [b[0] for b in times.buckets] == list(range(n))
    assert all(0 < start <= end for _, _, start, end in times.buckets)
    assert times.buckets[0][2] <= times.backward_end  # the first bucket left during backward


def _wrapped_twice(rank, world_size, view):
    """A cell run twice: the module is wrapped again while the first wrapper is still alive."""
    model = _model("mlp", seed=rank)
    first = ddp.DDP(model, bucket_cap_mb=0.0002, gradient_as_bucket_view=view)
    first_buckets = first.buckets
    wrapped = ddp.DDP(model, bucket_cap_mb=0.0002, gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for step in range(STEPS):
        x, y, loss_fn = _data("mlp", step)
        mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        loss_fn(wrapped(x[mine]), y[mine]).backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    try:
        first(x)
        old = "no error"
    except RuntimeError as e:
        old = str(e)
    untouched = all(b.work is None for b in first_buckets) and first.stats.all_reduces == 0
    return [p.detach().clone() for p in model.parameters()], \
        wrapped.stats.all_reduces / len(wrapped.buckets), old, untouched


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket view"])
def test_wrapping_a_module_again_moves_the_hooks_and_trains_like_torch(view):
    expected = _single_process("mlp")
    for params, all_reduces, old, untouched in launch.run(_wrapped_twice, 2, view, timeout=60):
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert untouched and all_reduces == STEPS           # one wrapper's buckets, not two
        assert "a newer DDP wraps this module" in old


def test_bucket_times_on_a_gpu_come_from_cuda_events(monkeypatch):
    """On CUDA the host clock times launches; `_Marks` records events (the all-reduce's end on
    NCCL's stream, from the `.then()` callback) and turns them into seconds after one sync.
    Emulated with events that know their time."""
    from companion.ddp.core import BucketTimes, _Marks
    clock = iter([0.0, 0.004, 0.001, 0.009])               # t0, backward end, launch, end

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = next(clock)

        def elapsed_time(self, other):                      # milliseconds, as CUDA's
            return 1000 * (other.at - self.at)
    synced = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    marks = _Marks(cuda=True)
    t0, times = marks.mark(), BucketTimes()
    times.backward_end = marks.mark()
    times.buckets.append([0, 1024, marks.mark(), marks.mark()])
    marks.resolve(times, t0)
    assert synced == [True] and times.backward_end == pytest.approx(0.004)
    assert times.buckets[0][2:] == [pytest.approx(0.001), pytest.approx(0.009)]
