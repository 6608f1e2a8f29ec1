"""Chapter 04's checks pass on the reference and fail on known-wrong answers."""
import math

import pytest
import torch

from companion import checkpointing as ck
from companion.checks import ch04
from companion.checks.ch04 import (check_checkpoint_function, check_saved_bytes,
                                   check_segments_for_budget)
from companion.checks.core import CheckFailed


def _saved_bytes(fn, x):
    return ck.activation_bytes(fn, x)


def _every_save(fn, x):
    return sum(s.nbytes for s in ck.saved_for_backward(fn, x) if not s.is_parameter)


def _with_parameters(fn, x):
    return sum({s.storage: s.storage_nbytes for s in ck.saved_for_backward(fn, x)}.values())


def _by_tensor_data_ptr(fn, x):
    """Known wrong: views told apart by t.data_ptr(), each counted by its own bytes."""
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, torch.nn.Module) else set()
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen.setdefault(t.data_ptr(), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def _first_view_bytes(fn, x):
    """Known wrong: each storage counted once, but as the bytes of the first view seen of it."""
    first = {}
    for s in ck.saved_for_backward(fn, x):
        if not s.is_parameter:
            first.setdefault(s.storage, s.nbytes)
    return sum(first.values())


def test_saved_bytes_reference_passes():
    check_saved_bytes(_saved_bytes)


@pytest.mark.parametrize("wrong, hint", [
    (_every_save, "count each storage once"),
    (_with_parameters, "leave out the parameters"),
    (_first_view_bytes, "whole storage alive"),
    (_by_tensor_data_ptr, r"not t\.data_ptr\(\)"),
    (lambda fn, x: x.numel() * x.element_size(), None),
    (lambda fn, x: float(_saved_bytes(fn, x)) + 4, None),
])
def test_saved_bytes_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_saved_bytes(wrong)


class _NoRng(torch.autograd.Function):
    """Known wrong: recomputes without restoring the random state."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x)
        y.backward(grad)
        return None, x.grad


class _NoForkRng(_NoRng):
    """Known wrong: restores the random state in backward without fork_rng, which rewinds the
    caller's random stream (seen with two stacked checkpoints)."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.rng = torch.get_rng_state()
        return _NoRng.forward(ctx, fn, x)

    @staticmethod
    def backward(ctx, grad):
        torch.set_rng_state(ctx.rng)
        return _NoRng.backward(ctx, grad)


class _KeepsGraph(torch.autograd.Function):
    """Known wrong: runs fn with grad on in forward, so everything inside is saved."""

    @staticmethod
    def forward(ctx, fn, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            ctx.x, ctx.y = x, fn(x)
        return ctx.y.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.y.backward(grad)
        return None, ctx.x.grad


class _NoInputGrad(_NoRng):
    @staticmethod
    def backward(ctx, grad):
        return None, None


def _no_grad_at_all(fn, x):
    with torch.no_grad():
        return fn(x)


def test_checkpoint_function_reference_passes():
    check_checkpoint_function(ck.checkpoint)
    check_checkpoint_function(lambda fn, x: ck.Checkpoint.apply(fn, torch.empty(0), x))


@pytest.mark.parametrize("wrong, hint", [
    (lambda fn, x: _NoRng.apply(fn, x), "rng_state"),
    (lambda fn, x: _NoForkRng.apply(fn, x), "fork_rng"),
    (lambda fn, x: _KeepsGraph.apply(fn, x), "no_grad"),
    (lambda fn, x: _NoInputGrad.apply(fn, x), "recompute|twice"),
    (lambda fn, x: fn(x), "forward kept"),
    (_no_grad_at_all, "requires grad"),
    (lambda fn, x: (fn(x), fn(x))[1], "fn ran 2 times"),
])
def test_checkpoint_function_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_checkpoint_function(wrong)


def test_segments_for_budget_reference_passes():
    check_segments_for_budget(ck.segments_for_budget)


def _forgot_boundaries(n, unit, budget):
    return next((s for s in range(1, n + 1) if math.ceil(n / s) * unit <= budget), None)


def _ceil_longest(n, unit, budget):
    """Known wrong: the longest segment taken as ceil(n / s) (checkpoint_sequential's last
    segment takes the remainder, n - (n // s)(s - 1), which can be longer)."""
    return next((s for s in range(1, n + 1) if (s - 1 + math.ceil(n / s)) * unit <= budget), None)


def test_ceil_rule_differs_from_the_reference_on_the_fixed_cases():
    assert (ck.segments_for_budget(26, 1000, 10000), _ceil_longest(26, 1000, 10000)) == (5, 4)
    assert (ck.segments_for_budget(11, 1000, 6000), _ceil_longest(11, 1000, 6000)) == (None, 3)


@pytest.mark.parametrize("wrong, hint", [
    (_forgot_boundaries, "stay in memory too"),
    (_ceil_longest, "remainder"),
    (lambda n, unit, budget: ck.sqrt_segments(n), "fewest"),
    (lambda n, unit, budget: ck.segments_for_budget(n, unit, budget) or 1, "None"),
    (lambda n, unit, budget: n, None),
    (lambda n, unit, budget: str(ck.segments_for_budget(n, unit, budget)), None),
])
def test_segments_for_budget_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_segments_for_budget(wrong)


def _hangs(*args):
    while True:
        pass


CHECKS = [check_saved_bytes, check_checkpoint_function, check_segments_for_budget]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: torch.tensor(float("nan")),
                                     lambda *a: torch.ones(3, dtype=torch.int64)])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)


@pytest.mark.parametrize("check", CHECKS)
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)


def test_selective_policy_reference_passes(capsys):
    ch04.check_selective_policy(ck.save_linear_outputs)
    assert "your policy" in capsys.readouterr().out


_aten = torch.ops.aten


@pytest.mark.parametrize("wrong, hint", [
    (lambda op: True, "keeping everything saves nothing"),
    (lambda op: False, "keep what nn.Linear computes"),
    (ck.save_matmul_outputs, "attention's q·kᵀ"),
    (lambda op: op.overloadpacket in (_aten.mm, _aten.addmm, _aten._softmax), "softmax"),
    (lambda op: op.overloadpacket == _aten.addmm, "aten.mm and aten.addmm"),
    (lambda op: 1, "return a bool"),
    (lambda op: op.name(), "return a bool"),
])
def test_selective_policy_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        ch04.check_selective_policy(wrong)
