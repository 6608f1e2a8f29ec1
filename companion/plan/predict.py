"""Predict a plan's peak memory and step time before running anything.

Memory. A step's peak is not the sum of weights, gradients, optimizer state and activations: the
parts are not all alive at once. With gradients set to None at each step's start, the candidates
for the peak are (per rank, P weights, O optimizer state, G gradients, A activations):
  forward end     P + O + G' + A + the logits and their fp32 copy (+ autocast's cached bf16
                  weight copies of the checkpointed blocks, freed when autocast exits)
  backward start  P + O + G' + A + the loss's two fp32 (N, vocab) gradients
  backward end    P + O + G           (every activation freed, every gradient made)
  optimizer step  P + O + G + its temporaries (bf16 weights: the fp32 gradient copies)
where G' is what gradients hold while the last micro-batch starts: all of G when earlier
micro-batches left theirs (accumulation), ZeRO-1's flat buffer, else nothing. Weights, gradients
and state follow `companion.estimate.model_states` (ZeRO-3 here keeps 1-D tensors whole);
activations follow `companion.estimate.gpt_activations` (a Llama's `llama_activations`), with
fused attention's (B, heads, T) log-sum-exp in place of the (T, T) softmax, checkpoint segments
as in `companion.checkpointing.predicted_activation_bytes`, and the adapters' (N, r) inputs.

Levers beyond those: fp32 main_grad (Megatron's 18 B: bf16 weights 2, fp32 gradients 4 made up
front, fp32 master and moments 12); the chunked loss (no logits or log-softmax kept; backward
holds one slice's logits, log-softmax and gradients, ~(16 + 2)·N·V / slices, and the hidden
state's gradient); activation offload (every saved tensor on the host, the log-softmax twice:
log_softmax and nll_loss both save it; backward brings a segment's back at a time, and the
log-softmax with the loss's gradients); fused attention as a lever (the model rebuilt with it);
the NVMe tier (host: the gradients' 4 B and one tensor's master and moments; disk: 12 B).
On the course's test grid these land within 6% of the simulated step (tests/test_plan_levers.py).

Practitioners' levers (issue 52). Selective checkpointing (torchtitan's op-level policy,
`checkpointing.selective.alternate_matmuls`, under torch's `create_selective_checkpoint_contexts`,
every block): each block keeps its input, every second matmul's output and fused attention's
output and log-sum-exp (`parts.selective_block_bytes`); the rest is recomputed in the block's
backward, where the block's whole activations and the last gradients made live together
("selective recompute"); time: the dropped matmuls' FLOPs (`parts.selective_recompute_flops`),
the written core's products again (4·N·T·C per block) and the recomputed bytes written and read
at the memory's speed.
Pure bf16: 2 + 2 + 4 B per parameter (8-bit states: 2 + 2 + 2.03), the unfused step's fp32
temporaries for the largest tensor (`parts.STEP_TEMPORARIES`: 36 B per value, 40 with 8-bit
states) and its bytes (`BF16ADAMW_BYTES`). The step in backward: one gradient alive (the
largest's), its step inside backward while the blocks' activations are alive ("optimizer in
backward"). Paged 8-bit states: on a GPU the codes on the host (`parts.paged_state_bytes`), a
page of 2^20 values stepped at a time; time: a bound, every page out and back over the host
link ("paging"). Within 1.2% of the simulated step for each on a GPT and a Llama, 6% for all
four together (tests/test_plan_practitioners.py).

Issue 59's levers. The fused loss (`chunked_loss.fused_linear_cross_entropy`, `fused_loss`
slices): no logits kept, as the chunked loss; in its forward the hidden state, one slice's fp32
logits (4·n·V bytes; 16-bit logits and their fp32 copy, 6·n·V: the log-softmax, loss and
softmax are made in their place), the head input's gradient (the size of the input the chunked
loss keeps) and the head's weight and bias gradients (`parts.head_gradient_bytes`: V·C + V in
the weights' dtype, none under LoRA), made there and kept to backward: extra bytes either way,
before the head's .grad exists (one micro-batch) or beside it (accumulation, which adds them to
it); backward scales them in place and autograd takes them as they are. Time: the plain loss's
(its two gradient matmuls move into forward), no head matmul recomputed as the chunked loss does.
Offloaded checkpoint inputs (`offload_checkpoints`, `checkpointing.InputOffload` around the
checkpointed segments): (segments - 1) inputs (every segment's with checkpoint_last) leave the
device for the host until backward, which fetches them one segment ahead; backward through the
first segment is unchanged, so the peak falls only where the inputs were part of it (the loss's
phase, many tokens: `checkpointing.where_is_the_peak`). Time: each input down and up at the
rate saved tensors move, less what the segment's compute beside it hides (`_checkpoint_copies`).
On the GPT in fp32 both land within 0.01% of the simulated step (a real one: 8 B more), the
host's bytes exact; elsewhere they miss by what the levers they join miss by: a Llama in bf16
-1.7% to -3.0% (the chunked loss -1.7% to -2.9%), LoRA -1.0%, checkpointing a small Llama -0.8%,
activation offload's first block +12% (tests/test_plan_loss_and_inputs.py).

The Llama (`companion.models.Llama`: Llama, Mistral, Qwen2 shapes). Its activations are
`llama_activations` (RMSNorm, rotary q and k, GQA's narrower k and v, SwiGLU's four (N, I)
tensors; always SDPA, so no (T, T) term and fused attention is no lever), on "cuda" with the
fused RMSNorm's saved tensors. Two phases of its own: the last block's backward (through
SwiGLU's product: every block's activations but down_proj's input, the head's, final norm's and
down_proj's gradients, the product's gradient in and two out, 3·e·N·I, the residual's e·N·C:
the peak when a chunked loss leaves the head small), and with activation offload the first
block's, which brings back one node's tensors at a time, that product's two (N, I) inputs, not
the whole block's. The host then holds each saved tensor once per node that saved it
(`parts.offloaded_twice`: the norm outputs q, k and v all save, and more). Tied embeddings
(the head's gradient is the embedding's) and Qwen2's q, k, v biases are read off the model.
LoRA and QLoRA adapt its seven Linears (q, k, v, o, gate, up, down); its frozen RMSNorms and
head then save less (no x·rstd on the CPU, no head input). Searched on it: every lever but bf16
autocast outside ZeRO-3 (`space.LLAMA_NOT_SEARCHED` says why); ZeRO-3's autocast is FSDP
computing in bf16, which the formula covers. On a small Llama the predictions land within 1.1%
of the simulated step for every lever (LoRA's and QLoRA's within 2%, high), on one rank and two
(tests/test_plan_llama.py).

Time. `CostModel` adds: matmul FLOPs (forward 2·N·(params in matmuls) plus
attention's 4·N·T·C per block, backward twice that, or once with LoRA's frozen weights, the
recomputed blocks once more) at `flops` (times `half_speedup` in bf16), a fixed cost per layer
and micro-batch (kernel launches: small micro-batches cost more than their FLOPs), the
optimizer's bytes at the speed of the memory it runs in (the device's, or the host's when
offloaded; `ADAM8BIT_BYTES` for 8-bit states, or where calibrate timed the 8-bit step, a CPU's,
its rate per parameter and per tensor: compute-bound there), QLoRA's dequantizations (`DEQUANTIZE_BYTES` per
base value and the cast to a 16-bit compute dtype, in forward, backward and recompute), offload's
copies over the host link (PCIe), activation offload's (each saved byte down and up), the NVMe
tier's 24 B per parameter at `disk_bandwidth` and a flush per file (three per trainable tensor),
the chunked loss's second head matmul, LoRA adapters' own passes (~40·N·out + 24·N·in bytes per
adapted Linear at `adapter_bandwidth`), and the part of ZeRO's or DDP's traffic that compute
does not hide (`_exposed_communication`; the rest is reported as "communication hidden"). A
Llama's blocks: its matmul weights (q, k, v, o, gate, up, down: 2·C² + 2·C·kv_heads·d + 3·C·I)
for the GPT's 12·C², attention the same 4·N·T·C.

8-bit states and QLoRA (chapter 11): the moments are `estimate.model_states(state_bits=8)` less the
tensors under 4096 values, which keep fp32 moments; QLoRA's adapted Linear weights are
`estimate.nf4_bytes`, the rest of the base dense and frozen, with two more terms: backward through
the last block's NF4 Linears, one row block of a base weight dequantized while every block's
activations are alive (`parts.qlora_dequantize_bytes`, counted from `lowbit.nf4_row_blocks`'s
buffers), and, where host and device are one memory (the CPU), the build, which holds the dense
model before it is quantized (on a GPU the base is quantized on the host and only its codes move;
`training.build`).

Simplified vs measurement: the temporaries inside backward are two named terms (the loss's
gradients, a block's 5·N·C), and ZeRO-2/3's buckets and gathers are rough: on the course's test
grid single-device predictions land within 6% of the simulated step, ZeRO-2/3 within 20%. The
simulation runs the CPU's dispatch but RMSNorm's, which it runs as CUDA's fused kernel saves when
simulating CUDA (`simulation._FusedRMSNorm`; the CPU's composite keeps fp32 copies besides, ~1.3x
a Llama block's activations in bf16); the Llama's other CUDA terms (SDPA's kernels) are read
off torch's dispatch, not measured. The cost model overlaps communication with compute only
(per block: ZeRO-3's gathers and reduce-scatters, DDP's and ZeRO-1/2's gradient reductions;
`CostModel.overlap` says how much can hide: all on a GPU, none for the course's ZeRO on gloo);
copies, the optimizer and the host step are added in full.
"""
from __future__ import annotations

