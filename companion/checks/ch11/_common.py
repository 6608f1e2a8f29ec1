"""Chapter 11's checks: codes against levels, shared by the block-wise, 8-bit Adam and NF4
exercises."""
from __future__ import annotations

import torch

from companion.checks.core import CheckFailed, require


def _nearest(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest to each value of x (the reference's rule)."""
    return (x.reshape(-1, 1) - levels.reshape(1, -1)).abs().argmin(1).reshape(x.shape)


def _as_codes(got, n: int, label: str) -> torch.Tensor:
    require(isinstance(got, torch.Tensor), f"{label}: expected a tensor of codes, got "
            f"{type(got).__name__}")
    require(got.dtype == torch.uint8, f"{label}: codes are uint8 (one byte each), got {got.dtype}",
            hint="store each index with .to(torch.uint8): an int64 index takes 8 bytes, not 1.")
    require(got.numel() == n, f"{label}: expected {n} codes, got {got.numel()}")
    return got.reshape(-1).long()


def _codes_nearest(codes: torch.Tensor, scaled: torch.Tensor, levels: torch.Tensor,
                   label: str, hint: str, known: dict | None = None) -> None:
    """Every code is a nearest level of its scaled value (ties either way)."""
    err = (levels[codes] - scaled.reshape(-1)).abs()
    best = (levels[_nearest(scaled.reshape(-1), levels)] - scaled.reshape(-1)).abs()
    bad = (err > best + 1e-6).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        hints = [h for h, wrong in (known or {}).items()
                 if torch.equal(codes, wrong.reshape(-1).long())]
        value = scaled.reshape(-1)[i]
        nearest = levels[_nearest(value.reshape(1), levels)][0]
        raise CheckFailed(f"{label}: {len(bad)} of {codes.numel()} codes are not the nearest "
                          f"level; value {i} divided by its block's absmax is {float(value):.6g}, "
                          f"the nearest level {float(nearest):.6g}, yours "
                          f"{float(levels[codes[i]]):.6g}", expected=float(nearest),
                          got=float(levels[codes[i]]), hint=hints[0] if hints else hint)
