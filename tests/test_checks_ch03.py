"""Chapter 03's checks pass on the reference and fail on known-wrong answers."""
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from companion import accumulation
from companion.checks.ch03 import (check_accumulation_step, check_batch_size_search,
                                   check_token_normalized_step)
from companion.checks.core import CheckFailed, evaluate
from elsewhere import Elsewhere


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_step(model, loss_fn, opt, x, y, k):
    return accumulation.accumulation_step(model, loss_fn, opt, x, y, accum_steps=k)


def _chunked(model, loss_fn, opt, x, y, k):
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()


def test_accumulation_step_reference_and_a_plain_loop_pass():
    check_accumulation_step(_reference_step)
    check_accumulation_step(_chunked)


def _forgot_k(model, loss_fn, opt, x, y, k):
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss_fn(model(xb), yb).backward()
    opt.step()


def _forgot_zero_grad(model, loss_fn, opt, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()


def _steps_every_micro_batch(model, loss_fn, opt, x, y, k):
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
        opt.step()


def _full_batch(model, loss_fn, opt, x, y, k):
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


def _zero_grad_inside(model, loss_fn, opt, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        opt.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()


@pytest.mark.parametrize("wrong, hint", [
    (_forgot_k, "1/k"),
    (_forgot_zero_grad, "zero_grad"),
    (_steps_every_micro_batch, "step once"),
    (_full_batch, "micro-batches of"),
    (_zero_grad_inside, "once, before the loop"),
    (lambda model, loss_fn, opt, x, y, k: None, "ran 0 times"),
])
def test_accumulation_step_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_accumulation_step(wrong)


def token_reference(model, opt, micro_batches):
    accumulation.token_normalized_step(model, opt, micro_batches)


def _token_step(normalize, *, zero_grad=True):
    """A learner's token step; `normalize(summed, mean, micro_batches, y)` gives the loss."""
    def answer(model, opt, micro_batches):
        if zero_grad:
            opt.zero_grad()
        for x, y in micro_batches:
            logits, target = model(x).flatten(0, 1), y.flatten()
            summed = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            mean = F.cross_entropy(logits, target, ignore_index=-100)
            normalize(summed, mean, micro_batches, y).backward()
        opt.step()
    return answer


def _tokens(micro):
    return sum(int((y != -100).sum()) for _, y in micro)


def test_token_normalized_step_reference_and_a_plain_loop_pass():
    check_token_normalized_step(token_reference)
    check_token_normalized_step(_token_step(lambda s, m, micro, y: s / _tokens(micro)))


def _one_big_batch(model, opt, micro):
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    accumulation.token_normalized_step(model, opt, [(x, y)])


@pytest.mark.parametrize("wrong, hint", [
    (_token_step(lambda s, m, micro, y: m / len(micro)), "2024 bug"),
    (_token_step(lambda s, m, micro, y: m), "k times too large"),
    (_token_step(lambda s, m, micro, y: s), "divide the summed loss"),
    (_token_step(lambda s, m, micro, y: s / sum(t.numel() for _, t in micro)), "padding"),
    (_token_step(lambda s, m, micro, y: s / _tokens(micro), zero_grad=False), "zero_grad"),
    (_token_step(lambda s, m, micro, y: s / int((y != -100).sum())), "k times too large"),
    (_token_step(lambda s, m, micro, y: 2 * s / _tokens(micro)), "does not match"),
    (_one_big_batch, "one by one"),
])
def test_token_normalized_step_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_token_normalized_step(wrong)


def _one_backward(model, loss_fn, opt, x, y, k):
    """The losses of all micro-batches added up, one backward: every graph alive at once."""
    opt.zero_grad()
    sum(loss_fn(model(xb), yb) / k for xb, yb in zip(x.chunk(k), y.chunk(k))).backward()
    opt.step()


def _token_one_backward(model, opt, micro):
    opt.zero_grad()
    tokens = sum(int((y != -100).sum()) for _, y in micro)
    sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                        reduction="sum") / tokens for x, y in micro).backward()
    opt.step()


def _autograd_grad(model, loss_fn, opt, x, y, k):
    """Right, by another road: torch.autograd.grad per micro-batch, summed into .grad."""
    opt.zero_grad()
    params = list(model.parameters())
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        for p, g in zip(params, torch.autograd.grad(loss_fn(model(xb), yb) / k, params)):
            p.grad = g if p.grad is None else p.grad + g
    opt.step()


def _one_backward_call(model, loss_fn, opt, x, y, k):
    """The same mistake with a list: one backward pass over every micro-batch's loss."""
    opt.zero_grad()
    torch.autograd.backward([loss_fn(model(xb), yb) / k for xb, yb in zip(x.chunk(k), y.chunk(k))])
    opt.step()


