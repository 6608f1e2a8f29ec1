"""Chapter 10's checks: what several of them share (the −inf of masked scores, and the q, k, v a
seed draws for the forward loop and the Triton kernel alike)."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _qkv(seed: int, b: int, nq: int, nk: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, nq, d, generator=g), torch.randn(b, nk, d, generator=g),
            torch.randn(b, nk, d, generator=g))
