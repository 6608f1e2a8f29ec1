"""Chapter 11, exercise 4: one block of weights in NF4, two codes a byte."""
from __future__ import annotations

import random

import torch

from companion.checks.ch11._common import _as_codes, _codes_nearest, _nearest
from companion.checks.core import call, compare, exercise, fresh_seeds, require
from companion.lowbit import NF4


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed.long() >> 4, packed.long() & 15], 1).reshape(-1)[:n]


@exercise(points=2, reference=("companion.lowbit.quantize_nf4",
                               "companion.lowbit.nf4.quantize_nf4",
                               "companion.lowbit.quantize_blockwise"))
def check_nf4_block(answer) -> str:
    """answer(w) -> (packed uint8 of ceil(n / 2) bytes, high nibble first; absmax fp32): one block
    of weights in NF4."""
    rng = random.Random(fresh_seeds(1)[0])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    for n in (64, rng.randrange(3, 63, 2), rng.randrange(66, 200, 2)):
        w = torch.randn(n, generator=g) * rng.uniform(0.01, 2.0)
        if n == 64:                                   # the largest magnitude is negative
            w[rng.randrange(n)] = -1.5 * w.abs().max()
        label = f"a block of {n} weights"
        want_absmax = w.abs().max()
        got = call(answer, w)
        require(isinstance(got, (tuple, list)) and len(got) == 2,
                f"{label}: expected (packed, absmax), got {type(got).__name__}")
        packed, absmax = got
        compare(torch.as_tensor(absmax).float().reshape(()), want_absmax, name=f"{label}: absmax",
                rtol=1e-6, atol=0, hint="the block's scale is its largest |weight|.")
        packed = _as_codes(packed, (n + 1) // 2, f"{label}: packed codes")
        codes = _unpack(packed.to(torch.uint8), n)
        scaled = w / want_absmax
        right = _nearest(scaled, NF4).reshape(-1)
        pairs = torch.cat([right, right.new_zeros(n % 2)]).view(-1, 2)
        _codes_nearest(codes, scaled, NF4, label,
                       "each weight / absmax goes to the nearest of the 16 NF4 levels; two codes "
                       "per byte (an odd block pads a zero code).",
                       {"the first code of each pair goes in the high four bits: byte = "
                        "(first << 4) | second.": pairs.flip(1).reshape(-1)[:n]})
        if n % 2:
            pad = int(packed[-1]) & 15
            require(pad == 0, f"{label}: the last byte's low four bits pad the odd block; they "
                    f"hold code {pad}, the exercise asks for code 0",
                    hint="an odd block has no partner for its last code: pad with the code 0 "
                         "(the exercise's choice), whatever level that stands for.")
    return "NF4 codes of blocks of odd, even and full length: nearest levels, packed two per byte"
