"""Attention written out: the (n_queries, n_keys) scores and probabilities in memory.

    S = q kᵀ · scale        (..., Nq, Nk)
    P = softmax(S)          (..., Nq, Nk), masked entries 0
    O = P v                 (..., Nq, d)

Autograd keeps P for backward (softmax's derivative needs its output, P v needs P), the bool mask,
and q, k, v for the two products: the T×T term that dominates a block's activations at long
sequences (Korthikanti et al., 2022: 5·a·s²·b of a layer's bytes with dropout).
`naive_saved_bytes` counts it; tests/test_attention.py holds it to `activation_bytes`.
"""
from __future__ import annotations

import torch

from companion.attention.shapes import causal_mask, check_inputs

__all__ = ["naive_attention", "naive_saved_bytes", "flash_saved_bytes"]


def naive_attention(q, k, v, is_causal: bool = False, *, scale: float | None = None,
                    align: str = "bottom_right", return_lse: bool = False):
    """softmax(q kᵀ · scale) v with the whole score matrix in memory (the baseline).

    Saves for backward: q, k and v (k and v repeated to q's heads under grouped-query attention),
    the (..., Nq, Nk) probabilities and, when causal, the (Nq, Nk) bool mask. Costs nothing in
    recomputation. A query that sees no key (bottom-right alignment with Nq > Nk) gives zeros and
    a log-sum-exp of -inf.

    Example:
        >>> o = naive_attention(q, k, v, is_causal=True)          # q (B, T, d)
        >>> o, lse = naive_attention(q, k, v, return_lse=True)     # lse (B, T), fp32

    Args: `align` "bottom_right" (FlashAttention-2's causal mask) or "top_left" (SDPA's);
    `return_lse` also returns the fp32 log-sum-exp of each query's scores.
    """
    scale = check_inputs(q, k, v, is_causal, scale)
    if q.ndim > 3 and k.shape[-3] != q.shape[-3]:              # grouped-query: repeat k, v
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = (q @ k.transpose(-2, -1)) * scale                 # (..., Nq, Nk)
    if is_causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], align=align, device=q.device)
        scores = scores.masked_fill(mask, float("-inf"))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(scores.detach().to(acc), dim=-1) if return_lse else None
    probs = scores.softmax(dim=-1)                             # (..., Nq, Nk)
    if is_causal and bool(mask.all(-1).any()):                 # rows that see nothing: 0, not NaN
        probs = probs.masked_fill(mask.all(-1, keepdim=True), 0.0)
    out = probs @ v                                            # (..., Nq, d)
    return (out, lse) if return_lse else out


def naive_saved_bytes(q_shape, k_shape, dtype: torch.dtype, *, is_causal: bool = False) -> int:
    """Bytes `naive_attention` keeps for backward when q, k, v require grad, each storage once:
    q, k, v (k and v at q's head count), P and, causal, the mask; when some query sees no key
    (causal with Nq > Nk), also a bool per query and a second P, with those rows set to 0."""
    e = torch.empty((), dtype=dtype).element_size()
    q_numel, nq, nk, d = _numel(q_shape), q_shape[-2], k_shape[-2], q_shape[-1]
    rows = q_numel // d                                        # (..., Nq) query rows
    kv_numel = rows // nq * nk * d                             # k, v at q's head count
    saved = (q_numel + 2 * kv_numel) * e + rows * nk * e       # q, k, v, P
    if is_causal:
        saved += nq * nk                                       # the mask
        if nq > nk:                                            # rows that see no key, zeroed P
            saved += nq + rows * nk * e
    return saved


def flash_saved_bytes(q_shape, k_shape, dtype: torch.dtype) -> int:
    """Bytes FlashAttention keeps for backward: q, k, v, the output (q's shape) and one fp32
    log-sum-exp per query row. Linear in the lengths."""
    e = torch.empty((), dtype=dtype).element_size()
    q_numel, d = _numel(q_shape), q_shape[-1]
    return (2 * q_numel + 2 * _numel(k_shape)) * e + 4 * (q_numel // d)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
