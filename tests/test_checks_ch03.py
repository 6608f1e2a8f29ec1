"""Chapter 03's checks pass on the reference and fail on known-wrong answers."""
import math

import pytest
import torch

from companion import accumulation
from companion.checks.ch03 import (check_accumulation_step, check_batch_size_search,
                                   check_choose_micro_batch)
from companion.checks.core import CheckFailed


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
    (_zero_grad_inside, "zero_grad"),
    (lambda model, loss_fn, opt, x, y, k: None, "ran 0 times"),
])
def test_accumulation_step_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_accumulation_step(wrong)


def test_choose_micro_batch_reference_passes():
    check_choose_micro_batch(accumulation.choose_micro_batch)


@pytest.mark.parametrize("wrong, hint", [
    (lambda t, m: (min(t, m), math.ceil(t / min(t, m))), "divide the target"),
    (lambda t, m: (1, t), "largest"),
    (lambda t, m: (t, 1), None),
    (lambda t, m: min(t, m), None),
    (lambda t, m: accumulation.choose_micro_batch(t, m)[::-1], None),
])
def test_choose_micro_batch_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_choose_micro_batch(wrong)


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


def test_batch_size_search_reference_passes():
    check_batch_size_search(_search)


@pytest.mark.parametrize("wrong, hint", [
    (_doubling_only, "rarely a power of two"),
    (_linear, "trial steps"),
    (_uncaught, "except torch.OutOfMemoryError"),
    (_off_by_one, "bisect"),
    (lambda step, start: step(0), "batch size 0"),
])
def test_batch_size_search_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_batch_size_search(wrong)


def _hangs(*args):
    while True:
        pass


@pytest.mark.parametrize("check", [check_accumulation_step, check_choose_micro_batch,
                                   check_batch_size_search])
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: (torch.tensor(float("nan")),) * 2,
                                     lambda *a: torch.ones(3, dtype=torch.int64)])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)


@pytest.mark.parametrize("check", [check_accumulation_step, check_choose_micro_batch,
                                   check_batch_size_search])
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)
