"""QLoRA: a frozen base weight in NF4 under trainable low-rank adapters (Dettmers et al., 2023).

`QLoRALinear` is `companion.lora.LoRALinear` with its frozen weight stored as NF4 codes
(`nf4`): forward dequantizes the base (to the input's dtype) one block of rows at a time, each
block's matmul filling those columns of the output, adds the bias and the scaled adapter; only A
and B get gradients. `merge()` returns a dense `nn.Linear` for inference.

Memory per base weight: about 0.5 byte (4.127 bits with double quantization) instead of 2 (bf16)
or 4 (fp32); the adapters keep their full fp32 states (16 bytes per adapter parameter with Adam).
Backward keeps only the codes: `nn.functional.linear(x, dequant(W))` would save the dense weight
for the input's gradient, as many bytes per layer as a 16- or 32-bit base, until backward reaches
it. Nor does the dense weight exist whole in forward or backward: one row block of it does
(`nf4.BLOCK_VALUES` values, 4 MiB in fp32, a quarter of the rows at most), where bitsandbytes
0.50's CPU backend dequantizes the whole weight for each matmul. Cost: one dequantization of each
base weight per forward and one more per backward; the row blocks cost no time measured against
one whole dequantization and one matmul per pass (2048 x 2048, 256 tokens, a loaded 2-core CPU:
0.87x and 0.95x, 95% intervals 0.65-1.41 and 0.77-1.31), and hold 12.25 MiB at the step's peak
against 22.25.

Example:
    >>> layer = QLoRALinear.from_linear(torch.nn.Linear(512, 512), rank=8)
    >>> model = apply_qlora(GPT(...), rank=8)                 # every Linear, the rest frozen

Simplified vs bitsandbytes + PEFT: dequantize then matmul in plain torch (no fused 4-bit kernel),
one adapter per layer, no dropout on the adapter's input; the NF4 base is a plain attribute, not a
buffer: `.to(device)` moves it, `state_dict()` does not save it (merge() for inference).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from companion.lora import adapter_parameters, linear_targets
from companion.lowbit.nf4 import NF4Tensor, dequantize_nf4, nf4_row_blocks, quantize_nf4

__all__ = ["QLoRALinear", "apply_qlora"]


class _FrozenNF4Linear(torch.autograd.Function):
    """x·dequant(W)ᵀ + b, one block of W's rows at a time, and a backward that dequantizes W again
    the same way: the dense weight never exists whole, and nothing dense is saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: NF4Tensor, bias: torch.Tensor | None,
                keep_input: bool = False) -> torch.Tensor:
        ctx.base = base                                     # codes and scales only
        if keep_input and ctx.needs_input_grad[0]:          # bitsandbytes < 0.43.2's ctx.tensors
            ctx.kept = x                                    # (when an input needs a gradient):
                                                            # never read, freed with the graph
        y = x.new_empty(x.shape[0], base.shape[0])          # (N, out)
        for r0, r1, w in nf4_row_blocks(base, x.dtype):     # w: (rows, in), reused buffers
            torch.mm(x, w.T, out=y[:, r0:r1])               # y's columns r0..r1
        if bias is not None:
            y.add_(bias.to(y.dtype))
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad_x = grad.new_zeros(grad.shape[0], ctx.base.shape[1])     # (N, in)
        for r0, r1, w in nf4_row_blocks(ctx.base, grad.dtype):
            grad_x.addmm_(grad[:, r0:r1], w)                # Σ over row blocks of g·W
        return grad_x, None, None, None


