"""Chapter 08's checks pass on the reference and fail on known-wrong answers, each with its hint."""
import math

import pytest
import torch

from companion import estimate, offload
from companion.checks.ch08 import (check_choose_offload, check_offload_hooks,
                                   check_offloaded_step, check_placement_arithmetic)
from companion.checks.core import CheckFailed


# ---------------------------------------------------------------- exercise 1: the offloaded step

def _step(params, masters, host_grads, optimizer, *, free=True, up="after", in_place=True,
          via_host=True, device_grad=False):
    for p, m, g in zip(params, masters, host_grads):
        if via_host:
            g.copy_(p.grad)                               # device -> host
            m.grad = p.grad if device_grad else g
        else:
            m.grad = p.grad.clone()
        if free:
            p.grad = None
    if up == "before":
        _up(params, masters, in_place)
    optimizer.step()
    if up == "after":
        _up(params, masters, in_place)


def _up(params, masters, in_place):
    with torch.no_grad():
        for p, m in zip(params, masters):
            if in_place:
                p.copy_(m)                                # host -> device
            else:
                p.data = m


def test_offloaded_step_reference_passes():
    check_offloaded_step(_step)


@pytest.mark.parametrize("options, hint", [
    ({"up": None}, "copy the updated masters back up"),
    ({"up": "before"}, "after optimizer.step\\(\\)"),
    ({"free": False}, "p.grad = None"),
    ({"in_place": False}, "in place"),
    ({"via_host": False}, "host_grads\\[i\\].copy_"),
    ({"device_grad": True}, "not the device gradient"),
])
def test_offloaded_step_wrong_answers_fail(options, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_offloaded_step(lambda *args: _step(*args, **options))


def test_offloaded_step_with_its_own_optimizer_on_the_device_fails():
    own = {}

    def device_adamw(params, masters, host_grads, optimizer):
        if own.get("params") is not params[0]:
            own.update(params=params[0], opt=torch.optim.AdamW(params, lr=0.05,
                                                                 weight_decay=0.1, fused=True))
        for p, g in zip(params, host_grads):
            g.copy_(p.grad)
        own["opt"].step()                                # the same weights, on the device
        for p in params:
            p.grad = None
    with pytest.raises(CheckFailed, match="step the optimizer you are given"):
        check_offloaded_step(device_adamw)


def test_offloaded_step_that_overwrites_the_masters_fails():
    def backwards_copy(params, masters, host_grads, optimizer):
        _step(params, masters, host_grads, optimizer)
        with torch.no_grad():
            for p, m in zip(params, masters):
                m.copy_(p * 1.0001)                       # masters no longer what AdamW made
    with pytest.raises(CheckFailed, match="do not overwrite them"):
        check_offloaded_step(backwards_copy)


def test_offloaded_step_that_steps_twice_fails():
    def twice(params, masters, host_grads, optimizer):
        _step(params, masters, host_grads, optimizer)
        optimizer.step()
        _up(params, masters, True)
    with pytest.raises(CheckFailed, match="weights after step 1"):
        check_offloaded_step(twice)


# ---------------------------------------------------------------- exercise 2: placement

def _placement(n_params, *, zero_stage, offload_optimizer, offload_params, gpus,
               largest_layer_params, **extra):
    placed = estimate.offload_placement(n_params, zero_stage=zero_stage,
                                        offload_optimizer=offload_optimizer,
                                        offload_params=offload_params, gpus_per_node=gpus,
                                        largest_layer_params=largest_layer_params, **extra)
    return placed.device, placed.host


def test_placement_arithmetic_reference_passes():
    check_placement_arithmetic(_placement)


def _no_largest_layer(n, **kw):
    device, host = _placement(n, **kw)
    return (device - 4 * kw["largest_layer_params"], host) if kw["zero_stage"] == 3 else (device,
                                                                                          host)


def _sixteen(n, **kw):
    device, host = _placement(n, **kw)
    cpu_z2 = kw["zero_stage"] == 2 and kw["offload_optimizer"] == "cpu"
    return (device, int(16 * n * 1.5)) if cpu_z2 else (device, host)


def _ceil(n, **kw):
    device, host = _placement(n, **kw)
    stage3_cpu = kw["zero_stage"] == 3 and kw["offload_optimizer"] == "cpu"
    if stage3_cpu and kw["offload_params"] is None:
        device = 4 * kw["largest_layer_params"] + math.ceil(2 * n / kw["gpus"])
    return device, host


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, **kw: _placement(n, **kw, buffer_factor=1.0), "additional_buffer_factor"),
    (_no_largest_layer, "largest layer"),
    (_sixteen, "max\\(4 x gpus, 16\\)"),
    (lambda n, **kw: (_placement(n, **kw)[0], _placement(n, **kw)[1] // kw["gpus"]), "per node"),
    (lambda n, **kw: estimate.offload_placement(
        n, zero_stage=kw["zero_stage"], offload_optimizer=kw["offload_optimizer"],
        offload_params=kw["offload_params"]), "expected 2 values"),
    (lambda n, **kw: tuple(reversed(_placement(n, **kw))), "device column first"),
    (_ceil, "not round or ceil"),
    (lambda n, **kw: tuple(float(v) for v in _placement(n, **kw)), "return Python ints"),
])
def test_placement_arithmetic_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_placement_arithmetic(wrong)


