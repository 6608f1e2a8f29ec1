"""companion.offload: offloaded training equals plain training bit for bit, the device keeps only
the weights (measured, against offload_placement). Activation offload and the host copies are
tested in test_activation_offload.py."""
import copy
import gc
import weakref

import pytest
import torch

from companion.estimate import offload_placement
from companion.memory import memory_budget, track
from companion.models import GPT, make_tokens
from companion.offload import CPUOffloadOptimizer, offload_activations, step_phases


def _gpt(seed=0, dtype=torch.float32):
    return GPT(32, 16, 32, 2, 4, seed=seed, dtype=dtype)


def _data(seed=0):
    return make_tokens(6, 16, vocab=32, seed=seed)


def _train(model, opt, steps=4, *, micro=1, scheduler=None):
    losses = []
    for step in range(steps):
        for k in range(micro):
            x, y = _data(seed=10 * step + k)
            loss = model.loss(x, y) / micro
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("options", [{}, {"foreach": False}, {"foreach": True}])
def test_offloaded_adamw_equals_plain_adamw_bit_for_bit(options):
    plain, offloaded = _gpt(), _gpt()
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1,
                                  **(options or {"fused": True}))
    opt = CPUOffloadOptimizer(offloaded.parameters(), lr=3e-3, weight_decay=0.1, **options)
    assert opt.optimizer.defaults.get("fused") is (True if not options else None)
    assert _train(plain, reference) == _train(offloaded, opt)
    assert _equal(plain, offloaded)


def test_groups_schedules_and_accumulation_match_too():
    plain, offloaded = _gpt(), _gpt()

    def groups(model):
        decay = [p for p in model.parameters() if p.ndim == 2]
        return [{"params": decay, "weight_decay": 0.1},
                {"params": [p for p in model.parameters() if p.ndim < 2], "lr": 1e-3}]

    reference = torch.optim.AdamW(groups(plain), lr=3e-3, fused=True)
    opt = CPUOffloadOptimizer(groups(offloaded), lr=3e-3)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                 for o in (reference, opt)]
    assert (_train(plain, reference, micro=2, scheduler=schedules[0])
            == _train(offloaded, opt, micro=2, scheduler=schedules[1]))
    assert _equal(plain, offloaded)
    assert opt.param_groups[1]["lr"] == reference.param_groups[1]["lr"] == 1e-3 / 16


def test_other_optimizers_run_on_the_host_too():
    plain, offloaded = _gpt(), _gpt()
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, fused=True)
    opt = CPUOffloadOptimizer(offloaded.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    assert _train(plain, reference) == _train(offloaded, opt)
    assert _equal(plain, offloaded)


def test_gradients_leave_the_device_as_backward_makes_them():
    plain, offloaded = _gpt(), _gpt()
    opt = CPUOffloadOptimizer(offloaded.parameters())
    seen = []
    for p in offloaded.parameters():                       # runs after the optimizer's own hook
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    x, y = _data()
    plain.loss(x, y).backward()
    offloaded.loss(x, y).backward()
    assert all(p.grad is None for p in offloaded.parameters()) and set(map(id, seen)) == {id(None)}
    assert all(torch.equal(p.grad, g) for p, g in zip(plain.parameters(), opt._grads))


def test_the_device_keeps_only_the_weights_measured_against_offload_placement():
    x, y = _data()
    with track("cpu") as t:
        model = _gpt()
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)
        for _ in range(2):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    n = sum(p.numel() for p in model.parameters())
    placed = offload_placement(n, zero_stage=2, offload_optimizer="cpu", convention="course",
                               param_bytes=4)
    step_counters = 4 * len(list(model.parameters()))      # AdamW's step: one fp32 per tensor
    ledger = opt.host_ledger()
    assert t.current == placed.device
    assert t.host_current == ledger["total reserved"]       # what the ledger says is reserved
    assert ledger["arena used"] == 8 * n                    # fp32 masters and gradients
    assert ledger["optimizer state"] == 8 * n + step_counters
    assert placed.host == ledger["arena used"] + ledger["optimizer state"] - step_counters
    assert 0 <= ledger["arena reserved"] - ledger["arena used"] < ledger["arena used"] // 4


