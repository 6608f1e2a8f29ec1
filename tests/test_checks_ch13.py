"""Chapter 13's checks pass on the reference solutions over several seeds and fail, with a
CheckFailed that names the mistake, on the wrong answers a learner writes; bad input fails
cleanly.

The row-parallel answers live at module level, so the gloo workers can import them by name.
"""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from companion.checks.ch13 import check_one_f_one_b, check_row_parallel
from companion.checks.core import CheckFailed, NotDone, evaluate, seeded
from companion.pipeline.schedules import gpipe

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- exercise 1: the references

class ReduceFromTP(torch.autograd.Function):
    """g: the sum over the group forward, the gradient as it is backward."""

    @staticmethod
    def forward(ctx, partial, group):
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_parallel_linear(x, weight, bias, group=None):
    """The reference: partial sums, summed over the group, then the bias once."""
    y = ReduceFromTP.apply(F.linear(x, weight), group)
    return y if bias is None else y + bias


class ReduceInPlace(torch.autograd.Function):
    """Right too: the partial sum all-reduced in place and returned (nothing else holds it)."""

    @staticmethod
    def forward(ctx, partial, group):
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(), None


def row_parallel_in_place(x, weight, bias, group=None):
    y = ReduceInPlace.apply(F.linear(x, weight), group)
    return y if bias is None else y + bias


# ---------------------------------------------------------------- exercise 1: wrong answers

class ReduceBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceGradDivided(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.t = dist.get_world_size(group)
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.t, None


def _with_bias(y, bias):
    return y if bias is None else y + bias


def row_reduces_in_backward_too(x, weight, bias, group=None):
    return _with_bias(ReduceBothWays.apply(F.linear(x, weight), group), bias)


def row_without_all_reduce(x, weight, bias, group=None):
    return F.linear(x, weight, bias)


def row_bias_before_reduce(x, weight, bias, group=None):
    return ReduceFromTP.apply(F.linear(x, weight, bias), group)


def row_averages(x, weight, bias, group=None):
    return _with_bias(ReduceMean.apply(F.linear(x, weight), group), bias)


def row_reduces_the_input_gradient(x, weight, bias, group=None):
    return _with_bias(ReduceFromTP.apply(F.linear(CopyToTP.apply(x, group), weight), group),
                      bias)


def row_divides_the_gradient(x, weight, bias, group=None):
    return _with_bias(ReduceGradDivided.apply(F.linear(x, weight), group), bias)


def row_ignores_the_group(x, weight, bias, group=None):
    return _with_bias(ReduceFromTP.apply(F.linear(x, weight), None), bias)


def row_outside_autograd(x, weight, bias, group=None):
    out = F.linear(x, weight).detach()
    dist.all_reduce(out, group=group)
    return _with_bias(out, bias)


def row_torch_nn_all_reduce(x, weight, bias, group=None):
    from torch.distributed.nn.functional import all_reduce
    return _with_bias(all_reduce(F.linear(x, weight), group=group), bias)


def row_all_gathers(x, weight, bias, group=None):
    partial = F.linear(x, weight)
    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, partial, group=group)
    return _with_bias(sum(parts), bias)


def row_reduces_twice(x, weight, bias, group=None):
    y = ReduceFromTP.apply(F.linear(x, weight), group)
    dist.all_reduce(torch.zeros_like(y), group=group)
    return _with_bias(y, bias)


def row_no_function(x, weight, bias, group=None):
    """In place on a tensor autograd tracks: torch warns that c10d's all_reduce has no autograd
    kernel; the gradients come out right by luck."""
    y = F.linear(x, weight)
    dist.all_reduce(y, group=group)
    return _with_bias(y, bias)


def row_no_function_data(x, weight, bias, group=None):
    y = F.linear(x, weight)
    dist.all_reduce(y.data, group=group)
    return _with_bias(y, bias)


def row_no_function_no_grad(x, weight, bias, group=None):
    y = F.linear(x, weight)
    with torch.no_grad():
        dist.all_reduce(y, group=group)
    return _with_bias(y, bias)


