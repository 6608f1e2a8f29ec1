"""Chapter 11's checks pass on the reference and fail on the wrong answers a learner writes."""
import pytest
import torch

from companion.checks.ch11 import (CHOICES, adam8bit_block, check_adam8bit_block,
                                   check_blockwise, check_nf4_block, check_pick_layout,
                                   check_stochastic_rounding, layout_bytes, pick_layout)
from companion.checks.core import CheckFailed
from companion.lowbit import NF4, quantize_blockwise, quantize_nf4, round_stochastic


# ---------------------------------------------------------------- exercise 1

def _per_tensor(x, code, blocksize):
    codes, _ = quantize_blockwise(x, code, 2 ** 20)
    return codes, quantize_blockwise(x, code, blocksize)[1]


def _round_down(x, code, blocksize):
    _, absmax = quantize_blockwise(x, code, blocksize)
    scale = absmax.clamp_min(1e-30).repeat_interleave(blocksize)[:x.numel()]
    index = torch.bucketize(x.reshape(-1) / scale, code).clamp(max=len(code) - 1)
    return index.to(torch.uint8).view(x.shape), absmax


def _int64_codes(x, code, blocksize):
    codes, absmax = quantize_blockwise(x, code, blocksize)
    return codes.long(), absmax


def _flat_codes(x, code, blocksize):
    codes, absmax = quantize_blockwise(x, code, blocksize)
    return codes.reshape(-1), absmax


def test_blockwise_reference_passes():
    check_blockwise(quantize_blockwise)


@pytest.mark.parametrize("wrong, hint", [
    (_per_tensor, "its own block's absmax"),
    (_round_down, "nearest level"),
    (_int64_codes, "uint8"),
    (_flat_codes, "reshaped back"),
])
def test_blockwise_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_blockwise(wrong)


# ---------------------------------------------------------------- exercise 2

def _no_bias_correction(p, grad, mc, ma, vc, va, t, lr, betas, eps):
    out = list(adam8bit_block(p, grad, mc, ma, vc, va, t, lr, betas, eps))
    from companion.lowbit import dynamic_map
    m = dynamic_map(True)[mc.long()] * ma
    v = dynamic_map(False)[vc.long()] * va
    m = betas[0] * m + (1 - betas[0]) * grad
    v = betas[1] * v + (1 - betas[1]) * grad ** 2
    out[0] = p - lr * m / (v.sqrt() + eps)
    return tuple(out)


def _old_absmax(p, grad, mc, ma, vc, va, t, lr, betas, eps):
    out = list(adam8bit_block(p, grad, mc, ma, vc, va, t, lr, betas, eps))
    out[2] = ma if float(ma) > 0 else out[2]
    return tuple(out)


def _signed_v(p, grad, mc, ma, vc, va, t, lr, betas, eps):
    from companion.lowbit import dynamic_map
    out = list(adam8bit_block(p, grad, mc, ma, vc, va, t, lr, betas, eps))
    signed = dynamic_map(True)
    v = dynamic_map(False)[out[3].long()] * out[4]
    index = (v.reshape(-1, 1) / out[4].clamp_min(1e-30) - signed).abs().argmin(1)
    out[3] = index.to(torch.uint8)
    return tuple(out)


def test_adam8bit_block_reference_passes():
    check_adam8bit_block(adam8bit_block)


@pytest.mark.parametrize("wrong, hint", [
    (_no_bias_correction, "bias corrections"),
    (_old_absmax, "its own new absmax"),
    (_signed_v, "unsigned"),
])
def test_adam8bit_block_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_adam8bit_block(wrong)


# ---------------------------------------------------------------- exercise 3

def _nearest(x):
    return x.to(torch.bfloat16)


def _signed_value_rounds(x):
    """Known wrong: the noise moves the signed value up, so negatives round toward zero more."""
    noise = torch.rand_like(x)
    low = (x.view(torch.int32) & -65536).view(torch.float32)
    high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    frac = (x - low) / (high - low)
    return torch.where(noise < frac.abs() * 0.5 + 0.25, high, low).to(torch.bfloat16)


def _fifteen_bits(x):
    """Known wrong: noise over 15 of the 16 dropped bits, so it rounds up half as often."""
    noise = torch.randint(0, 1 << 15, x.shape, dtype=torch.int32)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def test_stochastic_rounding_reference_passes():
    check_stochastic_rounding(round_stochastic)


@pytest.mark.parametrize("wrong, hint", [
    (_nearest, "biased"),
    (_signed_value_rounds, "uniform"),
    (_fifteen_bits, "should round up with probability"),
    (lambda x: x, None),                                     # fp32 back: wrong dtype
])
def test_stochastic_rounding_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_stochastic_rounding(wrong)


# ---------------------------------------------------------------- exercise 4

def _nf4(w):
    blocksize = 1 << max(1, (w.numel() - 1).bit_length())
    q = quantize_nf4(w, blocksize)
    return q.packed, q.absmax[0]


def _low_nibble_first(w):
    packed, absmax = _nf4(w)
    return (packed << 4) | (packed >> 4), absmax


def _linear_levels(w):
    absmax = w.abs().max()
    codes = ((w / absmax + 1) / 2 * 15).round().long()
    flat = torch.cat([codes, codes.new_zeros(codes.numel() % 2)])
    return ((flat[0::2] << 4) | flat[1::2]).to(torch.uint8), absmax


def test_nf4_block_reference_passes():
    check_nf4_block(_nf4)


@pytest.mark.parametrize("wrong, hint", [
    (_low_nibble_first, "high four bits"),
    (_linear_levels, "nearest of the 16 NF4 levels"),
    (lambda w: (_nf4(w)[0], w.abs().mean()), "largest"),
])
def test_nf4_block_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_nf4_block(wrong)


def test_nf4_levels_in_the_check_are_the_packages():
    assert NF4.numel() == 16 and float(NF4[7]) == 0.0


# ---------------------------------------------------------------- exercise 5

def _ignores_absmax(n, n_linear, n_adapter, gpu, other):
    per = {"bf16+master": 16, "fp32+adam8bit": 10, "bf16+kahan": 10, "bf16": 8}
    for c in CHOICES[:-1]:
        if per[c] * n + other <= gpu:
            return c
    return pick_layout(n, n_linear, n_adapter, gpu, other)


def _qlora_free_base(n, n_linear, n_adapter, gpu, other):
    got = pick_layout(n, n_linear, n_adapter, gpu, other)
    if got is None and 16 * n_adapter + other <= gpu:
        return "qlora"
    return got


def _cheapest(n, n_linear, n_adapter, gpu, other):
    """Known wrong: the layout that saves the most, not the most precise one that fits."""
    fits = [c for c in CHOICES if layout_bytes(c, n, n_linear, n_adapter) + other <= gpu]
    return min(fits, key=lambda c: layout_bytes(c, n, n_linear, n_adapter)) if fits else None


def test_pick_layout_reference_passes():
    check_pick_layout(pick_layout)


@pytest.mark.parametrize("wrong, hint", [
    (_ignores_absmax, "absmax per block"),
    (_qlora_free_base, "not free"),
    (_cheapest, "first choice"),
])
def test_pick_layout_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_pick_layout(wrong)
