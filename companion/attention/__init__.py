"""Attention without the T×T matrix (chapter 10): the written-out baseline, the online softmax,
FlashAttention-2 in PyTorch and in Triton, and the tile sizes that fit a GPU's SRAM.

    >>> from companion.attention import FlashAttentionTorch, naive_attention
    >>> o = FlashAttentionTorch.apply(q, k, v, True)      # saves q, k, v, o and one fp32 per query

`FlashAttentionTriton` needs Triton (Linux; `pip install triton`): it is imported on first use,
so `companion.attention` works without it (`triton_available()` says whether it can run).
`companion.attention.triton_launch.launch_forward` launches a forward kernel of your own (the
chapter's Triton exercise), compiled on a GPU or interpreted on CPU tensors.
"""
from companion.attention.flash import FlashAttentionTorch, flash_backward, flash_forward
from companion.attention.naive import flash_saved_bytes, naive_attention, naive_saved_bytes
from companion.attention.online import merge, tile_states
from companion.attention.shapes import causal_mask

__all__ = ["FlashAttentionTorch", "FlashAttentionTriton", "flash_forward", "flash_backward",
           "naive_attention", "naive_saved_bytes", "flash_saved_bytes", "merge", "tile_states",
           "causal_mask", "triton_available"]


def __getattr__(name: str):
    if name in ("FlashAttentionTriton", "triton_available"):
        from companion.attention import triton_flash
        return getattr(triton_flash, name)
    raise AttributeError(f"module 'companion.attention' has no attribute {name!r}")
