"""FlashAttention-2 in plain PyTorch: attention over tiles, one log-sum-exp per query kept.

Forward (Dao, 2023, "FlashAttention-2", Algorithm 1): for each tile of block_q queries, loop over
tiles of block_k keys, compute the (block_q, block_k) scores, and merge them into a running
maximum m, sum l and unnormalized output with the online softmax (`companion.attention.online`).
Only O and L = m + log l, one fp32 value per query, are written. Backward (Algorithm 2) recomputes
each tile's probabilities from q, k and L, P = exp(S − L), and uses D = rowsum(dO ∘ O) in place of
the softmax's sum over all keys, which no tile sees:

    dV += Pᵀ dO     dP = dO Vᵀ     dS = P ∘ (dP − D)     dQ += dS K · scale     dK += dSᵀ Q · scale

Memory: saved for backward are q, k, v, O and L, linear in the sequence, instead of the
(Nq, Nk) probabilities; the price is one more q kᵀ product in backward (recomputation, as in
chapter 04's checkpointing, inside one operator). Scores and accumulators are fp32 whatever the
input dtype.

Example:
    >>> o = FlashAttentionTorch.apply(q, k, v, True)                  # q (B, H, T, d)
    >>> o = FlashAttentionTorch.apply(q, k, v, False, None, 32, 64)   # scale, block_q, block_k
    >>> o, lse = flash_forward(q, k, v, is_causal=True)

Simplified vs FlashAttention-2's CUDA kernel: the tiles run one after another in a Python loop
(a GPU runs the query tiles of every head in parallel, one thread block each); P v is an fp32
product where the kernel casts P to 16 bits; no dropout, no variable-length batches. The Triton
version (`FlashAttentionTriton`) runs the same algorithm as kernels.
"""
from __future__ import annotations

import torch

from companion.attention.shapes import check_inputs, grouped, ungrouped, visible_keys

__all__ = ["FlashAttentionTorch", "flash_forward", "flash_backward", "check_blocks"]

NEG_INF = float("-inf")


