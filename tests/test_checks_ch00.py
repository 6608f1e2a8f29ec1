"""Chapter 00's checks pass on the reference and fail on known-wrong and bad answers."""
import time

import pytest
import torch

from companion import estimate
from companion.checks.ch00 import check_activation_bytes, check_model_state_bytes, check_param_bytes
from companion.checks.core import CheckFailed, NotDone


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _states(n, optimizer, precision):
    s = estimate.model_states(n, optimizer=optimizer, precision=precision)
    return s.params, s.grads, s.optimizer


def _activations(B, W, L, K, e):
    return L * B * W * e + B * K * e


def _raises(model):
    raise ValueError("boom")


def _not_done(*args):
    raise NotImplementedError("write this")


def _hangs(*args):
    while True:
        time.sleep(0.01)


BAD = [None, "a string", 42, _raises]


def test_param_bytes_reference_passes():
    check_param_bytes(_param_bytes)
    check_param_bytes(lambda m: torch.tensor(_param_bytes(m)))


@pytest.mark.parametrize("wrong, hint", [
    (lambda m: sum(p.numel() for p in m.parameters()), "number of values"),
    (lambda m: 4 * sum(p.numel() for p in m.parameters()), "depends on the dtype"),
    (lambda m: 8 * _param_bytes(m), "bits"),
    (lambda m: _param_bytes(m) + 4, "does not match"),
    (lambda m: float("nan"), "NaN"),
    (lambda m: [_param_bytes(m)], "number of bytes"),
])
def test_param_bytes_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_param_bytes(wrong)


def test_model_state_bytes_reference_passes():
    check_model_state_bytes(_states)
    check_model_state_bytes(lambda n, o, p: list(_states(n, o, p)))


def _no_master(n, optimizer, precision):
    p, g, o = _states(n, optimizer, precision)
    return (p, g, o - 4 * n) if precision == "mixed" else (p, g, o)


def _half_everything(n, optimizer, precision):
    p, g, o = _states(n, optimizer, "fp32")
    return (p // 2, g // 2, o // 2) if precision == "mixed" else (p, g, o)


def _one_adam_state(n, optimizer, precision):
    p, g, o = _states(n, optimizer, precision)
    return (p, g, o - 4 * n) if optimizer == "adam" and precision == "fp32" else (p, g, o)


@pytest.mark.parametrize("wrong, hint", [
    (_no_master, "master copy"),
    (_half_everything, "master copy|does not halve"),
    (lambda n, o, p: _half_everything(n, o, p) if o == "adam" else _states(n, o, p), "does not halve"),
    (_one_adam_state, "two tensors"),
    (lambda n, o, p: _states(n, o, p)[:2], "tuple"),
    (lambda n, o, p: sum(_states(n, o, p)), "tuple"),
    (lambda n, o, p: ("a", "b", "c"), "number of bytes"),
])
def test_model_state_bytes_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_model_state_bytes(wrong)


def test_activation_bytes_reference_passes():
    check_activation_bytes(_activations)
    check_activation_bytes(lambda B, W, L, K, e: estimate.mlp_activations(
        B, W, L, K, precision="fp32" if e == 4 else "bf16"))


@pytest.mark.parametrize("wrong, hint", [
    (lambda B, W, L, K, e: L * B * W * e, "log-softmax"),
    (lambda B, W, L, K, e: 2 * L * B * W * e + B * K * e, "freed once ReLU"),
    (lambda B, W, L, K, e: L * B * W + B * K, "multiply values"),
    (lambda B, W, L, K, e: (L + 1) * B * W * e + B * K * e, "does not match"),
])
def test_activation_bytes_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_activation_bytes(wrong)


@pytest.mark.parametrize("check", [check_param_bytes, check_model_state_bytes,
                                   check_activation_bytes])
@pytest.mark.parametrize("bad", BAD)
def test_bad_input_is_a_failed_check(check, bad):
    with pytest.raises(CheckFailed):
        check(bad)


@pytest.mark.parametrize("check", [check_param_bytes, check_model_state_bytes,
                                   check_activation_bytes])
def test_not_done_and_hangs(check):
    with pytest.raises(NotDone):
        check.__wrapped__(_not_done)
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=0.5)
