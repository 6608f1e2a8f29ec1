"""The tiled MLP against the plain one: the same output and gradients, fewer bytes."""
import pytest
import torch
import torch.nn.functional as F

from companion.checkpointing import tiled_mlp
from companion.memory import track
from companion.models.gpt import Block
from companion.models import Llama


def _gpt_mlp(width=16, seed=0):
    torch.manual_seed(seed)
    block = Block(width, 2).double()
    return (lambda h: block.out(F.gelu(block.fc(h)))), [*block.fc.parameters(),
                                                          *block.out.parameters()]


def _grads(fn, x, params):
    x = x.detach().requires_grad_()
    y = fn(x)
    return (y, *torch.autograd.grad(y, [x, *params], torch.cos(y)))


@pytest.mark.parametrize("tiles", [1, 3, 7, 64])
def test_output_and_gradients_equal_the_plain_mlps(tiles):
    mlp, params = _gpt_mlp()
    x = torch.randn(2, 21, 16, dtype=torch.float64)          # 42 rows: tiles of unequal size
    want = _grads(mlp, x, params)
    got = _grads(lambda h: tiled_mlp(mlp, h, tiles=tiles, params=params), x, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_llama_swiglu_mlp():
    block = Llama(64, 8, 32, 1, 4, kv_heads=2, intermediate=64, seed=1).double().blocks[0]
    x = torch.randn(3, 8, 32, dtype=torch.float64)
    params = [p for m in (block.gate_proj, block.up_proj, block.down_proj) for p in m.parameters()]
    want = _grads(block.mlp, x, params)
    got = _grads(lambda h: tiled_mlp(block.mlp, h, tiles=4, params=params), x, params)
    for g, w in zip(got, want):                              # SwiGLU: gate and up, then down
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_forward_keeps_no_intermediate_and_the_peak_falls_with_the_tiles():
    mlp, params = _gpt_mlp(width=32)
    x = torch.randn(1, 512, 32, dtype=torch.float64, requires_grad=True)
    held, peaks = {}, {}
    for tiles in (1, 4, 16):
        with track(x.device) as t:
            y = tiled_mlp(mlp, x, tiles=tiles, params=params) if tiles > 1 else mlp(x)
            held[tiles] = t.current - y.untyped_storage().nbytes()
            y.backward(torch.ones_like(y))
        peaks[tiles] = t.peak
    assert held[1] == 2 * 512 * 4 * 32 * 8                   # fc's output and GELU's, fp64
    assert held[4] == held[16] == 0                          # x is the caller's
    assert peaks[1] > peaks[4] > peaks[16]


def test_bad_input_gets_a_clear_message():
    mlp, params = _gpt_mlp()
    x = torch.randn(4, 16, dtype=torch.float64)
    for tiles in (0, 2.0, True):
        with pytest.raises(ValueError, match="tiles"):
            tiled_mlp(mlp, x, tiles=tiles, params=params)
    with pytest.raises(TypeError, match="params"):
        tiled_mlp(mlp, x, tiles=2)
    with pytest.raises(TypeError, match="tensor"):
        tiled_mlp(mlp, [1, 2], tiles=2, params=params)
