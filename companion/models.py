"""The small models and the data the course trains, deterministic given a seed."""
from __future__ import annotations

import torch

__all__ = ["make_regression"]


def make_regression(m: int, d: int, *, noise: float = 0.1, seed: int = 0,
                    dtype: torch.dtype = torch.float32):
    """Linear-regression data: y = X @ w_true + b_true + noise.

    Returns (X, y, w_true, b_true) with X (m, d), y (m,), w_true (d,), b_true a 0-d tensor; X and
    w_true are standard normal, so the best possible MSE is about noise².
    """
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(m, d, generator=g, dtype=dtype)               # (m, d)
    w_true = torch.randn(d, generator=g, dtype=dtype)             # (d,)
    b_true = torch.randn((), generator=g, dtype=dtype)            # ()
    y = X @ w_true + b_true + noise * torch.randn(m, generator=g, dtype=dtype)  # (m,)
    return X, y, w_true, b_true
