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
the adapter's input, nn.Linear and nn.MultiheadAttention only (no Embedding or Conv adapters: `apply_lora` warns
naming the layers it froze that hold weights it cannot adapt), merging returns a new nn.Linear
instead of editing the layer in place, and alpha defaults to r (a scale of 1) where PEFT's
lora_alpha defaults to 8 (a scale of 8/r).

nn.MultiheadAttention reads its projections' weights directly (`in_proj_weight`,
`out_proj.weight`, in `F.multi_head_attention_forward`), so its Linear cannot be swapped for a
`LoRALinear`; its weights get a `LowRankDelta` parametrization instead, W + s·B·A formed at each
forward (as PEFT's MultiheadAttention layer merges on the fly): the same function and gradients,
at the cost of one dense (out, in) temporary and its gradient per projection during the step.
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["LoRALinear", "LowRankDelta", "apply_lora", "adapter_parameters", "linear_targets",
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


class LowRankDelta(nn.Module):
    """A parametrization W -> W + s·B·A (`torch.nn.utils.parametrize`), for weights a module reads
    directly instead of through an nn.Linear (nn.MultiheadAttention's projections)."""

    def __init__(self, weight: torch.Tensor, rank: int, *, alpha: float | None = None):
        super().__init__()
        out_f, in_f = weight.shape
        self.A, self.B = adapter_parameters(in_f, out_f, rank, dtype=weight.dtype,
                                            device=weight.device)
        self.rank, self.scale = rank, (rank if alpha is None else alpha) / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.B @ self.A)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _adapt_attention(mha: nn.MultiheadAttention, rank: int, alpha: float | None) -> None:
    """LowRankDelta on each projection weight of `mha` (packed or separate q, k, v; and out)."""
    for owner, name in [(mha, n) for n in _MHA_WEIGHTS] + [(mha.out_proj, "weight")]:
        weight = getattr(owner, name, None)
        if isinstance(weight, nn.Parameter):
            parametrize.register_parametrization(owner, name,
                                                 LowRankDelta(weight, rank, alpha=alpha))


def _inside_attention(model: nn.Module) -> set[str]:
    """Names of the nn.Linear layers that belong to an nn.MultiheadAttention (its out_proj)."""
    return {f"{name}.{child}" if name else child
            for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
            for child, _ in m.named_children()}


def _unadapted_weights(model: nn.Module) -> list[str]:
    """Frozen layers holding a matrix (or larger) that LoRA here cannot adapt: convolutions and
    other modules that are neither nn.Linear, nn.Embedding nor adapted attention."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding, LoRALinear, LowRankDelta, nn.MultiheadAttention,
                          parametrize.ParametrizationList)) or parametrize.is_parametrized(m):
            continue
        if any(p.dim() >= 2 and not p.requires_grad for p in m.parameters(recurse=False)):
            names.append(f"{name or '(model)'} ({type(m).__name__})")
    return names


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
    """Freeze every parameter of `model` and put a LoRA adapter on the chosen nn.Linear layers
    and nn.MultiheadAttention modules (each projection weight: see the module docstring).

    `targets`: names of layers ("qkv" matches every "blocks.N.qkv"; a full dotted name matches one)
    or module types; default every nn.Linear and nn.MultiheadAttention. Edits `model` in place and
    returns it. A target name that matches no such layer is an error (a typo would otherwise
    train nothing). Warns naming the layers it froze whose weights it cannot adapt (a CNN's
    convolutions: only its Linear layers would train)."""
    targets = None if targets is None else list(targets)
    attention = [(n, m) for n, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention) and _wanted(n, m, targets)]
    chosen = linear_targets(model, targets, allow_empty=bool(attention),
                            also=[n for n, _ in attention])
    model.requires_grad_(False)
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank, alpha=alpha))
    for _, mha in attention:
        _adapt_attention(mha, rank, alpha)
    frozen = _unadapted_weights(model)
    if frozen:
        warnings.warn(f"apply_lora froze {len(frozen)} layer(s) whose weights it cannot adapt "
                      f"(only nn.Linear and nn.MultiheadAttention get adapters): "
                      f"{', '.join(frozen[:8])}{' ...' if len(frozen) > 8 else ''}. They will not "
                      "train; unfreeze them with requires_grad_(True) if they should.",
                      stacklevel=2)
    return model


def linear_targets(model: nn.Module, targets: Iterable[str | type] | None = None, *,
                   allow_empty: bool = False, also: Iterable[str] = ()
                   ) -> list[tuple[str, nn.Linear]]:
    """The (name, nn.Linear) pairs of `model` that `targets` choose (see `apply_lora`), leaving out
    the Linear layers inside nn.MultiheadAttention (it reads their weights directly); a target
    name that matches no nn.Linear (nor one of the names in `also`), or no Linear at all (unless
    `allow_empty`), is an error that lists the names."""
    targets = None if targets is None else list(targets)
    inside = _inside_attention(model)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name and name not in inside
              and _wanted(name, m, targets)]
    also = list(also)
    for target in targets or []:
        if isinstance(target, str) and not any(_wanted(n, m, [target]) for n, m in chosen) \
                and not any(_wanted(n, None, [target]) for n in also):
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                              if isinstance(m, nn.Linear) and n not in inside})
            attention = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                if isinstance(m, nn.MultiheadAttention)})
            raise ValueError(f"no nn.Linear named {target!r} in the model; its Linear layers are "
                             f"called {', '.join(linears) or 'nothing'}"
                             + (f", its nn.MultiheadAttention {', '.join(attention)}"
                                if attention else ""))
    if not chosen and not allow_empty:
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
