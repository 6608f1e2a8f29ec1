"""companion.accumulation: equal to the full batch where it should be, and not where it cannot be."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from companion import accumulation as acc


def _mlp(d=7, *extra):
    return torch.nn.Sequential(torch.nn.Linear(d, 13), *extra, torch.nn.ReLU(), torch.nn.Linear(13, 1))


def _data(n, d=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)


def _params_after_step(k, x, y, *, momentum=0.9, seed=0):
    torch.manual_seed(seed)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    losses = [acc.accumulation_step(model, F.mse_loss, opt, x, y, accum_steps=k) for _ in range(2)]
    return [p.detach().clone() for p in model.parameters()], losses


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), data=st.data())
def test_accumulation_step_equals_the_full_batch_step(n, data):
    k = data.draw(st.integers(1, n))
    x, y = _data(n, seed=n)
    full, full_losses = _params_after_step(1, x, y)
    ours, losses = _params_after_step(k, x, y)
    for a, b in zip(ours, full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(full_losses, rel=1e-5)


def test_forgetting_one_over_k_gives_k_times_the_gradient():
    x, y = _data(24)
    torch.manual_seed(0)
    model = _mlp()
    want = acc.accumulated_gradients(model, F.mse_loss, x, y, accum_steps=1)
    model.zero_grad()
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        F.mse_loss(model(xb), yb).backward()
    for g, w in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(g, 4 * w, rtol=1e-5, atol=1e-6)


def test_uneven_micro_batches_need_weights_by_size_not_one_over_k():
    x, y = _data(10)
    torch.manual_seed(0)
    model = _mlp()
    want = acc.accumulated_gradients(model, F.mse_loss, x, y, accum_steps=1)
    got = acc.accumulated_gradients(model, F.mse_loss, x, y, accum_steps=3)   # 4 + 3 + 3
    model.zero_grad()
    for xb, yb in zip(x.tensor_split(3), y.tensor_split(3)):
        (F.mse_loss(model(xb), yb) / 3).backward()
    one_over_k = [p.grad for p in model.parameters()]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(one_over_k, want))


def test_gap_is_rounding_for_a_plain_mlp_and_large_with_batchnorm_or_two_dropouts():
    x, y = _data(32)
    plain = acc.gradient_gap(_mlp, F.mse_loss, x, y, accum_steps=4)
    batchnorm = acc.gradient_gap(lambda: _mlp(7, torch.nn.BatchNorm1d(13)), F.mse_loss, x, y,
                                 accum_steps=4)
    dropouts = acc.gradient_gap(
        lambda: torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                    torch.nn.Linear(13, 13), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(13, 1)), F.mse_loss, x, y, accum_steps=4)
    assert plain < 1e-5
    assert batchnorm > 1e3 * max(plain, 1e-7)
    assert dropouts > 1e3 * max(plain, 1e-7)


def test_batchnorm_running_statistics_differ_after_accumulation():
    x, y = _data(32)
    stats = []
    for k in (1, 4):
        torch.manual_seed(0)
        model = _mlp(7, torch.nn.BatchNorm1d(13))
        acc.accumulation_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.0),
                              x, y, accum_steps=k)
        stats.append(model[1].running_var.clone())
    assert not torch.allclose(*stats, rtol=1e-3)


def test_a_schedule_stepped_per_micro_step_runs_k_times_too_fast():
    def lrs(k, per_micro):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 8))
        out = []
        for _ in range(4):                        # four optimizer steps
            for _ in range(k if per_micro else 1):
                opt.step()
                sched.step()
            out.append(opt.param_groups[0]["lr"])
        return out

    assert lrs(4, per_micro=False) == pytest.approx([2 / 8, 3 / 8, 4 / 8, 5 / 8])
    assert lrs(4, per_micro=True) == pytest.approx([5 / 8, 1.0, 1.0, 1.0])


def test_accumulation_step_rejects_bad_k():
    x, y = _data(4)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, 5):
        with pytest.raises(ValueError, match="accum_steps must be between 1 and the batch size 4"):
            acc.accumulation_step(model, F.mse_loss, opt, x, y, accum_steps=bad)


def _oom_above(limit, calls):
    def step(b):
        calls.append(b)
        if b > limit:
            raise torch.OutOfMemoryError(f"tried {b}")
    return step


@settings(max_examples=8, deadline=None)   # each failed try runs gc.collect()
@given(limit=st.integers(1, 5000), start=st.integers(1, 64))
def test_find_max_batch_size_finds_the_limit_in_logarithmic_tries(limit, start):
    calls = []
    if start > limit:
        with pytest.raises(torch.OutOfMemoryError, match="even a batch of start"):
            acc.find_max_batch_size(_oom_above(limit, calls), start=start)
        return
    assert acc.find_max_batch_size(_oom_above(limit, calls), start=start) == limit
    assert len(calls) <= math.log2(2 * limit / start) + math.log2(2 * limit) + 2   # doubling, bisection


def test_find_max_batch_size_stops_at_its_limit_and_lets_other_errors_through():
    assert acc.find_max_batch_size(lambda b: None, limit=100) == 100

    def broken(b):
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes"):
        acc.find_max_batch_size(broken)


@given(target=st.integers(1, 600), max_batch=st.integers(1, 700))
def test_choose_micro_batch_is_the_largest_divisor_that_fits(target, max_batch):
    b, k = acc.choose_micro_batch(target, max_batch)
    assert b * k == target and b <= max_batch
    assert not any(target % d == 0 for d in range(b + 1, min(target, max_batch) + 1))


def test_step_memory_counts_model_states_once_and_activations_per_micro_batch():
    from companion import estimate, models
    d_in, width, depth, classes = 8, 64, 4, 5
    x, y = models.make_classification(512, d_in, classes, seed=0)
    make = lambda: models.MLP(d_in, width, depth, classes, seed=0)
    n_params = estimate.mlp_params(d_in, width, depth, classes)
    peaks = {}
    for b, k in [(256, 1), (512, 1), (512, 4)]:
        t = acc.step_memory(make, F.cross_entropy, x[:b], y[:b], accum_steps=k)
        parts = t.breakdown()
        assert parts["parameters"] == 4 * n_params
        assert 8 * n_params <= parts["optimizer_state"] <= 8 * n_params + 4 * 64   # + step counters
        peaks[b, k] = t.peak
    per_example = (peaks[512, 1] - peaks[256, 1]) / 256
    assert depth * width * 4 <= per_example <= (depth + 3) * width * 4
    assert peaks[512, 4] < peaks[256, 1]                   # the peak follows the micro-batch


def test_find_max_batch_size_under_a_cpu_memory_budget():
    from companion import models
    from companion.memory import memory_budget
    x, y = models.make_classification(4096, 8, 5, seed=0)
    with memory_budget("2 MiB"):
        model = models.MLP(8, 64, 4, 5, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = lambda b: acc.accumulation_step(model, F.cross_entropy, opt, x[:b], y[:b],
                                               accum_steps=1)
        best = acc.find_max_batch_size(step, start=4)
        step(best)
        with pytest.raises(torch.OutOfMemoryError):
            step(best + 1)
    assert 16 < best < 4096



class _Ledger:
    """A step whose memory follows the accumulation ledger: weights P; the optimizer's state O
    from the end of the first step on; one set of gradients G while a second micro-batch runs;
    a micro-batch's activations A per example. Raises OutOfMemoryError above `limit`."""

    def __init__(self, limit, P=100, O=200, G=200, A=1):
        self.limit, self.P, self.O, self.G, self.A = limit, P, O, G, A
        self.stepped, self.calls = False, []

    def __call__(self, batch, accum_steps):
        self.calls.append((batch, accum_steps))
        micro = -(-batch // accum_steps)
        peak = (self.P + self.O * self.stepped + self.G * (accum_steps > 1) + self.A * micro)
        if peak > self.limit:
            raise torch.OutOfMemoryError(f"{peak} > {self.limit}")
        self.stepped = True


def test_fit_accumulation_vouches_for_the_configuration_it_ran():
    ledger = _Ledger(limit=700)                      # plain: 300 + 400 fits; micro: 500 + 200
    with pytest.warns(UserWarning, match="outside memory_budget"):
        plain = acc.find_max_batch_size(lambda b: ledger(b, 1), limit=2000)
    assert plain == 400
    b, k = acc.choose_micro_batch(1000, plain)       # the plain batch's search, reused: 4 × 250
    ledger.stepped = True                            # as at any step after the first
    with pytest.raises(torch.OutOfMemoryError):
        ledger(1000, k)
    ledger = _Ledger(limit=700)
    with pytest.warns(UserWarning, match="outside memory_budget"):
        b, k = acc.fit_accumulation(ledger, 1000, start=8)
    assert (b, k) == (200, 5)
    assert all(k > 1 for n, k in ledger.calls[2:])    # after the whole batch's try: accumulation
    assert ledger.calls[-2:] == [(1000, 5), (1000, 5)]   # the answer itself, run for two steps


@pytest.mark.filterwarnings("ignore:fit_accumulation on the CPU outside memory_budget")
def test_fit_accumulation_needs_no_divisor_and_takes_the_whole_batch_when_it_fits():
    b, k = acc.fit_accumulation(_Ledger(limit=700), 1009, start=8)   # 1009 is prime
    assert (b, k) == (169, 6)                         # ceil(1009 / 200) micro-batches of <= 169
    assert acc.fit_accumulation(_Ledger(limit=5000), 1009) == (1009, 1)
    with pytest.raises(ValueError, match="at least 2"):
        acc.fit_accumulation(_Ledger(limit=700), 1000, steps=1)
    with pytest.raises(torch.OutOfMemoryError):
        acc.fit_accumulation(_Ledger(limit=350), 1000)            # states alone: 400


def test_fit_accumulation_survives_more_steps_where_the_plain_search_does_not():
    from companion import models
    from companion.memory import memory_budget
    x, y = models.make_classification(4096, 8, 5, seed=0)
    make = lambda: models.MLP(8, 64, 4, 5, seed=0)
    with memory_budget("1 MiB"):
        model = make()
        opt = torch.optim.Adam(model.parameters())
        step = lambda n, k: acc.accumulation_step(model, F.cross_entropy, opt, x[:n], y[:n],
                                                  accum_steps=k)
        plain = acc.find_max_batch_size(lambda b: step(b, 1), start=4, limit=1024)
        target = 4 * plain
        b, k = acc.fit_accumulation(step, target, start=4)
        assert b < plain < 1024
    for micro, steps_ok in [(acc.choose_micro_batch(target, plain), False), ((b, k), True)]:
        with memory_budget("1 MiB"):
            model = make()
            opt = torch.optim.Adam(model.parameters())
            run = lambda: acc.accumulation_step(model, F.cross_entropy, opt, x[:target], y[:target],
                                                accum_steps=micro[1])
            run()                                     # the first step: no Adam state yet
            if steps_ok:
                run(), run()
            else:
                with pytest.raises(torch.OutOfMemoryError):
                    run()


# ---------------------------------------------------------------- token-count normalization

def _padded_micro_batches(seed, rows=(3, 2, 4), T=9, V=23):
    """Micro-batches of token sequences with different numbers of real tokens (-100: padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in rows:
        x = torch.randint(V, (b, T), generator=g)
        y = torch.randint(V, (b, T), generator=g)
        lengths = torch.randint(1, T + 1, (b,), generator=g)
        y[torch.arange(T)[None, :] >= lengths[:, None]] = -100
        out.append((x, y))
    return out


def _gpt(seed):
    from companion.models import GPT
    return GPT(23, 9, 16, 1, 2, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_normalized_step_is_the_full_batch_step(seed):
    micro = _padded_micro_batches(seed)
    model, full = _gpt(seed), _gpt(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = acc.token_normalized_step(model, opt, micro)
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    full_opt = torch.optim.SGD(full.parameters(), lr=0.5)
    full_loss = F.cross_entropy(full(x).flatten(0, 1), y.flatten())   # mean over real tokens
    full_loss.backward()
    full_opt.step()
    assert loss == pytest.approx(full_loss.item(), rel=1e-5)
    for a, b in zip(model.parameters(), full.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_mean_per_micro_batch_is_not_the_full_batch_mean():
    """The 2024 bug: mean of each micro-batch, divided by k, weights short micro-batches more."""
    micro = _padded_micro_batches(0)
    model = _gpt(0)
    means = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in micro]
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    full = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert abs(sum(means).item() / len(micro) - full.item()) > 1e-3
    tokens = [int((y != -100).sum()) for _, y in micro]
    weighted = sum(m * n for m, n in zip(means, tokens)) / sum(tokens)
    assert weighted.item() == pytest.approx(full.item(), rel=1e-5)


def test_token_normalized_step_with_only_padding_says_so():
    x = torch.zeros(1, 3, dtype=torch.long)
    model = _gpt(0)
    with pytest.raises(ValueError, match="no token"):
        acc.token_normalized_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  [(x, torch.full((1, 3), -100))])
