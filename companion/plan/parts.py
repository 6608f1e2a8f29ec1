"""The bytes each part of a plan's step holds, per rank: weights, gradients and optimizer state
(`state_bytes`), the activations one micro-batch saves (`activation_bytes`), QLoRA's dense build
(`qlora_build_bytes`) and its dequantization's buffers (`qlora_dequantize_bytes`).
`companion.plan.predict` puts them together into the step's phases and its peak; the formulas are
explained there.
"""
from __future__ import annotations

import functools

from companion import estimate
from companion.checkpointing import predicted_activation_bytes
from companion.lowbit.nf4 import BLOCK_VALUES, ROW_BLOCKS_AT_LEAST
from companion.plan.space import Candidate, GPTShape

__all__ = ["BUCKET_BYTES", "activation_bytes", "bf16_weights", "segment_sizes", "state_bytes",
           "selective_block_bytes", "selective_recompute_flops", "paged_state_bytes",
           "STEP_TEMPORARIES", "PAGE", "qlora_build_bytes", "qlora_dequantize_bytes",
           "offloaded_twice", "offloaded_checkpoints", "head_gradient_bytes"]

BUCKET_BYTES = 25 * 2**20      # ShardedOptimizer's and DDP's default bucket (bucket_cap_mb=25)
# fp32 temporaries of one tensor's step, bytes per value of the largest trainable tensor, counted
# in the course's unfused code and equal to the simulated step (two 2^20-value tensors, fake
# tensors): `lowbit.BF16AdamW` (stochastic): m, v, direction, w, the update, w + update, the
# rounding's int32 noise, sum and masked bits, 9 x 4 = 36; `lowbit.Adam8bit` on bf16 weights with
# stochastic rounding 40, on fp32 ones 32 (its codes dequantized, the step, the codes' block
# scaling); torch's fused AdamW none. Counted where a step runs inside backward (the step in
# backward) and for pure bf16's optimizer phase.
STEP_TEMPORARIES = {("bf16", 32): 36, ("bf16", 8): 40, ("fp32", 8): 32, ("autocast", 8): 32}
PAGE = 2**20                   # values of a paged step's page (`training.PagedAdam8bit`)


def activation_bytes(s: GPTShape, c: Candidate,
                     device_type: str) -> tuple[int, int, int, int, int]:
    """(bytes one micro-batch saves for backward, of them per block, one checkpoint (a block's
    input), the bf16 weight copies autocast caches beyond them until the forward ends, of the
    saved bytes those outside the blocks (embeddings, final norm, loss)). The fused loss keeps
    what the chunked one does (the head's input's size: its gradient), the head's own gradient
    apart (`head_gradient_bytes`); offloaded checkpoints are not among the saved bytes."""
    B, T, C, L, V, h = c.micro_batch, s.seq_len, s.width, s.depth, s.vocab, s.heads
    precision = {"fp32": "fp32", "autocast": "autocast", "mixed": "bf16",
                 "main_grad": "bf16", "bf16": "bf16"}[c.precision]
    if c.zero_stage == 3 and c.precision == "autocast":
        precision = "bf16"                             # FSDP gathers and computes in bf16
    if s.llama:                                        # its own formula, exact in fp32, bf16
        saved = functools.partial(estimate.llama_activations, B, T, C, heads=h,
                                  kv_heads=s.kv_heads, intermediate=s.intermediate,
                                  precision=precision, device_type=device_type)
        full, outside = saved(depth=L, vocab=V), saved(depth=0, vocab=V)
        loss = outside - saved(depth=0, vocab=0) + 2 * B * T * V * (precision == "bf16")
    else:
        attention = "fused" if s.fused_attention or c.fused_attention else "written"  # fused:
        full = estimate.gpt_activations(B, T, C, L, h, V, precision=precision,   # no (T, T)
                                        device_type=device_type, attention=attention)
        outside = estimate.gpt_activations(B, T, C, 0, h, V, precision=precision,
                                           device_type=device_type)  # embeddings, final LN, loss
    per_block = (full - outside) // L
    if s.llama and c.lora_rank:                        # frozen RMSNorm weights and head: the
        cpu = device_type == "cpu"                     # CPU's fp32 x·rstd (the weight's
        per_block -= 2 * 4 * B * T * C * cpu           # product saves it) and the head's input
        outside -= (4 * cpu + (2 if precision == "bf16" else 4)) * B * T * C   # are not saved
    if precision == "bf16":
        outside += 2 * B * T * V                       # the loss's log-softmax is fp32 here
    if c.lora_rank:                                    # x·Aᵀ, (N, r), saved for B's gradient
        per_block += (len(s.lora_linear_shapes(c.lora_targets)) * B * T * c.lora_rank
                      * (2 if c.precision != "fp32" else 4))
        per_block -= unadapted_inputs(s, c) * B * T * (2 if c.precision != "fp32" else 4)
    if c.nf4_base and precision == "autocast":         # the base is dequantized again in
        per_block -= 24 * C * C                        # backward: no 16-bit weight copies saved
    if c.chunked_loss or c.fused_loss:                 # no logits kept: their fp32 log-softmax
        outside -= loss if s.llama else 4 * B * T * V + (2 * C * V if precision == "autocast"
                                                         else 0)   # and the head's
    checkpoint = (2 if bf16_weights(c) else 4) * B * T * C    # bf16 weight copy go
    blocks = predicted_activation_bytes(L, c.segments, per_block, checkpoint)
    blocks -= (c.segments - 1) * checkpoint * c.offload_checkpoints   # on the host
    if c.selective:                                    # each block keeps its input and what
        blocks = L * selective_block_bytes(s, c)       # the policy saves (per_block: all of
                                                       # it, back while its backward runs)
    cached = 0                                         # autocast caches casts of trained weights
    if precision == "autocast" and c.segments > 1 and not c.lora_rank:
        cached = (L - segment_sizes(L, c.segments)[1]) * 24 * C * C
    return outside + blocks, per_block, checkpoint, cached, outside


