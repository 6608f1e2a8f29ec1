"""Korthikanti et al.'s selective recomputation: recompute only the attention core.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, §4) count what a transformer layer keeps for backward in 16 bits:
s·b·h·(34 + 5·a·s/h) bytes (sequence s, batch b, width h, a heads). The 5·a·s²·b part is the
attention core, q·kᵀ, softmax, softmax dropout and the product with v, whose (T, T) tensors grow
with the square of the sequence yet cost few FLOPs to redo. They recompute that core alone and keep
everything else (LayerNorms, the Linear layers' inputs and outputs, GELU), down to 34·s·b·h bytes.

Two ways to do it here, for `companion.models.Block` (written-out attention):
- `selective_block(block, x)`: the block's forward with `checkpoint_hooks` around the core only;
  the checkpoint keeps the core's inputs q, k, v (views of the one qkv output).
- `attention_core_policy(op)`: a policy for `checkpoint_hooks(block, x, policy=...)` over aten
  operators, keeping the outputs of those that compute outside the core.

- `selective_checkpoint(block, x)`: torch's own selective checkpointing
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) with `alternate_matmuls()`,
  torchtitan's op-level policy, which the planner's "selective-checkpointing" lever runs on every
  block of a GPT or a Llama (`policy=save_matmuls` keeps every matmul instead).

`block_activation_bytes` is their formula adapted to this block: no dropout (Megatron has two
dropout masks per layer, 2·s·b·h bytes, and a third, a·s²·b bytes, on the attention weights), a
stored (T, T) causal mask, and LayerNorm's two statistics per row.

Example:
    >>> y = selective_block(block, x)        # same output and gradients as block(x)
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from companion.checkpointing.hooks import checkpoint_hooks

__all__ = ["attention_core", "selective_block", "attention_core_policy", "block_activation_bytes",
           "megatron_activation_bytes", "SAVED_OPS", "MATMULS", "save_matmuls",
           "alternate_matmuls", "selective_checkpoint"]

aten = torch.ops.aten

# What `save_matmuls` keeps: the Linear layers' products, and fused attention's outputs (its
# output and the (B, heads, T) fp32 log-sum-exp; the kernels whose backward needs no (T, T)
# tensor). Batched products (aten.bmm: the written-out core's q·kᵀ and weights·v) are not here.
SAVED_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None) and
    aten._scaled_dot_product_cudnn_attention.default) if op is not None)
MATMULS = frozenset((aten.mm.default, aten.addmm.default))   # a Linear's product, with its bias


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√hs with a causal mask)·v for (B, heads, T, hs) tensors, as
    `companion.models.Block.attention` computes it: what Korthikanti et al. recompute."""
    T, hs = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))           # (B, nh, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)    # (T, T) bool
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v    # (B, nh, T, hs)


def selective_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`block(x)` for a `companion.models.Block`, with only the attention core recomputed.

    Memory: the core's (B, heads, T, T) softmax output and its (T, T) mask are not kept (in fp32
    4·a·s²·b + s² bytes); the checkpoint keeps q, k and v, views of the qkv output, 3·s·b·h
    values, in place of the contiguous copies plain autograd saves. Cost: the core runs forward
    once more in backward: 2·2·b·a·s²·hs FLOPs of batched products, no Linear layer.
    Simplified vs Megatron: no dropout, and the mask is built again instead of fused away.
    """
    B, T, C = x.shape
    hs = C // block.heads
    # 1. Outside the core: LayerNorm and the qkv Linear, saved as usual.
    q, k, v = block.qkv(block.ln1(x)).split(C, dim=2)                     # 3 x (B, T, C) views
    q, k, v = (t.view(B, T, block.heads, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    # 2. The core: only q, k, v kept; its (T, T) tensors recomputed in backward.
    y = checkpoint_hooks(attention_core, q, k, v)                         # (B, nh, T, hs)
    # 3. The projection and the MLP, saved as usual.
    x = x + block.proj(y.transpose(1, 2).reshape(B, T, C))
    return x + block.out(F.gelu(block.fc(block.ln2(x))))


def attention_core_policy(op: torch._ops.OpOverload) -> bool:
    """Keep the outputs of the operators that compute outside the attention core (LayerNorm, the
    Linear layers, GELU, the residual adds); recompute the rest: the core's products, scaling,
    mask, softmax, and the copies and views that feed them, so no (T, T) tensor is kept."""
    return op.overloadpacket in (aten.native_layer_norm, aten.addmm, aten.mm, aten.gelu, aten.add)


def block_activation_bytes(batch: int, seq: int, width: int, heads: int, *,
                           dtype: torch.dtype = torch.float32, recompute_core: bool = False) -> int:
    """Bytes one `companion.models.Block` (written-out attention) keeps for backward.

    Korthikanti et al.'s count for this block, in elements of e bytes: LayerNorm inputs 2·sbh,
    the qkv input sbh, q, k and v 3·sbh, the projection's input sbh, the MLP's 4·sbh after fc and
    4·sbh after GELU: 16·sbh·e (their 34·sbh at e = 2 less the two sbh-byte dropout masks).
    Then what they leave out: 2 statistics per row for each LayerNorm, 4·s·b·e. The core: the
    softmax output, a·s²·b·e (their 5·a·s²·b less the dropout mask and output), and the causal
    mask, s² bytes of bool. `recompute_core` drops the core's two terms."""
    e = torch.empty((), dtype=dtype).element_size()
    s, b, h = seq, batch, width
    kept = 16 * s * b * h * e + 4 * s * b * e
    return kept if recompute_core else kept + heads * s * s * b * e + s * s