def check_blocks(block_q, block_k) -> tuple[int, int]:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    return block_q, block_k


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and 16-bit inputs; fp64 inputs (tests) keep fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_last(q: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor of q's shape laid out (..., Nq, heads, d) in memory, as SDPA lays out its
    output: `out.transpose(-2, -3).reshape(..., Nq, heads·d)` is then a view, not a copy."""
    dtype = q.dtype if dtype is None else dtype
    if q.ndim < 4:
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    shape = (*q.shape[:-3], q.shape[-2], q.shape[-3], q.shape[-1])
    return torch.empty(shape, dtype=dtype, device=q.device).transpose(-2, -3)


def _tile_scores(qi, kj, scale, rows, cols, offset, is_causal):
    """(…, Bq, Bk) fp32 scores of one tile, −inf where the causal mask hides a key."""
    s = (qi @ kj.transpose(-2, -1)) * scale                  # (..., g, Bq, Bk) fp32
    if is_causal and cols[-1] > rows[0] + offset:            # the tile crosses the diagonal
        s = s.masked_fill(cols[None, :] > rows[:, None] + offset, NEG_INF)
    return s


def flash_forward(q, k, v, is_causal: bool = False, *, scale: float | None = None,
                  block_q: int = 128, block_k: int = 128):
    """(O, L): the attention output (q's shape and dtype) and the fp32 log-sum-exp of each
    query's scores ((..., Nq); −inf for a query that sees no key, whose output is 0)."""
    scale = check_inputs(q, k, v, is_causal, scale)
    block_q, block_k = check_blocks(block_q, block_k)
    q5, k5, v5 = grouped(q, k, v)                            # (.., Hkv, g, Nq, d), (.., Hkv, 1, Nk, d)
    acc = _accumulator(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = visible_keys(n_q, n_k)                          # query i sees keys j <= i + offset
    out = _heads_last(q)                                     # q's shape, (..., Nq, H, d) in memory
    out5 = grouped(out, k, v)[0]                             # a view: tiles write into `out`
    lse = torch.empty(q5.shape[:-1], dtype=acc, device=q.device)
    for i0 in range(0, n_q, block_q):
        qi = q5[..., i0:i0 + block_q, :].to(acc)             # (..., g, Bq, d)
        rows = torch.arange(i0, i0 + qi.shape[-2], device=q.device)
        m = torch.full(qi.shape[:-1], NEG_INF, dtype=acc, device=q.device)  # running max (.., Bq)
        l = torch.zeros(qi.shape[:-1], dtype=acc, device=q.device)          # running sum (.., Bq)
        num = torch.zeros(qi.shape, dtype=acc, device=q.device)   # unnormalized O  (..., Bq, d)
        stop = min(n_k, int(rows[-1]) + offset + 1) if is_causal else n_k
        for j0 in range(0, stop, block_k):                   # key tiles this query tile can see
            kj, vj = k5[..., j0:j0 + block_k, :].to(acc), v5[..., j0:j0 + block_k, :].to(acc)
            cols = torch.arange(j0, j0 + kj.shape[-2], device=q.device)
            s = _tile_scores(qi, kj, scale, rows, cols, offset, is_causal)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)    # rows that saw no key yet
            p = torch.exp(s - m_safe[..., None])             # (..., Bq, Bk)
            alpha = torch.exp(m - m_safe)                    # rescales what was summed before
            l = alpha * l + p.sum(dim=-1)
            num = alpha[..., None] * num + p @ vj
            m = m_new
        out5[..., i0:i0 + block_q, :] = num / l.masked_fill(l == 0, 1.0)[..., None]
        lse[..., i0:i0 + block_q] = m + torch.log(l)         # −inf + −inf where l == 0
    return out, lse.reshape(q.shape[:-1])


def flash_backward(q, k, v, out, lse, grad_out, is_causal: bool = False, *,
                   scale: float | None = None, block_q: int = 128, block_k: int = 128):
    """(dq, dk, dv) by recomputing each tile's probabilities from q, k and the log-sum-exp."""
    scale = check_inputs(q, k, v, is_causal, scale)
    q5, k5, v5 = grouped(q, k, v)
    do5, o5 = grouped(grad_out, k, v)[0], grouped(out, k, v)[0]
    lse5 = grouped(lse[..., None], k, v)[0][..., 0]           # (..., Hkv, g, Nq)
    acc = _accumulator(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = visible_keys(n_q, n_k)
    D = (do5.to(acc) * o5.to(acc)).sum(dim=-1)              # (..., g, Nq): rowsum(dO ∘ O)
    lse_safe = lse5.masked_fill(lse5 == NEG_INF, float("inf"))   # P = 0 for rows that saw nothing
    dq = torch.zeros(q5.shape, dtype=acc, device=q.device)   # fp32 accumulators
    dk = torch.zeros(k5.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v5.shape, dtype=acc, device=q.device)
    for j0 in range(0, n_k, block_k):
        kj, vj = k5[..., j0:j0 + block_k, :].to(acc), v5[..., j0:j0 + block_k, :].to(acc)
        cols = torch.arange(j0, j0 + kj.shape[-2], device=q.device)
        first = max(0, j0 - offset) // block_q * block_q if is_causal else 0
        for i0 in range(first, n_q, block_q):                # query tiles that see this key tile
            qi, doi = q5[..., i0:i0 + block_q, :].to(acc), do5[..., i0:i0 + block_q, :].to(acc)
            rows = torch.arange(i0, i0 + qi.shape[-2], device=q.device)
            s = _tile_scores(qi, kj, scale, rows, cols, offset, is_causal)
            p = torch.exp(s - lse_safe[..., i0:i0 + block_q, None])      # (..., g, Bq, Bk)
            dv[..., j0:j0 + block_k, :] += (p.transpose(-2, -1) @ doi).sum(-3, keepdim=True)
            dp = doi @ vj.transpose(-2, -1)                  # (..., g, Bq, Bk)
            ds = p * (dp - D[..., i0:i0 + block_q, None])
            dq[..., i0:i0 + block_q, :] += (ds @ kj) * scale
            dk[..., j0:j0 + block_k, :] += (ds.transpose(-2, -1) @ qi).sum(-3, keepdim=True) * scale
    return (ungrouped(dq, q).to(q.dtype), dk.reshape(k.shape).to(k.dtype),
            dv.reshape(v.shape).to(v.dtype))


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention-2 as an autograd Function: `FlashAttentionTorch.apply(q, k, v, is_causal,
    scale=None, block_q=128, block_k=128)` (options by position or keyword).

    Saves for backward exactly q, k, v, the output and the (..., Nq) fp32 log-sum-exp.
    The causal mask is aligned bottom-right (see `companion.attention.shapes`)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, block_q=128, block_k=128):
        out, lse = flash_forward(q, k, v, is_causal, scale=scale, block_q=block_q,
                                 block_k=block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (is_causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, scale, block_q, block_k = ctx.options
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, is_causal, scale=scale,
                                    block_q=block_q, block_k=block_k)
        return dq, dk, dv, None, None, None, None
