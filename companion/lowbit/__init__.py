"""Fewer bits for what stays in memory (chapter 11): block-wise 8-bit codes and NF4.

Modules: `blockwise` (the dynamic map of the 8-bit optimizers paper, block-wise quantization with
one fp32 absmax per block), `nf4` (QLoRA's 4-bit NormalFloat levels and double quantization).
The per-block absmax is `companion.scaling.block_absmax`, shared with FP8's per-tile scales.

Example:
    >>> codes, absmax = quantize_blockwise(adam_moment, dynamic_map(signed=True), 256)
    >>> q = quantize_nf4(frozen_weight, 64, double_quant=True); w = dequantize_nf4(q)
"""
from companion.lowbit.blockwise import dequantize_blockwise, dynamic_map, quantize_blockwise
from companion.lowbit.nf4 import (NF4, NF4Tensor, dequantize_nf4, normal_float_levels,
                                  quantize_nf4)

__all__ = ["dynamic_map", "quantize_blockwise", "dequantize_blockwise", "NF4", "NF4Tensor",
           "normal_float_levels", "quantize_nf4", "dequantize_nf4"]
