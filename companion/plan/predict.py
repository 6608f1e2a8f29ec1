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

Time. `CostModel` adds, with no overlap: matmul FLOPs (forward 2·N·(params in matmuls) plus
attention's 4·N·T·C per block, backward twice that, or once with LoRA's frozen weights, the
recomputed blocks once more) at `flops` (times `half_speedup` in bf16), a fixed cost per layer
and micro-batch (kernel launches: small micro-batches cost more than their FLOPs), the
optimizer's bytes at the speed of the memory it runs in (the device's, or the host's when
offloaded; `ADAM8BIT_BYTES` for 8-bit states), QLoRA's dequantizations (`DEQUANTIZE_BYTES`
per base value, in forward, backward and recompute), offload's copies over the host link
(PCIe), activation offload's (each saved byte down and up), the NVMe tier's 24 B per parameter
at `disk_bandwidth` and a flush per file (three per trainable tensor), the chunked loss's second
head matmul, and ZeRO's traffic. A Llama's blocks: its matmul weights for the GPT's 12·C².

8-bit states and QLoRA (chapter 11): the moments are `estimate.model_states(state_bits=8)` less the
tensors under 4096 values, which keep fp32 moments; QLoRA's adapted Linear weights are
`estimate.nf4_bytes`, the rest of the base dense and frozen, with two more terms: one base weight's
dequantization in flight while every activation is alive, and, where host and device are one memory
(the CPU), the build, which holds the dense model before it is quantized (on a GPU the base is
quantized on the host and only its codes move; `training.build`).

