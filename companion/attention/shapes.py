"""What every attention implementation here checks first, and the shapes they share.

q is (..., n_queries, d), k and v are (..., n_keys, d) with the same leading dimensions, except
that with four or more dimensions the one before the sequence is the heads, and k, v may have
fewer heads than q when their number divides q's (grouped-query attention: Llama 2 70B has 64
query heads and 8 key/value heads; multi-query attention has one). `grouped` reshapes q to
(..., kv_heads, group, n_queries, d) and k, v to (..., kv_heads, 1, n_keys, d), so one batched
matmul broadcasts each key/value head over its group of query heads without copying it.

The causal mask is aligned bottom-right, as FlashAttention-2 (from 2.1) does: query i of n_q sees
key j of n_k when j <= i + (n_k - n_q), so the last query sees every key (decoding with a cache).
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)` aligns it top-left (j <= i).
The two agree when n_q == n_k.
"""
from __future__ import annotations

import math

import torch

__all__ = ["check_inputs", "grouped", "ungrouped", "causal_mask", "visible_keys", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(q, k, v, is_causal, scale) -> float:
    """Raise a clear error for inputs no attention here accepts; return the scale to use
    (1/√d when `scale` is None)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; attention takes floating-point "
                            "tensors (fp16, bf16, fp32, fp64)")
        if t.ndim < 3:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected (batch, ..., length, "
                             "head_dim), at least 3 dimensions")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v must have the same number of dimensions, got "
                         f"{q.ndim}, {k.ndim}, {v.ndim}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dimensions differ: q has d = {q.shape[-1]}, k and v have "
                         f"{k.shape[-1]}")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        raise ValueError(f"empty sequence or head: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.ndim == 3 and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k and v have {k.shape[0]}")
    if q.ndim > 3:
        if q.shape[:-3] != k.shape[:-3]:
            raise ValueError(f"leading dimensions differ: q {tuple(q.shape[:-3])}, k "
                             f"{tuple(k.shape[:-3])}")
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(f"q has {q.shape[-3]} heads and k, v have {k.shape[-3]}: for "
                             "grouped-query attention the key/value heads must divide the query "
                             "heads")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def grouped(q, k, v):
    """(q, k, v) as (..., kv_heads, group, n, d) and (..., kv_heads, 1, n, d) views."""
    if q.ndim == 3:                                       # (B, n, d): one head
        return q[:, None, None], k[:, None, None], v[:, None, None]
    kv_heads = k.shape[-3]
    q5 = q.unflatten(-3, (kv_heads, q.shape[-3] // kv_heads))   # (..., Hkv, g, Nq, d)
    return q5, k.unsqueeze(-3), v.unsqueeze(-3)                 # (..., Hkv, 1, Nk, d)


def ungrouped(t5: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A grouped (..., H, g, n, x) tensor back to `like`'s layout (the inverse of `grouped`)."""
    return t5.reshape(*like.shape[:-2], *t5.shape[-2:])


def visible_keys(n_queries: int, n_keys: int) -> int:
    """The offset of the bottom-right causal mask: query i sees keys j <= i + offset."""
    return n_keys - n_queries


def causal_mask(n_queries: int, n_keys: int, *, align: str = "bottom_right",
                device: torch.device | str | None = None) -> torch.Tensor:
    """(n_queries, n_keys) bool, True where a key is hidden from a query. `align`:
    "bottom_right" (FlashAttention-2 >= 2.1) or "top_left" (SDPA's is_causal)."""
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    offset = visible_keys(n_queries, n_keys) if align == "bottom_right" else 0
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).triu(1 + offset)