def megatron_activation_bytes(batch: int, seq: int, width: int, heads: int, *,
                              recompute_core: bool = False) -> int:
    """Korthikanti et al.'s per-layer bytes for Megatron's block in 16 bits (eq. 1 and §4):
    s·b·h·(34 + 5·a·s/h), or 34·s·b·h with selective recomputation."""
    s, b, h, a = seq, batch, width, heads
    return 34 * s * b * h + (0 if recompute_core else 5 * a * s * s * b)


def save_matmuls(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy:
    """A policy for `create_selective_checkpoint_contexts`: keep what `SAVED_OPS` makes, the
    products that cost FLOPs to redo, recompute everything else in backward.

    Korthikanti et al.'s selective recomputation redoes the attention core (q·kᵀ, mask, softmax,
    dropout, weights·v: cheap FLOPs, (T, T) bytes); this policy redoes it too (its batched
    products are not kept), and with it the element-wise ops between the products (norms, GELU or
    SiLU, SwiGLU's product, rotary, residual adds), whose recompute is memory traffic, not
    FLOPs, as torchtitan's op-level policy does. Under fused attention the core is one kernel
    whose saved tensors hold no (T, T) term: its output and log-sum-exp are kept, not redone.
    Simplified vs torchtitan (torchtitan/distributed/activation_checkpoint.py, which saves
    aten.mm, the SDPA kernels and the reduce-scatter): every matmul is kept (torchtitan redoes
    every second one), and no collective runs inside a block here."""
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in SAVED_OPS else policy.PREFER_RECOMPUTE


def alternate_matmuls() -> Callable[..., torch.utils.checkpoint.CheckpointPolicy]:
    """A fresh policy for one checkpointed region: keep what `SAVED_OPS` makes but every second
    matmul, counted in the order the region runs them; recompute the rest. Forward and
    recompute are counted apart: torch 2.13 replays the forward's choices in recompute without
    asking again, older versions ask again and must get the same answers. One policy per region:
    shared by several blocks, its count would run on from one block into the next.

    This is torchtitan's op-level selective policy ("Saves output of all compute ops, except
    every second mm": `_apply_ac_to_transformer_block` in
    torchtitan/parallelisms/parallelize_llama.py, pytorch/torchtitan at 004b314, the policy of
    its Llama 3 benchmarks). On a Llama block the matmuls run q, k, v, o, gate, up, down: q, v,
    gate and down are kept, k, o and up redone in backward (their FLOPs, 2·N·(C·kv + C² + C·I),
    about a third of the block's forward products). On a GPT block: qkv and fc kept, proj and
    out redone. Simplified vs torchtitan: its count is of aten.mm alone (its Llama has no bias),
    here of addmm too (the GPT's Linears have biases), and no collective runs inside a block."""
    counts = {"forward": 0, "recompute": 0}
    policy = torch.utils.checkpoint.CheckpointPolicy

    def choose(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if op in MATMULS:
            counts[mode] += 1
        keep = op in SAVED_OPS and not (op in MATMULS and counts[mode] % 2 == 0)
        return policy.MUST_SAVE if keep else policy.PREFER_RECOMPUTE

    return choose


def selective_checkpoint(block: torch.nn.Module, x: torch.Tensor, *,
                         policy: Callable | None = None) -> torch.Tensor:
    """`block(x)` under a selective policy: `alternate_matmuls()` (the default, torchtitan's),
    or `save_matmuls` (every matmul kept). What backward needs is the block's input, the kept
    matmuls' outputs and fused attention's (out, log-sum-exp); the rest is recomputed from them.

    Memory per block (N = B·T tokens, e bytes per activation, kv = kv_heads·d, I the MLP's
    width), the input's bytes besides: a Llama's q e·N·C, v e·N·kv, gate e·N·I, down e·N·C,
    SDPA's output e·N·C and log-sum-exp 4·B·heads·T (`save_matmuls`: k, o and up too); a GPT's
    qkv 3·e·N·C and fc 4·e·N·C (with proj and out: 9·e·N·C), with fused attention its output
    and log-sum-exp. Cost: one more forward of the recomputed ops in backward (the dropped
    matmuls' FLOPs, the written core's 4·N·T·C, the element-wise ops' bytes)."""
    choose = alternate_matmuls() if policy is None else policy
    context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                                choose)
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context)
