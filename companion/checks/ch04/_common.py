"""Chapter 04's checks: helpers several exercises share."""
from __future__ import annotations

import torch


def _block(seed: int, width: int, p: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 3 * width), torch.nn.GELU(),
                               torch.nn.Dropout(p), torch.nn.Linear(3 * width, width), torch.nn.Tanh())


def _input(seed: int, width: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed),
                       requires_grad=True)