def offloaded_checkpoints(s: GPTShape, c: Candidate) -> int:
    """Checkpointed segments' inputs a micro-batch keeps on the host (`offload_checkpoints`):
    every checkpointed segment's, the last one's too with checkpoint_last."""
    return (c.segments - 1 + c.checkpoint_last) * c.offload_checkpoints


def head_gradient_bytes(s: GPTShape, c: Candidate) -> int:
    """Bytes of the head's weight and bias gradients the fused loss makes in forward and keeps
    until backward (its weight's dtype; none when LoRA freezes the head; the GPT's head has a
    bias unless tied to the embedding, the Llama's none)."""
    if c.lora_rank:
        return 0
    return (2 if bf16_weights(c) else 4) * s.vocab * (s.width + (not s.llama and not s.tied))


def unadapted_inputs(s: GPTShape, c: Candidate) -> int:
    """Values per token of a block's Linear inputs no one saves when LoRA adapts only some of
    its Linears (`c.lora_targets`): a frozen Linear saves nothing (no weight gradient), so an
    input is kept only for an adapter's A, whose gradient needs it; the ops before it need their
    own inputs, not this output (RMSNorm's and LayerNorm's, SwiGLU's and GELU's, the attention's
    output copied out of its heads). The Linears that read one input are grouped: a Llama's q, k
    and v read the first norm's output, gate and up the second's."""
    if not c.lora_targets:
        return 0
    return sum(width for names, width in linear_inputs(s)
               if not set(names) & set(c.lora_targets))


def linear_inputs(s: GPTShape) -> list[tuple[tuple[str, ...], int]]:
    """A block's Linear inputs: (the Linears that read it, its values per token)."""
    C, I = s.width, s.intermediate
    return ([(("q_proj", "k_proj", "v_proj"), C), (("o_proj",), C),
             (("gate_proj", "up_proj"), C), (("down_proj",), I)] if s.llama else
            [(("qkv",), C), (("proj",), C), (("fc",), C), (("out",), 4 * C)])


def bf16_weights(c: Candidate) -> bool:
    """Whether the plan keeps bf16 weights (with fp32 masters, or none: pure bf16)."""
    return c.precision in ("mixed", "main_grad", "bf16")


