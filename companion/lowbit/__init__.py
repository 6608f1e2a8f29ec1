"""Fewer bits for what stays in memory (chapter 11): 8-bit states, bf16 without a master, NF4.

Modules: `blockwise` (the dynamic map of the 8-bit optimizers paper, block-wise quantization with
one fp32 absmax per block), `nf4` (QLoRA's 4-bit NormalFloat levels and double quantization),
`adam8bit` (`Adam8bit`: Adam's moments as block-wise 8-bit codes), `bf16` (`BF16AdamW`: bf16
weights with no fp32 master, with stochastic rounding or Kahan compensation), `qlora`
(`QLoRALinear`, `apply_qlora`: an NF4 base under LoRA adapters), `layouts` (the bytes per
parameter of each layout of model states, measured and predicted).
The per-block absmax is `companion.scaling.block_absmax`, shared with FP8's per-tile scales.

Example:
    >>> codes, absmax = quantize_blockwise(adam_moment, dynamic_map(signed=True), 256)
    >>> q = quantize_nf4(frozen_weight, 64, double_quant=True); w = dequantize_nf4(q)
"""
from companion.lowbit.adam8bit import Adam8bit, direction_error
from companion.lowbit.bf16 import BF16AdamW, fp32_products, round_stochastic
from companion.lowbit.blockwise import (dequantize_blockwise, dynamic_map, linear_map,
                                        quantize_blockwise)
from companion.lowbit.nf4 import (NF4, NF4Tensor, dequantize_nf4, normal_float_levels,
                                  quantize_nf4)
from companion.lowbit.qlora import QLoRALinear, apply_qlora

__all__ = ["dynamic_map", "linear_map", "quantize_blockwise", "dequantize_blockwise",
           "direction_error", "NF4", "NF4Tensor", "normal_float_levels", "quantize_nf4", "dequantize_nf4", "Adam8bit", "BF16AdamW",
           "round_stochastic", "fp32_products", "QLoRALinear", "apply_qlora"]
