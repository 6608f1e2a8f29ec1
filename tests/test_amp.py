"""companion.amp against PyTorch's own: GradScaler beside torch.amp.GradScaler step for step,
the scale rule and the unscale kernel beside torch's, MasterWeights beside fp32 training, and
autocast_dtypes beside the dtypes the tensors really have."""
import copy
import math
import random

import pytest
import torch

from companion import amp
from companion import estimate as E
from companion.memory import track
from companion.models import GPT, MLP, make_classification, make_tokens


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one thread is as fast, and on a loaded 2-core machine two OpenMP
    threads that wait for each other make every operator many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _twins(seed=0, dtype=torch.float32, device="cpu"):
    model = MLP(9, 24, 3, 5, seed=seed, dtype=dtype, device=device)
    return model, copy.deepcopy(model)


def _run_side_by_side(ours, theirs, steps, *, autocast=torch.float16, inject=True, clip=True,
                      device="cpu"):
    """Train two copies of one model, one with each scaler; return (our, their) models, optimizers
    and the scale after every step."""
    m1, m2 = _twins(device=device)
    o1, o2 = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (m1, m2))
    X, y = (t.to(device) for t in make_classification(33, 9, 5))
    trace = []
    for step in range(steps):
        for model, opt, scaler in ((m1, o1, ours), (m2, o2, theirs)):
            opt.zero_grad()
            with torch.autocast(device, dtype=autocast):
                loss = model.loss(X, y)
            scaled = scaler.scale(loss)
            if inject and step % 13 == 5:
                scaled = scaled * math.inf                    # every gradient becomes inf/NaN
            if inject and step % 29 == 11:
                scaled = scaled * math.nan
            scaled.backward()
            if clip:
                scaler.unscale_(opt)                          # true gradients before clipping
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        trace.append((ours.get_scale(), theirs.get_scale()))
    return (m1, o1), (m2, o2), trace


@pytest.mark.parametrize("autocast, clip", [(torch.float16, True), (torch.bfloat16, False)])
def test_same_scale_trajectory_and_parameters_bit_for_bit_as_torch(autocast, clip):
    kwargs = dict(init_scale=2.0**12, growth_interval=7)
    ours, theirs = amp.GradScaler("cpu", **kwargs), torch.amp.GradScaler("cpu", **kwargs)
    (m1, o1), (m2, o2), trace = _run_side_by_side(ours, theirs, 300, autocast=autocast, clip=clip)
    scales = [a for a, _ in trace]
    assert all(a == b for a, b in trace)
    assert any(b < a for a, b in zip(scales, scales[1:]))          # backoffs happened
    assert any(b > a for a, b in zip(scales, scales[1:]))          # growth happened
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for s1, s2 in zip(o1.state.values(), o2.state.values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s2)
    assert ours.state_dict() == theirs.state_dict()


def _torch_replay(amaxes, init_scale, interval):
    """torch.amp.GradScaler over gradients an fp16 backward would make: scale * amax in fp16."""
    weight = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.0)
    ran = []
    opt.register_step_post_hook(lambda *_: ran.append(True))
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=interval)
    steps = []
    for amax in amaxes:
        scale = scaler.scale(torch.ones(())).item()        # the scale this step's backward uses
        scaled = (torch.tensor([amax, -amax / 2, 0.0]) * torch.tensor(scale)).half()
        weight.grad = scaled.float()
        before = len(ran)
        scaler.step(opt)
        scaler.update()
        steps.append((scale, len(ran) > before))
    return steps