class QLoRALinear(nn.Module):
    """y = x·dequant(W)ᵀ + b + s·(x·Aᵀ)·Bᵀ; W in NF4 (frozen), b frozen, A and B trained.
    rank=0: no adapter, the frozen NF4 Linear alone (a Linear quantized but not adapted).
    `keeps_input = True` does what bitsandbytes' MatMul4Bit did before 0.43.2 (fixed by its PR
    #1270, July 2024): it kept its input on the autograd node (`ctx.tensors = (A, B)`, an
    attribute, which backward does not free) until the graph itself is freed. Off by default:
    the planner turns it on to predict runs made with those versions."""

    keeps_input = False

    def __init__(self, base: NF4Tensor, bias: torch.Tensor | None, rank: int, *,
                 alpha: float | None = None):
        super().__init__()
        out_f, in_f = base.shape
        if rank == 0 and not isinstance(rank, bool):
            self.A = self.B = None
        else:
            self.A, self.B = adapter_parameters(in_f, out_f, rank, dtype=base.dtype,
                                                device=base.packed.device)   # checks the rank
        self.base, self.rank = base, rank
        self.scale = ((rank if alpha is None else alpha) / rank) if rank else 0.0
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rank: int, alpha: float | None = None,
                    blocksize: int = 64, double_quant: bool = True) -> "QLoRALinear":
        """Quantize `linear`'s weight to NF4 and put an adapter of `rank` beside it."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QLoRALinear wraps an nn.Linear, got {type(linear).__name__}")
        base = quantize_nf4(linear.weight.detach(), blocksize, double_quant=double_quant)
        return cls(base, linear.bias, rank, alpha=alpha)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.base = self.base.apply(fn)                  # .to(device) moves the codes too
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_f, in_f = self.base.shape
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"QLoRALinear takes a floating-point tensor (..., {in_f}), got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != in_f:
            raise ValueError(f"QLoRALinear expects inputs of shape (..., {in_f}) "
                             f"(in_features), got {tuple(x.shape)}")
        if torch.is_autocast_enabled(x.device.type):        # compute in autocast's dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead, x = x.shape[:-1], x.reshape(-1, in_f)        # (N, in)
        with torch.autocast(x.device.type, enabled=False):
            y = _FrozenNF4Linear.apply(x, self.base, self.bias, self.keeps_input)  # (N, out)
            if self.A is not None:
                y = y.addmm_(x @ self.A.T.to(x.dtype), self.B.T.to(x.dtype), alpha=self.scale)
        return y.view(*lead, out_f)

    def merge(self) -> nn.Linear:
        """A dense nn.Linear with dequant(W) + s·B·A (and the bias)."""
        out_f, in_f = self.base.shape
        merged = nn.Linear(in_f, out_f, bias=self.bias is not None, dtype=self.base.dtype,
                           device=self.base.packed.device)
        with torch.no_grad():
            merged.weight.copy_(dequantize_nf4(self.base) if self.A is None else
                                dequantize_nf4(self.base) + self.scale * self.B @ self.A)
            if self.bias is not None:
                merged.bias.copy_(self.bias)
        return merged

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, scale={self.scale:g}, base=NF4 "
                f"{self.base.bits_per_value():.2f} bits per weight")


def apply_qlora(model: nn.Module, rank: int, targets: Iterable[str | type] | None = None, *,
                quantize: Iterable[str | type] | None = None, alpha: float | None = None,
                blocksize: int = 64, double_quant: bool = True) -> nn.Module:
    """Freeze `model` and replace the chosen nn.Linear layers (as `lora.apply_lora` chooses them)
    by `QLoRALinear`s; edits `model` in place and returns it. `quantize`: the Linears whose
    weights go to NF4, the adapted ones among them (default: the adapted ones); those not in
    `targets` are quantized without an adapter, as loading a model in 4 bits before LoRA does."""
    model.requires_grad_(False)
    adapted = [name for name, _ in linear_targets(model, targets)]  # names only: each dense
    names = adapted if quantize is None else [name for name, _ in linear_targets(model, quantize)]
    if set(adapted) - set(names):
        raise ValueError(f"QLoRA adapts only quantized Linears; not quantized: "
                         f"{sorted(set(adapted) - set(names))}")
    for name in names:                                              # weight is freed once its
        parent_name, _, child = name.rpartition(".")               # codes replace it
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QLoRALinear.from_linear(
            getattr(parent, child), rank=rank if name in adapted else 0, alpha=alpha,
            blocksize=blocksize, double_quant=double_quant))
    return model
