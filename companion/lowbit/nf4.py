"""4-bit NormalFloat (NF4) and double quantization (Dettmers et al., 2023, "QLoRA: Efficient
Finetuning of Quantized LLMs", sections 3 and appendix E).

Pretrained weights are close to normally distributed, so QLoRA's 16 levels are quantiles of a
normal distribution, normalized to [-1, 1], with an exact zero: 8 levels on the positive side, 7
on the negative, and 0. A block of `blocksize` (64) weights is divided by its absmax and each
weight stored as the index of its nearest level: 4 bits, two per byte. Double quantization stores
the fp32 absmax values (one per 64 weights: 0.5 bit per weight) in 8 bits themselves, block-wise
(256) after subtracting their mean: 8/64 + 32/(64·256) bits per weight, 0.127 instead of 0.5.

Memory: 0.5 byte per weight + 4/64 bytes per weight of absmax (4.5 bits per weight), or with
double quantization 4.127 bits. Cost: dequantizing a block before each use.

Example:
    >>> q = quantize_nf4(weight, blocksize=64, double_quant=True)
    >>> q.bits_per_value()                                # 4.127
    >>> w = dequantize_nf4(q)                             # weight's shape and dtype

Simplified vs bitsandbytes: the same levels, packing (first value in the high nibble) and
double quantization, in plain torch (no fused 4-bit matmul).
"""
from __future__ import annotations

import dataclasses

import torch

from companion.lowbit.blockwise import (check_blocksize, dequantize_blockwise, dynamic_map,
                                        quantize_blockwise)

__all__ = ["NF4", "normal_float_levels", "NF4Tensor", "quantize_nf4", "dequantize_nf4"]


def normal_float_levels(bits: int = 4) -> torch.Tensor:
    """The 2^bits NormalFloat levels: the quantiles of N(0, 1) at equal steps of probability from
    `offset` to 1/2 on each side (2^(bits-1) positive, one fewer negative), plus 0, divided by the
    largest. The offset sits between the last quantile a grid of 2^bits - 1 and of 2^bits steps
    would use, (1 - 1/(2·15) + 1 - 1/(2·16)) / 2 for 4 bits, as QLoRA chooses it."""
    n = 2**bits
    offset = (1 - 1 / (2 * (n - 1)) + 1 - 1 / (2 * n)) / 2
    ndtri = torch.special.ndtri
    positive = ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    negative = -ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative])
    return (levels / levels.max()).sort().values.float()


NF4 = normal_float_levels(4)


@dataclasses.dataclass(frozen=True)
class NF4Tensor:
    """A tensor in NF4: packed 4-bit codes, and its block scales (fp32, or double-quantized)."""

    packed: torch.Tensor                  # (ceil(numel / 2),) uint8: two codes per byte
    absmax: torch.Tensor                  # (blocks,) fp32, or uint8 codes when double-quantized
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocksize: int
    absmax_scale: torch.Tensor | None = None   # double quantization: fp32 per 256 absmax codes
    absmax_offset: torch.Tensor | float = 0.0  # and the mean subtracted before (0-d fp32)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def nbytes(self) -> int:
        """Bytes stored: codes, block scales (and the second level's)."""
        second = self.absmax_scale.numel() * 4 + 4 if self.absmax_scale is not None else 0
        return self.packed.numel() + self.absmax.numel() * self.absmax.element_size() + second

    def bits_per_value(self) -> float:
        return 8 * self.nbytes() / self.numel

    def apply(self, fn) -> "NF4Tensor":
        """This tensor with `fn` applied to each stored tensor, which keeps its dtype: what
        `module.to(device)` does to a module's tensors, without `.half()` casting the scales."""
        def move(t):
            return t if not isinstance(t, torch.Tensor) else fn(t).to(t.dtype)
        return dataclasses.replace(self, packed=move(self.packed), absmax=move(self.absmax),
                                   absmax_scale=move(self.absmax_scale),
                                   absmax_offset=move(self.absmax_offset))


def quantize_nf4(w: torch.Tensor, blocksize: int = 64, *, double_quant: bool = False
                 ) -> NF4Tensor:
    """`w` in NF4: each block of `blocksize` values divided by its absmax, each value the index of
    the nearest NF4 level, two indices per byte; with `double_quant`, the absmax values quantized
    to 8 bits (dynamic map, blocks of 256) after subtracting their mean."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"quantize a floating-point tensor, got "
                        f"{w.dtype if isinstance(w, torch.Tensor) else type(w).__name__}")
    check_blocksize(blocksize)
    codes, absmax = quantize_blockwise(w, NF4, blocksize)              # (numel,) indices < 16
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    packed = (flat[0::2] << 4) | flat[1::2]                            # high nibble first
    if not double_quant:
        return NF4Tensor(packed, absmax, tuple(w.shape), w.dtype, blocksize)
    offset = absmax.mean()                     # a 0-d tensor: no host sync, and fake tensors work
    second, scale = quantize_blockwise(absmax - offset, dynamic_map(signed=True), 256)
    return NF4Tensor(packed, second, tuple(w.shape), w.dtype, blocksize, scale, offset)


def dequantize_nf4(q: NF4Tensor) -> torch.Tensor:
    """The tensor `q` stands for, in its original shape and dtype."""
    absmax = q.absmax
    if q.absmax_scale is not None:                                     # undo the second level
        absmax = dequantize_blockwise(absmax, q.absmax_scale, dynamic_map(signed=True), 256) \
            + q.absmax_offset
    codes = torch.stack([q.packed >> 4, q.packed & 15], dim=1).reshape(-1)[:q.numel]
    return dequantize_blockwise(codes, absmax, NF4, q.blocksize).view(q.shape).to(q.dtype)