def _trace(rng, n):
    trace = [10 ** rng.uniform(-2, 0.5) for _ in range(n)]
    for i in rng.sample(range(n), n // 8):
        trace[i] *= rng.choice([30.0, 1e3, math.inf, math.nan])
    return trace


@pytest.mark.parametrize("seed", range(4))
def test_replay_scale_is_torchs_scaler_over_fp16_gradients(seed):
    rng = random.Random(seed)
    trace = _trace(rng, 120)
    scale = 2.0**16
    interval = rng.randint(2, 8)
    ours = amp.replay_scale(trace, scale, interval)
    assert ours == _torch_replay(trace, scale, interval)
    assert any(not stepped for _, stepped in ours) and len({s for s, _ in ours}) > 2


def test_replay_scale_overflows_where_fp16_rounding_reaches_inf_not_at_65504():
    trace = [65510 / 2.0**15, 65519 / 2.0**15, 65521 / 2.0**15, 65510 / 2.0**14]
    ours = amp.replay_scale(trace, 2.0**15, 100)
    assert ours == _torch_replay(trace, 2.0**15, 100)
    assert ours == [(2.0**15, True), (2.0**15, True), (2.0**15, False), (2.0**14, True)]


def test_replay_scale_keeps_a_scale_that_float32_cannot_grow():
    trace = [1e-36] * 6
    ours = amp.replay_scale(trace, 2.0**126, 2)
    assert ours == _torch_replay(trace, 2.0**126, 2)
    assert [s for s, _ in ours] == [2.0**126] * 2 + [2.0**127] * 4


def test_a_skipped_step_leaves_parameters_and_optimizer_untouched():
    scaler = amp.GradScaler("cpu")
    model, _ = _twins()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    X, y = make_classification(8, 9, 5)
    before = [p.detach().clone() for p in model.parameters()]
    (scaler.scale(model.loss(X, y)) * math.inf).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state                                            # Adam never ran
    assert scaler.get_scale() == 2.0**15


@pytest.mark.parametrize("growth_factor, backoff_factor, interval", [(2.0, 0.5, 3), (1.7, 0.3, 2),
                                                                     (3.0, 0.9, 1)])
@pytest.mark.parametrize("start_count", [0, 5])
def test_update_scale_matches_torchs_kernel(growth_factor, backoff_factor, interval, start_count):
    """Also from a count past the interval (a shortened interval): torch grows only at `==`."""
    rng = random.Random(interval)
    scale, tracker = torch.full((), 2.0**120), torch.full((), start_count, dtype=torch.int32)
    ours = (scale.item(), start_count)
    for _ in range(400):                                  # reaches float32's top: growth refused
        found = rng.random() < 0.1
        torch._amp_update_scale_(scale, tracker, torch.full((), float(found)), growth_factor,
                                 backoff_factor, interval)
        ours = amp.update_scale(*ours, found, growth_factor=growth_factor,
                                backoff_factor=backoff_factor, growth_interval=interval)
        assert ours == (scale.item(), tracker.item())
        assert math.isfinite(ours[0])


@pytest.mark.parametrize("inv_scale", [2.0**-16, 1 / 3, 1.0])
def test_unscale_grads_matches_torchs_kernel(inv_scale):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(37, generator=g), torch.randn(5, 3, generator=g).bfloat16(),
             torch.randn(4, generator=g) * 1e30, torch.empty(0)]
    for poison in [None, math.inf, -math.inf, math.nan]:
        ours = [t.clone() for t in grads]
        theirs = [t.clone() for t in grads]
        if poison is not None:
            ours[1][2, 1] = theirs[1][2, 1] = poison
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, torch.tensor(inv_scale))
        flag = amp.unscale_grads_(ours, torch.tensor(inv_scale))
        assert flag.item() == found.item() == float(poison is not None)
        assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("poisons", [(math.inf, math.inf), (math.nan, -math.inf),
                                     (math.inf, math.inf, math.nan)])
def test_unscale_grads_returns_a_flag_however_many_dtype_groups_overflow(poisons):
    dtypes = [torch.float32, torch.bfloat16, torch.float64]
    grads = [torch.full((3,), poison, dtype=dtype) for poison, dtype in zip(poisons, dtypes)]
    found = torch.zeros(())
    for group in (torch.float32, torch.bfloat16, torch.float64):      # torch: one call per group
        mine = [g.clone() for g in grads if g.dtype == group]
        if mine:
            torch._amp_foreach_non_finite_check_and_unscale_(mine, found, torch.tensor(0.5))
    assert amp.unscale_grads_(grads, torch.tensor(0.5)).item() == found.item() == 1.0


def _one_backward(scaler, model, opt):
    X, y = make_classification(8, 9, 5)
    opt.zero_grad()
    scaler.scale(model.loss(X, y)).backward()


@pytest.mark.parametrize("make", [lambda: amp.GradScaler("cpu"),
                                  lambda: torch.amp.GradScaler("cpu")])
def test_misuse_raises_the_same_errors_as_torch(make):
    scaler, (model, _) = make(), _twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _one_backward(scaler, model, opt)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called on this "
                                           "optimizer since the last update\\(\\)"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last "
                                           "update\\(\\)"):
        scaler.step(opt)
    scaler.update()
    _one_backward(scaler, model, opt)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)


def test_errors_say_what_to_do():
    model, _ = _twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="before scale"):
        amp.GradScaler("cpu").unscale_(opt)
    scaler = amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.step(opt)                                   # no parameter has a gradient
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    half, _ = _twins(dtype=torch.float16)
    opt16 = torch.optim.SGD(half.parameters(), lr=0.1)
    opt16.zero_grad()
    X, y = make_classification(8, 9, 5)
    scaler.scale(half.loss(X.half(), y)).backward()
    with pytest.raises(ValueError, match="FP16 gradients.*MasterWeights"):
        scaler.unscale_(opt16)
    for bad in [dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0),
                dict(growth_interval=2.5)]:
        with pytest.raises(ValueError):
            amp.GradScaler("cpu", **bad)
    with pytest.raises(ValueError, match="Tensor"):
        amp.GradScaler("cpu").scale("loss")
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=torch.ones(2))
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)