def _run(optimizer_cls):
    model = _gpt()
    _train(model, optimizer_cls(model.parameters()), steps=2)


def test_a_budget_too_small_for_adam_trains_with_offload():
    peaks = {}
    for cls in (torch.optim.AdamW, CPUOffloadOptimizer):
        with track("cpu") as t:
            _run(cls)
        peaks[cls] = t.peak
    n = sum(p.numel() for p in _gpt().parameters())
    assert peaks[torch.optim.AdamW] - peaks[CPUOffloadOptimizer] >= 8 * n   # Adam's two moments
    budget = (peaks[torch.optim.AdamW] + peaks[CPUOffloadOptimizer]) // 2
    with pytest.raises(torch.OutOfMemoryError):
        with memory_budget(budget):
            _run(torch.optim.AdamW)
    with memory_budget(budget):
        _run(CPUOffloadOptimizer)


def test_16_bit_weights_keep_an_fp32_master_on_the_host():
    model, plain = _gpt(dtype=torch.bfloat16), _gpt(dtype=torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in plain.parameters()]
    reference = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _data(seed=step)
        for m in (model, plain):
            m.loss(x, y).backward()
        for p, m in zip(plain.parameters(), masters):
            m.grad = p.grad.float()                        # what the hook copies down
        reference.step()
        for p, m in zip(plain.parameters(), masters):
            p.grad = None
            p.data.copy_(m.data)                           # fp32 master -> bf16 weights
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(m, r) for m, r in zip(opt.master_params, masters))
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
               for p, m in zip(model.parameters(), masters))


def test_state_dict_round_trip_continues_identically():
    a, b = _gpt(), _gpt()
    opt_a = CPUOffloadOptimizer(a.parameters(), lr=1e-2)
    _train(a, opt_a, steps=2)
    b.load_state_dict(a.state_dict())
    opt_b = CPUOffloadOptimizer(b.parameters(), lr=5.0)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))   # as torch.save + torch.load
    assert opt_b.param_groups[0]["lr"] == 1e-2
    assert _train(a, opt_a, steps=2) == _train(b, opt_b, steps=2)
    assert _equal(a, b)


@pytest.mark.parametrize("params, message", [
    ([], "no parameters"),
    ([torch.zeros(3, dtype=torch.int64)], "floating-point"),
    ([torch.zeros(3)], "requires grad"),
])
def test_bad_parameters_raise_clear_errors(params, message):
    with pytest.raises(ValueError, match=message):
        CPUOffloadOptimizer(params)


