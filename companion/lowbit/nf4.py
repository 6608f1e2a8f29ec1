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

Dequantizing goes `BLOCK_VALUES` values at a time, straight into the dtype asked for: a table of
the two levels each byte holds unpacks and looks up in one indexing (int32 byte indices, 2 bytes
per value of a block), the block's scales multiply in place. Naively (unpack to int64 codes, index
the levels, multiply, cast) a 2048 x 2048 weight's 16 MiB dequantization peaked 52 MiB above its
start; now at the output and 2.25 MiB (one block's indices, the scales). `nf4_row_blocks` gives a 2-D weight's rows a block at a
time, for a matmul that never holds the dense weight (`QLoRALinear`).

Example:
    >>> q = quantize_nf4(weight, blocksize=64, double_quant=True)
    >>> q.bits_per_value()                                # 4.127
    >>> w = dequantize_nf4(q)                             # weight's shape and dtype
    >>> for r0, r1, rows in nf4_row_blocks(q, torch.bfloat16): y[:, r0:r1] = x @ rows.T

Simplified vs bitsandbytes: the same levels, packing (first value in the high nibble) and
double quantization, in plain torch (bitsandbytes 0.50's CPU backend dequantizes the whole weight
in one C++ loop, and fuses it into the matmul only for bf16 inference).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from companion.lowbit.blockwise import (_levels, check_blocksize, dequantize_blockwise,
                                        dynamic_map, quantize_blockwise)

__all__ = ["NF4", "normal_float_levels", "NF4Tensor", "quantize_nf4", "dequantize_nf4",
           "nf4_row_blocks", "BLOCK_VALUES",
           "ROW_BLOCKS_AT_LEAST"]


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


# Values per block when dequantizing: 2^20, 4 MiB of fp32 (and 2 MiB of int32 byte indices) at a
# time, however large the weight: its dense copy is then only the output asked for, or none. Row
# blocks are also at most a quarter of the rows: a block costs 6 bytes per value (fp32 and the
# index), so a small weight in one block would cost more than its dense fp32 copy (4 bytes).
# Smaller blocks save memory but run more operators, each a wait for every thread: on a shared
# 2-core CPU 2^18 took 1.1-5.6x bitsandbytes' time where 2^20 took 0.9-2.3x (same processes).
BLOCK_VALUES = 2**20
ROW_BLOCKS_AT_LEAST = 4


# The two NF4 levels each byte holds, high nibble first: (256, 2) fp32. Indexing it with the packed
# bytes unpacks them and looks their levels up in one step, with no int64 codes or fp32 levels per
# value between. Constants, like NF4, made once (a simulation's tracker does not see them made).
_NF4_PAIRS = torch.stack([NF4.repeat_interleave(16), NF4.repeat(16)], dim=1)
_SIGNED_MAP = dynamic_map(signed=True)                 # the second level's (double quantization)


def _absmax(q: NF4Tensor) -> torch.Tensor:
    """The fp32 scale of each block of `blocksize` values (second level undone): (blocks,)."""
    if q.absmax_scale is None:
        return q.absmax.float()
    return dequantize_blockwise(q.absmax, q.absmax_scale, _SIGNED_MAP, 256) + q.absmax_offset


def _dequantize_range(q: NF4Tensor, absmax: torch.Tensor, table: torch.Tensor, start: int,
                      stop: int, buf: torch.Tensor) -> torch.Tensor:
    """Values [start, stop) of `q`, flat, as fp32, written into `buf` (fp32, contiguous, at least
    stop - start + 1 values); `start` is a multiple of the blocksize, so a byte's first value."""
    n, bs = stop - start, q.blocksize
    index = q.packed[start // 2:(stop + 1) // 2].int()                # (ceil(n / 2),) int32
    vals = buf[:2 * index.numel()]
    torch.index_select(table, 0, index, out=vals.view(-1, 2))         # 1. unpack and look up
    vals, first, full = vals[:n], start // bs, n // bs * bs
    vals[:full].view(-1, bs).mul_(absmax[first:first + full // bs].unsqueeze(1))   # 2. scale
    if full < n:                                                      # a short last block
        vals[full:].mul_(absmax[first + full // bs])
    return vals


def _cast(vals: torch.Tensor, q: NF4Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded as `q.dtype` stores them, then copied into `out` (in its dtype)."""
    return out.copy_(vals if q.dtype == torch.float32 else vals.to(q.dtype))


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor `q` stands for, in its original shape and dtype (or as `q.dtype` rounds it,
    then in `dtype`).

    Memory: the output and one block's temporaries (`BLOCK_VALUES` values at most), nothing of
    the whole tensor's size in fp32 or int64 besides."""
    dtype = q.dtype if dtype is None else dtype
    absmax, table = _absmax(q), _levels(_NF4_PAIRS, q.packed)
    step = max(BLOCK_VALUES // q.blocksize, 1) * q.blocksize
    device, n = q.packed.device, q.numel
    if dtype == q.dtype == torch.float32:                             # straight into the output
        out = torch.empty(n + n % 2, dtype=dtype, device=device)     # (+1: an odd tail's byte)
        for start in range(0, n, step):
            _dequantize_range(q, absmax, table, start, min(start + step, n), out[start:])
        return out[:n].view(q.shape)
    out = torch.empty(n, dtype=dtype, device=device)                  # the only full-size one
    buf = torch.empty(min(step, n) + 1, dtype=torch.float32, device=device)
    for start in range(0, n, step):
        stop = min(start + step, n)
        _cast(_dequantize_range(q, absmax, table, start, stop, buf), q, out[start:stop])
    return out.view(q.shape)


def nf4_row_blocks(q: NF4Tensor, dtype: torch.dtype | None = None, *,
                   block_values: int | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, row after the last, those rows of the dense weight in `dtype`) for a 2-D `q`,
    about `block_values` values (`BLOCK_VALUES`) at a time, and at least `ROW_BLOCKS_AT_LEAST`
    blocks: a matmul over the blocks never holds the whole dense weight. Each block is written
    into the same buffers: use it before taking the next."""
    block_values = BLOCK_VALUES if block_values is None else block_values
    if len(q.shape) != 2:
        raise ValueError(f"row blocks of a 2-D (out, in) weight, got shape {tuple(q.shape)}")
    dtype = q.dtype if dtype is None else dtype
    rows, cols = q.shape
    step = max(min(block_values // max(cols, 1), -(-rows // ROW_BLOCKS_AT_LEAST)), 1)  # rows
    absmax, table = _absmax(q), _levels(_NF4_PAIRS, q.packed)
    bs, device = q.blocksize, q.packed.device
    buf = torch.empty(step * cols + 2 * bs + 1, dtype=torch.float32, device=device)
    cast = (None if dtype == q.dtype == torch.float32
            else torch.empty(step * cols, dtype=dtype, device=device))
    def span(r0: int) -> tuple[int, int, int]:
        r1 = min(r0 + step, rows)
        start = r0 * cols // bs * bs                                  # whole blocks of scales
        return r1, start, min(-(-r1 * cols // bs) * bs, q.numel)

    firsts = range(0, rows, step)
    if isinstance(q.packed, FakeTensor):      # a simulated step (`plan.simulate`): every block
        widest = max(firsts, key=lambda r0: span(r0)[2] - span(r0)[1])   # fills the same
        firsts = [widest]                     # buffers, so the widest stands for all (the same
    for r0 in firsts:                         # peak, one block's operators: a 7B QLoRA step in
        r1, start, stop = span(r0)            # seconds, not tens of minutes)
        vals = _dequantize_range(q, absmax, table, start, stop, buf)
        vals = vals[r0 * cols - start:r1 * cols - start]              # ((r1 - r0) · in,)
        if cast is not None:
            vals = _cast(vals, q, cast[:vals.numel()])
        yield r0, r1, vals.view(r1 - r0, cols)                        # (rows, in)
