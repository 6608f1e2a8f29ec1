"""Block-wise 8-bit quantization with a dynamic map (Dettmers et al., 2022, "8-bit Optimizers via
Block-wise Quantization", sections 2.1-2.2).

Each block of `blocksize` consecutive values is divided by its largest magnitude (its absmax, kept
in fp32) and every value, now in [-1, 1], is stored as the index of the nearest of 256 levels: one
byte per value plus 4 bytes per block. Blocks keep an outlier from costing the whole tensor its
precision; the *dynamic* (tree) map spends its levels on every order of magnitude, because Adam's
moments span many: a byte reads as a sign bit, then as many zeros as the decimal exponent e, an
indicator 1, and the remaining bits a linear fraction in [0.1, 1] at 10^-e.

Memory: 1 byte per value + 4 bytes per block (256: 1.016 bytes per value). Cost: finding the
nearest of 256 levels per value. A binary search (`torch.bucketize`, 8 comparisons) is the plain
way; here a table indexed by the value's top 16 bits (its bf16 bin) gives the answer up to one
comparison, because no bf16 bin of [-1, 1] holds two midpoints of the dynamic map (checked when the
table is built; maps that fail it fall back to the search).

Example:
    >>> code = dynamic_map(signed=True)
    >>> codes, absmax = quantize_blockwise(x, code)          # uint8 like x, fp32 per block
    >>> x_again = dequantize_blockwise(codes, absmax, code)

Simplified vs bitsandbytes: the same map and nearest-level rounding, in plain torch (no CUDA or
CPU kernel, no stochastic rounding, no paged buffers).
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from companion.scaling import block_absmax

__all__ = ["dynamic_map", "linear_map", "quantize_blockwise", "dequantize_blockwise",
           "check_blocksize"]


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256 levels of the dynamic tree map, sorted, in [-1, 1] (signed) or [0, 1].

    With 7 bits after the sign, exponent e (e = 0..6 zeros) leaves 6 - e fraction bits: 2^(6-e)
    levels at 10^-e, the midpoints of as many equal bins of [0.1, 1]. Unsigned, the sign bit is
    one more fraction bit: 2^(7-e) levels. Both add 0 and 1: 2·127 + 2 or 254 + 2 levels."""
    levels = [0.0, 1.0]
    with unset_fake_temporarily():          # a real constant, also inside a simulation
        for e in range(7):
            bins = 2 ** (6 - e + (0 if signed else 1))
            edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float64)
            middles = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** -e).tolist()
            levels += middles + ([-m for m in middles] if signed else [])
        return torch.tensor(sorted(levels), dtype=torch.float32)


def linear_map(signed: bool = True) -> torch.Tensor:
    """256 evenly spaced levels over [-1, 1] (signed) or [0, 1]: the map the dynamic one beats
    on values that span several orders of magnitude."""
    return torch.linspace(-1.0 if signed else 0.0, 1.0, 256)


def check_blocksize(blocksize: int) -> None:
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 2 or \
            blocksize & (blocksize - 1):
        raise ValueError(f"blocksize must be a power of two >= 2 (64, 256, 4096, ...), "
                         f"got {blocksize!r}")


def _check(x: torch.Tensor, code: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if code.dim() != 1 or not code.is_floating_point() or code.numel() > 256:
        raise ValueError("code must be a 1-D float tensor of at most 256 levels (dynamic_map())")


def _blocks(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """(blocks, blocksize): flat padded with zeros to whole blocks (a view when it divides)."""
    pad = (-flat.numel()) % blocksize
    return (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(-1, blocksize)


@lru_cache(maxsize=16)
def _bin_table(levels: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a sorted map of at most 256 levels, per bf16 bin (the top 16 bits of an fp32 value):
    (uint8: the rank of the level nearest the bin's smallest value, fp32: the first midpoint at
    or above that value, past which the next level is nearer; +inf above the last), or None when
    some bin holds two midpoints."""
    ranked = torch.tensor(levels, dtype=torch.float32)
    if ranked.numel() > 256:
        return None
    middles = (ranked[1:] + ranked[:-1]) / 2
    top = torch.arange(1 << 16, dtype=torch.int32) << 16               # each bin's fp32 pattern
    low = torch.where(top < 0, top | 0xFFFF, top).view(torch.float32)  # the bin's smallest value
    high = torch.where(top < 0, top, top | 0xFFFF).view(torch.float32)
    below = torch.bucketize(low, middles)                              # midpoints < low
    within = torch.bucketize(high, middles, right=True) - below        # midpoints in [low, high]
    finite = torch.isfinite(low) & torch.isfinite(high)
    if bool((within[finite] > 1).any()):
        return None
    middles = torch.cat([middles, torch.tensor([float("inf")])])
    return below.to(torch.uint8), middles[below]


def _nearest(scaled: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """Index into the sorted levels `ranked` of the level nearest each value (ties: the lower);
    uint8 from the bin table, int64 from the binary search."""
    table = (_bin_table(tuple(ranked.tolist())) if scaled.device.type == "cpu"
             and not is_fake(scaled) else None)          # fake tensors (a simulation) have
                                                        # no values to build a table from
    if table is None:
        return torch.bucketize(scaled, (ranked[1:] + ranked[:-1]) / 2)
    ranks, thresholds = table
    flat = scaled.reshape(-1)
    bins = (flat.view(torch.int32) >> 16).bitwise_and_(0xFFFF)         # the bf16 bin, (n,) int32
    index = ranks.index_select(0, bins)          # index_select: a faster gather than [bins]
    index += thresholds.index_select(0, bins) < flat                   # one comparison left
    return index.view(scaled.shape)


def _levels(code: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The map as fp32 on `like`'s device; a fake copy when `like` is fake (a simulation) and the
    map a real constant (`NF4`, a map made before the simulation began)."""
    if is_fake(like) and not is_fake(code):
        code = like.fake_mode.from_tensor(code)
    return code.to(like.device, torch.float32)


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int = 256
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes: uint8 of x's shape, the index of the level nearest to x / its block's absmax;
    absmax: float32, one per block of `blocksize` consecutive values, the last one may be short)."""
    _check(x, code)
    check_blocksize(blocksize)
    absmax = block_absmax(x, blocksize)                                  # (blocks,) fp32
    blocks = _blocks(x.detach().reshape(-1).float(), blocksize)          # (blocks, size)
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    ranked, order = _levels(code, x).sort()
    index = _nearest(scaled, ranked)        # rank of the nearest level (ties: the lower one)
    if is_fake(order) or not torch.equal(order, torch.arange(order.numel(), device=order.device)):
        index = order[index.long()]         # rank -> index into the map (a map not sorted)
    codes = index.to(torch.uint8).reshape(-1)[:x.numel()]
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         blocksize: int = 256) -> torch.Tensor:
    """The float32 tensor `codes` stand for: level times its block's absmax, in codes' shape."""
    check_blocksize(blocksize)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes are uint8 (from quantize_blockwise), got {codes.dtype}")
    n = codes.numel()
    if absmax.numel() != -(-n // blocksize):
        raise ValueError(f"{absmax.numel()} absmax values cover {absmax.numel() * blocksize} "
                         f"values, not {n}: pass the blocksize used to quantize")
    blocks = _blocks(codes.reshape(-1), blocksize)                      # (blocks, size) uint8
    levels = _levels(code, codes).index_select(0, blocks.reshape(-1).int()).view(blocks.shape)
    return levels.mul_(absmax.float().unsqueeze(1)).reshape(-1)[:n].view(codes.shape)