def row_hangs(x, weight, bias, group=None):
    """Rank 0 never reaches the all-reduce the others wait in."""
    while dist.get_rank() == 0:
        time.sleep(0.05)
    return row_parallel_linear(x, weight, bias, group)


def row_mismatched(x, weight, bias, group=None):
    """Rank 0 all-reduces one more tensor than the others: gloo ends the process."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), group=group)
    return row_parallel_linear(x, weight, bias, group)


def row_returns_none(x, weight, bias, group=None):
    row_parallel_linear(x, weight, bias, group)


def row_returns_nan(x, weight, bias, group=None):
    return row_parallel_linear(x, weight, bias, group) * float("nan")


def row_not_done(x, weight, bias, group=None):
    raise NotImplementedError("exercise 1")


def test_the_row_parallel_references_pass(capsys):
    for seed in range(3):
        with seeded(seed):
            check_row_parallel(row_parallel_linear)
    check_row_parallel(row_parallel_in_place)
    assert capsys.readouterr().out.count("passed") == 4


@pytest.mark.parametrize("answer, words", [
    (row_reduces_in_backward_too, "t times too large"),
    (row_without_all_reduce, "partial sum alone"),
    (row_bias_before_reduce, "bias before the all-reduce"),
    (row_averages, "mean of the partial sums"),
    (row_reduces_the_input_gradient, "input's gradient was all-reduced"),
    (row_divides_the_gradient, "t times too small"),
    (row_ignores_the_group, "two tensor-parallel groups"),
    (row_outside_autograd, "is None after backward"),
    (row_torch_nn_all_reduce, "t times too large"),
    (row_all_gathers, "not an all-reduce"),
    (row_reduces_twice, "forward all-reduced 2 tensor(s)"),
    (row_returns_none, "expected the output tensor"),
    (row_returns_nan, "NaN"),
    (row_no_function, "autograd tracks, outside a torch.autograd.Function"),
    (row_no_function_data, "goes through no torch.autograd.Function"),
    (row_no_function_no_grad, "goes through no torch.autograd.Function"),
])
@pytest.mark.parametrize("seed", range(2))
def test_row_parallel_wrong_answers_fail_on_every_draw(answer, words, seed):
    with seeded(seed), pytest.raises(CheckFailed) as failure:
        evaluate("check_row_parallel", answer)
    assert words in str(failure.value), str(failure.value)


def test_row_parallel_bad_input_fails_cleanly(capsys):
    for bad in (None, 3, "row_parallel_linear", lambda *a: None):
        with pytest.raises(CheckFailed):
            evaluate("check_row_parallel", bad)
    with pytest.raises(CheckFailed, match="did not finish"):      # the worker timeout fired
        evaluate("check_row_parallel", row_hangs, worker_timeout=5.0)
    with pytest.raises(CheckFailed, match="rank 0"):
        evaluate("check_row_parallel", row_mismatched, worker_timeout=10.0)
    with pytest.raises(NotDone):
        evaluate("check_row_parallel", row_not_done)
    check_row_parallel(row_not_done)
    assert "not done yet" in capsys.readouterr().out


# ---------------------------------------------------------------- exercise 2: 1F1B

def one_f_one_b(p, m):
    """The reference: warm-up forwards, one forward and one backward in turn, the drain."""
    schedule = []
    for s in range(p):
        warm = min(p - s - 1, m)
        row = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            row += [("F", warm + i), ("B", i)]
        schedule.append(row + [("B", i) for i in range(m - warm, m)])
    return schedule


def _one_f_one_b_warming(warm_up):
    """1F1B's shape with `warm_up(p, s)` forwards before the first backward."""
    def schedule(p, m):
        rows = []
        for s in range(p):
            warm = max(0, min(warm_up(p, s), m))
            row = [("F", i) for i in range(warm)]
            for i in range(m - warm):
                row += [("F", warm + i), ("B", i)]
            rows.append(row + [("B", i) for i in range(m - warm, m)])
        return rows
    return schedule


