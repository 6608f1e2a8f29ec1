"""Chapter 11, exercise 1: block-wise codes (each value's nearest level of a map, scaled by its
block's absmax)."""
from __future__ import annotations

import random

import torch

from companion.checks.ch11._common import _as_codes, _codes_nearest, _nearest
from companion.checks.core import call, compare, exercise, fresh_seeds, require
from companion.lowbit import dynamic_map


def _blocks_absmax(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize).abs().amax(1)


@exercise(points=2, reference=("companion.lowbit.quantize_blockwise",
                               "companion.lowbit.blockwise.quantize_blockwise",
                               "companion.scaling.block_absmax"))
def check_blockwise(answer) -> str:
    """answer(x, code, blocksize) -> (codes uint8 in x's shape, absmax fp32 per block)."""
    rng = random.Random(fresh_seeds(1)[0])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    lopsided = torch.sort(torch.rand(37, generator=g) ** 3 * 2 - 1).values   # not symmetric
    lopsided = torch.cat([lopsided, torch.tensor([0.0, 1.0])]).sort().values
    cases = [(dynamic_map(True), (rng.randrange(300, 900),), 64, "the signed dynamic map"),
             (dynamic_map(False), (7, rng.randrange(30, 90)), 32, "the unsigned dynamic map"),
             (lopsided, (rng.randrange(100, 400),), 16, "a map of 39 uneven levels"),
             (dynamic_map(True), (3, rng.randrange(20, 60)), 32, "the signed map, x in bf16")]
    for code, shape, blocksize, name in cases:
        x = torch.randn(shape, generator=g) * torch.logspace(-4, 0, shape[-1])
        if code.min() >= 0:
            x = x.abs()
        x.view(-1)[:blocksize] = 0.0                                # a block of zeros
        if "bf16" in name:                                          # absmax is fp32 all the same
            x = x.to(torch.bfloat16)
        label = f"x of shape {tuple(shape)}, blocks of {blocksize}, {name}"
        want = _blocks_absmax(x, blocksize)
        scale = torch.where(want > 0, want, torch.ones_like(want)).repeat_interleave(blocksize)
        scaled = x.reshape(-1) / scale[:x.numel()]
        wrong = {"divide each value by its own block's absmax, not by the whole tensor's: "
                 "a block is `blocksize` consecutive values of the flattened tensor.":
                 _nearest(x.reshape(-1) / x.abs().max(), code),
                 "pick the nearest level, not the first level above the value (rounding "
                 "down or up biases every code).":
                 torch.bucketize(scaled, code).clamp(max=len(code) - 1)}
        got = call(answer, x, code, blocksize)
        require(isinstance(got, (tuple, list)) and len(got) == 2,
                f"{label}: expected (codes, absmax), got {type(got).__name__}")
        codes, absmax = got
        require(getattr(codes, "shape", None) == x.shape, f"{label}: codes have x's shape "
                f"{tuple(x.shape)}, got {tuple(getattr(codes, 'shape', ()))}",
                hint="one code per value of x, reshaped back to x's shape.")
        codes = _as_codes(codes, x.numel(), label)
        compare(absmax, want, name=f"{label}: absmax", rtol=1e-6, atol=0.0,
                hint="one absmax per block of `blocksize` consecutive values (the last block "
                     "may be short), the largest |value| in it, in float32 whatever x's dtype.")
        _codes_nearest(codes, scaled, code, label,
                       "each code is the index of the level nearest to value / absmax; a "
                       "block whose absmax is 0 is all zeros (do not divide by 0).", wrong)
    return ("codes and absmax match the nearest-level rule on two dynamic maps and an uneven "
            "one, with short last blocks, an all-zero block and a bf16 x")
