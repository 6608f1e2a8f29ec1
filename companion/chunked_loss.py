"""Cross-entropy over a large vocabulary without the whole (tokens, vocab) logits in memory.

A language model's last step multiplies each token's hidden state (C values) by the head's weight
(vocab × C) and takes the cross-entropy of the resulting logits. For N tokens the logits are N·V
values: the loss saves their log-softmax for backward (N·V, fp32 when the loss runs in fp32), and
backward makes a gradient of the same size. With a vocabulary of 50,257 that is 201 kB per token
for each copy, more than a whole layer of GPT-2 small saves (87.6 kB: `estimate.transformer_layer_
activations`). Chunking computes the loss over k slices of the tokens, each through
`torch.utils.checkpoint`: the forward keeps no logits at all, and backward recomputes one slice's
logits at a time. Memory: N·V·4 bytes of saved log-softmax become 0, and backward's peak holds
one slice's logits (N·V/k) instead of all. Cost: the head's matmul runs twice (once more in backward).

Example:
    >>> hidden = model.ln(model.blocks(x))                              # (B, T, C)
    >>> loss = chunked_cross_entropy(hidden.flatten(0, 1), model.head.weight, y.flatten(),
    ...                              bias=model.head.bias, chunks=8)
    >>> loss.backward()

Simplified vs PyTorch and others: PyTorch has no chunked loss; Liger-Kernel's fused linear
cross-entropy goes further, computing the gradients of each chunk during the forward so nothing is
recomputed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy"]


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)                 # (n, V): one slice's logits only
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunks: int, bias: torch.Tensor | None = None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(hidden, weight, bias)` against `targets`, in fp32, equal to
    `F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`, computed over `chunks`
    slices of the N tokens so that no more than one slice's logits exist at a time.

    hidden (N, C), weight (V, C), targets (N,) class indices; tokens whose target is
    `ignore_index` count neither in the sum nor in the mean."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, C) and targets (N,); got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}: flatten the batch and sequence dimensions")
    if not 1 <= chunks <= len(hidden):
        raise ValueError(f"chunks must be between 1 and the number of tokens {len(hidden)}, "
                         f"got {chunks}")
    counted = (targets != ignore_index).sum()               # tokens in the mean
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks)):
        # each slice saves only its inputs; backward recomputes its logits
        total = total + checkpoint(_chunk_loss, h, weight, bias, t, ignore_index,
                                   use_reentrant=False)
    return total / counted