def selective_block_bytes(s: GPTShape, c: Candidate) -> int:
    """Bytes one block keeps under `checkpointing.selective.alternate_matmuls`, torchtitan's
    op-level policy (N = B·T tokens, e the compute dtype's bytes, r the residual stream's: fp32
    under autocast, bf16 when FSDP computes in bf16): its input r·N·C, every second matmul's
    output (a Llama's q N·C, v N·kv·d, gate N·I, down N·C; a GPT's qkv 3·N·C and fc 4·N·C) and
    fused attention's output e·N·C and fp32 log-sum-exp 4·B·heads·T (written-out attention:
    nothing of its core, recomputed). Korthikanti et al.'s 34·s·b·h for Megatron's block keeps
    every Linear's input and output, its LayerNorms' and GELU's too."""
    N, C, B, T = c.micro_batch * s.seq_len, s.width, c.micro_batch, s.seq_len
    e = 4 if c.precision == "fp32" else 2
    r = 4 if c.precision == "fp32" or (c.precision == "autocast" and c.zero_stage != 3) else 2
    if s.llama:
        kv = s.kv_heads * (C // s.heads)
        matmuls = 2 * N * C + N * kv + N * s.intermediate
    else:
        matmuls = 7 * N * C
    fused = s.llama or s.fused_attention or c.fused_attention
    return r * N * C + e * matmuls + (e * N * C + 4 * B * s.heads * T if fused else 0)


def selective_recompute_flops(s: GPTShape, c: Candidate) -> int:
    """Forward FLOPs one block's backward redoes under `alternate_matmuls`: the dropped
    matmuls (a Llama's k, o and up: 2·N·(C·kv + C² + C·I); a GPT's proj and out: 2·N·5·C²)."""
    N, C = c.micro_batch * s.seq_len, s.width
    if s.llama:
        kv = s.kv_heads * (C // s.heads)
        return 2 * N * (C * kv + C * C + C * s.intermediate)
    return 2 * N * 5 * C * C


def paged_state_bytes(s: GPTShape, c: Candidate, optimizer: int,
                      device_type: str) -> tuple[int, int]:
    """(device, host) bytes of paged 8-bit Adam states (bitsandbytes' `PagedAdamW8bit`).

    bitsandbytes' paged optimizers "take advantage of CUDA's unified memory to transfer memory
    from the GPU to the CPU when GPU memory is exhausted" (huggingface.co/docs/bitsandbytes,
    reference/optim/adam): the states are allocated outside PyTorch's caching allocator, and each
    tensor's are brought to the GPU for its update; under pressure the driver evicts pages. The planner's model
    (`training.PagedAdam8bit`): on a GPU the 8-bit codes live on the host, a page of them at a
    time brought in for its step (counted in the step's temporaries), the small tensors' fp32
    moments (8 B per value) on the device; on the CPU there is nothing to page: host and device
    are one memory, all of it counts. Limits: with room to spare the pages stay on the GPU
    (they fill memory PyTorch's allocator does not see, nor its peak statistics); when they move,
    each crosses PCIe (time: `predict_seconds`' "paging")."""
    if device_type == "cpu":
        return optimizer, 0
    small = 8 * s.n_params_small
    return small, optimizer - small


def segment_sizes(depth: int, segments: int) -> tuple[int, int]:
    """(blocks in the first segment, in the last one) of checkpoint_sequential."""
    size = depth // segments
    return (size if segments > 1 else depth), depth - size * (segments - 1)


def state_bytes(s: GPTShape, c: Candidate, world_size: int) -> tuple[int, int, int, int, int]:
    """(weights, gradients, optimizer state, gradients live while a micro-batch starts, host)."""
    trainable = s.lora_params(c.lora_rank, c.lora_targets) if c.lora_rank else s.n_params
    if c.precision == "bf16":                          # pure bf16: 2 + 2 + moments, no master
        n, small = trainable, s.n_params_small
        optimizer = 4 * n if c.state_bits == 32 else (  # bf16 moments 2 + 2, or 8-bit codes
            estimate.model_states(n - small, precision="bf16", state_bits=8).optimizer
            + 8 * small)                               # (small tensors' moments in fp32)
        return 2 * n, 2 * n, optimizer, 2 * n * (c.accumulation > 1), 0
    if c.zero_stage == 3:                              # FSDP: matrices sharded, 1-D kept whole
        share = -(-(s.n_params - s.n_params_1d) // world_size) + s.n_params_1d
        gathered = 2 * (2 if c.precision == "autocast" else 4) * s.largest
        return 4 * share, 4 * share + gathered, 8 * share, 4 * share * (c.accumulation > 1), 0
    precision = "mixed" if bf16_weights(c) else "fp32"
    states = estimate.model_states(trainable, optimizer="adamw", precision=precision,
                                   fp32_grads=c.precision == "main_grad",
                                   zero_stage=c.zero_stage, world_size=world_size)
    dense = 2 if bf16_weights(c) else 4
    frozen = dense * s.n_params if c.lora_rank else 0  # the base beside the adapters
    if c.nf4_base:                                     # every block Linear's weight in NF4
        linear = s.lora_linear_weights()
        frozen += s.depth * sum(estimate.nf4_bytes(n) - dense * n for n in linear)
    weights = states.params + frozen
    grads, optimizer = states.grads, states.optimizer
    if c.state_bits == 8:                              # small tensors keep fp32 moments
        optimizer = (estimate.model_states(trainable - s.n_params_small, precision=precision,
                                           state_bits=8).optimizer
                     + estimate.model_states(s.n_params_small, precision=precision).optimizer)
    if c.offload:                                      # one gradient at a time on the device
        host = 16 * trainable + (2 * trainable if bf16_weights(c) else 0)
        if c.nvme:                                     # masters and moments in files, paged in
            host = (4 * trainable + 12 * s.largest     # a tensor at a time
                    + (2 * trainable if bf16_weights(c) else 0))
        return weights, (weights // max(trainable, 1)) * s.largest, 0, 0, host
    before = grads if c.accumulation > 1 or world_size > 1 or c.precision == "main_grad" \
        else 0                           # main_grad: made up front; DDP: gradients live in
    if c.zero_stage == 1:                                           # buckets across steps
        grads = before = 4 * trainable                 # one flat buffer, allocated up front
    if c.zero_stage == 2:                              # full gradients of the buckets in flight
        grads = before = grads + min(4 * trainable, 2 * BUCKET_BYTES)
    return weights, grads, optimizer, before, 0


def qlora_build_bytes(s: GPTShape, c: Candidate) -> tuple[int, int]:
    """QLoRA's build where host and device are one memory (the CPU): (the dense model with its
    adapters, a layer's quantization temporaries (about 21 bytes per value of the first
    block's qkv weight in fp32, 29 from bf16: fitted to the simulated build))."""
    dense = 2 if bf16_weights(c) else 4
    return (dense * (s.n_params + s.lora_params(c.lora_rank, c.lora_targets)),
            (29 if dense == 2 else 21) * s.lora_linear_weights()[0])


def qlora_dequantize_bytes(s: GPTShape, c: Candidate, blocksize: int = 64) -> int:
    """QLoRA's temporaries in backward through a block's NF4 Linear (`lowbit.QLoRALinear`), the
    largest of its Linears': counted from `lowbit.nf4_row_blocks`, which dequantizes `step` rows
    of the (out, in) weight at a time, step = min(BLOCK_VALUES // in, ceil(out /
    ROW_BLOCKS_AT_LEAST)), n = step·in values, into buffers reused by every row block:
      fp32 buffer     4·(n + 2·blocksize + 1)     (room for the blocks of scales at both ends)
      cast buffer     e·n in the compute dtype e  (none when the base and compute are fp32)
      byte indices    4·ceil(n' / 2)  the packed bytes as int32 while they are looked up (n': the
                                      values of whole scale blocks the rows touch), or, once
                                      freed, a bf16 base's rounding (vals.to(bf16), 2·n) before
                                      its copy into the cast buffer: the larger of the two
      scales          4·ceil(in·out / blocksize)  (double quantization undone, fp32)
    and beside them the input's gradient the backward builds, (N, in) in the compute dtype, and
    the block's (N, C) fp32 gradient arriving. Counted from the code, not fitted: a width-512
    GPT's (2048, 512) fp32 base weight (4 MiB) needs 1.56 MiB of buffers, where the term fitted to
    the whole-weight dequantization before row blocks counted 9 bytes per value (9 MiB)."""
    N = c.micro_batch * s.seq_len
    base = 2 if bf16_weights(c) else 4                 # the NF4 base's dtype (its rounding)
    e = 4 if c.precision == "fp32" else 2              # the compute dtype (autocast: bf16)
    largest = 0
    for cols, rows in s.lora_linear_shapes():          # (in, out) features
        n = max(min(BLOCK_VALUES // cols, -(-rows // ROW_BLOCKS_AT_LEAST)), 1) * cols
        touched = min(-(-n // blocksize) * blocksize + blocksize * (n % blocksize > 0),
                      rows * cols)
        buffers = (4 * (n + 2 * blocksize + 1) + (0 if base == e == 4 else e * n)
                   + max(4 * -(-touched // 2), 2 * n * (base == 2))
                   + 4 * -(-rows * cols // blocksize))
        largest = max(largest, buffers + e * N * cols)
    return largest + 4 * N * s.width


def offloaded_twice(s: GPTShape, c: Candidate, device_type: str) -> int:
    """Bytes activation offload's hooks copy to the host beyond what one micro-batch saves: a
    tensor saved by several autograd nodes is copied once for each. The Llama's, per block: the
    RMSNorm outputs (q, k, v share one, gate and up the other: 3 more copies), SDPA's output (o_proj
    saves a view of it), the rotary's cos and sin (buffers, copied for q and for k), and on the
    CPU each RMSNorm's fp32 input and rstd, saved twice by its composite (and the final norm's);
    checkpointed blocks save only their input. The GPT's are counted once: 0."""
    if not s.llama:
        return 0
    e = 2 if bf16_weights(c) else 4
    N, C, d = c.micro_batch * s.seq_len, s.width, s.width // s.heads
    norm = 4 * N * C + 4 * N if device_type == "cpu" else 0
    block = 2 * norm + 3 * e * N * C + e * N * d * s.heads + 4 * e * s.seq_len * d
    kept = segment_sizes(s.depth, c.segments)[1] if c.segments > 1 else s.depth   # blocks not
    return kept * block + norm                        # checkpointed save all of theirs
