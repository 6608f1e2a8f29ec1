"""Train fewer parameters: a low-rank adapter (LoRA) beside a frozen weight.

A weight W of shape (out, in) stays frozen; training learns only a low-rank update ΔW = s·B·A
with A (r, in), B (out, r) and r ≪ min(in, out) (Hu et al., 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", section 4.1). B starts at zero, so the adapted model starts exactly where
the frozen one is, and s = alpha / r keeps the update's size steady when r changes.

Memory: the frozen weight needs no gradient and no optimizer state. With Adam in fp32, a layer
costs 4·in·out bytes (the weight alone) + 16·r·(in + out) bytes (the adapter's weight, gradient,
m and v) instead of 16·in·out: for in = out = 4096 and r = 8, 64 MiB + 1 MiB against 256 MiB.
A frozen weight kept in bf16 is 2 bytes per value (32 MiB here), and in NF4 about 0.52
(QLoRA, `companion.lowbit`: 8.3 MiB).
Activations are not reduced: backward still needs each layer's input (for A's gradient), and one
extra (N, r) tensor per layer.

Example:
    >>> model = apply_lora(GPT(vocab=64, seq_len=32, width=48, depth=2, heads=4), rank=4)
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    >>> trainable_params(model)        # only the adapters' A and B

Simplified vs PEFT (Hugging Face's implementation; the same outputs, gradients and merged weights
are tested beside it): one adapter per layer (no named adapters to switch between), no dropout on
the adapter's input, nn.Linear only (no Embedding or Conv adapters), merging returns a new
nn.Linear instead of editing the layer in place, and alpha defaults to r (a scale of 1) where
PEFT's lora_alpha defaults to 8 (a scale of 8/r).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

__all__ = ["LoRALinear", "apply_lora", "adapter_parameters", "linear_targets",
           "trainable_params", "lora_params"]


class LoRALinear(nn.Module):
    """y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ, with W and b frozen and only A and B trained.

    Args:
        base: the nn.Linear to adapt; its weight and bias are frozen (requires_grad False) and
            kept as they are (the adapter does not copy them).
        rank: r, the rank of the update (1 <= r <= min(in, out)).
        alpha: the update's scale is s = alpha / r (default alpha = r, so s = 1).
    """

    def __init__(self, base: nn.Linear, rank: int, *, alpha: float | None = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear adapts an nn.Linear, got {type(base).__name__}")
        out_f, in_f = base.weight.shape
        self.A, self.B = adapter_parameters(in_f, out_f, rank, dtype=base.weight.dtype,
                                            device=base.weight.device)   # checks the rank
        self.base, self.rank = base, rank
        self.scale = (rank if alpha is None else alpha) / rank
        base.requires_grad_(False)                                    # frozen: no grad, no state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> (..., r) -> (..., out): two thin matmuls, never the (out, in) product B·A
        return self.base(x) + (x @ self.A.T @ self.B.T) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + s·B·A, the weight of one nn.Linear that computes the same function."""
        return (self.base.weight + self.scale * self.B @ self.A).detach()

    def merge(self) -> nn.Linear:
        """A plain nn.Linear with the merged weight (and the base's bias): no extra cost at
        inference."""
        out_f, in_f = self.base.weight.shape
        merged = nn.Linear(in_f, out_f, bias=self.base.bias is not None,
                           dtype=self.base.weight.dtype, device=self.base.weight.device)
        with torch.no_grad():
            merged.weight.copy_(self.merged_weight())
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


def adapter_parameters(in_f: int, out_f: int, rank: int, *, dtype: torch.dtype,
                       device: torch.device | str | None = None
                       ) -> tuple[nn.Parameter, nn.Parameter]:
    """A (rank, in) initialised as nn.Linear initialises a weight, and B (out, rank) at zero, so
    that a fresh adapter changes nothing. Shared with `companion.lowbit.QLoRALinear`."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(in_f, out_f):
        raise ValueError(f"rank must be an int from 1 to min(in, out) = {min(in_f, out_f)}, "
                         f"got {rank!r}")
    A = nn.Parameter(torch.empty(rank, in_f, dtype=dtype, device=device))    # (r, in)
    B = nn.Parameter(torch.zeros(out_f, rank, dtype=dtype, device=device))   # (out, r): zero
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))
    return A, B


def _wanted(name: str, module: nn.Module, targets) -> bool:
    if targets is None:
        return True
    for target in targets:
        if isinstance(target, type) and isinstance(module, target):
            return True
        if isinstance(target, str) and (name == target or name.endswith("." + target)):
            return True
    return False


def apply_lora(model: nn.Module, rank: int, targets: Iterable[str | type] | None = None, *,
               alpha: float | None = None) -> nn.Module:
    """Freeze every parameter of `model` and put a LoRA adapter on the chosen nn.Linear layers.

    `targets`: names of layers ("qkv" matches every "blocks.N.qkv"; a full dotted name matches one)
    or module types; default every nn.Linear. Edits `model` in place and returns it. A target
    name that matches no nn.Linear is an error (a typo would otherwise train nothing)."""
    chosen = linear_targets(model, targets)
    model.requires_grad_(False)
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank, alpha=alpha))
    return model


def linear_targets(model: nn.Module, targets: Iterable[str | type] | None = None
                   ) -> list[tuple[str, nn.Linear]]:
    """The (name, nn.Linear) pairs of `model` that `targets` choose (see `apply_lora`); a target
    name that matches no nn.Linear, or no Linear at all, is an error that lists the names."""
    targets = None if targets is None else list(targets)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name and _wanted(name, m, targets)]
    for target in targets or []:
        if isinstance(target, str) and not any(_wanted(n, m, [target]) for n, m in chosen):
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                              if isinstance(m, nn.Linear)})
            raise ValueError(f"no nn.Linear named {target!r} in the model; its Linear layers are "
                             f"called {', '.join(linears) or 'nothing'}")
    if not chosen:
        raise ValueError("no nn.Linear layer to adapt: pass targets that name Linear layers")
    return chosen


def trainable_params(model: nn.Module) -> int:
    """Parameters that will get a gradient and optimizer state (requires_grad), each counted
    once."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    return sum(p.numel() for p in trainable.values())


def lora_params(in_features: int, out_features: int, rank: int) -> int:
    """Trainable parameters of one adapter: r·(in + out)."""
    return rank * (in_features + out_features)
