"""Chapter 05's checks pass on the reference and fail on known-wrong answers, each with its hint."""
import math

import pytest
import torch

from companion.checks.ch05 import (check_autocast_activation_bytes, check_master_step,
                                   check_to_e4m3, check_unscale_grads, check_update_scale)
from companion.checks.core import CheckFailed


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # tiny models: two threads on a loaded machine only wait
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- the update rule

def update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, interval):
    """The notebook's solution: written out, floats only."""
    if found_inf:
        return scale * backoff_factor, 0
    tracker += 1
    if tracker == interval:
        grown = scale * growth_factor
        if grown <= torch.finfo(torch.float32).max:
            scale = grown
        tracker = 0
    return scale, tracker


def _keeps_count(scale, tracker, found, gf, bf, n):
    if found:
        return scale * bf, tracker
    return update_scale(scale, tracker, found, gf, bf, n)


def _ignores_inf(scale, tracker, found, gf, bf, n):
    return update_scale(scale, tracker, False, gf, bf, n)


def _grows_every_step(scale, tracker, found, gf, bf, n):
    return update_scale(scale, tracker, found, gf, bf, 1)


def _grows_late(scale, tracker, found, gf, bf, n):
    return update_scale(scale, tracker, found, gf, bf, n + 1)


def _never_resets(scale, tracker, found, gf, bf, n):
    if found:
        return scale * bf, 0
    tracker += 1
    return (scale * gf if tracker >= n else scale), tracker


def _divides_to_back_off(scale, tracker, found, gf, bf, n):
    if found:
        return scale / bf, 0
    return update_scale(scale, tracker, found, gf, bf, n)


def _keeps_count_at_the_ceiling(scale, tracker, found, gf, bf, n):
    if found:
        return scale * bf, 0
    tracker += 1
    if tracker == n:
        grown = scale * gf
        if grown <= torch.finfo(torch.float32).max:
            return grown, 0                          # reset only when it grew
    return scale, tracker


def _grows_to_float64(scale, tracker, found, gf, bf, n):
    if found:
        return scale * bf, 0
    return (scale * gf, 0) if tracker + 1 == n else (scale, tracker + 1)


def test_update_scale_reference_passes():
    from companion.amp import update_scale as ours
    check_update_scale(update_scale)
    check_update_scale(lambda s, t, f, g, b, n: ours(s, t, f, growth_factor=g, backoff_factor=b,
                                                     growth_interval=n))


@pytest.mark.parametrize("wrong, hint", [
    (_keeps_count, "starts again at 0"),
    (_ignores_inf, "multiply it by backoff_factor"),
    (_grows_every_step, "not after every one"),
    (_grows_late, "not one step later"),
    (_never_resets, "reset the count"),
    (_grows_to_float64, r"float32 \(largest"),
    (_divides_to_back_off, "dividing by it doubles"),
    (_keeps_count_at_the_ceiling, "even when float32's ceiling"),
    (lambda s, t, f, g, b, n: s, "two values"),
    (lambda s, t, f, g, b, n: (s, t), None),
])
def test_update_scale_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_update_scale(wrong)


def test_update_scale_failure_shows_the_inf_steps():
    with pytest.raises(CheckFailed, match=r"found_inf by step: [.I]{80}\[\d+\] does not") as failed:
        check_update_scale(_divides_to_back_off)
    assert "I" in failed.value.summary.split("found_inf by step: ")[1]


# ---------------------------------------------------------------- unscale and find infs

def unscale_grads(grads, inv_scale):
    found_inf = torch.zeros(())
    for g in grads:
        found_inf += (~torch.isfinite(g)).any()
        g.mul_(inv_scale)
    return found_inf > 0


def _isinf_only(grads, inv_scale):
    found = any(bool(g.isinf().any()) for g in grads)
    for g in grads:
        g.mul_(inv_scale)
    return found


def _first_only(grads, inv_scale):
    found = not bool(torch.isfinite(grads[0]).all())
    for g in grads:
        g.mul_(inv_scale)
    return found


def _copies(grads, inv_scale):
    found = any(not bool(torch.isfinite(g).all()) for g in grads)
    for i, g in enumerate(grads):
        grads[i] = g * inv_scale                 # new tensors: p.grad never sees them
    return found


def _divides(grads, inv_scale):
    found = any(not bool(torch.isfinite(g).all()) for g in grads)
    for g in grads:
        g.div_(inv_scale)
    return found


def _multiplies_then_looks(grads, inv_scale):
    for g in grads:
        g.mul_(inv_scale)
    return any(not bool(torch.isfinite(g).all()) for g in grads)


