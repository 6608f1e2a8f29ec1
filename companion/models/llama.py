"""`Llama`: a Llama-shaped decoder (Llama 2 and 3, Mistral, Qwen2), deterministic given a seed.

Where `GPT` has learned positions, LayerNorm, one qkv Linear and a 4x GELU MLP, a Llama block has
RMSNorm, rotary position embeddings, grouped-query attention (fewer key/value heads than query
heads) and a SwiGLU MLP; no biases, except Qwen2's on q, k and v (`qkv_bias=True`) and those a
Llama config asks for (`attention_bias`: `qkv_bias` and `o_bias`; `mlp_bias`). Attention is
always `F.scaled_dot_product_attention` (fused: no (T, T) tensor is kept for backward). The
interface is `GPT`'s (`seq_len`, `tok`, `blocks`, `norm`, `head`, `loss`), so the planner's
training code drives either; `companion.plan.configs` builds one from a Hugging Face config.json.

Example:
    >>> model = Llama(vocab=64, seq_len=32, width=48, depth=2, heads=4, kv_heads=2,
    ...               intermediate=128, seed=0)
    >>> x, y = make_tokens(8, 32, vocab=64, seed=0)
    >>> loss = model.loss(x, y)

Simplified vs Hugging Face's `LlamaForCausalLM`: no KV cache, attention mask, dropout or rope
scaling (Llama 3.1's long-context rule); head_dim is width // heads; initialisation is
PyTorch's default for each layer, not normal(0, 0.02).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Rotary", "LlamaBlock", "Llama", "llama_intermediate"]


def llama_intermediate(width: int, *, multiple_of: int = 256) -> int:
    """The SwiGLU width Meta's Llama code picks: 8·C/3 (three matrices cost what a 4C GELU MLP's
    two do), rounded up to a multiple of `multiple_of` (Llama 2 7B: 4096 -> 11008)."""
    return multiple_of * math.ceil(int(8 * width / 3) / multiple_of)


class Rotary(nn.Module):
    """Rotary position embeddings (Su et al., 2021, "RoFormer"), in the rotate-half layout of
    Hugging Face's Llama: channel i of a head is paired with channel i + d/2 and the pair at
    position t is turned by the angle t·θ^(-2i/d):

        x' = x·cos + rotate_half(x)·sin,   rotate_half(x₁, x₂) = (-x₂, x₁)

    cos and sin, (seq_len, d) each, are buffers made once and shared by every block (2·T·d values
    of the model's dtype); backward needs only them, so rotating q and k saves nothing new."""

    def __init__(self, head_dim: int, seq_len: int, *, theta: float = 10000.0, **factory):
        super().__init__()
        dtype, device = factory.get("dtype", torch.float32), factory.get("device")
        half = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        inv_freq = 1.0 / theta ** half                                       # (d/2,)
        t = torch.arange(seq_len, dtype=torch.float32, device=device)        # (T,)
        angles = torch.outer(t, inv_freq).repeat(1, 2)                       # (T, d)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, heads, T, d) -> the same, rotated."""
        T, half = x.shape[-2], x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)         # (B, h, T, d)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)      # x's dtype: under
        return x * cos + rotated * sin             # autocast q and k stay bf16, as v (SDPA)