import dataclasses

from companion.checkpointing import Overlap
from companion.plan.costmodel import CostModel
from companion.plan.parts import (BUCKET_BYTES, PAGE, STEP_TEMPORARIES, activation_bytes,
                                  bf16_weights, head_gradient_bytes, linear_inputs,
                                  offloaded_checkpoints, offloaded_twice, paged_state_bytes,
                                  qlora_build_bytes, qlora_dequantize_bytes, segment_sizes,
                                  selective_block_bytes, selective_recompute_flops,
                                  state_bytes, unadapted_inputs)
from companion.plan.space import Candidate, GPTShape

__all__ = ["Prediction", "predict_memory", "CostModel", "predict_seconds", "BUCKET_BYTES",
           "ADAM8BIT_BYTES", "DEQUANTIZE_BYTES", "DISK_BANDWIDTH", "BF16ADAMW_BYTES",
           "ADAM8BIT_BF16_BYTES"]

# Bytes read and written per value by the course's unfused 8-bit code, counted operator by
# operator (a GPU is bound by them; each op's tensor operands read once, its result written; the
# maps' tables, read in part, and the per-block scales (4 B per 256) left out). `lowbit.Adam8bit`'s step on an fp32 parameter with
# AdamW's decay (the planner's): per parameter, dequantizing each moment 21 (codes to int32 1+4,
# index_select 4+4, scales in place 4+4), AdamW's decay 8, Adam's update 76 (lerp_ 12, mul_ 8,
# addcmul_ 12, sqrt, div_, add_ 8 each, div 8, div_ 12), the weight 12, quantizing each moment 69
# (block absmax: abs 8, amax 4; divide 8; the bf16 bin: >> 8, & 8; the two table gathers 5 and
# 8; the comparison 9, its add 3; no pad where the blocks are whole): 42 + 8 + 76 + 12 + 122 = 260,
# where fused AdamW moves 32 (bitsandbytes' one kernel ~18). On the course's 2-core CPU, one
# thread, 2^20 parameters, it took 33x fused AdamW's time (median of 15 interleaved, a loaded
# machine, 2026-12-06): compute-bound there, the bytes under-count it.
# One NF4 dequantization into fp32, per value (`lowbit.nf4_row_blocks`): the packed byte to int32
# 0.5+2, the byte-pair table's index_select 2+4, the scales in place 4+4 (+0.06), double
# quantization's scales ~0.4: 17. The cast to a bf16 compute dtype adds 6 from an fp32 base (a
# copy 4+2), 10 from a bf16 one (rounded 4+2, copied 2+2): `_DEQUANTIZE_CAST_BYTES`.
ADAM8BIT_BYTES = 260
# `lowbit.BF16AdamW`'s step (stochastic rounding), per parameter, counted the same way: m, v and
# the gradient to fp32 18, Adam's update 76 (as above), each moment rounded back stochastically 34
# (int32 noise 4, its sum 12, the mask 8, to bf16 6, the copy 4) twice, the weight to fp32 and
# its decay and update 34, w + update and its rounding 46: 242. `Adam8bit` on bf16 weights with
# stochastic rounding: 260 less the fp32 weight's update 12, plus the weight to fp32, its decay
# and update and rounding 60: 308.
BF16ADAMW_BYTES = 242
ADAM8BIT_BF16_BYTES = 308
DEQUANTIZE_BYTES = 17
_DEQUANTIZE_CAST_BYTES = {"fp32": 0, "autocast": 6, "mixed": 10, "main_grad": 10, "bf16": 10}
# the GPUs' NVMe tier (CostModel's default: a PCIe 4.0 x4 SSD streams up to 7 GB/s; 3 assumed)
DISK_BANDWIDTH = CostModel.disk_bandwidth