Simplified vs measurement: the temporaries inside backward are two named terms (the loss's
gradients, a block's 5·N·C), and ZeRO-2/3's buckets and gathers are rough: on the course's test
grid single-device predictions land within 6% of the simulated step, ZeRO-2/3 within 20%; the
Llama's within 1.5% but activation offload (up to 35% high), and on CUDA below the simulation,
which runs the CPU's RMSNorm with fp32 copies CUDA's fused kernel does not save (up to a fifth in
bf16; tests/test_plan_llama.py). The cost model assumes no overlap of compute, copies and links.
"""
from __future__ import annotations

import dataclasses
import functools

from companion import estimate
from companion.checkpointing import predicted_activation_bytes
from companion.plan.costmodel import CostModel
from companion.plan.space import Candidate, GPTShape

__all__ = ["Prediction", "predict_memory", "CostModel", "predict_seconds", "BUCKET_BYTES",
           "ADAM8BIT_BYTES", "DEQUANTIZE_BYTES", "DISK_BANDWIDTH"]

BUCKET_BYTES = 25 * 2**20      # ShardedOptimizer's and DDP's default bucket (bucket_cap_mb=25)
# Bytes read and written per value by the course's unfused 8-bit code, counted operator by
# operator (a GPU is bound by them): `lowbit.Adam8bit`'s step ~290 per parameter (dequantize both
# moments ~58, Adam's update ~100, quantize both ~120, the weight ~12) where fused AdamW moves 32
# (bitsandbytes' one kernel ~18); one NF4 dequantization ~40 per value (unpack, index, scale,
# cast). On the course's CPU, compute-bound there, they ran 125x fused AdamW and ~400 bytes.
ADAM8BIT_BYTES = 290
DEQUANTIZE_BYTES = 40
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


def _activations(s: GPTShape, c: Candidate, device_type: str) -> tuple[int, int, int, int]:
    """(bytes one micro-batch saves for backward, of them per block, one checkpoint (a block's
    input), the bf16 weight copies autocast caches beyond them until the forward ends)."""
    B, T, C, L, V, h = c.micro_batch, s.seq_len, s.width, s.depth, s.vocab, s.heads
    precision = {"fp32": "fp32", "autocast": "autocast", "mixed": "bf16",
                 "main_grad": "bf16"}[c.precision]
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
    if precision == "bf16":
        outside += 2 * B * T * V                       # the loss's log-softmax is fp32 here
    if c.lora_rank:                                    # x·Aᵀ, (N, r), saved for B's gradient
        per_block += 4 * B * T * c.lora_rank * (2 if c.precision != "fp32" else 4)
    if c.nf4_base and precision == "autocast":         # the base is dequantized again in
        per_block -= 24 * C * C                        # backward: no 16-bit weight copies saved
    if c.chunked_loss:                                 # no logits kept: their fp32 log-softmax
        outside -= loss if s.llama else 4 * B * T * V + (2 * C * V if precision == "autocast"
                                                         else 0)   # and the head's
    checkpoint = (2 if _bf16(c) else 4) * B * T * C    # bf16 weight copy go
    blocks = predicted_activation_bytes(L, c.segments, per_block, checkpoint)
    cached = 0                                         # autocast caches casts of trained weights
    if precision == "autocast" and c.segments > 1 and not c.lora_rank:
        cached = (L - _segment(L, c.segments)[1]) * 24 * C * C
    return outside + blocks, per_block, checkpoint, cached


def _bf16(c: Candidate) -> bool:
    """Whether the plan keeps bf16 weights (with fp32 masters)."""
    return c.precision in ("mixed", "main_grad")


def _segment(depth: int, segments: int) -> tuple[int, int]:
    """(blocks in the first segment, in the last one) of checkpoint_sequential."""
    size = depth // segments
    return (size if segments > 1 else depth), depth - size * (segments - 1)


def _states(s: GPTShape, c: Candidate, world_size: int) -> tuple[int, int, int, int, int]:
    """(weights, gradients, optimizer state, gradients live while a micro-batch starts, host)."""
    trainable = s.lora_params(c.lora_rank) if c.lora_rank else s.n_params
    if c.zero_stage == 3:                              # FSDP: matrices sharded, 1-D kept whole
        share = -(-(s.n_params - s.n_params_1d) // world_size) + s.n_params_1d
        gathered = 2 * (2 if c.precision == "autocast" else 4) * s.largest
        return 4 * share, 4 * share + gathered, 8 * share, 4 * share * (c.accumulation > 1), 0
    precision = "mixed" if _bf16(c) else "fp32"
    states = estimate.model_states(trainable, optimizer="adamw", precision=precision,
                                   fp32_grads=c.precision == "main_grad",
                                   zero_stage=c.zero_stage, world_size=world_size)
    dense = 2 if _bf16(c) else 4
    frozen = dense * s.n_params if c.lora_rank else 0  # the base beside the adapters
    if c.nf4_base:                                     # its adapted weights in NF4
        linear = s.lora_linear_weights()
        frozen += s.depth * sum(estimate.nf4_bytes(n) - dense * n for n in linear)
    weights = states.params + frozen
    grads, optimizer = states.grads, states.optimizer
    if c.state_bits == 8:                              # small tensors keep fp32 moments
        optimizer = (estimate.model_states(trainable - s.n_params_small, precision=precision,
                                           state_bits=8).optimizer
                     + estimate.model_states(s.n_params_small, precision=precision).optimizer)
    if c.offload:                                      # one gradient at a time on the device
        host = 16 * trainable + (2 * trainable if _bf16(c) else 0)
        if c.nvme:                                     # masters and moments in files, paged in
            host = 4 * trainable + 12 * s.largest + (2 * trainable if _bf16(c) else 0)  # a tensor
        return weights, (weights // max(trainable, 1)) * s.largest, 0, 0, host   # at a time
    before = grads if c.accumulation > 1 or world_size > 1 or c.precision == "main_grad" \
        else 0                           # main_grad: made up front; DDP: gradients live in
    if c.zero_stage == 1:                                           # buckets across steps
        grads = before = 4 * trainable                 # one flat buffer, allocated up front
    if c.zero_stage == 2:                              # full gradients of the buckets in flight
        grads = before = grads + min(4 * trainable, 2 * BUCKET_BYTES)
    return weights, grads, optimizer, before, 0


def _dense_build(s: GPTShape, c: Candidate) -> tuple[int, int]:
    """QLoRA's build where host and device are one memory (the CPU): (the dense model with its
    adapters, a layer's quantization temporaries (about 21 bytes per value of the first
    block's qkv weight in fp32, 29 from bf16: fitted to the simulated build))."""
    dense = 2 if _bf16(c) else 4
    return (dense * (s.n_params + s.lora_params(c.lora_rank)),
            (29 if dense == 2 else 21) * s.lora_linear_weights()[0])


def predict_memory(shape: GPTShape, cand: Candidate, *, world_size: int = 1,
                   device_type: str = "cpu") -> Prediction:
    """Predicted peak bytes per rank of `cand`'s training step, by kind (see the module doc)."""
    s, c = shape, cand
    c.check_depth(s.depth)
    P, G, O, G_before, host = _states(s, c, world_size)
    A, per_block, checkpoint, cached = _activations(s, c, device_type)
    N, V, C = c.micro_batch * s.seq_len, s.vocab, s.width
    low = c.precision != "fp32"
    logits = N * V * (2 + 4 if low else 4)             # the logits (and their fp32 copy)
    loss_grads = 8 * N * V                             # the loss's two fp32 (N, vocab) gradients
    if c.chunked_loss:                                 # one slice's at a time, and the hidden
        logits = logits // c.chunked_loss              # (its recompute, log-softmax, gradients)
        loss_grads = (16 + 2 * low) * N * V // c.chunked_loss + 4 * N * C
    host_acts = 0
    if c.activation_offload and not c.chunked_loss:    # the log-softmax back from the host
        loss_grads += 4 * N * V
    if c.activation_offload:                           # saved tensors wait on the host; backward
        host_acts, A = A + 4 * N * V * (not c.chunked_loss), 0   # a segment's back at a time;
        # the log-softmax is saved twice (log_softmax, nll_loss) and crosses twice
        early_acts_back = per_block * (_segment(s.depth, c.segments)[0] if c.segments > 1 else 1)
    # backward through the first segment (or the first block, without checkpointing): the later
    # blocks' gradients exist, the first segment's activations are back, and its own gradients
    # flow: the block input's and the (N, 4C) MLP one's, 5·N·C fp32 values
    first = _segment(s.depth, c.segments)[0] if c.segments > 1 else 1
    block_share = 0 if c.lora_rank else s.block_params() / s.n_params
    lora_share = 1 / s.depth if c.lora_rank else 0
    embedded = s.vocab + (0 if s.llama else s.seq_len)   # token (and position) embeddings
    early = int(G * (1 - first * (block_share + lora_share) - embedded * C
                     / s.n_params * (not c.lora_rank)))
    early_acts = first * per_block + (checkpoint if c.segments > 1 else 0)
    if c.activation_offload:
        early_acts = early_acts_back
    step_temp = G if c.precision == "mixed" and not c.offload else 0
    moving = G if c.offload else 0                     # a gradient on its way to the host
    phases = [("forward", G_before, A, logits + cached),
              ("backward", G_before + moving, A, loss_grads),
              ("first block's backward", max(G_before, early) + moving, early_acts,
               4 * N * (C + (2 * s.intermediate if s.llama else 4 * C))),
              ("backward end", G, 0, 0),
              # one base weight dequantized (about 9 bytes per value of the largest in flight,
              # and a block's (N, C) fp32 gradient: fitted to the simulated step)
              *([("QLoRA's dequantization", G_before, A, 9 * max(s.lora_linear_weights())
                  + 4 * N * C)] if c.nf4_base else []),

              ("optimizer", G, 0, step_temp)]
    phase, grads, acts, temp = max(phases, key=lambda p: p[1] + p[2] + p[3])
    disk = 12 * (s.lora_params(c.lora_rank) if c.lora_rank else s.n_params) if c.nvme else 0
    step = Prediction(P, grads, O, acts, temp, phase, host + host_acts, disk)
    if c.nf4_base and device_type == "cpu":            # QLoRA's build, in the same memory
        weights, quantizing = _dense_build(s, c)
        if weights + quantizing > step.peak:
            return Prediction(weights, 0, 0, 0, quantizing, "build (the dense base)", host)
    return step


def predict_seconds(shape: GPTShape, cand: Candidate, cost: CostModel, *,
                    world_size: int = 1) -> dict[str, float]:
    """Predicted seconds of one optimizer step by part: compute, recompute, overhead,
    optimizer, dequantize (QLoRA), offload, communication (and their "total")."""
    s, c = shape, cand
    tokens = c.micro_batch * c.accumulation * s.seq_len            # this rank's, per step
    C, L, V, T = s.width, s.depth, s.vocab, s.seq_len
    block = 2 * s.block_matmul_params() + 4 * T * C                # forward FLOPs per token
    forward = tokens * (L * block + 2 * C * V)
    backward = forward if c.lora_rank else 2 * forward             # frozen: no weight gradients
    recompute = tokens * block * (L // c.segments) * (c.segments - 1)
    if c.chunked_loss:                                 # the head's matmul again in backward
        recompute += tokens * 2 * C * V
    speed = cost.flops * (cost.half_speedup if c.precision != "fp32" else 1.0)
    trainable = s.lora_params(c.lora_rank) if c.lora_rank else s.n_params
    weight_bytes = 2 if _bf16(c) else 4
    shard = trainable / world_size if c.zero_stage else trainable
    ring = (world_size - 1) / world_size
    sent = {0: 2 * ring * 4 * trainable, 1: 2 * ring * 4 * trainable,
            2: (c.accumulation + 1) * ring * 4 * trainable,
            3: c.accumulation * ring * trainable * (4 + 2 * (2 if c.precision == "autocast"
                                                             else 4))}[c.zero_stage]
    optimizer_bytes = ADAM8BIT_BYTES if c.state_bits == 8 else 32
    dequantized = 0                                    # QLoRA: base values dequantized
    if c.nf4_base:                                     # forward, backward, and recompute
        per_pass = sum(s.lora_linear_weights())
        dequantized = c.accumulation * per_pass * (2 * L + (L // c.segments) * (c.segments - 1))
    parts = {
        "compute": (forward + backward) / speed,
        "recompute": recompute / speed,
        "overhead": c.accumulation * (L + 2) * cost.layer_seconds,
        # AdamW reads and writes ~32 B per parameter (weight, gradient, two moments) through
        # the memory it runs in: the host's when offloaded, the device's otherwise
        "optimizer": optimizer_bytes * shard / (cost.host_memory_bandwidth if c.offload
                                                else cost.memory_bandwidth),
        "dequantize": DEQUANTIZE_BYTES * dequantized / cost.memory_bandwidth,
        "offload": (c.accumulation * weight_bytes * trainable + weight_bytes * trainable)
        / cost.host_bandwidth if c.offload else 0.0,
        "communication": sent / cost.network_bandwidth if world_size > 1 else 0.0,
        # saved activations down in forward and up in backward, not overlapped (our hooks copy
        # on the compute stream); the NVMe tier reads and writes 12 B per parameter each step
        "activation offload": (2 * c.accumulation * _activations(s, c, "cuda")[0]
                               / cost.host_bandwidth if c.activation_offload else 0.0),
        "disk": (2 * 12 * trainable / cost.disk_bandwidth + 3 * s.trainable_tensors(
            c.lora_rank) * cost.disk_sync_seconds) if c.nvme else 0.0,
    }
    parts["total"] = sum(parts.values())
    return parts
