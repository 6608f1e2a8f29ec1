"""companion.scaling: FP8 scales per tensor (current, delayed) and per block, against torch's
float8 casts."""
import math

import pytest
import torch

from companion import scaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_amax_scale_maps_the_amax_onto_the_formats_largest_value():
    assert float(scaling.amax_scale(2.0, "e4m3")) == 224.0                # 448 / 2
    assert float(scaling.amax_scale(2.0, "e5m2")) == 57344.0 / 2
    assert float(scaling.amax_scale(2.0, "e4m3", margin=1)) == 112.0
    assert [float(scaling.amax_scale(a)) for a in (0.0, math.inf, math.nan)] == [1.0] * 3
    with pytest.raises(ValueError, match="e4m3"):
        scaling.amax_scale(1.0, "fp8")


@pytest.mark.parametrize("fmt, dtype", [("e4m3", E4M3), ("e5m2", E5M2)])
def test_quantize_is_torchs_cast_of_the_scaled_tensor_and_round_trips(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 3
    scale = scaling.amax_scale(x.abs().max(), fmt)
    codes, overflows = scaling.quantize(x, scale, fmt)
    assert codes.dtype == dtype and overflows == 0
    assert torch.equal(codes.float(), (x * scale).to(dtype).float())
    back = scaling.dequantize(codes, scale)
    mantissa = {"e4m3": 3, "e5m2": 2}[fmt]
    normal = (x * scale).abs() >= torch.finfo(dtype).tiny
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= 2.0 ** -(mantissa + 1) + 1e-7            # half an ulp


def test_overflows_are_counted_before_the_cast_which_saturates_or_gives_inf():
    assert (scaling.overflow_limit("e4m3"), scaling.overflow_limit("e5m2")) == (464.0, 61440.0)
    x = torch.tensor([1.0, -2.0, 450.0, 470.0, -1000.0, math.inf])
    codes, overflows = scaling.quantize(x, 1.0, "e4m3")
    assert overflows == 3                                            # 470, -1000, inf
    assert codes.float().tolist() == [1.0, -2.0, 448.0, 448.0, -448.0, 448.0]   # saturated
    codes, overflows = scaling.quantize(torch.tensor([1e5, 1.0]), 1.0, "e5m2")
    assert overflows == 1 and math.isinf(codes.float()[0])


def test_a_tie_at_the_limit_rounds_to_even_and_counts_only_where_the_cast_leaves_the_range():
    # e4m3: 464 lies halfway between 448 (mantissa 110, even) and 480 (not a value of e4m3fn)
    codes, overflows = scaling.quantize(torch.tensor([464.0, -464.0, 464.0001]), 1.0, "e4m3")
    assert overflows == 1 and codes.float().tolist() == [448.0, -448.0, 448.0]
    # e5m2: 61440 lies halfway between 57344 (mantissa 11, odd) and 65536: the cast gives inf
    codes, overflows = scaling.quantize(torch.tensor([61440.0, 61439.0]), 1.0, "e5m2")
    assert overflows == 1 and math.isinf(codes.float()[0]) and codes.float()[1] == 57344.0


def test_delayed_scaling_lags_a_spike_that_current_scaling_follows():
    delayed = scaling.DelayedScaling(history=4, fmt="e4m3", margin=1)   # 2x room, as TE's
    g = torch.Generator().manual_seed(1)
    trace = [torch.randn(256, generator=g) * (50 if step == 6 else 1) for step in range(10)]
    delayed_overflows, current_overflows = [], []
    for x in trace:
        _, n = scaling.quantize(x, delayed.scale(), "e4m3")
        delayed_overflows.append(n)
        _, n = scaling.quantize(x, scaling.amax_scale(x.abs().max()), "e4m3")
        current_overflows.append(n)
        delayed.update(x.abs().max())
    assert sum(current_overflows) == 0
    assert delayed_overflows[6] > 0 and sum(delayed_overflows[:6]) == 0   # only at the spike
    assert len(delayed.amaxes) == 4 and float(delayed.scale()) < float(
        scaling.amax_scale(trace[9].abs().max()))          # the spike stays in the history
    with pytest.raises(ValueError, match="history"):
        scaling.DelayedScaling(history=0)


def test_block_absmax_by_hand():
    x = torch.arange(10.0) - 5                                       # -5 .. 4
    assert scaling.block_absmax(x, 4).tolist() == [5.0, 2.0, 4.0]     # a short last block
    t = torch.arange(35.0).view(5, 7)
    tiles = scaling.block_absmax(t, (2, 3))
    want = [[max(abs(t[r, c]) for r in range(i, min(i + 2, 5)) for c in range(j, min(j + 3, 7)))
             for j in range(0, 7, 3)] for i in range(0, 5, 2)]
    assert tiles.tolist() == [[float(v) for v in row] for row in want]
    with pytest.raises(ValueError, match="2-D"):
        scaling.block_absmax(torch.ones(2, 2, 2), (1, 2))


def test_one_scale_per_tile_confines_an_outlier_to_its_tile():
    """DeepSeek-V3's 1 x 128 tiles on activations with one outlier channel in the first tile."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 512, generator=g)
    x[:, 3] *= 1e4                                                   # an outlier channel
    codes, scales = scaling.block_quantize(x, (1, 128), "e4m3")
    assert codes.shape == x.shape and scales.shape == (16, 4)
    tiled = codes.float() / scales.repeat_interleave(128, 1)
    per_tensor = scaling.dequantize(*(lambda s: (scaling.quantize(x, s, "e4m3")[0], s))(
        scaling.amax_scale(x.abs().max())))
    rest = slice(128, None)                                          # the tiles without it
    flushed = lambda y: float((y[:, rest] == 0).float().mean())
    far_off = lambda y: float(((y - x)[:, rest].abs() > 0.25 * x[:, rest].abs()).float().mean())
    assert flushed(tiled) == far_off(tiled) == 0.0                   # e4m3's own rounding only
    assert flushed(per_tensor) > 0.01 and far_off(per_tensor) > 0.03  # below e4m3's normals


def test_mx_scales_are_powers_of_two_that_bring_each_block_into_range():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g) * torch.logspace(-3, 3, 64)
    scales = scaling.mx_scales(x, 32, "e4m3")
    assert scales.shape == (8,)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))          # E8M0
    top = scaling.block_absmax(x, 32) / scales
    assert ((top >= 256) & (top < 512)).all()          # 2^8 <= amax / scale < 2^9: e4m3's top


# ---------------------------------------------------------------- FP8 training, simulated

def _fake_fp8(x, fmt):
    """x through the format with its own amax's scale: what an FP8 matmul sees."""
    scale = scaling.amax_scale(x.abs().max(), fmt)
    return scaling.dequantize(scaling.quantize(x, scale, fmt)[0], scale)


def test_fp8_linears_multiply_the_e4m3_codes_and_backpropagate_e5m2_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 10)
    x = torch.randn(3, 5, 24, requires_grad=True)
    upstream = torch.randn(3, 5, 10) * 1e-3
    with scaling.fp8_linears(layer, "current") as fp8:
        out = layer(x)
        out.backward(upstream)
    xq, wq = _fake_fp8(x.detach().reshape(-1, 24), "e4m3"), _fake_fp8(layer.weight.detach(), "e4m3")
    assert torch.allclose(out.detach(), (xq @ wq.T + layer.bias.detach()).reshape(3, 5, 10),
                          rtol=1e-6, atol=1e-6)
    gq = _fake_fp8(upstream.reshape(-1, 10), "e5m2")
    assert torch.allclose(layer.weight.grad, gq.T @ xq, rtol=1e-5, atol=1e-9)
    assert torch.allclose(x.grad, (gq @ wq).reshape(3, 5, 24), rtol=1e-5, atol=1e-9)
    assert torch.allclose(layer.bias.grad, upstream.sum((0, 1)))
    assert fp8.values == {"input": 3 * 5 * 24, "weight": 240, "grad": 3 * 5 * 10}
    assert sum(fp8.overflows.values()) == 0
    assert "forward" not in vars(layer)                       # restored on leaving