def test_looking_before_multiplying_is_what_torch_does():
    """A finite gradient near the largest float, unscaled by 2: torch's kernel flags nothing (it
    looks first), though the product is inf; the check's case rests on this."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g, found = torch.tensor([torch.finfo(dtype).max / 1.5, 1.0], dtype=dtype), torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([g], found, torch.tensor(2.0))
        assert found.item() == 0.0 and g[0].isinf()
        assert not bool(unscale_grads([g.new_tensor([torch.finfo(dtype).max / 1.5])],
                                      torch.tensor(2.0)))


def _sum_is_finite(grads, inv_scale):
    found = not bool(torch.isfinite(sum(g.float().sum() for g in grads)))
    for g in grads:
        g.mul_(inv_scale)
    return found


def _sum_per_tensor(grads, inv_scale):
    found = any(not bool(torch.isfinite(g.float().sum())) for g in grads)
    for g in grads:
        g.mul_(inv_scale)
    return found


def _inf_sum_or_nan_element(grads, inv_scale):
    found = any(bool(g.double().sum().isinf() or g.isnan().any()) for g in grads)  # no overflow
    for g in grads:
        g.mul_(inv_scale)
    return found


def _early_return(grads, inv_scale):
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            return True
        g.mul_(inv_scale)
    return False


def _always(grads, inv_scale):
    unscale_grads(grads, inv_scale)
    return True


def test_unscale_grads_reference_passes():
    from companion.amp import unscale_grads_
    check_unscale_grads(unscale_grads)
    check_unscale_grads(unscale_grads_)


@pytest.mark.parametrize("wrong, hint", [
    (_isinf_only, "isinf misses NaN"),
    (_first_only, "every gradient tensor"),
    (_copies, "in place"),
    (_divides, "multiply by inv_scale"),
    (_always, "flag only inf and NaN"),
    (_multiplies_then_looks, "look before you multiply"),
    (_sum_is_finite, "sum of finite gradients can overflow"),
    (_sum_per_tensor, "sum of finite gradients can overflow"),
    (_inf_sum_or_nan_element, "inf \\+ \\(-inf\\) is NaN"),
    (_early_return, "Do not return early"),
    (lambda grads, inv_scale: None, "found_inf as a bool"),
])
def test_unscale_grads_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_unscale_grads(wrong)


# ---------------------------------------------------------------- master weights

def master_step(model, master_params, optimizer):
    for p, m in zip(model.parameters(), master_params):
        m.grad = p.grad.float()                     # 2 bytes -> 4 bytes per element
        p.grad = None
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master_params):
            p.copy_(m)                              # rounded to 16 bits
            m.grad = None


def _no_copy_back(model, master_params, optimizer):
    for p, m in zip(model.parameters(), master_params):
        m.grad, p.grad = p.grad.float(), None
    optimizer.step()
    for m in master_params:
        m.grad = None


def _copy_first(model, master_params, optimizer):
    with torch.no_grad():
        for p, m in zip(model.parameters(), master_params):
            p.copy_(m)
    _no_copy_back(model, master_params, optimizer)


def _no_grads_moved(model, master_params, optimizer):
    model.zero_grad(set_to_none=True)
    optimizer.step()


def _keeps_grads(model, master_params, optimizer):
    for p, m in zip(model.parameters(), master_params):
        m.grad = p.grad.float()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master_params):
            p.copy_(m)


def _replaces_params(model, master_params, optimizer):
    _no_copy_back(model, master_params, optimizer)
    for p, m in zip(model.parameters(), master_params):
        p.data = m.detach().clone()                  # the model silently becomes fp32


def _copy_back_with_autograd(model, master_params, optimizer):
    for p, m in zip(model.parameters(), master_params):
        m.grad, p.grad = p.grad.float(), None
    optimizer.step()
    for p, m in zip(model.parameters(), master_params):
        p.copy_(m)                                   # no torch.no_grad(): autograd refuses
        m.grad = None


def _copies_model_to_master(model, master_params, optimizer):
    for p, m in zip(model.parameters(), master_params):
        m.grad, p.grad = p.grad.float(), None
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master_params):
            m.copy_(p)                               # the wrong direction: the step is undone
            m.grad = None


def _steps_16_bit(model, master_params, optimizer):
    with torch.no_grad():                           # plain SGD on the 16-bit weights
        for p in model.parameters():
            p -= 1e-3 * p.grad
            p.grad = None


def test_master_step_reference_passes():
    from companion.amp import MasterWeights

    def with_helper(model, master_params, optimizer):
        helper = MasterWeights(model.parameters())
        helper.master_params = master_params
        helper.step(optimizer)

    check_master_step(master_step)
    check_master_step(with_helper)


@pytest.mark.parametrize("wrong, hint", [
    (_no_copy_back, "copy the master weights back"),
    (_copy_first, "one step behind"),
    (_no_grads_moved, "did not move: set m.grad = p.grad.float"),
    (_keeps_grads, "free each 16-bit gradient"),
    (_replaces_params, "do not replace them"),
    (_steps_16_bit, "did not move: set m.grad = p.grad.float"),
    (_copy_back_with_autograd, r"under `with torch.no_grad\(\):` \(p.copy_\(m\)\): autograd"),
    (_copies_model_to_master, "never model -> master"),
])
def test_master_step_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_master_step(wrong)


# ---------------------------------------------------------------- a prediction

def autocast_activation_bytes(batch, d_in, width, depth, d_out):
    input_copy = 2 * batch * d_in                                   # saved by the first Linear
    weight_copies = 2 * ((depth - 1) * width * width + width * d_out)   # not the first's
    relu_outputs = 2 * depth * batch * width
    log_softmax = 4 * batch * d_out                                 # fp32: the loss's list
    return input_copy + weight_copies + relu_outputs + log_softmax + 4


def test_autocast_activation_bytes_reference_passes():
    check_autocast_activation_bytes(autocast_activation_bytes)


@pytest.mark.parametrize("wrong, hint", [
    (lambda B, d, W, L, K: 2 * (L * B * W + B * K + 1), "half of fp32"),
    (lambda B, d, W, L, K: 4 * (L * B * W + B * K + 1), "ReLU outputs are 16-bit"),
    (lambda B, d, W, L, K: 2 * B * d + 2 * L * B * W + 4 * B * K + 4, "weight matrix"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) + 2 * d * W, "first Linear's"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) - 2 * B * K, "fp32 list"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) - 2 * B * d, "input batch"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) + 2 * L * B * W,
     "count it once"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) + 2 * B * K,
     "16-bit logits are not saved"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) + 2 * ((L - 1) * W + K),
     "does not save its bias"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) - 2 * B * W,
     r"depth ReLU outputs, depth \+ 1 Linears"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) - 4, "total weight, 4 bytes"),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) + 1, None),
    (lambda B, d, W, L, K: autocast_activation_bytes(B, d, W, L, K) + 0.25, None),
    (lambda B, d, W, L, K: float(autocast_activation_bytes(B, d, W, L, K)), "return an int"),
])
def test_autocast_activation_bytes_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_autocast_activation_bytes(wrong)


# ---------------------------------------------------------------- FP8 with a scale

def to_e4m3(x, amax):
    amax = float(amax)
    scale = 448.0 / amax if amax > 0 and math.isfinite(amax) else 1.0
    scaled = x.float() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() >= 464).sum())


def test_to_e4m3_reference_passes():
    from companion import scaling
    check_to_e4m3(to_e4m3)

    def from_the_companion(x, amax):
        scale = scaling.amax_scale(amax, "e4m3")
        codes, overflows = scaling.quantize(x, scale, "e4m3")
        return codes, scale, overflows
    check_to_e4m3(from_the_companion)


def test_the_overflow_limit_is_where_torchs_cast_stops_rounding_to_448():
    below, above = torch.tensor([463.99]), torch.tensor([464.01])
    assert below.to(torch.float8_e4m3fn).float().item() == 448.0
    assert above.to(torch.float8_e4m3fn).float().item() == 448.0           # saturated, silently
    assert to_e4m3(below, 448.0)[2] == 0 and to_e4m3(above, 448.0)[2] == 1


def _inverted(x, amax):
    codes, scale, overflows = to_e4m3(x, amax)
    return codes, 1.0 / scale, overflows


def _counted_after_the_cast(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int((codes.float().abs() >= 464).sum())


def _beyond_448(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int(((x.float() * scale).abs() > 448).sum())


def _own_amax(x, amax):
    return to_e4m3(x, x.float().abs().max())


def _no_zero_case(x, amax):
    scale = 448.0 / float(amax) if float(amax) != 0 else math.inf
    scaled = x.float() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() >= 464).sum())


def _positive_only(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int(((x.float() * scale) >= 464).sum())


def _bf16_product(x, amax):
    _, scale, overflows = to_e4m3(x, amax)
    return (x * scale).to(torch.float8_e4m3fn), scale, overflows     # in x's dtype: rounds twice


@pytest.mark.parametrize("wrong, hint", [
    (_inverted, "not amax / 448"),
    (_counted_after_the_cast, "count before the cast"),
    (_beyond_448, "still rounds to 448"),
    (_own_amax, "the amax you are given"),
    (_no_zero_case, "nothing to scale by"),
    (_positive_only, "about magnitude"),
    (_bf16_product, "multiply in float32"),
    (lambda x, amax: (x.to(torch.float8_e4m3fn), 1.0, 0), "scale"),
])
def test_to_e4m3_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_to_e4m3(wrong)


# ---------------------------------------------------------------- garbage and hangs

CHECKS = [check_update_scale, check_unscale_grads, check_master_step,
          check_autocast_activation_bytes, check_to_e4m3]


def _hangs(*args):
    while True:
        pass


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: torch.tensor(math.nan),
                                     lambda *a: torch.ones(3, dtype=torch.int64)])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)


@pytest.mark.parametrize("check", CHECKS)
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)