def one_f_one_b_as_tuples(p, m):
    """Right too: tuples of tuples."""
    return tuple(tuple(row) for row in one_f_one_b(p, m))


def warm_up_p_minus_s(p, m):
    return _one_f_one_b_warming(lambda p, s: p - s)(p, m)


def warm_up_s(p, m):
    return _one_f_one_b_warming(lambda p, s: s)(p, m)


def warm_up_too_short(p, m):
    return _one_f_one_b_warming(lambda p, s: p - s - 2)(p, m)


def stage_zero_all_forwards_first(p, m):
    return [gpipe(1, m)[0]] + one_f_one_b(p, m)[1:]


def stage_zero_without_warm_up(p, m):
    """A deadlock: stage 0 waits for a backward that needs a forward it has not sent."""
    return [_one_f_one_b_warming(lambda p, s: 0)(p, m)[0]] + one_f_one_b(p, m)[1:]


def backward_before_forward(p, m):
    rows = one_f_one_b(p, m)
    rows[-1] = [("B", 0)] + [a for a in rows[-1] if a != ("B", 0)]
    return rows


def backwards_reversed(p, m):
    """1F1B's positions, the backwards taken from the last micro-batch down."""
    rows = []
    for row in one_f_one_b(p, m):
        backwards = iter(range(m - 1, -1, -1))
        rows.append([a if a[0] == "F" else ("B", next(backwards)) for a in row])
    return rows


def all_backwards_reversed(p, m):
    """GPipe's backwards from the last micro-batch down."""
    return [[("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
            for _ in range(p)]


def schedule_as_lists(p, m):
    return [[list(a) for a in row] for row in one_f_one_b(p, m)]


def schedule_missing_a_stage(p, m):
    return one_f_one_b(p, m)[1:]


def schedule_loops(p, m):
    while True:
        pass


def schedule_not_done(p, m):
    raise NotImplementedError("exercise 2")


def test_the_1f1b_references_pass(capsys):
    for seed in range(5):
        with seeded(seed):
            check_one_f_one_b(one_f_one_b)
    check_one_f_one_b(one_f_one_b_as_tuples)
    assert capsys.readouterr().out.count("passed") == 6


@pytest.mark.parametrize("answer, words", [
    (gpipe, "holds the activations of"),
    (warm_up_p_minus_s, "holds the activations of"),
    (warm_up_s, "deadlock"),
    (warm_up_too_short, "idle"),
    (stage_zero_all_forwards_first, "stage 0 holds"),
    (stage_zero_without_warm_up, "deadlock"),
    (backward_before_forward, "before the forward"),
    (backwards_reversed, "before the forward"),
    (all_backwards_reversed, "holds the activations of"),
    (schedule_as_lists, "is not an action"),
    (schedule_missing_a_stage, "action lists"),
    (lambda p, m: None, "expected a list"),
    (lambda p, m: [None] * p, "not a list"),
])
@pytest.mark.parametrize("seed", range(6))
def test_1f1b_wrong_answers_fail_on_every_draw(answer, words, seed):
    with seeded(seed), pytest.raises(CheckFailed) as failure:
        evaluate("check_one_f_one_b", answer)
    assert words in str(failure.value), str(failure.value)


def test_1f1b_messages_do_not_give_the_warm_up_away():
    for answer in (warm_up_p_minus_s, warm_up_s, warm_up_too_short, gpipe):
        with pytest.raises(CheckFailed) as failure:
            evaluate("check_one_f_one_b", answer)
        text = str(failure.value)
        assert "warm-up" not in text and "p - s" not in text and "p − s" not in text, text


def test_1f1b_bad_input_fails_cleanly(capsys):
    for bad in (None, 3, "one_f_one_b", one_f_one_b(2, 2)):
        with pytest.raises(CheckFailed):
            evaluate("check_one_f_one_b", bad)
    with pytest.raises(CheckFailed, match="did not finish"):
        evaluate("check_one_f_one_b", schedule_loops, timeout=1.0)
    check_one_f_one_b(schedule_not_done)
    assert "not done yet" in capsys.readouterr().out