def _all_forwards_first(model, loss_fn, opt, x, y, k):
    """k backward passes, but only after every forward: every graph alive at once all the same."""
    opt.zero_grad()
    losses = [loss_fn(model(xb), yb) / k for xb, yb in zip(x.chunk(k), y.chunk(k))]
    for loss in losses:
        loss.backward()
    opt.step()


def _token_all_forwards_first(model, opt, micro):
    opt.zero_grad()
    tokens = sum(int((y != -100).sum()) for _, y in micro)
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                              reduction="sum") / tokens for x, y in micro]
    for loss in losses:
        loss.backward()
    opt.step()


def _retained_to_log(model, loss_fn, opt, x, y, k):
    """Forward and backward in turn, but every graph kept (retain_graph=True, losses kept to log):
    the activations of all micro-batches alive at once."""
    opt.zero_grad()
    logged = []
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss = loss_fn(model(xb), yb) / k
        loss.backward(retain_graph=True)
        logged.append(loss)
    opt.step()


def _retained(model, loss_fn, opt, x, y, k):
    """retain_graph=True alone: each graph lives on until `loss` is rebound, after the next
    forward: two micro-batches' activations at once."""
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss = loss_fn(model(xb), yb) / k
        loss.backward(retain_graph=True)
    opt.step()


def _token_retained_to_log(model, opt, micro):
    opt.zero_grad()
    tokens, logged = sum(int((y != -100).sum()) for _, y in micro), []
    for x, y in micro:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                               reduction="sum") / tokens
        loss.backward(retain_graph=True)
        logged.append(loss)
    opt.step()


def _logged(model, loss_fn, opt, x, y, k):
    """Right: the losses and outputs kept to log, but each graph freed by its backward."""
    opt.zero_grad()
    logged = []
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        out = model(xb)
        loss = loss_fn(out, yb) / k
        loss.backward()
        logged.append((out, loss))
    opt.step()


@pytest.mark.parametrize("check, wrong, hint", [
    (check_accumulation_step, _retained_to_log, "outlived its backward"),
    (check_accumulation_step, _retained, "outlived its backward"),
    (check_token_normalized_step, _token_retained_to_log, "outlived its backward"),
    (check_accumulation_step, _one_backward, "adding the losses up"),
    (check_accumulation_step, _one_backward_call, "adding the losses up"),
    (check_accumulation_step, _all_forwards_first, "before the next micro-batch's forward"),
    (check_token_normalized_step, _token_one_backward, "adding the losses up"),
    (check_token_normalized_step, _token_all_forwards_first,
     "before the next micro-batch's forward"),
])
def test_one_backward_after_all_the_forwards_fails_every_run(check, wrong, hint):
    # the same step and the same micro-batches, but the memory of the whole batch: the reviewer
    # measured 9.33 MiB against 3.17 for k = 8. Each passed 40 of 40 runs at the review's commit;
    # the graphs kept by retain_graph passed 20 of 20 while the check watched only the order
    # (10.34 MiB kept to log, 3.93 MiB with retain_graph alone, in the reviewer's setting)
    for _ in range(20):
        with pytest.raises(CheckFailed, match=hint):
            check(wrong)


def _func_grad(model, loss_fn, opt, x, y, k):
    """Right, by torch.func: no backward pass reaches the weights' hooks."""
    opt.zero_grad()
    params = dict(model.named_parameters())

    def loss(p, xb, yb):
        return loss_fn(torch.func.functional_call(model, p, (xb,)), yb) / k
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        grads = torch.func.grad(loss)({n: t.detach() for n, t in params.items()}, xb, yb)
        for n, p in params.items():
            p.grad = grads[n] if p.grad is None else p.grad + grads[n]
    opt.step()


@pytest.mark.parametrize("right", [_autograd_grad, _func_grad])
def test_gradients_by_another_road_per_micro_batch_pass(right):
    check_accumulation_step(right)


@pytest.mark.parametrize("check, right", [
    (check_accumulation_step, _reference_step), (check_accumulation_step, _chunked),
    (check_accumulation_step, _logged),
    (check_accumulation_step, _autograd_grad), (check_accumulation_step, _func_grad),
    (check_token_normalized_step, token_reference)])
def test_accumulation_and_its_honest_variants_pass_every_run(check, right):
    for _ in range(20):
        check(right)


def test_token_normalized_step_steps_once():
    def steps_each(model, opt, micro):
        for x, y in micro:
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
            opt.step()
    with pytest.raises(CheckFailed, match="ran 3 times"):
        check_token_normalized_step(steps_each)


def _search(step, start):
    return accumulation.find_max_batch_size(step, start=start)


def _doubling_only(step, start):
    b = start
    while True:
        try:
            step(2 * b)
        except torch.OutOfMemoryError:
            return b
        b *= 2