def test_fp8_error_is_e4m3s_precision_not_more():
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64)
    with torch.no_grad():
        exact = layer(x)
        with scaling.fp8_linears(layer):
            fp8 = layer(x)
    err = float((fp8 - exact).norm() / exact.norm())
    assert 2**-6 < err < 2**-3            # e4m3 keeps 3 bits: a few percent, from both operands


def test_delayed_fp8_counts_a_spike_and_saturates_it_unless_told_not_to():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    for saturate, finite in ((True, True), (False, False)):
        with scaling.fp8_linears(layer, "delayed", saturate=saturate) as fp8:
            layer(x).sum().backward()                     # history: this step's amaxes
            layer.zero_grad()
            layer(x).backward(torch.full((16, 4), 1e6))   # a gradient far above its history
        assert fp8.overflows["grad"] == 64 and fp8.overflows["input"] == 0
        assert torch.isfinite(layer.weight.grad).all() == finite


def test_fp8_linears_refuse_a_model_without_linears_and_nesting():
    with pytest.raises(ValueError, match="no nn.Linear"):
        with scaling.fp8_linears(torch.nn.ReLU()):
            pass
    layer = torch.nn.Linear(2, 2)
    with scaling.fp8_linears(layer):
        with pytest.raises(RuntimeError, match="nested"):
            with scaling.fp8_linears(layer):
                pass
    with pytest.raises(ValueError, match="'current' or 'delayed'"):
        with scaling.fp8_linears(layer, "jit"):
            pass
