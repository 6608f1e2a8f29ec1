"""companion.lowbit against bitsandbytes (CPU backend; a test-only dependency): the same maps, the
nearest codes, NF4's levels, packing and dequantized values, and the bytes stored."""
import pytest
import torch

from companion import lowbit

F = pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_map_is_bitsandbytes(signed):
    ours, theirs = lowbit.dynamic_map(signed), F.create_dynamic_map(signed=signed).sort().values
    assert ours.shape == (256,) and torch.allclose(ours, theirs, atol=1e-7, rtol=0)
    assert ours.max() == 1.0 and (ours == 0).sum() == 1                # +1 and 0 exactly
    assert (ours.min() > -1) if signed else (ours.min() == 0)


@pytest.mark.parametrize("numel, blocksize", [(1000, 256), (4096, 64), (77, 4096)])
def test_block_wise_codes_are_the_nearest_and_never_worse_than_bitsandbytes(numel, blocksize):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, 1, numel)    # moments' many scales
    code = lowbit.dynamic_map(True)
    codes, absmax = lowbit.quantize_blockwise(x.view(-1, 1) if numel % 2 else x, code, blocksize)
    assert codes.dtype == torch.uint8 and absmax.shape == (-(-numel // blocksize),)
    ours = lowbit.dequantize_blockwise(codes, absmax, code, blocksize).reshape(-1)
    q, state = F.quantize_blockwise(x, code=F.create_dynamic_map(True), blocksize=blocksize)
    theirs = F.dequantize_blockwise(q, state)
    assert torch.equal(absmax, state.absmax)
    block = absmax.repeat_interleave(blocksize)[:numel]
    assert ((ours - x).abs() - (theirs - x).abs()).max() <= 1e-4 * block.max()
    levels = code.view(1, -1) * block.view(-1, 1)                     # every level, per value
    best = (levels - x.view(-1, 1)).abs().min(dim=1).values
    assert torch.allclose((ours - x).abs(), best, atol=1e-6)          # the nearest level


def test_nf4_levels_are_qloras():
    theirs = F.get_4bit_type("nf4", device="cpu").sort().values
    assert lowbit.NF4.shape == (16,) and torch.allclose(lowbit.NF4, theirs, atol=1e-6, rtol=0)
    assert (lowbit.NF4 == 0).sum() == 1 and lowbit.NF4.max() == 1 and lowbit.NF4.min() == -1


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_dequantizes_to_bitsandbytes_values_and_stores_its_bits(double_quant):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64 * 300 + 7, generator=g) * 0.02                 # odd: a short last block
    q = lowbit.quantize_nf4(w, 64, double_quant=double_quant)
    ours = lowbit.dequantize_nf4(q)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                    compress_statistics=double_quant)
    theirs = F.dequantize_4bit(packed, state).reshape(-1)
    assert ours.shape == w.shape and torch.allclose(ours, theirs, atol=1e-7, rtol=0)
    blocks = -(-w.numel() // 64)
    absmax_bits = 8 * blocks + 32 * -(-blocks // 256) + 32 if double_quant else 32 * blocks
    assert q.nbytes() * 8 == 4 * (w.numel() + 1) + absmax_bits
    assert 4.12 < q.bits_per_value() < 4.2 if double_quant else 4.49 < q.bits_per_value() < 4.51


def test_bad_input_says_what_to_do():
    code = lowbit.dynamic_map()
    with pytest.raises(TypeError, match="floating-point"):
        lowbit.quantize_blockwise(torch.arange(10), code)
    with pytest.raises(ValueError, match="power of two"):
        lowbit.quantize_blockwise(torch.ones(10), code, blocksize=100)
    with pytest.raises(ValueError, match="blocksize used"):
        codes, absmax = lowbit.quantize_blockwise(torch.ones(512), code, 256)
        lowbit.dequantize_blockwise(codes, absmax, code, 64)
    with pytest.raises(TypeError, match="floating-point"):
        lowbit.quantize_nf4(torch.ones(4, dtype=torch.int32))