def _linear(step, start):
    b = start
    while True:
        try:
            step(b + 1)
        except torch.OutOfMemoryError:
            return b
        b += 1


def _uncaught(step, start):
    b = start
    while True:
        step(2 * b)
        b *= 2


def _off_by_one(step, start):
    return _search(step, start) + 1


def _float_midpoint(step, start, *, catch_all=False):
    """Bisects with / : the midpoint is a float."""
    def fits(b):
        try:
            step(b)
            return True
        except (Exception if catch_all else torch.OutOfMemoryError):
            return False
    good, bad = start, 2 * start
    while fits(bad):
        good, bad = bad, 2 * bad
    while bad - good > 1:
        middle = (good + bad) / 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return int(good)


def test_batch_size_search_reference_passes():
    check_batch_size_search(_search)
    check_batch_size_search(lambda step, start: _search(lambda b: step(np.int64(b)), start))


@pytest.mark.parametrize("wrong, hint", [
    (_doubling_only, "rarely a power of two"),
    (_linear, "trial steps"),
    (_uncaught, "except torch.OutOfMemoryError"),
    (_off_by_one, "one more than the largest size that fits"),
    (lambda step, start: step(0), "batch size 0"),
    (_float_midpoint, "integer division"),
    (functools.partial(_float_midpoint, catch_all=True), "integer division"),
])
def test_batch_size_search_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_batch_size_search(wrong)


def _fits(step, b):
    try:
        step(b)
        return True
    except torch.OutOfMemoryError:
        return False


def _hi_unverified(step, start):
    """Review 54a, finding 7: a lo/hi bisection with hi = mid - 1 that returns hi untried."""
    lo, hi = start, 2 * start
    while _fits(step, hi):
        lo, hi = hi, 2 * hi
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(step, mid):
            lo = mid + 1
        else:
            hi = mid - 1
    return hi


def _stops_two_apart(step, start):
    """Bisects until the bounds are two apart and returns the lower one."""
    good, bad = start, 2 * start
    while _fits(step, bad):
        good, bad = bad, 2 * bad
    while bad - good > 2:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(step, mid) else (good, mid)
    return good


def _upper_mid(step, start):
    """An honest variant: bisection on [good, bad - 1] with the upper midpoint."""
    lo, hi = start, 2 * start
    while _fits(step, hi):
        lo, hi = hi, 2 * hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(step, mid) else (lo, mid - 1)
    return lo


@pytest.mark.parametrize("wrong, hint", [(_hi_unverified, "one more than"),
                                         (_stops_two_apart, "one less than")])
def test_batch_size_search_off_by_one_bisections_fail_every_time(wrong, hint):
    # the first passed 5 of 46 runs on random limits alone (review 54a, finding 7)
    for _ in range(20):
        with pytest.raises(CheckFailed, match=hint):
            check_batch_size_search(wrong)


@pytest.mark.parametrize("right", [_search, _upper_mid])
def test_batch_size_search_reference_and_an_upper_mid_bisection_pass_every_time(right):
    for _ in range(20):
        check_batch_size_search(right)


def _scaled_twice(model, loss_fn, opt, x, y, k):
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (2 * loss_fn(model(xb), yb) / k).backward()
    opt.step()


@pytest.mark.parametrize("check, answer", [
    (check_accumulation_step, _scaled_twice),
    (check_token_normalized_step, _token_step(lambda s, m, micro, y: 2 * s / _tokens(micro)))])
def test_the_fallback_hint_asks_rather_than_tells(check, answer):
    # the fallback hints gave the whole recipe (review 54a): they ask for the principle now
    with pytest.raises(CheckFailed, match="parameters after the step") as failure:
        check(answer)
    assert failure.value.hint.rstrip().endswith("?")
    assert "step once" not in failure.value.hint and "/ that count" not in failure.value.hint


def _hangs(*args):
    while True:
        pass


@pytest.mark.parametrize("check", [check_accumulation_step, check_token_normalized_step,
                                   check_batch_size_search])
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: (torch.tensor(float("nan")),) * 2,
                                     lambda *a: torch.ones(3, dtype=torch.int64)])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)


@pytest.mark.parametrize("check", [check_accumulation_step, check_token_normalized_step,
                                   check_batch_size_search])
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)


def test_a_wrong_batch_size_prints_as_an_int():
    with pytest.raises(CheckFailed) as failure:
        check_batch_size_search(_off_by_one)
    assert ".0" not in str(failure.value).split("hint")[0]


@pytest.mark.parametrize("name, answer", [("check_accumulation_step", _reference_step),
                                          ("check_token_normalized_step", token_reference)])
def test_checks_pass_on_an_answer_that_lives_in_another_process(name, answer):
    assert evaluate(name, Elsewhere(answer))