# ---------------------------------------------------------------- exercise 3: what to offload

def _choose(n_params, *, device_budget, host_budget, gpus, largest_layer_params, order=None,
            host=True, fits=lambda need, budget: need <= budget, use_gpus=True, use_largest=True):
    for setting in order or estimate.OFFLOAD_LADDER:
        placed = estimate.offload_placement(
            n_params, **setting, gpus_per_node=gpus if use_gpus else 1,
            largest_layer_params=largest_layer_params if use_largest else 0)
        if fits(placed.device, device_budget) and (not host or fits(placed.host, host_budget)):
            return setting
    return None


def test_choose_offload_reference_passes():
    check_choose_offload(_choose)


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, **kw: _choose(n, **kw, host=False), "host must fit"),
    (lambda n, **kw: _choose(n, **kw, order=estimate.OFFLOAD_LADDER[::-1]), "fastest first"),
    (lambda n, **kw: estimate.OFFLOAD_LADDER.index(_choose(n, **kw)) if _choose(n, **kw) else None,
     "not its position"),
    (lambda n, **kw: _choose(n, **kw) or estimate.OFFLOAD_LADDER[-1], "return None when no"),
    (lambda n, **kw: _choose(n, **kw, fits=lambda need, budget: need < budget), "<=, not <"),
    (lambda n, **kw: _choose(n, **kw, use_gpus=False), "gpus_per_node=gpus"),
    (lambda n, **kw: _choose(n, **kw, use_largest=False), "largest_layer_params"),
])
def test_choose_offload_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_choose_offload(wrong)


# ---------------------------------------------------------------- exercise 4: pack and unpack

def _is_parameter(t):
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def _hooks(min_bytes, *, skip_params=True, threshold=True, to_host=offload.to_host,
           back=offload.to_device):
    def pack(t):
        small = threshold and t.numel() * t.element_size() < min_bytes
        if small or (skip_params and _is_parameter(t)):
            return t
        return t.device, to_host(t)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return back(host, device)
    return pack, unpack


def test_offload_hooks_reference_passes():
    check_offload_hooks(_hooks)
    check_offload_hooks(lambda min_bytes: (offload.offload_activations(min_bytes=min_bytes)._pack,
                                           offload.offload_activations(min_bytes=min_bytes)._unpack))


def _keeps_a_reference(min_bytes):
    pack, unpack = _hooks(min_bytes)

    def pack_and_keep(t):
        packed = pack(t)
        return packed if isinstance(packed, torch.Tensor) else (*packed, t)   # t stays alive
    return pack_and_keep, lambda packed: unpack(packed if isinstance(packed, torch.Tensor)
                                                else packed[:2])


def test_the_reference_moves_no_expanded_tensor():
    hooks = offload.offload_activations(min_bytes=0)
    source = torch.randn(1, 64, requires_grad=True) * 2
    expanded = source.expand(256, 64)                      # 256 KiB seen, 256 B stored
    assert hooks._pack(expanded) is expanded and hooks.bytes_to_host == 0


@pytest.mark.parametrize("wrong, hint", [
    (lambda m: (lambda t: t, lambda p: p), "to_host"),
    (lambda m: _hooks(m, to_host=lambda t: t.clone()), "clone"),
    (lambda m: _hooks(m, back=lambda host, device: host), "back to its device"),
    (lambda m: _hooks(m, skip_params=False), "leave parameters"),
    (lambda m: _hooks(m, threshold=False), "at least min_bytes"),
    (lambda m: _hooks(m, to_host=lambda t: offload.to_host(t, dtype=torch.float32)), "dtype"),
    (lambda m: _hooks(m)[0], "tuple \\(pack, unpack\\)"),
    (lambda m: tuple(reversed(_hooks(m))), "unpack_hook expected to be a Tensor"),
    (_keeps_a_reference, "don't keep a reference to t"),
])
def test_offload_hooks_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_offload_hooks(wrong)


CHECKS = [check_offload_hooks, check_offloaded_step, check_placement_arithmetic,
          check_choose_offload]


def _hangs(*args, **kwargs):
    while True:
        pass


@pytest.mark.parametrize("check", CHECKS)
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)