def test_removed_hooks_stop_the_copies():
    model = _gpt()
    opt = CPUOffloadOptimizer(model.parameters())
    opt.remove_hooks()
    model.loss(*_data()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_step_phases_reports_the_offloaded_phases():
    model = _gpt()
    opt = CPUOffloadOptimizer(model.parameters())
    x, y = _data()
    phases = step_phases(lambda: model.loss(x, y), opt, steps=2)
    assert set(phases) == {"forward", "backward", "step", "copy_down", "wait", "host_step",
                           "copy_up"}
    assert all(v > 0 for v in phases.values()) and phases["host_step"] < phases["step"]
    assert phases["copy_down"] < phases["backward"]        # the hooks run inside backward


@pytest.mark.parametrize("steps, loss_fn, error", [
    (0, None, ValueError), (1.5, None, ValueError), (1, lambda: 1.0, TypeError)])
def test_step_phases_rejects_bad_arguments(steps, loss_fn, error):
    model = _gpt()
    x, y = _data()
    with pytest.raises(error, match="steps|loss tensor"):
        step_phases(loss_fn or (lambda: model.loss(x, y)), torch.optim.SGD(model.parameters(),
                                                                          lr=0.1), steps=steps)


# ---------------------------------------------------------------- settings, hooks, clipping

@pytest.mark.parametrize("settings, error, message", [
    ({"lr": -1.0}, ValueError, "Invalid learning rate"),
    ({"lr": "fast"}, TypeError, "rejects the settings"),
    ({"weight_decy": 0.1}, TypeError, "weight_decy"),
    ({"optimizer_cls": 3}, TypeError, "torch.optim.Optimizer class"),
])
def test_settings_are_validated_by_the_optimizer(settings, error, message):
    with pytest.raises(error, match=message):
        CPUOffloadOptimizer(_gpt().parameters(), **settings)


def test_settings_reach_the_host_optimizer():
    opt = CPUOffloadOptimizer(_gpt().parameters(), lr=2e-3, betas=(0.8, 0.9))
    group = opt.optimizer.param_groups[0]
    assert (group["lr"], group["betas"]) == (2e-3, (0.8, 0.9))


def test_the_model_or_a_tensor_instead_of_parameters_fails_clearly():
    with pytest.raises(TypeError, match="model.parameters"):
        CPUOffloadOptimizer(_gpt())


def test_a_discarded_optimizer_is_freed_and_its_hooks_removed():
    model = _gpt()
    opt = CPUOffloadOptimizer(model.parameters())
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    model.loss(*_data()).backward()                        # no hook moves the gradients now
    assert all(p.grad is not None for p in model.parameters())
    second = CPUOffloadOptimizer(model.parameters())       # and a new optimizer works
    model.zero_grad(set_to_none=True)
    model.loss(*_data()).backward()
    assert all(p.grad is None for p in model.parameters()) and all(second._has_grad)


def test_two_live_optimizers_on_the_same_parameters_fail_clearly():
    model = _gpt()
    first = CPUOffloadOptimizer(model.parameters())
    second = CPUOffloadOptimizer(model.parameters())       # noqa: F841 (alive: its hooks run)
    with pytest.raises(RuntimeError, match="remove_hooks"):
        model.loss(*_data()).backward()
    first.remove_hooks()
    model.zero_grad(set_to_none=True)
    model.loss(*_data()).backward()                        # now the second one takes them
    assert all(p.grad is None for p in model.parameters()) and all(second._has_grad)


def test_clip_grad_norm_on_the_host_equals_pytorch_on_the_device():
    plain, offloaded = _gpt(), _gpt()
    reference = torch.optim.AdamW(plain.parameters(), lr=0.1, fused=True)
    opt = CPUOffloadOptimizer(offloaded.parameters(), lr=0.1)
    x, y = _data()
    for model in (plain, offloaded):
        (model.loss(x, y) * 1000).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    assert float(torch.nn.utils.clip_grad_norm_(offloaded.parameters(), 1e-3)) == 0.0  # no grads
    assert torch.equal(opt.clip_grad_norm_(1e-3), norm) and float(norm) > 1e-3   # it clipped
    reference.step()
    opt.step()
    assert _equal(plain, offloaded)


def test_clip_grad_norm_before_backward_fails_clearly():
    with pytest.raises(RuntimeError, match="after backward"):
        CPUOffloadOptimizer(_gpt().parameters()).clip_grad_norm_(1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_pins_host_memory_and_tracks_plain_training():
    plain, offloaded = _gpt().cuda(), copy.deepcopy(_gpt()).cuda()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    opt = CPUOffloadOptimizer(offloaded.parameters(), lr=1e-3)
    assert all(m.is_pinned() and not m.is_cuda for m in opt.master_params)
    for step in range(3):
        x, y = (t.cuda() for t in _data(seed=step))
        for model, o in ((plain, reference), (offloaded, opt)):
            model.loss(x, y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(plain.parameters(), offloaded.parameters()):   # CUDA's and the CPU's fused
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)     # kernels round alike, not same
    with offload_activations(min_bytes=0) as moved:
        loss = offloaded.loss(x, y)
    loss.backward()
    assert moved.bytes_to_host == moved.bytes_to_device > 0


def test_chapter_sizes_for_a_gpu_fit_an_80_gb_device_at_60_percent():
    from companion import estimate
    from companion.device import _SIZES
    s = _SIZES["cuda"]
    n = estimate.gpt_params(s.vocab, s.seq_len, s.offload_width, s.offload_depth)
    states = estimate.model_states(n, optimizer="adamw").total
    activations = estimate.gpt_activations(s.offload_batch, s.seq_len, s.offload_width,
                                           s.offload_depth, s.gpt_heads, s.vocab)
    plain = states + activations
    n_act = estimate.gpt_params(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth)
    activation_demo = estimate.model_states(n_act).total + estimate.gpt_activations(
        s.act_offload_batch, s.seq_len, s.gpt_width, s.gpt_depth, s.gpt_heads, s.vocab)
    assert plain <= 0.6 * 80e9 and activation_demo <= 0.6 * 80e9
    assert states > 2 * activations          # the model states are what does not fit


# ---------------------------------------------------------------- the contract of torch.optim.AdamW

def test_an_added_param_group_trains_on_the_host_as_with_adamw():
    plain, offloaded = _gpt(), _gpt()
    runs = []
    for model, make in ((plain, lambda ps: torch.optim.AdamW(ps, lr=3e-3, fused=True)),
                        (offloaded, lambda ps: CPUOffloadOptimizer(ps, lr=3e-3))):
        params = list(model.parameters())
        opt = make(params[:3])
        losses = _train(model, opt, steps=1)
        opt.add_param_group({"params": params[3:], "lr": 1e-3, "weight_decay": 0.3})
        runs.append(losses + _train(model, opt, steps=3))
    assert runs[0] == runs[1] and _equal(plain, offloaded)


@pytest.mark.parametrize("direction", ["offload to AdamW", "AdamW to offload"])
def test_a_state_dict_moves_between_adamw_and_the_offloaded_optimizer(direction):
    first, second = (_gpt(), _gpt())
    reference = _gpt()
    offload = lambda ps, lr: CPUOffloadOptimizer(ps, lr=lr)
    adamw = lambda ps, lr: torch.optim.AdamW(ps, lr=lr, fused=True)
    make_first, make_second = (offload, adamw) if direction == "offload to AdamW" else (adamw, offload)
    opt = make_first(first.parameters(), 1e-2)
    _train(first, opt, steps=2)
    second.load_state_dict(first.state_dict())
    resumed = make_second(second.parameters(), 5.0)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.param_groups[0]["lr"] == 1e-2
    plain = adamw(reference.parameters(), 1e-2)
    _train(reference, plain, steps=2)
    assert _train(second, resumed, steps=2) == _train(reference, plain, steps=2)
    assert _equal(second, reference)


# ---------------------------------------------------------------- issue 26: bytes, pipeline, arena, DPU

def test_16_bit_gradients_travel_as_16_bit_and_accumulate_on_the_host():
    model, plain = _gpt(dtype=torch.bfloat16), _gpt(dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    sums = [torch.zeros(p.shape) for p in plain.parameters()]
    for k in range(3):                                      # three micro-batches, one step
        x, y = _data(seed=k)
        model.loss(x, y).backward()
        plain.loss(x, y).backward()
        for s, p in zip(sums, plain.parameters()):
            s.add_(p.grad.float())                          # fp32 sums of the bf16 gradients
            p.grad = None
        assert opt.bytes_down == 2 * n * (k + 1)            # 2 bytes per parameter, not 4
    opt._wait()
    for i in range(len(opt._params)):
        opt._drain(i)
    assert all(g.dtype == torch.float32 and torch.equal(g, s) for g, s in zip(opt._grads, sums))
    opt.step()
    assert opt.bytes_up == 2 * n
    assert all(land.dtype == torch.bfloat16 for land in opt._landing)


def test_fp32_weights_send_4_bytes_each_way_and_accumulate_like_adamw():
    plain, offloaded = _gpt(), _gpt()
    n = sum(p.numel() for p in offloaded.parameters())
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, fused=True)
    opt = CPUOffloadOptimizer(offloaded.parameters(), lr=3e-3)
    assert _train(plain, reference, steps=2, micro=3) == _train(offloaded, opt, steps=2, micro=3)
    assert _equal(plain, offloaded)
    assert (opt.bytes_down, opt.bytes_up) == (4 * n * 6, 4 * n * 2)


def _grouped(model):
    return [{"params": list(b.parameters())} for b in
            (model.tok, model.pos, *model.blocks, model.ln, model.head)]


def test_the_step_goes_group_by_group_each_copy_up_right_after_its_host_step():
    plain, offloaded = _gpt(), _gpt()
    reference = torch.optim.AdamW(_grouped(plain), lr=3e-3, weight_decay=0.1, fused=True)
    opt = CPUOffloadOptimizer(_grouped(offloaded), lr=3e-3, weight_decay=0.1)
    assert _train(plain, reference, steps=3) == _train(offloaded, opt, steps=3)
    assert _equal(plain, offloaded)
    order = [(g, what) for g, what, _, _ in opt.timeline]
    groups = len(opt.param_groups)
    assert order == [(g, w) for g in range(groups) for w in ("host_step", "copy_up")]
    ends = [end for _, _, _, end in opt.timeline]
    starts = [start for _, _, start, _ in opt.timeline]
    assert all(a <= b for a, b in zip(ends, starts[1:]))     # in that order, on one host thread


def test_each_group_s_host_step_walks_only_that_group_and_restores_the_rest():
    model = _gpt()
    opt = CPUOffloadOptimizer(_grouped(model), lr=3e-3)
    every, seen, step = opt.optimizer.param_groups, [], opt.optimizer.step

    def recording():
        seen.append([id(g) for g in opt.optimizer.param_groups])
        return step()

    opt.optimizer.step = recording
    _train(model, opt, steps=1)
    assert seen == [[id(g)] for g in every]                   # one group per call, in order
    assert opt.optimizer.param_groups is every
    assert all(m.grad is None for m in opt.master_params)

    def broken():
        raise RuntimeError("broken")

    opt.optimizer.step = broken
    model.loss(*_data()).backward()
    with pytest.raises(RuntimeError, match="broken"):
        opt.step()
    assert opt.optimizer.param_groups is every               # restored after a failed step
    assert all(m.grad is None for m in opt.master_params)


def test_16_bit_weights_are_the_masters_rounded_after_each_step():
    model = _gpt(dtype=torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    _train(model, opt, steps=2)
    assert all(torch.equal(p, m.to(torch.bfloat16))
               for p, m in zip(model.parameters(), opt.master_params))


def test_the_arena_reserves_powers_of_two_and_the_ledger_says_so():
    from companion.offload import HostArena, pinned_reserved
    sizes = [40_960_000, 3, 4096, 1_000_000]
    assert pinned_reserved([40_960_000], arena=False) == 64 * 2**20   # rounded alone
    assert pinned_reserved(sizes, arena=False) == 2**26 + 4 + 4096 + 2**20
    arena = HostArena(pin=False)
    tensors = arena.carve([((s,), torch.uint8) for s in sizes])
    assert [t.numel() for t in tensors] == sizes and arena.used == sum(sizes)
    assert arena.reserved == pinned_reserved(sizes) == sum(b.numel() for b in arena.blocks)
    assert all(b.numel() & (b.numel() - 1) == 0 for b in arena.blocks)   # each a power of two
    assert arena.reserved < pinned_reserved(sizes, arena=False)
    many = [1_300_000 + 4096 * k for k in range(30)]        # a model's many tensors
    assert pinned_reserved(many) - sum(many) < 0.1 * sum(many) < pinned_reserved(
        many, arena=False) - sum(many)
    tensors[0].fill_(7)
    assert tensors[1].sum() == 0                                      # the views do not overlap
    with pytest.raises(ValueError, match="power of two"):
        HostArena(pin=False, chunk_bytes=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_bytes_tracked_equal_the_ledger(dtype):
    x, y = _data()
    with track("cpu") as t:
        model = _gpt(dtype=dtype)
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)
        for _ in range(2):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert t.host_current == opt.host_ledger()["total reserved"]


def _dpu_reference(model, steps, exact_steps):
    """Delayed update by hand: step t's gradients are taken at weights that hold the updates of
    steps up to t - 2 (after the exact ones)."""
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.1, fused=True)
    losses, late = [], False
    for step in range(steps):
        x, y = _data(seed=10 * step)                     # as _train draws them
        loss = model.loss(x, y)
        loss.backward()
        losses.append(loss.item())
        if late:                                          # the previous host step's weights
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
        for p, m in zip(model.parameters(), masters):
            m.grad, p.grad = p.grad, None
        opt.step()
        if step < exact_steps:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
        late = step >= exact_steps
    return losses


@pytest.mark.parametrize("exact_steps", [1, 3])
def test_delayed_update_follows_its_documented_staleness(exact_steps):
    by_hand, offloaded = _gpt(), _gpt()
    want = _dpu_reference(by_hand, 6, exact_steps)
    opt = CPUOffloadOptimizer(offloaded.parameters(), lr=3e-3, weight_decay=0.1, delay=1,
                              exact_steps=exact_steps)
    got = _train(offloaded, opt, steps=6)
    assert got == want
    plain = _gpt()
    exact = _train(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1,
                                            fused=True), steps=6)
    assert got[:exact_steps + 1] == exact[:exact_steps + 1]   # the same until the delay starts
    assert got[exact_steps + 1] != exact[exact_steps + 1]     # then one step staler
    opt.synchronize()                                    # the last host step's weights go up
    assert opt._background is None


def test_host_weights_hold_every_update_and_leave_the_training_as_it_was():
    """host_weights() waits for the host step in flight and returns the masters, which then hold
    what synchronize() would put on the device; the device keeps its staler weights, so the run
    trains exactly as one that never looked."""
    looked, untouched = _gpt(), _gpt()
    opt = CPUOffloadOptimizer(looked.parameters(), lr=3e-3, weight_decay=0.1, delay=1)
    other = CPUOffloadOptimizer(untouched.parameters(), lr=3e-3, weight_decay=0.1, delay=1)
    seen, losses = [], []
    for step in range(4):
        x, y = _data(seed=10 * step)
        for model, o in ((looked, opt), (untouched, other)):
            loss = model.loss(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        seen = [w.clone() for w in opt.host_weights()]
        assert opt._background is None or opt._background.done()
    assert losses[0::2] == losses[1::2]                  # looking changed nothing
    stale = [p.detach().clone() for p in looked.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(stale, seen))   # the device is behind
    opt.synchronize()
    assert all(torch.equal(p, w) for p, w in zip(looked.parameters(), seen))
    other.synchronize()


def test_delay_0_is_exact_and_bad_delays_fail_clearly():
    plain, offloaded = _gpt(), _gpt()
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, fused=True)
    opt = CPUOffloadOptimizer(offloaded.parameters(), lr=3e-3, delay=0)
    assert _train(plain, reference) == _train(offloaded, opt)
    for bad, message in [({"delay": 2}, "delay must be 0"), ({"delay": True}, "delay must be 0"),
                         ({"exact_steps": 0}, "exact_steps must be")]:
        with pytest.raises(ValueError, match=message):
            CPUOffloadOptimizer(_gpt().parameters(), **bad)


def test_delayed_update_with_16_bit_weights_and_accumulation_trains():
    model = _gpt(dtype=torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=3e-3, delay=1)
    losses = _train(model, opt, steps=5, micro=2)
    opt.synchronize()
    assert all(l == l for l in losses) and losses[-1] < losses[0] + 0.5