def test_state_dict_loads_across_implementations():
    kwargs = dict(init_scale=2.0**10, growth_interval=5)
    ours, theirs = amp.GradScaler("cpu", **kwargs), torch.amp.GradScaler("cpu", **kwargs)
    _run_side_by_side(ours, theirs, 33)
    assert ours.state_dict()["_growth_tracker"] > 0           # mid-interval: the count matters
    for source in (ours, theirs):
        for load_into in (amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
            load_into.load_state_dict(source.state_dict())
            assert load_into.state_dict() == source.state_dict()
    with pytest.raises(RuntimeError, match="empty"):
        amp.GradScaler("cpu").load_state_dict({})


def test_state_dict_mid_run_continues_the_same_trajectory():
    kwargs = dict(init_scale=2.0**10, growth_interval=5)
    straight = amp.GradScaler("cpu", **kwargs)
    model, _ = _twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = make_classification(8, 9, 5)

    def steps(scaler, n, start):
        out = []
        for i in range(start, start + n):
            opt.zero_grad()
            loss = scaler.scale(model.loss(X, y))
            (loss * (math.inf if i % 9 == 4 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            out.append(scaler.get_scale())
        return out

    reference = steps(straight, 40, 0)
    model, _ = _twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = amp.GradScaler("cpu", **kwargs)
    head = steps(first, 17, 0)
    second = amp.GradScaler("cpu")
    second.load_state_dict(first.state_dict())
    assert head + steps(second, 23, 17) == reference


def test_disabled_scaler_does_nothing():
    scaler = amp.GradScaler("cpu", enabled=False)
    model, twin = _twins()
    opt, opt2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    X, y = make_classification(8, 9, 5)
    loss = model.loss(X, y)
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    twin.loss(X, y).backward()
    opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()


def test_scale_lists_and_update_to_a_given_scale():
    scaler = amp.GradScaler("cpu", init_scale=4.0)
    a, b = scaler.scale([torch.ones(2), (torch.ones(()),)])
    assert torch.equal(a, torch.full((2,), 4.0)) and b[0].item() == 4.0
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0 == scaler._scale.item()
    scaler.update(new_scale=torch.tensor(2.0))
    assert scaler.get_scale() == 2.0 == scaler._scale.item()


@pytest.mark.parametrize("new_scale", [0.1, 3e38, math.inf, torch.tensor(3),
                                       torch.tensor(0.1, dtype=torch.float64)])
def test_update_to_a_given_scale_as_torch_does(new_scale):
    """The same float32 value as torch's scaler, for floats and 0-d tensors of any dtype."""
    results = []
    for make in (amp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu")
        scaler.scale(torch.ones(()))
        scaler.update(new_scale=new_scale)
        results.append(scaler.get_scale())
    assert results[0] == results[1]


@pytest.mark.parametrize("new_scale", [8, True, 1e39, torch.tensor([2.0]), "8.0",
                                       torch.ones((), requires_grad=True)])
def test_update_rejects_what_torch_rejects(new_scale):
    theirs = torch.amp.GradScaler("cpu")
    theirs.scale(torch.ones(()))
    with pytest.raises((AssertionError, AttributeError, RuntimeError)):
        theirs.update(new_scale=new_scale)
    ours = amp.GradScaler("cpu")
    ours.scale(torch.ones(()))
    with pytest.raises(ValueError, match="new_scale should be a float .* or a 0-d tensor.*e.g."):
        ours.update(new_scale=new_scale)


def test_factor_getters_and_setters_like_torch():
    """Changing the policy mid-run moves both scalers alike, including a count left past a
    shortened interval (PyTorch's kernel grows only when the count reaches it exactly)."""
    traces = []
    for make in (amp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu", init_scale=2.0**8, growth_interval=6)
        model, _ = _twins()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        trace = []
        for i in range(40):
            if i == 4:
                scaler.set_growth_interval(2)        # count 4 is already past 2
            if i == 20:
                scaler.set_growth_factor(4.0)
                scaler.set_backoff_factor(0.25)
            _one_backward(scaler, model, opt)
            if i == 30:
                next(model.parameters()).grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
            trace.append(scaler.get_scale())
        traces.append((trace, scaler.get_growth_factor(), scaler.get_backoff_factor(),
                       scaler.get_growth_interval(), scaler.state_dict()))
    assert traces[0] == traces[1]
    trace = traces[0][0]
    assert set(trace[:30]) == {2.0**8}                  # count past the interval: no growth
    assert trace[30:33] == [2.0**6, 2.0**6, 2.0**8]    # backoff resets it; 2 clean steps grow


def test_update_makes_no_host_device_sync(monkeypatch):
    """`.item()` (a sync on CUDA) runs once per step, in `step`: `update` and `get_scale` read
    the host copy of the scale."""
    scaler, (model, _) = amp.GradScaler("cpu", growth_interval=1), _twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _one_backward(scaler, model, opt)
    calls = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: (calls.append(1), item(t))[1])
    scaler.step(opt)
    scaler.update()
    scaler.get_scale()
    scaler.state_dict()
    assert len(calls) == 1
    monkeypatch.undo()
    assert scaler.get_scale() == scaler._scale.item() == 2.0**17


def test_two_optimizers_back_off_together_like_torch():
    results = []
    for make in (amp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu", init_scale=2.0**8)
        first, second = _twins()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
        X, y = make_classification(8, 9, 5)
        for i in range(6):
            for o in opts:
                o.zero_grad()
            loss = first.loss(X, y) + second.loss(X, y) * (math.inf if i == 2 else 1.0)
            scaler.scale(loss).backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
        results.append((scaler.get_scale(), [p.clone() for p in first.parameters()]))
    assert results[0][0] == results[1][0] == 2.0**7
    assert all(torch.equal(p, q) for p, q in zip(results[0][1], results[1][1]))


@pytest.mark.gpu
def test_same_as_torch_on_cuda():
    kwargs = dict(init_scale=2.0**12, growth_interval=7)
    ours, theirs = amp.GradScaler("cuda", **kwargs), torch.amp.GradScaler("cuda", **kwargs)
    (m1, _), (m2, _), trace = _run_side_by_side(ours, theirs, 100, device="cuda")
    assert all(a == b for a, b in trace)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


# ---------------------------------------------------------------- MasterWeights

def _teacher_data(seed=0):
    """Labels from a random teacher network: learnable, but not in a few steps."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(2048, 16, generator=g)
    with torch.no_grad():
        y = (MLP(16, 32, 1, 4, seed=seed + 100)(X) * 3).argmax(1)
    return X, y


def _train(model, step, *, steps=300, seed=0):
    """Mean loss of the last 50 of `steps` Adam steps on batches of 64."""
    X, y = _teacher_data(seed)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(X), (64,), generator=g)
        loss = model.loss(X[idx].to(next(model.parameters()).dtype), y[idx])
        loss.backward()
        step()
        losses.append(loss.item())
    return sum(losses[-50:]) / 50


def test_master_weights_train_as_well_as_fp32_and_pure_bf16_does_not():
    lr = 1e-4                            # Adam's steps of ~1e-4 are below half a bf16 ulp of ~0.1
    fp32 = MLP(16, 64, 3, 4, seed=1)
    opt = torch.optim.Adam(fp32.parameters(), lr=lr)
    fp32_loss = _train(fp32, lambda: (opt.step(), opt.zero_grad()))

    model = MLP(16, 64, 3, 4, seed=1).to(torch.bfloat16)
    master = amp.MasterWeights(model.parameters())
    opt = torch.optim.Adam(master.master_params, lr=lr)
    master_loss = _train(model, lambda: master.step(opt))

    pure = MLP(16, 64, 3, 4, seed=1).to(torch.bfloat16)
    opt = torch.optim.Adam(pure.parameters(), lr=lr)
    pure_loss = _train(pure, lambda: (opt.step(), opt.zero_grad()))

    X, y = _teacher_data()
    start = MLP(16, 64, 3, 4, seed=1).loss(X, y).item()
    assert fp32_loss < 0.7 * start                                  # fp32 learned something
    assert abs(master_loss - fp32_loss) <= 0.05 * fp32_loss         # and so did the master copy
    assert pure_loss > fp32_loss + 0.2                              # bf16 weights alone lag


def test_small_updates_survive_in_the_master_copy_not_in_bf16():
    model = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(model.weight)
    master = amp.MasterWeights(model.parameters())
    opt = torch.optim.SGD(master.master_params, lr=1e-3)
    plain = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(plain.weight)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    for _ in range(100):                         # each update 1e-3, below half a bf16 ulp at 1.0
        for m in (model, plain):
            m(torch.ones(1, 1, dtype=torch.bfloat16)).sum().backward()
        master.step(opt)
        plain_opt.step()
        plain_opt.zero_grad()
    assert plain.weight.item() == 1.0                           # every update rounded away
    assert master.master_params[0].item() == pytest.approx(0.9, abs=1e-4)
    assert model.weight.item() == master.master_params[0].to(torch.bfloat16).item()


def test_master_weights_with_a_scaler_skip_overflowing_steps():
    model = MLP(16, 32, 2, 4, seed=0).to(torch.float16)
    master = amp.MasterWeights(model.parameters())
    opt = torch.optim.Adam(master.master_params, lr=1e-3)
    scaler = amp.GradScaler("cpu")
    X, y = make_classification(32, 16, 4)
    before = [p.clone() for p in model.parameters()]
    (scaler.scale(model.loss(X.half(), y)) * math.inf).backward()
    master.step(opt, scaler)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0**15
    scaler.scale(model.loss(X.half(), y)).backward()
    master.step(opt, scaler)
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in [*model.parameters(), *master.master_params])  # all freed
    with pytest.raises(ValueError, match="16-bit"):
        amp.MasterWeights(MLP(4, 4, 1, 2).parameters())



@pytest.mark.parametrize("grads", ["main_grad", "both"])
def test_fp32_gradient_buffers_accumulate_micro_batches_that_bf16_grad_rounds(grads):
    """k micro-batches: the fp32 buffer holds the fp32 sum of each backward's bf16 gradient (as
    Megatron-LM's main_grad and DeepSpeed's bf16 optimizer do); a bf16 .grad drifts from it, more
    with more micro-batches; the step uses the buffer, then zeroes it."""
    X, y = make_classification(512, 12, 3, seed=0)
    model = MLP(12, 32, 3, 3, seed=0).to(torch.bfloat16)
    master = amp.MasterWeights(model.parameters(), grads=grads)
    plain = MLP(12, 32, 3, 3, seed=0).to(torch.bfloat16)           # .grad accumulated in bf16
    drift, want = [], [torch.zeros_like(m) for m in master.master_params]
    for i, (xb, yb) in enumerate(zip(X.bfloat16().split(8), y.split(8))):
        for p in plain.parameters():
            p.grad = None
        plain.loss(xb, yb).backward()
        for w, p in zip(want, plain.parameters()):
            w.add_(p.grad.float())                                  # each bf16 gradient, fp32 sum
        model.loss(xb, yb).backward()
        assert all(torch.equal(p.main_grad, w) for p, w in zip(model.parameters(), want))
        kept = [p.grad for p in model.parameters()]
        assert all(g is None for g in kept) if grads == "main_grad" else \
            all(g.dtype == torch.bfloat16 for g in kept)
        if grads == "both" and i + 1 in (4, 64):
            err = sum((g.float() - w).norm() ** 2 for g, w in zip(kept, want)) ** 0.5
            drift.append(float(err / sum(w.norm() ** 2 for w in want) ** 0.5))
    if grads == "both":
        assert 0 < drift[0] < drift[1]                               # bf16's sum drifts with k
    opt = torch.optim.SGD(master.master_params, lr=0.1)
    before = [m.detach().clone() for m in master.master_params]
    master.step(opt)
    assert all(torch.equal(b.add(w, alpha=-0.1), m) for b, w, m in zip(before, want, master.master_params))
    assert all(p.grad is None and not p.main_grad.any() for p in model.parameters())
    with pytest.raises(ValueError, match="grads is one of"):
        amp.MasterWeights(model.parameters(), grads="fp32")

def test_master_weights_clip_between_unscale_and_step():
    """grads_to_master, unscale_, clip the fp32 gradients, step: the masters move by the clipped
    gradient (step must not copy the freed 16-bit gradients over them)."""
    model = MLP(6, 8, 2, 3, seed=0).half()
    master = amp.MasterWeights(model.parameters())
    opt = torch.optim.SGD(master.master_params, lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=2.0**8)
    X, y = make_classification(10, 6, 3, seed=0)
    before = [m.detach().clone() for m in master.master_params]
    scaler.scale(model.loss(X.half(), y)).backward()
    master.grads_to_master()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(master.master_params, 0.1)
    clipped = [m.grad.clone() for m in master.master_params]
    master.step(opt, scaler)
    scaler.update()
    assert norm > 0.1                                               # clipping did something
    assert torch.linalg.vector_norm(torch.cat([g.view(-1) for g in clipped])) == pytest.approx(
        0.1, rel=1e-3)
    for m, b, g in zip(master.master_params, before, clipped):
        torch.testing.assert_close(m.detach(), b - 0.1 * g)
    for p, m in zip(model.parameters(), master.master_params):
        assert torch.equal(p, m.detach().half())


def _states_at_end_of_backward(layout):
    """Bytes by kind live at the end of the second backward (the first step made Adam's state)."""
    V, T, C, L, H = 64, 16, 32, 2, 4
    x, y = make_tokens(4, T, vocab=V)
    with track("cpu") as t:                     # everything made inside: all of it counted
        if layout == "autocast":
            model = GPT(V, T, C, L, H, seed=0)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            forward = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
            step = opt.step
        else:
            model = GPT(V, T, C, L, H, seed=0, dtype=torch.bfloat16)
            master = amp.MasterWeights(model.parameters())
            opt = torch.optim.Adam(master.master_params, lr=1e-3)
            forward = torch.enable_grad
            step = lambda: master.step(opt)                                 # noqa: E731
        for i in range(2):
            with forward():
                loss = model.loss(x, y)
            loss.backward()
            if i == 0:
                step()
    return E.gpt_params(V, T, C, L), t.breakdown("current")   # labels are final once it exits


@pytest.mark.parametrize("layout", ["autocast", "master"])
def test_both_mixed_layouts_hold_16_bytes_per_parameter(layout):
    n, parts = _states_at_end_of_backward(layout)
    states = parts["parameters"] + parts["gradients"] + parts["optimizer_state"]
    assert parts["activations"] == 0 and parts["temporaries"] <= 4        # only the loss is left
    counters = 4 * sum(1 for _ in GPT(64, 16, 32, 2, 4).parameters())   # Adam's step, fp32 each
    assert states - counters == 16 * n
    precision = "autocast" if layout == "autocast" else "mixed"
    assert E.model_states(n, precision=precision).total == 16 * n


# ---------------------------------------------------------------- autocast_dtypes

def test_autocast_dtypes_on_the_course_gpt_cpu_bf16():
    model = GPT(50, 16, 32, 1, 4)
    x, y = make_tokens(2, 16, vocab=50)
    ops = amp.autocast_dtypes(model.loss, x, y)
    by_op: dict[str, set] = {}
    for o in ops:
        by_op.setdefault(o.op, set()).add(o.output)
    assert by_op["addmm"] == by_op["bmm"] == {torch.bfloat16}             # lower-precision list
    assert by_op["_log_softmax"] == by_op["nll_loss_forward"] == {torch.float32}   # fp32 list
    assert by_op["native_layer_norm"] == {torch.float32}                  # fp32 residual stream
    assert by_op["_softmax"] == by_op["gelu"] == {torch.bfloat16}         # input's dtype on CPU
    assert {o.output for o in ops if o.op == "_to_copy"} == {torch.bfloat16, torch.float32}
    assert not any(o.op.endswith("view") or o.op in ("t", "transpose") for o in ops)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == by_op["addmm"].pop()                     # the head's output


def test_autocast_dtypes_lists_in_place_ops_and_leaves_out_views():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    ops = amp.autocast_dtypes(lambda t: model(t).t().add_(1.0), x)
    assert [o.op for o in ops if not o.op.startswith("_to_copy")] == ["addmm", "relu_", "addmm",
                                                                       "add_"]
    assert [o.output for o in ops if o.op in ("relu_", "add_")] == [torch.bfloat16] * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16


def test_autocast_dtypes_follow_the_dtype_asked_for():
    model = MLP(8, 16, 2, 3)
    X, y = make_classification(4, 8, 3)
    ops = amp.autocast_dtypes(model.loss, X, y, dtype=torch.float16)
    assert {o.output for o in ops if o.op == "addmm"} == {torch.float16}
    assert {o.output for o in ops if o.op == "_log_softmax"} == {torch.float32}


def test_autocast_dtypes_cache_casts_a_weight_once_per_region():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    twice = lambda t: layer(layer(t))
    casts = lambda **kw: sum(o.op == "_to_copy" for o in amp.autocast_dtypes(twice, x, **kw))
    assert casts() == 3                          # x, weight, bias; the second call reuses them
    assert casts(cache_enabled=False) == 5       # weight and bias cast again for the second call


def test_autocast_ops_matches_what_autocast_does_on_the_cpu():
    cpu, cuda = amp.autocast_ops("cpu"), amp.autocast_ops("cuda")
    # the promote lists differ: CPU's cat, stack, index_copy; CUDA's out-of-place cross, index_put
    assert {"aten::cat", "aten::stack", "aten::index_copy"} <= cpu
    assert not {"aten::cat", "aten::stack", "aten::index_copy"} & cuda
    assert {"aten::cross", "aten::index_put", "aten::dot", "aten::scatter_add"} <= cuda
    assert not {"aten::linalg_cross", "aten::index_put_"} & (cpu | cuda)
    assert {"aten::mm", "aten::addmm", "aten::mse_loss"} <= cpu & cuda
    assert "aten::softmax.int" in cuda and "aten::softmax.int" not in cpu
    # what the CPU registrations say, measured: index_copy is rescued, dot is not
    a, b, idx = torch.randn(4), torch.randn(4, dtype=torch.bfloat16), torch.tensor([0, 1])
    with pytest.raises(RuntimeError):
        torch.index_copy(a, 0, idx, b[:2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.index_copy(a, 0, idx, b[:2]).dtype == torch.float32
        with pytest.raises(RuntimeError):
            torch.dot(a, b)
    with pytest.raises(ValueError, match="device_type is one of"):
        amp.autocast_ops("tpu")


def test_chapter_sizes_for_a_gpu_fit_an_80_gb_device_at_60_percent():
    from companion.device import _SIZES
    s = _SIZES["cuda"]
    n = E.gpt_params(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth)
    activations = max(E.gpt_activations(s.amp_gpt_batch, s.seq_len, s.gpt_width, s.gpt_depth,
                                        s.gpt_heads, s.vocab, precision=p, device_type="cuda")
                      for p in ("fp32", "autocast", "mixed"))   # the three layouts' largest
    states = max(E.model_states(n, precision=p).total for p in ("fp32", "autocast", "mixed"))
    logits_grad = 4 * s.amp_gpt_batch * s.seq_len * s.vocab     # arrives at the peak of backward
    assert states + activations + logits_grad <= 0.6 * 80e9
    mlp = E.mlp_params(32, s.amp_width, s.amp_depth, 10)
    assert E.model_states(mlp).total + E.mlp_activations(s.amp_batch, s.amp_width, s.amp_depth,
                                                         10) <= 0.6 * 80e9
    assert s.amp_batch * s.amp_accum == _SIZES["cpu"].amp_batch * _SIZES["cpu"].amp_accum == 2**20


# ---------------------------------------------------------------- the contract of torch.amp.GradScaler
# Scenarios from PyTorch's AMP examples, run through torch.amp.GradScaler and ours side by side.

def _accumulated(make, k=4, steps=6, overflow_at=2):
    """Gradient accumulation: k scaled micro-batch backwards, then one unscale_, clip and step."""
    scaler = make("cpu", init_scale=2.0**10, growth_interval=3)
    model = _twins(seed=4)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    X, y = make_classification(32, 9, 5)
    scales = []
    for step in range(steps):
        for micro in range(k):
            part = slice(micro * 8, (micro + 1) * 8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model.loss(X[part], y[part]) / k
            if step == overflow_at and micro == k - 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def test_gradient_accumulation_unscales_once_and_matches_torch():
    (our_scales, ours), (their_scales, theirs) = (_accumulated(make) for make in
                                                  (amp.GradScaler, torch.amp.GradScaler))
    assert our_scales == their_scales and our_scales[2] == 2.0**9       # the overflow backed off
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_two_losses_two_optimizers_one_scaler_like_torchs_example():
    """PyTorch's AMP example "Working with multiple models, losses, and optimizers"."""
    results = []
    for make in (amp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu", init_scale=2.0**6)
        (a, b), X, y = _twins(seed=2), *make_classification(8, 9, 5)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters())
        for i in range(5):
            opt_a.zero_grad()
            opt_b.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out_a, out_b = a.loss(X, y), b.loss(X, y)
                loss0 = 0.3 * out_a + 0.7 * out_b
                loss1 = 0.6 * out_a - 0.4 * out_b * (math.inf if i == 3 else 1.0)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.unscale_(opt_a)                   # clip one optimizer's gradients only
            torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
        results.append((scaler.get_scale(), [p.clone() for m in (a, b) for p in m.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(p, q) for p, q in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("impl", ["fused", "foreach", "loop"])
def test_every_adam_implementation_takes_torchs_steps(impl):
    """torch hands a fused optimizer the scale and the inf flag (`_step_supports_amp_scaling`)
    and it unscales inside its kernel; ours unscales first and then calls step: same numbers."""
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    results = []
    for make in (amp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu", init_scale=2.0**8)
        model = _twins(seed=5)[0]
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, **options[impl])
        X, y = make_classification(16, 9, 5)
        for i in range(5):
            opt.zero_grad()
            scaler.scale(model.loss(X, y) * (math.inf if i == 1 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
        results.append((scaler.get_scale(), [p.clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0] == 2.0**7
    for p, q in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ---------------------------------------------------------------- sharded gradients (ZeRO, FSDP)

def _sharded_scaler(rank, world_size, kind):
    """FSDP on 2 gloo ranks; at step 1 an overflow lands in rank 1's shard only."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
    from companion.zero import FSDP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = {"ours": lambda: amp.ShardedGradScaler("cpu", init_scale=2.0**8),
              "torch": lambda: TorchSharded("cpu", init_scale=2.0**8),
              "unsharded": lambda: amp.GradScaler("cpu", init_scale=2.0**8)}[kind]()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    scales, stepped = [], []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        model.finish_gradient_synchronization()
        if step == 1 and rank == 1:
            model.shards[0].grad.view(-1)[0] = math.inf         # in this rank's shard alone
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    return scales, stepped, [p.clone() for p in model.gather_full_params().values()]


def test_a_sharded_scaler_makes_every_rank_skip_an_overflow_on_one_like_torchs():
    from companion import launch
    results = {kind: launch.run(_sharded_scaler, 2, kind, timeout=60)
               for kind in ("ours", "torch", "unsharded")}
    for kind in ("ours", "torch"):
        (scales0, stepped0, full0), (scales1, stepped1, full1) = results[kind]
        assert stepped0 == stepped1 == [True, False, True, True]
        assert scales0 == scales1 == [256.0, 128.0, 128.0, 128.0]
        assert all(torch.equal(a, b) for a, b in zip(full0, full1))
    ours, theirs = results["ours"][0][2], results["torch"][0][2]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    (_, stepped0, _), (_, stepped1, _) = results["unsharded"]    # without agreeing: rank 0
    assert stepped0 == [True, True, True, True] and stepped1[1] is False   # steps, rank 1 skips


# ---------------------------------------------------------------- host reads (GPU syncs)

def _reads_per_step(scaler, **adam):
    """host_reads of scaler.step + update on the third step of an fp16-autocast MLP."""
    X, y = make_classification(64, 8, 3, seed=0)
    model = MLP(8, 16, 2, 3, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **adam)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(X, y)
        scaler.scale(loss).backward()
        reads = amp.host_reads(lambda: (scaler.step(opt), scaler.update()),
                               ignore=amp.step_counters(opt))
        opt.zero_grad()
    return reads


def test_torch_gradscaler_reads_the_inf_flag_except_for_fused_optimizers():
    """torch.amp.GradScaler._maybe_opt_step calls .item() on the inf flag; a fused optimizer
    (_step_supports_amp_scaling) gets the flag on the device and nothing is read."""
    for adam, expected in ((dict(foreach=False), 1), (dict(foreach=True), 1), (dict(fused=True), 0)):
        assert _reads_per_step(torch.amp.GradScaler("cpu"), **adam) == expected, adam
        assert _reads_per_step(amp.GradScaler("cpu"), **adam) == 1, adam     # ours: always one


def test_host_reads_counts_item_bool_and_float_but_not_device_ops():
    t = torch.ones(3)
    assert amp.host_reads(lambda: (t.sum() * 2, t.max())) == 0
    assert amp.host_reads(lambda: (t.sum().item(), bool(t[0]), float(t[1]))) == 3
    assert amp.host_reads(lambda: t[0].item(), ignore=[t]) == 0           # same storage, ignored
    with pytest.raises(TypeError, match="function"):
        amp.host_reads(t)


def _two_losses(make_scaler, steps=30, k=4):
    """Two models, two Adams, one scaler, k micro-batches unscaled once after the last, an inf in
    model 1's loss every 7th step: (steps each optimizer took, scales, parameters)."""
    models = [MLP(9, 24, 3, 5, seed=s) for s in (0, 1)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    scaler = make_scaler("cpu", init_scale=2.0**12, growth_interval=5)
    xs, ys = make_classification(4 * 33, 9, 5, seed=0)
    taken, scales = [0, 0], []
    for i in range(steps):
        for opt in opts:
            opt.zero_grad()
        for j, (xb, yb) in enumerate(zip(xs.split(33), ys.split(33))):
            with torch.autocast("cpu", dtype=torch.float16):
                losses = [m.loss(xb, yb) / k for m in models]
            if i % 7 == 3 and j == 2:
                losses[1] = losses[1] * math.inf
            scaler.scale(losses[0] + losses[1]).backward()
        for n, (model, opt) in enumerate(zip(models, opts)):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            taken[n] += any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        scaler.update()
        scales.append(scaler.get_scale())
    return taken, scales, [p.detach() for m in models for p in m.parameters()]


def test_one_scaler_for_accumulated_micro_batches_and_two_optimizers_is_torchs():
    ours, theirs = _two_losses(amp.GradScaler), _two_losses(torch.amp.GradScaler)
    assert ours[0] == theirs[0] == [30, 26]          # each optimizer skips only its own overflow
    assert ours[1] == theirs[1]
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))
