"""Three models the course does not ship, for trying the companion's tools on someone else's code
(the tests use them, and the README's `python -m companion plan --model` line):

- `mha_lm`: a small language model on `nn.MultiheadAttention` (`nn.TransformerEncoderLayer`);
- `llama`: Llama-style blocks: RMSNorm, rotary-free attention through SDPA, a SwiGLU MLP, no biases;
- `cnn`: a small CNN with BatchNorm, trained with SGD and momentum (`cnn_step` makes its batch).

Each factory takes `dtype` and `device` keywords, as model factories usually do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MHALanguageModel(nn.Module):
    """Token embedding + learned positions, `depth` encoder layers with a causal mask, a head."""

    def __init__(self, vocab: int = 512, seq_len: int = 64, width: int = 128, depth: int = 4,
                 heads: int = 4, *, dtype=None, device=None):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.vocab, self.seq_len = vocab, seq_len
        self.tokens = nn.Embedding(vocab, width, **kw)
        self.positions = nn.Embedding(seq_len, width, **kw)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                       norm_first=True, **kw) for _ in range(depth))
        self.norm = nn.LayerNorm(width, **kw)
        self.head = nn.Linear(width, vocab, bias=False, **kw)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        h = self.tokens(idx) + self.positions(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def mha_lm(*, dtype=None, device=None) -> MHALanguageModel:
    """0.93 M parameters: vocabulary 512, 64 tokens, width 128, 4 layers of 4 heads."""
    return MHALanguageModel(dtype=dtype, device=device)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, *, dtype=None, device=None):
        super().__init__()
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.heads = heads
        self.attn_norm = RMSNorm(width, dtype=dtype, device=device)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, **kw) for _ in range(4))
        self.mlp_norm = RMSNorm(width, dtype=dtype, device=device)
        self.gate = nn.Linear(width, hidden, **kw)
        self.up = nn.Linear(width, hidden, **kw)
        self.down = nn.Linear(hidden, width, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, C))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int = 512, seq_len: int = 64, width: int = 128, depth: int = 4,
                 heads: int = 4, hidden: int = 344, *, dtype=None, device=None):
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len
        self.embed = nn.Embedding(vocab, width, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaBlock(width, heads, hidden, dtype=dtype, device=device)
                                    for _ in range(depth))
        self.norm = RMSNorm(width, dtype=dtype, device=device)
        self.head = nn.Linear(width, vocab, bias=False, dtype=dtype, device=device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def llama(*, dtype=None, device=None) -> Llama:
    """Llama-style: vocabulary 512, 64 tokens, width 128, 4 blocks, SwiGLU hidden 344."""
    return Llama(dtype=dtype, device=device)


def cnn(*, dtype=None, device=None) -> nn.Sequential:
    """Three conv-BatchNorm-ReLU stages on 3x32x32 images, global pooling, a 10-class Linear."""
    kw = {"dtype": dtype, "device": device}
    layers: list[nn.Module] = []
    channels = 3
    for out in (32, 64, 128):
        layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False, **kw),
                   nn.BatchNorm2d(out, **kw), nn.ReLU(), nn.MaxPool2d(2)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10, **kw)]
    return nn.Sequential(*layers)


def cnn_step(model: nn.Module, batch: int) -> torch.Tensor:
    """The loss of one batch of random 3x32x32 images with labels (the planner's `step`)."""
    param = next(model.parameters())
    x = torch.randn(batch, 3, 32, 32, dtype=param.dtype, device=param.device)
    y = torch.randint(10, (batch,), device=param.device)
    return F.cross_entropy(model(x).float(), y)


def cnn_optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum, as CNNs are usually trained."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
