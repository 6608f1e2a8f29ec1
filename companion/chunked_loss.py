"""Cross-entropy over a large vocabulary without the whole (tokens, vocab) logits in memory.

A language model's last step multiplies each token's hidden state (C values) by the head's weight
(vocab × C) and takes the cross-entropy of the resulting logits. For N tokens the logits are N·V
values: the loss saves their log-softmax for backward (N·V, fp32 when the loss runs in fp32), and
backward makes a gradient of the same size. With a vocabulary of 50,257 that is 201 kB per token
for each copy, more than a whole layer of GPT-2 small saves (87.6 kB: `estimate.transformer_layer_
activations`). Chunking computes the loss over k slices of the tokens, each through
`torch.utils.checkpoint`: the forward keeps no logits at all, and backward recomputes one slice's
logits at a time. Memory: N·V·4 bytes of saved log-softmax become 0, and backward holds one
slice's logits (N·V/k) instead of all; its peak is that or, when larger, the head's weight
gradient summed slice by slice (the running sum, one slice's gradient and their sum: 3·V·C
values). Cost: the head's matmul runs twice (once more in backward).

Example:
    >>> hidden = model.ln(model.blocks(x))                              # (B, T, C)
    >>> loss = chunked_cross_entropy(hidden.flatten(0, 1), model.head.weight, y.flatten(),
    ...                              bias=model.head.bias, chunks=8)
    >>> loss.backward()

`fused_linear_cross_entropy` goes further, as Liger-Kernel's fused linear cross-entropy does: the
forward computes each chunk's gradients for the head's input and weight at once (the softmax minus
the one-hot target is the gradient of the logits), keeps them, and drops the chunk's logits.
Backward only scales the kept gradients, in place: the head's matmul is not run again. Memory: no
logits at any time beyond one chunk's (chunk_size·V·4 bytes for fp32 inputs: the shifted logits,
their exponentials, the softmax and the gradient are each made in that tensor's place; 16-bit
inputs add their 16-bit logits and gradient, 6·chunk_size·V in all), plus the gradients
themselves, held from the forward on (N·C for the input, V·C for the weight). Cost: one head
matmul in forward and two for the gradients, against the chunked loss's four (two forward, then
its backward's two).

Example:
    >>> loss = fused_linear_cross_entropy(hidden.flatten(0, 1), model.head.weight, y.flatten(),
    ...                                   chunk_size=1024)

Simplified vs PyTorch and others: PyTorch has no chunked loss. Liger-Kernel fuses the softmax and
its gradient into one Triton kernel that writes the gradient over the logits in place; here each
step is a PyTorch call. A backward that receives a gradient other than a scalar's one scales the
kept gradients (the loss is linear in nothing else), as Liger does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy", "fused_linear_cross_entropy"]


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)                 # (n, V): one slice's logits only
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def _check_tokens(hidden: torch.Tensor, targets: torch.Tensor) -> None:
    if not isinstance(hidden, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"hidden and targets must be tensors, got {type(hidden).__name__} and "
                        f"{type(targets).__name__}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, C) and targets (N,); got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}: flatten the batch and sequence dimensions")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunks: int, bias: torch.Tensor | None = None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(hidden, weight, bias)` against `targets`, in fp32, equal to
    `F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`, computed over `chunks`
    slices of the N tokens so that no more than one slice's logits exist at a time.

    hidden (N, C), weight (V, C), targets (N,) class indices; tokens whose target is
    `ignore_index` count neither in the sum nor in the mean."""
    _check_tokens(hidden, targets)
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


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The loss and, in the same pass, the gradients of hidden, weight and bias, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index):
        counted = (targets != ignore_index).sum().clamp(min=1)      # tokens in the mean
        grad_hidden = torch.zeros_like(hidden) if hidden.requires_grad else None       # (N, C)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None       # (V, C)
        grad_bias = (torch.zeros_like(bias) if bias is not None and bias.requires_grad
                     else None)
        exact = torch.promote_types(hidden.dtype, torch.float32)   # fp32, or fp64 for fp64
        total = hidden.new_zeros((), dtype=exact)
        for start in range(0, len(hidden), chunk_size):
            h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
            # 1. one chunk's logits, fp32: (n, V) -> n·V·4 bytes, the only fp32 (n, V) tensor:
            #    shifted, exponentiated, divided into the softmax and made the gradient in place;
            #    the loss from (n, 1) row values
            grad = F.linear(h, weight, bias).to(exact)             # (n, V) logits
            kept = (t != ignore_index)[:, None]                    # (n, 1)
            safe = t[:, None].where(kept, 0)                       # an index even where ignored
            target = grad.gather(1, safe)                          # (n, 1) the targets' logits
            top = grad.amax(-1, keepdim=True)                      # (n, 1)
            sums = grad.sub_(top).exp_().sum(-1, keepdim=True)     # exp in place: no overflow
            # loss of a row: log Σ exp(logit) - logit[target] = log(sums) + top - target
            total += ((sums.log() + top - target) * kept).sum()
            # 2. d(sum of losses)/d(logits) = softmax - one_hot(target); 0 on ignored rows. No
            #    data-dependent shape (no host-device sync; fake tensors can run it)
            grad.div_(sums)                                        # softmax, in place
            grad.scatter_add_(1, safe, -kept.to(grad.dtype))
            grad = grad.mul_(kept.to(grad.dtype) / counted).to(hidden.dtype)   # the mean's 1/N
            # 3. the chunk's share of each gradient: two matmuls, no logits kept
            if grad_hidden is not None:                                        # (n, C), into
                torch.mm(grad, weight, out=grad_hidden[start:start + chunk_size])  # its place
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, h)                                  # (V, C) += (V, n)(n, C)
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            del grad
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total / (targets != ignore_index).sum()             # no token: 0/0, NaN, as torch

    @staticmethod
    def backward(ctx, grad_loss):
        if getattr(ctx, "used", False):
            raise RuntimeError("fused_linear_cross_entropy's backward scales the gradients it "
                               "kept in place, so it runs once: compute the loss again for a "
                               "second backward (retain_graph=True cannot reuse it)")
        ctx.used = True                   # scaled in place: no second (V, C) and (N, C) copy
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.saved_tensors]
        return (*scaled, None, None, None)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               *, chunk_size: int, bias: torch.Tensor | None = None,
                               ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(hidden, weight, bias)` against `targets`, in fp32 (fp64 for
    fp64 inputs), equal to `F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`,
    with the gradients of
    hidden, weight and bias computed during the forward, `chunk_size` tokens at a time, so that
    neither forward nor backward ever holds more than one chunk's logits.

    hidden (N, C), weight (V, C), targets (N,) class indices; tokens whose target is
    `ignore_index` count neither in the sum nor in the mean."""
    _check_tokens(hidden, targets)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got "
                         f"{chunk_size!r}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, C) with C = {hidden.shape[1]} as hidden's, got "
                         f"{tuple(weight.shape)}")
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, ignore_index)