_KINDS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")

@dataclasses.dataclass(frozen=True)
class Prediction:
    """Bytes per rank at the predicted peak, by kind (the tracker's kinds), and on the host."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    phase: str           # where the peak falls: "forward", "backward", "backward end", "optimizer"
    host: int = 0        # offloaded master weights, gradients, state, activations (not in peak)
    disk: int = 0        # the NVMe tier's files: fp32 masters and AdamW's moments

    @property
    def peak(self) -> int:
        """Bytes at the predicted peak: every kind added up (they are all alive then)."""
        return sum(getattr(self, k) for k in _KINDS)

    def kinds(self) -> dict[str, int]:
        """{kind: bytes}, the shape `companion.widgets.memory_bars` draws."""
        return {k: getattr(self, k) for k in _KINDS}


def predict_memory(shape: GPTShape, cand: Candidate, *, world_size: int = 1,
                   device_type: str = "cpu") -> Prediction:
    """Predicted peak bytes per rank of `cand`'s training step, by kind (see the module doc)."""
    s, c = shape, cand
    c.check_depth(s.depth)
    P, G, O, G_before, host = state_bytes(s, c, world_size)
    if c.paged:                                        # the states' pages on the host
        O, paged = paged_state_bytes(s, c, O, device_type)
        host += paged
    in_step = STEP_TEMPORARIES.get((c.precision, c.state_bits), 0) * (
        min(s.largest, PAGE) if c.paged else s.largest)   # paged: a page at a time
    if c.in_backward:                                  # each gradient stepped and freed as it
        G = G // s.n_params * s.largest                # is made: the largest one's, with its
        G_before = 0                                   # step's temporaries
    A, per_block, checkpoint, cached, outside = activation_bytes(s, c, device_type)
    N, V, C = c.micro_batch * s.seq_len, s.vocab, s.width
    low = c.precision != "fp32"
    logits = N * V * (2 + 4 if low else 4)             # the logits (and their fp32 copy)
    loss_grads = 8 * N * V                             # the loss's two fp32 (N, vocab) gradients
    if c.chunked_loss:                                 # one slice's at a time, and the hidden
        logits = logits // c.chunked_loss              # (its recompute, log-softmax, gradients)
        loss_grads = (16 + 2 * low) * N * V // c.chunked_loss + 4 * N * C
    head = head_gradient_bytes(s, c) if c.fused_loss else 0   # the fused loss's head
    if c.fused_loss:                                   # gradients, made in forward (its input's
        e = 2 if bf16_weights(c) else 4                # gradient among the activations; made
        back = e * N * C * c.activation_offload        # here, then on the host with offload);
        n = -(-N // c.fused_loss)                      # tokens a slice; its bias gradient's
        bias = e * V * (not s.llama and not s.tied and not c.lora_rank)   # sum, row statistics
        slice_peak = max((4 + 2 * low) * n * V, 4 * n * V + bias) + 24 * n   # one slice's
        logits = (e * N * C + back + head + slice_peak       # logits in fp32 (a 16-bit one
                  + 2 * C * V * (c.precision == "autocast" and not c.lora_rank))   # first),
        loss_grads = head + e * N * C + back           # autocast's cached bf16 head; backward:
    #   the kept gradients, scaled in place, no matmul
    sliced = c.chunked_loss or c.fused_loss
    host_acts = 0
    if c.activation_offload and not sliced:            # the log-softmax back from the host
        loss_grads += 4 * N * V
    if c.activation_offload:                           # saved tensors wait on the host; backward
        host_acts = A + 4 * N * V * (not sliced) + head + offloaded_twice(s, c, device_type)
        A = 0                                          # a segment's back at a time;
        # the log-softmax is saved twice (log_softmax, nll_loss) and crosses twice
        early_acts_back = per_block * (segment_sizes(s.depth, c.segments)[0]
                                       if c.segments > 1 else 1)
    # backward through the first segment (or the first block, without checkpointing): the later
    # blocks' gradients exist, the first segment's activations are back, and its own gradients
    # flow: the block input's and the (N, 4C) MLP one's, 5·N·C fp32 values
    first = segment_sizes(s.depth, c.segments)[0] if c.segments > 1 else 1
    block_share = 0 if c.lora_rank else s.block_params() / s.n_params
    lora_share = 1 / s.depth if c.lora_rank else 0
    embedded = 0 if s.tied else s.vocab + (0 if s.llama else s.seq_len)   # token (and
    # position) embeddings' gradients, not made yet (tied: the head's backward made it)
    early = int(G * (1 - first * (block_share + lora_share) - embedded * C
                     / s.n_params * (not c.lora_rank)))
    early_acts = first * per_block + (checkpoint if c.segments > 1 else 0)
    block_temp = 4 * N * (C + (2 * s.intermediate if s.llama else 4 * C))
    moving = G if c.offload else 0                     # a gradient on its way to the host
    early_moving = moving
    if c.activation_offload:
        early_acts = early_acts_back
    if c.activation_offload and s.llama and c.segments == 1:   # saved tensors come back one
        e, I = (2 if bf16_weights(c) else 4), s.intermediate  # node at a time: the peak is
        early_acts = 2 * e * N * I                     # SwiGLU's product's: silu(gate) and up
        block_temp = 3 * e * N * I + e * N * C         # back, its gradient in and two out, the
        early = 0 if c.offload else early + G * C * I // s.n_params  # residual's; down_proj's
        early_moving = 0                               # gradient made (offload: sent already)
    step_temp = G if c.precision == "mixed" and not c.offload else 0
    step_temp = in_step if (c.precision == "bf16" or c.paged) and not c.in_backward \
        else step_temp
    at_loss = A                                        # the last segment checkpointed too:
    if c.checkpoint_last:                              # only its input kept until its backward
        at_loss = A - segment_sizes(s.depth, c.segments)[1] * per_block \
            + checkpoint * (not c.offload_checkpoints)  # (offloaded: on the host)
    phases = [("forward", G_before, at_loss, logits + cached),
              ("backward", G_before + moving, at_loss, loss_grads),
              ("first block's backward", max(G_before, early) + early_moving, early_acts,
               block_temp),
              ("backward end", G, 0, 0),
              # backward through the last block's NF4 Linears: every block's activations (the
              # loss's and final norm's freed; offloaded: the last segment's back), one row
              # block's buffers, the input's gradient, the block's (N, C) gradient (`parts`)
              *([("QLoRA's dequantization", G_before,
                  per_block * (segment_sizes(s.depth, c.segments)[1] if c.segments > 1 else 1)
                  if c.activation_offload else A - outside, qlora_dequantize_bytes(s, c))]
                if c.nf4_base else []),

              ("optimizer", G, 0, step_temp)]
    if c.in_backward and c.chunked_loss:               # the head's gradient summed over the
        phases.append(("backward", 2 * G, at_loss, loss_grads))   # slices before its step: the
                                                       # sum and a slice's
    if c.in_backward:                                  # the head's step, its gradient made
        phases.append(("optimizer in backward", G, at_loss - outside, in_step))   # (the logits'
                                                       # gradient freed): the blocks' left
    if c.selective:                                    # the last block's backward: its
        recomputed = per_block - selective_block_bytes(s, c)   # recomputed tensors back, the
        mlp = C * (s.intermediate if s.llama else 4 * C)   # head's, final norm's and the MLP's
        made = G * (V * C + C + mlp) // s.n_params     # last Linear's gradients made
        phases.append(("selective recompute", max(G_before, made) + moving,
                       A - outside + recomputed, block_temp))
        first_phase = phases[2]                        # the first block's: its MLP's last
        phases[2] = (first_phase[0], first_phase[1] + G * mlp // s.n_params,   # gradient too
                     *first_phase[2:])
    if s.llama and not c.activation_offload:           # the last block's SwiGLU product's
        e, I = (2 if low else 4), s.intermediate       # backward: the head's, final norm's and
        made = G * (V * C + C + C * I) // s.n_params   # down_proj's gradients made, the blocks'
        phases.append(("last block's backward", max(G_before, made) + moving,   # activations
                       A - outside - e * N * I,        # but down_proj's input, gradients as in
                       3 * e * N * I + e * N * C))     # the first block's (a chunked loss's
    if c.nf4_keeps_inputs:
        # bitsandbytes < 0.43.2: every NF4 Linear's input that needs a gradient (all but the
        # first block's q, k and v input, a frozen embedding's norm) kept to the graph's end,
        # beyond what the blocks still save; the loop's variable holds the last forward's
        # output with its graph (litgpt's `logits`) through the step and until the next
        # forward returns: then the micro-batch before's inputs and output are alive too
        e = 2 if low else 4
        every = e * N * (s.depth * sum(width for _, width in linear_inputs(s)) - C)
        unsaved = e * N * s.depth * unadapted_inputs(s, c)
        intact = ("forward", "backward", "QLoRA's dequantization", "last block's backward")
        held = e * N * (C if c.chunked_loss else V)    # the output, held through backward
        phases = [(name, g, a + (unsaved if name in intact else every), t + held)
                  for name, g, a, t in phases]
        phases.append(("forward, the last output held", G_before,
                       at_loss + unsaved + every, 2 * held + cached))
    phase, grads, acts, temp = max(phases, key=lambda p: p[1] + p[2] + p[3])   # peak, V small)
    disk = 12 * (s.lora_params(c.lora_rank, c.lora_targets) if c.lora_rank else s.n_params) \
        if c.nvme else 0
    moved = offloaded_checkpoints(s, c) * checkpoint   # checkpointed segments' inputs
    step = Prediction(P, grads, O, acts, temp, phase, host + host_acts + moved, disk)
    if c.nf4_base and device_type == "cpu":            # QLoRA's build, in the same memory
        weights, quantizing = qlora_build_bytes(s, c)
        if weights + quantizing > step.peak:
            return Prediction(weights, 0, 0, 0, quantizing, "build (the dense base)", host)
    return step


def _exposed_communication(s: GPTShape, c: Candidate, cost: CostModel, world_size: int,
                           forward_per_block: float, recompute_share: float) -> float:
    """Seconds of one step's communication the compute does not hide (`cost.overlap` of what
    can hide does). Per block (a unit, FSDP's wrapping): ZeRO-3 gathers its weights before its
    forward and again before its backward, one block ahead (FSDP2's default prefetch), and
    reduce-scatters its fp32 gradient as its backward ends; DDP and ZeRO-1/2 reduce each
    block's gradient as backward makes it (the last micro-batch's, every one's under ZeRO-2)
    and ZeRO-1/2 gather the stepped weights after the step, with nothing to hide behind. The
    rest (embeddings, head, final norm) is one unit gathered first and reduced last, exposed.
    `companion.cost.step.exposed_link` schedules it, as `zero_step` does for chapter 07."""
    from companion.cost.step import exposed_link

    ring = (world_size - 1) / world_size
    per_byte = ring / cost.network_bandwidth
    L, block, trainable = s.depth, s.block_params(), s.n_params
    rest = trainable - L * block
    backward_per_block = forward_per_block * (2 + recompute_share)
    fwd, bwd = [forward_per_block] * L, [backward_per_block] * L
    if c.zero_stage == 3:
        gb = 2 if c.precision == "autocast" else 4     # FSDP gathers bf16 (autocast) or fp32
        gather, scatter = [gb * block * per_byte] * L, [4 * block * per_byte] * L
        micro = (2 * gb * rest + 4 * rest) * per_byte \
            + exposed_link(range(L), gather, fwd, 1, cost.overlap) \
            + exposed_link(range(L - 1, -1, -1), gather, bwd, 1, cost.overlap, after=scatter)
        return c.accumulation * micro
    reduce = (2 if c.zero_stage == 0 else 1) * 4 * per_byte   # all-reduce, or reduce-scatter
    syncs = c.accumulation if c.zero_stage == 2 else 1         # no_sync until the last
    backward = exposed_link(range(L - 1, -1, -1), [0.0] * L, bwd, 1, cost.overlap,
                            after=[reduce * block] * L) + reduce * rest
    gather_after = 4 * trainable * per_byte if c.zero_stage in (1, 2) else 0.0
    return syncs * backward + gather_after


def _checkpoint_copies(s: GPTShape, c: Candidate, cost: CostModel, forward_per_block: float
                       ) -> float:
    """Seconds one micro-batch's offloaded checkpoint inputs add (`offload_checkpoints`): each
    input down beside its segment's forward and up beside the next segment's recompute and
    backward (three forwards), at the rate saved tensors move; the part of a copy shorter than
    the compute beside it hides (`checkpointing.transfer_hides`' rule, `Overlap.hides`), where
    the device overlaps copies at all (`cost.overlap`), the rest is exposed."""
    nbytes = activation_bytes(s, c, "cuda")[2]        # a block's input, (B, T, C)
    forward = segment_sizes(s.depth, c.segments)[0] * (forward_per_block
                                                       + cost.layer_seconds / 3)
    o = Overlap(nbytes, nbytes / (cost.activation_bandwidth or cost.host_bandwidth), forward,
                3 * forward)
    exposed = sum(o.copy_seconds - cost.overlap * min(o.copy_seconds, beside)
                  for beside in (o.forward_seconds, o.backward_seconds))
    return offloaded_checkpoints(s, c) * exposed


def predict_seconds(shape: GPTShape, cand: Candidate, cost: CostModel, *,
                    world_size: int = 1) -> dict[str, float]:
    """Predicted seconds of one optimizer step by part: compute, recompute, overhead,
    optimizer, dequantize (QLoRA), offload, adapters (LoRA), communication (the part not
    hidden behind compute)
    and their "total"; and, outside the total, "communication hidden": the link time that
    overlaps compute (`_exposed_communication`)."""
    s, c = shape, cand
    tokens = c.micro_batch * c.accumulation * s.seq_len            # this rank's, per step
    C, L, V, T = s.width, s.depth, s.vocab, s.seq_len
    block = 2 * s.block_matmul_params() + 4 * T * C                # forward FLOPs per token
    forward = tokens * (L * block + 2 * C * V)
    backward = 2 * forward                             # frozen (LoRA): no weight gradients,
    if c.lora_rank:                                    # attention's backward as before
        backward -= tokens * (L * 2 * s.block_matmul_params() + 2 * C * V)
    recompute = tokens * block * c.recomputed_blocks(L)
    if c.chunked_loss:                                 # the head's matmul again in backward
        recompute += tokens * 2 * C * V
    speed = cost.flops * (cost.half_speedup if c.precision != "fp32" else 1.0)
    trainable = s.lora_params(c.lora_rank, c.lora_targets) if c.lora_rank else s.n_params
    weight_bytes = 2 if bf16_weights(c) else 4
    shard = trainable / world_size if c.zero_stage else trainable
    ring = (world_size - 1) / world_size
    sent = {0: 2 * ring * 4 * trainable, 1: 2 * ring * 4 * trainable,
            2: (c.accumulation + 1) * ring * 4 * trainable,
            3: c.accumulation * ring * trainable * (4 + 2 * (2 if c.precision == "autocast"
                                                             else 4))}[c.zero_stage]
    optimizer_bytes = ADAM8BIT_BYTES if c.state_bits == 8 else 32
    if c.precision == "bf16":                          # pure bf16's unfused steps
        optimizer_bytes = ADAM8BIT_BF16_BYTES if c.state_bits == 8 else BF16ADAMW_BYTES
    redone = 0.0                                       # share of a block's forward redone
    if c.selective:                                    # the dropped matmuls again, the written
        redone = selective_recompute_flops(s, c) / (c.micro_batch * T * block)   # core's
        recompute += tokens * 4 * T * C * L * (not (s.llama or s.fused_attention   # products,
                                                    or c.fused_attention))   # every element-
        recompute += c.accumulation * L * selective_recompute_flops(s, c)   # wise op's output
    recomputed = (c.accumulation * L * (activation_bytes(s, c, "cuda")[1]   # op's output
                                        - selective_block_bytes(s, c)) if c.selective else 0)
    dequantized = 0                                    # QLoRA: base values dequantized
    if c.nf4_base:                                     # forward, backward, and recompute
        per_pass = sum(s.lora_linear_weights())
        dequantized = c.accumulation * per_pass * (2 * L + c.recomputed_blocks(L))
    parts = {
        "compute": (forward + backward) / speed,
        "recompute": recompute / speed,
        # each block's operators' fixed cost, forward and backward, per micro-batch; a
        # recomputed block pays it again (its forward under the checkpoint's hooks: measured
        # 1.5 ms a block on the CPU, as much as a layer's forward and backward)
        "overhead": c.accumulation * (L + 2 + c.recomputed_blocks(L)) * cost.layer_seconds,
        # AdamW reads and writes ~32 B per parameter (weight, gradient, two moments) through
        # the memory it runs in: the host's when offloaded, the device's otherwise
        "optimizer": (shard / cost.adam8bit_rate + s.trainable_tensors(c.lora_rank, c.lora_targets)
                      * cost.adam8bit_tensor_seconds
                      if c.state_bits == 8 and cost.adam8bit_rate
                      else optimizer_bytes * shard / (cost.host_memory_bandwidth if c.offload
                                                      else cost.memory_bandwidth)),
        "dequantize": (DEQUANTIZE_BYTES + _DEQUANTIZE_CAST_BYTES[c.precision]) * dequantized
        / cost.memory_bandwidth,
        "offload": (c.accumulation * weight_bytes * trainable + weight_bytes * trainable)
        / cost.host_bandwidth if c.offload else 0.0,
        "communication": 0.0,
        # saved activations down in forward and up in backward, not overlapped (our hooks copy
        # on the compute stream); the NVMe tier reads and writes 12 B per parameter each step
        "activation offload": (2 * c.accumulation * activation_bytes(s, c, "cuda")[0]
                               / (cost.activation_bandwidth or cost.host_bandwidth)
                               if c.activation_offload else 0.0),
        "disk": (2 * 12 * trainable / cost.disk_bandwidth + 3 * s.trainable_tensors(
            c.lora_rank, c.lora_targets) * cost.disk_sync_seconds) if c.nvme else 0.0,
        # checkpointed segments' inputs over the host link, where the compute does not hide them
        "checkpoint offload": c.accumulation * _checkpoint_copies(
            s, c, cost, c.micro_batch * T * block / speed) if c.offload_checkpoints else 0.0,
        # selective checkpointing's element-wise recompute: what the policy does not keep,
        # written again and read by backward, at the device's memory speed
        "selective recompute": 2 * recomputed / cost.memory_bandwidth,
        # paged 8-bit states, a bound: every page evicted and brought back over the host link
        # each step (under memory pressure; with room to spare they stay and cost nothing)
        "paging": (2 * paged_state_bytes(s, c, state_bytes(s, c, world_size)[2], "cuda")[1]
                   / cost.host_bandwidth if c.paged else 0.0),
        # LoRA's adapters beyond their FLOPs: per adapted Linear and micro-batch, the thin
        # matmuls' operands, the scale and the add, forward and backward, and the input's two
        # gradients added: ~40·N·out + 24·N·in bytes in fp32 (half in 16 bits), at the rate
        # calibrate measures for them (on the CPU a fifth of the copy bandwidth)
        "adapters": c.accumulation * L * sum(40 * c.micro_batch * T * o + 24 * c.micro_batch
                                             * T * i for i, o in s.lora_linear_shapes(c.lora_targets))
        * (0.5 if c.precision != "fp32" else 1.0)
        / (cost.adapter_bandwidth or cost.memory_bandwidth)
        + c.accumulation * L * len(s.lora_linear_shapes(c.lora_targets)) * cost.adapter_seconds
        if c.lora_rank else 0.0,
    }
    if world_size > 1:
        exposed = _exposed_communication(s, c, cost, world_size, c.micro_batch * T * block / speed,
                                         c.recomputed_blocks(L) / L + redone)
        parts["communication"] = min(exposed, sent / cost.network_bandwidth)
    parts["total"] = sum(parts.values())
    if world_size > 1:
        parts["communication hidden"] = sent / cost.network_bandwidth - parts["communication"]
    return parts
