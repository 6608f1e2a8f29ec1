"""`MLP`: Linear-ReLU stacks, the course's smallest model.

Example:
    >>> model = MLP(20, 64, 3, 5, seed=0)
    >>> loss = model.loss(torch.randn(8, 20), torch.randint(5, (8,)))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """`depth` hidden Linear-ReLU layers of `width`, then a Linear to `d_out` classes.

    Parameters: d_in·w + w + (depth-1)·(w² + w) + w·d_out + d_out. Saved for backward per example:
    each ReLU's output (w values per layer), and the log-softmax of the logits in `loss`."""

    def __init__(self, d_in: int, width: int, depth: int, d_out: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        torch.manual_seed(seed)
        dims = [d_in] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b, dtype=dtype, device=device), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(dims[-1], d_out, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)                                         # (B, d_in) -> (B, d_out)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the logits against class labels y (B,)."""
        return F.cross_entropy(self(x), y)
