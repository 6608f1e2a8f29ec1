"""`GPT`: a small GPT-style decoder, deterministic given a seed.

Token and position embeddings, pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a
linear head; a plain `nn.Module` with no dropout, so a seed fixes every number. Attention is
written out (scores, mask, softmax, weighted sum) rather than fused, so the (T, T) score matrix
that fills memory at long sequences is there to see and to measure. `attention=` picks another
implementation: "sdpa" (`F.scaled_dot_product_attention`, also `fused_attention=True`), "flash"
(`companion.attention.FlashAttentionTorch`) or "flash_triton" (`FlashAttentionTriton`); the fused
ones keep no (T, T) tensor for backward.

Example:
    >>> model = GPT(vocab=64, seq_len=32, width=48, depth=2, heads=4, seed=0)
    >>> x, y = make_tokens(8, 32, vocab=64, seed=0)
    >>> loss = model.loss(x, y)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTIONS", "Block", "GPT"]


ATTENTIONS = ("written", "sdpa", "flash", "flash_triton")


def _attention_kind(attention: str | None, fused_attention: bool) -> str:
    if attention is None:
        return "sdpa" if fused_attention else "written"
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if fused_attention and attention == "written":
        raise ValueError("fused_attention=True contradicts attention='written'")
    return attention


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, *, fused_attention: bool = False,
                 attention: str | None = None, **factory):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.heads, self.kind = heads, _attention_kind(attention, fused_attention)
        self.ln1, self.ln2 = nn.LayerNorm(width, **factory), nn.LayerNorm(width, **factory)
        self.qkv = nn.Linear(width, 3 * width, **factory)
        self.proj = nn.Linear(width, width, **factory)
        self.fc = nn.Linear(width, 4 * width, **factory)
        self.out = nn.Linear(4 * width, width, **factory)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.heads
        q, k, v = self.qkv(x).split(C, dim=2)                      # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.heads, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.fused_attention:                                   # saves q, k, v, out, (B, nh, T)
            y = self._fused(q, k, v)                               # (B, nh, T, hs)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)  # (B, nh, T, T)
        y = (weights @ v).transpose(1, 2).reshape(B, T, C)         # (B, T, C)
        return self.proj(y)

    @property
    def fused_attention(self) -> bool:
        """True when no (T, T) tensor is kept: any kind but the written-out attention."""
        return self.kind != "written"

    def _fused(self, q, k, v):
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from companion import attention
        kernel = (attention.FlashAttentionTorch if self.kind == "flash"
                  else attention.FlashAttentionTriton)
        return kernel.apply(q, k, v, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-style decoder over `vocab` tokens and sequences up to `seq_len` long.

    Parameters: (vocab + seq_len)·C for embeddings, 12·C² + 13·C per block, 2·C for the final
    LayerNorm, C·vocab + vocab for the head (not tied to the embedding). `tie_head=True` builds
    GPT-2's head: no bias, its weight the token embedding's (one tensor, counted once; HF's
    `GPT2LMHeadModel` ties `lm_head.weight` to `transformer.wte.weight`), so the head adds
    nothing to the count."""

    def __init__(self, vocab: int, seq_len: int, width: int, depth: int, heads: int, *,
                 seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, fused_attention: bool = False,
                 attention: str | None = None, tie_head: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        factory = {"dtype": dtype, "device": device}
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, width, **factory)
        self.pos = nn.Embedding(seq_len, width, **factory)
        self.blocks = nn.Sequential(*[Block(width, heads, fused_attention=fused_attention,
                                            attention=attention, **factory)
                                      for _ in range(depth)])
        self.ln = nn.LayerNorm(width, **factory)
        self.head = nn.Linear(width, vocab, bias=not tie_head, **factory)
        if tie_head:
            self.head.weight = self.tok.weight                      # one (vocab, C) tensor

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(T, device=idx.device)                   # (T,)
        x = self.tok(idx) + self.pos(pos)                           # (B, T, C)
        return self.head(self.ln(self.blocks(x)))                   # (B, T, vocab)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; targets (B, T) are idx shifted by one."""
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