class LlamaBlock(nn.Module):
    """One pre-RMSNorm block: x + attention(norm(x)), then x + swiglu(norm(x)).

    Attention: q from `heads`, k and v from `kv_heads` heads of d = width // heads; each group of
    heads // kv_heads query heads shares one key/value head (grouped-query attention, Ainslie et
    al., 2023). SwiGLU (Shazeer, 2020): down(silu(gate(x)) · up(x))."""

    def __init__(self, width: int, heads: int, *, kv_heads: int, intermediate: int,
                 rotary: Rotary, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, norm_eps: float = 1e-5, **factory):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        if heads % kv_heads:
            raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads}: each "
                             "key/value head serves heads // kv_heads query heads")
        if kv_heads < heads and torch.__version__ < "2.5":
            raise RuntimeError(f"kv_heads < heads needs torch 2.5 or later (SDPA's enable_gqa); "
                               f"this is {torch.__version__}. Upgrade torch or set kv_heads=heads")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        hd = self.head_dim
        self.attn_norm = nn.RMSNorm(width, eps=norm_eps, **factory)
        self.q_proj = nn.Linear(width, heads * hd, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(width, kv_heads * hd, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(width, kv_heads * hd, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(heads * hd, width, bias=o_bias, **factory)
        self.rotary = rotary                                   # shared: one cos, one sin
        self.mlp_norm = nn.RMSNorm(width, eps=norm_eps, **factory)
        self.gate_proj = nn.Linear(width, intermediate, bias=mlp_bias, **factory)
        self.up_proj = nn.Linear(width, intermediate, bias=mlp_bias, **factory)
        self.down_proj = nn.Linear(intermediate, width, bias=mlp_bias, **factory)

    @property
    def fused_attention(self) -> bool:
        """Always True: attention runs in SDPA's kernel and keeps no (T, T) tensor."""
        return True

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.heads, hd).transpose(1, 2)      # (B, h, T, d)
        k = self.k_proj(x).view(B, T, self.kv_heads, hd).transpose(1, 2)   # (B, kv, T, d)
        v = self.v_proj(x).view(B, T, self.kv_heads, hd).transpose(1, 2)   # (B, kv, T, d)
        q, k = self.rotary(q), self.rotary(k)
        gqa = {"enable_gqa": True} if self.kv_heads < self.heads else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)  # (B, h, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * hd))  # (B, T, C)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, I) inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x))                           # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-shaped decoder over `vocab` tokens and sequences up to `seq_len` long.

    Parameters, with C = width, d = width // heads, I = intermediate, V = vocab, L = depth:
        V·C (embedding)
      + L·(2·C (two RMSNorms) + C·(heads·d) (q) + 2·C·(kv_heads·d) (k, v) + (heads·d)·C (o)
           + 3·C·I (gate, up, down) [+ heads·d + 2·kv_heads·d with qkv_bias, + C with o_bias,
           + 2·I + C with mlp_bias: transformers' Llama with attention_bias has all four
           attention biases, with mlp_bias the MLP's three])
      + C (final RMSNorm) + C·V (head, unless tied: then it is the embedding's weight).
    Llama 3 8B (V 128256, C 4096, L 32, 32 heads, 8 kv heads, I 14336): 8,030,261,248.
    What a step saves for backward: `companion.estimate.llama_activations`, to the byte on the
    CPU. `intermediate` defaults to `llama_intermediate(width)`; `fused_attention` is accepted
    for `GPT`'s interface and must be True."""

    def __init__(self, vocab: int, seq_len: int, width: int, depth: int, heads: int, *,
                 kv_heads: int | None = None, intermediate: int | None = None,
                 tied: bool = False, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, fused_attention: bool = True):
        super().__init__()
        if not fused_attention:
            raise ValueError("Llama's attention is always fused (F.scaled_dot_product_attention)"
                             ": leave fused_attention=True, or use GPT for written-out attention")
        torch.manual_seed(seed)
        factory = {"dtype": dtype, "device": device}
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, width, **factory)
        self.rotary = Rotary(width // heads, seq_len, theta=rope_theta, **factory)
        self.blocks = nn.Sequential(*[
            LlamaBlock(width, heads, kv_heads=kv_heads or heads,
                       intermediate=intermediate or llama_intermediate(width),
                       rotary=self.rotary, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                       norm_eps=norm_eps, **factory)
            for _ in range(depth)])
        self.norm = nn.RMSNorm(width, eps=norm_eps, **factory)
        self.head = nn.Linear(width, vocab, bias=False, **factory)
        if tied:
            self.head.weight = self.tok.weight                  # one (V, C) tensor, two uses

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.seq_len}")
        x = self.tok(idx)                                                   # (B, T, C)
        return self.head(self.norm(self.blocks(x)))                         # (B, T, vocab)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; targets (B, T) are idx shifted by one."""
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
