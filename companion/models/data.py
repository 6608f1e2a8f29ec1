"""The data the course's models train on, deterministic given a seed.

`make_regression` is chapter 01's linear-regression data, `make_classification` Gaussian
clusters for `MLP`, `make_tokens` token sequences from a random Markov chain for `GPT` and
`Llama`.

Example:
    >>> x, y = make_tokens(8, 32, vocab=64, seed=0)      # (8, 32) int64 each
"""
from __future__ import annotations

import torch

__all__ = ["make_regression", "make_classification", "make_tokens"]


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


def make_classification(n: int, d_in: int, n_classes: int, *, seed: int = 0,
                        dtype: torch.dtype = torch.float32):
    """(X, y): n points in d_in dimensions from n_classes Gaussian clusters; X (n, d_in), y (n,)."""
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(n_classes, d_in, generator=g, dtype=dtype)  # (k, d_in)
    y = torch.randint(n_classes, (n,), generator=g)                          # (n,)
    X = centres[y] + torch.randn(n, d_in, generator=g, dtype=dtype)          # (n, d_in)
    return X, y


def make_tokens(n: int, seq_len: int, *, vocab: int, seed: int = 0):
    """(x, y): n token sequences from a fixed random Markov chain, y = x shifted left by one.

    Each token has 4 likely successors, so a model can learn the chain; x and y are (n, seq_len)
    int64."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 4), generator=g)               # (vocab, 4)
    tokens = torch.empty(n, seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
    for t in range(seq_len):
        pick = torch.randint(4, (n,), generator=g)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
