"""Predicted peak memory of what each chapter runs on the device, from `companion.estimate`.

`companion.device.sizes` sizes every chapter's experiments for the GPU at hand; the predictions
here are what those sizes are checked against (tests/test_device.py holds each one under 60% of
its GPU class's memory) and what the recorder writes beside its measurements. Each prediction
follows the notebook's GPU code: what lives at once at the memory-heaviest moment of the chapter,
counted as the estimator counts it (weights, gradients, optimizer state, saved activations) plus
the few large temporaries named in each function.

Example:
    >>> from companion.device import sizes
    >>> peaks = predicted_peaks(sizes("cuda"))
    >>> max(peaks["04"].values()) / 1e9              # GB at the peak of chapter 04's largest run

Simplified vs measurement: upper bounds where a chapter keeps earlier models alive, and no
allocator rounding or fragmentation (the 40% left free is for those, and for the CUDA context).
"""
from __future__ import annotations

import math

import types

from companion import estimate as E

__all__ = ["predicted_peaks", "gpt_step_bytes", "mlp_step_bytes", "mlp_step_peak"]


def gpt_step_bytes(s, *, batch: int, depth: int, width: int | None = None,
                   optimizer: str = "adam", precision: str = "fp32") -> int:
    """Peak bytes of a training step of `companion.models.GPT` (vocab, seq_len, heads from `s`):
    model states, saved activations, and the two (B·T, vocab) gradients that live at once early
    in backward (of the log-softmax's output and of the logits), 4 bytes each value."""
    width = s.gpt_width if width is None else width
    n = E.gpt_params(s.vocab, s.seq_len, width, depth)
    states = E.model_states(n, optimizer=optimizer, precision=precision).total
    acts = E.gpt_activations(batch, s.seq_len, width, depth, s.gpt_heads, s.vocab,
                             precision=precision)
    return states + acts + 2 * 4 * batch * s.seq_len * s.vocab


def mlp_step_bytes(d_in: int, width: int, depth: int, d_out: int, *, batch: int,
                   optimizer: str = "adam") -> int:
    """Peak bytes of a training step of `companion.models.MLP`: model states, saved activations,
    the input batch and two (B, width) gradients flowing back at once."""
    n = E.mlp_params(d_in, width, depth, d_out)
    states = E.model_states(n, optimizer=optimizer).total
    return states + E.mlp_activations(batch, width, depth, d_out) + 4 * batch * (d_in + 2 * width)


def mlp_step_peak(d_in: int, width: int, depth: int, d_out: int, *, batch: int,
                  device_type: str) -> int:
    """The peak of a first training step (fp32 Adam, torch's default implementation for the
    device) of `companion.models.MLP`, where it falls: in backward, weights, gradients, saved
    activations and two (B, width) gradients flowing back; in the step, the model states and
    Adam's temporaries, two of the largest weight in the CPU's per-tensor loop, 4 bytes per
    parameter with foreach (CUDA's default). On CUDA every tensor is also rounded up to the
    allocator's 512-byte blocks (`companion.allocator.block_bytes`). cuBLAS's workspace is not
    in it: measure after a warm-up matmul (its size: `allocator.cublas_workspace`).
    """
    from companion.allocator import block_bytes
    shapes = [(width, d_in), (width,)] + [(width, width), (width,)] * (depth - 1) + \
        [(d_out, width), (d_out,)]
    sizes = [4 * math.prod(shape) for shape in shapes]
    if device_type == "cuda":
        sizes = [block_bytes(n) for n in sizes]
    weights = sum(sizes)
    temporaries = weights if device_type == "cuda" else 2 * max(sizes)
    backward = 2 * weights + E.mlp_activations(batch, width, depth, d_out) + 2 * batch * width * 4
    return max(backward, 4 * weights + temporaries)       # W + G + A (two moments) + T


def predicted_peaks(s) -> dict[str, dict[str, int]]:
    """Bytes at the peak of each memory-heavy run of each chapter at sizes `s` (a `Sizes`), by
    chapter ("00", ...) and run. Reads every field of `s` that sizes device memory."""
    return {"00": _anatomy(s), "01": _gradient_descent(s), "02": _float_formats(s),
            "03": _accumulation(s), "04": _checkpointing(s), "05": _mixed_precision(s),
            "06": _data_parallel(s), "07": _zero(s), "08": _offload(s), "09": _capstone(s),
            "10": _attention(s), "11": _fewer_bits(s), "12": _activations_budget(s),
            "13": _parallelisms(s)}


def _parallelisms(s) -> dict[str, int]:
    # Per GPU, the heaviest run of each kind (the references run on the CPU, in the host's memory).
    # The block whole on one rank (t = 1, `record.alone.block_shard_alone`; a split rank holds
    # less): fp32 weights and gradients 2·4(12h² + 13h), the bytes kept for backward
    # (`tensor_parallel.tp_activation_bytes`, about 16·sbh + a·s²·b values), and in backward two
    # (b, a, s, s) gradients (of the softmax and of the scores) and four (b, s, 4h) ones at once.
    b, t, h, a = s.tp_batch, s.tp_seq, s.tp_width, s.tp_heads
    block = (8 * (12 * h * h + 13 * h) + 4 * (16 * b * t * h + a * t * t * b + 4 * b * t)
             + t * t + 2 * 4 * b * a * t * t + 4 * 4 * b * t * 4 * h)
    # One ring rank of 2 alone (`ring_shard_alone`; more ranks, or zigzag's two chunks, make the
    # block smaller): at most six fp32 (B, H, T/2, T/2) blocks at once in backward (scores,
    # masked, less the log-sum-exp, P, dO·Vᵀ, dS; about four measured on the CPU), and q, k, v,
    # dO, the output and the three gradients, (B, H, T/2, d) each. Full attention over the whole
    # T by SDPA's memory-efficient kernel (fp32 on CUDA): the same eight (B, H, T, d) and the
    # log-sum-exp, no (T, T) tensor; every rank of `attention_step_seconds` runs it.
    rows = s.cp_batch * s.cp_heads
    half = s.cp_len // 2
    ring = 6 * rows * half * half * 4 + 8 * rows * half * s.cp_head_dim * 4
    full = 8 * rows * s.cp_len * s.cp_head_dim * 4 + rows * s.cp_len * 4
    # The pipeline's first stage on 2 ranks under GPipe (1F1B holds fewer micro-batches): its
    # half of the MLP's weights and gradients, and every micro-batch's saved inputs and ReLU
    # outputs, two (rows, width) per layer and the input.
    w, layers = s.pp_width, s.pp_depth // 2
    stage = (8 * layers * (w * w + w)
             + s.pp_micro_batches * s.pp_batch * w * 4 * (2 * layers + 1))
    return {"block, whole on one rank": block, "ring attention, one rank of 2": ring,
            "full attention (sdpa) over T": full, "pipeline stage 0, gpipe on 2 ranks": stage}


def _activations_budget(s) -> dict[str, int]:
    # The GPT block with every output kept (its most): six fp32 (B, H, T, T) tensors (scores,
    # scaled, masked, softmax, and in backward two gradients) and some forty (B, T, C) ones. The
    # plain loss: logits, log-softmax and their gradient, N·V each, and the head with its
    # gradient. The plain MLP: fc's and GELU's outputs and their gradients, four (N, 4C), and a
    # few (N, C).
    tt = 6 * s.remat_batch * s.gpt_heads * s.seq_len ** 2 * 4
    btc = 40 * s.remat_batch * s.seq_len * s.gpt_width * 4
    return {"block, every output kept": tt + btc,
            "plain loss": 3 * s.loss_tokens * s.loss_vocab * 4 + 2 * s.loss_vocab * s.gpt_width * 4,
            "plain mlp": (4 * 4 + 4) * s.tiled_tokens * s.gpt_width * 4,
            # where_is_the_peak's many-token GPT, plain: some twenty (2, 4T, C/4) per block
            "offload, many tokens": 20 * s.offload_depth_long * 2 * 4 * s.seq_len
            * (s.gpt_width // 4) * 4}


def _fewer_bits(s) -> dict[str, int]:
    # One GPT of chapter 11 at a time, fp32 Adam (the layouts hold less), at train_curve's batch;
    # the layouts' table measures the same GPT at batch 4.
    return {"gpt training step": gpt_step_bytes(s, batch=min(8, s.amp_gpt_batch),
                                                depth=s.gpt_depth)}


def _anatomy(s) -> dict[str, int]:
    return {"mlp training step": mlp_step_bytes(s.width, s.width, s.depth, 10, batch=s.batch),
            "gpt training step": gpt_step_bytes(s, batch=s.anatomy_gpt_batch, depth=s.gpt_depth)}


def _gradient_descent(s) -> dict[str, int]:
    # 1. the regression data (n_examples x 8, and y); 2. the 3-layer MLP of chapter 01's last
    # section, its activations at the largest batch it measures, 16·batch.
    data = 4 * s.n_examples * (8 + 1)
    mlp = mlp_step_bytes(64, s.width, 3, 10, batch=16 * s.batch, optimizer="sgd")
    return {"activations against the batch": data + mlp}


def _float_formats(s) -> dict[str, int]:
    # The MLP trained with Adam (12 B/param once its gradients are freed), its fp32 copy trained
    # one step (16) and its bf16 copy with fp32 masters (2 + 2 + 4 + 4 + 8 = 20), alive at once,
    # plus the data set and one hidden layer's output over all of it (the rounding report).
    n = E.mlp_params(32, s.width, s.depth - 1, 10)
    data = 4 * s.n_examples * (32 + 1 + 2 * s.width)
    acts = E.mlp_activations(s.batch, s.width, s.depth - 1, 10)
    return {"three copies of the mlp": 48 * n + data + acts}


def _accumulation(s) -> dict[str, int]:
    # The largest batch whose peak chapter 03 measures is 64·batch; the data set is that size.
    largest = 64 * s.batch
    # The token-mean demo: the course GPT's forward and backward over its three micro-batches at
    # once (weights, gradients, no optimizer) and two flat copies of its gradient, while the MLP
    # and the Adam state of the chapter's first cells are still alive.
    n = E.gpt_params(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth)
    mlp = E.model_states(E.mlp_params(32, s.width, s.depth, 10), optimizer="adam").total
    tokens = gpt_step_bytes(s, batch=3 * s.token_rows, depth=s.gpt_depth, optimizer="sgd")
    return {"largest batch step": mlp_step_bytes(32, s.width, s.depth, 10, batch=largest)
            + 4 * largest * (32 + 2),
            "token-mean micro-batches (the mlp alive)": mlp + tokens + 2 * 4 * n}


def _checkpointing(s) -> dict[str, int]:
    # The deep MLP (weights and gradients, no optimizer) stays alive while the GPT stack runs.
    mlp = 8 * E.mlp_params(s.width, s.width, s.ckpt_depth, 10)
    mlp_step = mlp + 4 * s.ckpt_batch * s.width * (s.ckpt_depth + 4)
    stack = gpt_step_bytes(s, batch=s.ckpt_gpt_batch, depth=s.ckpt_gpt_depth, optimizer="sgd")
    long_t = 4 * s.seq_len                          # the attention sweep's longest sequence
    block = 2 * E.gpt_activations(1, long_t, s.gpt_width, 1, s.gpt_heads, 1)
    return {"deep mlp, no checkpointing": mlp_step,
            "gpt stack, no checkpointing (deep mlp alive)": mlp + stack + block}


def _mixed_precision(s) -> dict[str, int]:
    n = E.gpt_params(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth)
    fp32 = gpt_step_bytes(s, batch=s.amp_gpt_batch, depth=s.gpt_depth)
    # bf16 weights and gradients, fp32 masters, their fp32 gradients and Adam: 2+2+4+4+8 = 20.
    master = 20 * n + E.gpt_activations(s.amp_gpt_batch, s.seq_len, s.gpt_width, s.gpt_depth,
                                        s.gpt_heads, s.vocab, precision="bf16") \
        + 2 * 2 * s.amp_gpt_batch * s.seq_len * s.vocab
    matmul = (2 * 4 + 2 * 2 + 4) * s.amp_matmul ** 2       # a, b fp32; 16-bit copies; product
    mlp = mlp_step_bytes(32, s.amp_width, s.amp_depth, 10, batch=s.amp_batch) + 4 * 16384 * 33
    return {"gpt two steps, fp32": fp32, "gpt two steps, fp32 master weights": master,
            "timed gpt step and matmul": fp32 + matmul, "mlp training": mlp}


def _data_parallel(s) -> dict[str, int]:
    # DataParallel on one device: the master module and 4 replicas with their gradients, the
    # global batch of 4·batch rows and its activations; a DDP rank: weights, gradients, buckets.
    n = s.depth // 2 * (s.width ** 2 + s.width)
    rows = 4 * s.batch
    dp = 5 * 8 * n + 4 * n + 4 * rows * s.width * (2 + 2 * (s.depth // 2))
    ddp = 12 * n + 4 * s.batch * s.width * (2 + 2 * (s.depth // 2))
    n_buckets = s.ddp_depth * (s.ddp_width ** 2 + s.ddp_width)      # gloo ranks, on the CPU
    buckets = 12 * n_buckets + 4 * s.ddp_batch * s.ddp_width * (2 + 2 * s.ddp_depth)
    return {"data parallel, 4 replicas on one device": dp, "ddp step on one rank": ddp,
            "bucket experiment (per gloo rank, host memory)": buckets}


def _zero(s) -> dict[str, int]:
    # One rank holds everything when there is one GPU: Adam's 16 B/param plus a full gathered or
    # flat copy (24 B/param in all); the FSDP comparison keeps ours and FSDP2 alive (36 B/param).
    n = E.mlp_params(s.zero_width, s.zero_width, s.zero_depth, 16)
    acts = 4 * s.zero_batch * s.zero_width * (2 * s.zero_depth + 1)
    balance = 2 * 16 * (s.zero_vocab * 64 + 64 * 64 + 64 + 64 * 8 + 8)
    return {"stages 0-3 on one rank": 24 * n + acts, "ours and fsdp2 on one rank": 36 * n + acts,
            "balance demo": balance}


def _offload(s) -> dict[str, int]:
    # The plain AdamW model (16 B/param) and the offloaded one (weights and a gradient in flight:
    # 8) timed side by side, then kept while the course GPT's activations are offloaded.
    n = E.gpt_params(s.vocab, s.seq_len, s.offload_width, s.offload_depth)
    step = E.gpt_activations(s.offload_batch, s.seq_len, s.offload_width, s.offload_depth,
                             s.gpt_heads, s.vocab) + 8 * s.offload_batch * s.seq_len * s.vocab
    models = 16 * n + 8 * n + 8 * n
    act = gpt_step_bytes(s, batch=s.act_offload_batch, depth=s.gpt_depth, optimizer="sgd")
    return {"plain and offloaded adamw": models + step, "activation offload": models + act}


def _capstone(s) -> dict[str, int]:
    # The unconstrained fp32 AdamW run the learner's plan is compared with (the whole batch at
    # once), and the plan itself, which trains under the budget.
    return {"unconstrained gpt step": gpt_step_bytes(s, batch=s.cap_batch, depth=s.cap_depth,
                                                     width=s.cap_width),
            "plan under the budget": s.cap_budget}


def _attention(s) -> dict[str, int]:
    # The written-out attention at its longest T, bounded by six fp32 (B, H, T, T) tensors at
    # once (scores, probabilities, mask, and in backward their gradients), plus q, k, v, o and
    # their gradients; our kernel at its longest T holds those eight and fp32 accumulators. The
    # GPT step at its longest sequence (no optimizer), with the other model's weights and
    # gradients still alive.
    rows = s.attn_batch * s.attn_heads
    qkvo = lambda T: 8 * rows * T * s.attn_head_dim * 4
    long = types.SimpleNamespace(vocab=s.vocab, seq_len=s.attn_gpt_len, gpt_width=s.gpt_width,
                                 gpt_heads=s.gpt_heads)
    other = 8 * E.gpt_params(s.vocab, s.attn_gpt_len, s.gpt_width, s.gpt_depth)
    return {"written-out attention": 6 * rows * s.attn_naive_max_len ** 2 * 4
            + qkvo(s.attn_naive_max_len),
            "flashattention": 2 * qkvo(s.attn_max_len),
            "gpt step, written-out attention": other + gpt_step_bytes(
                long, batch=s.attn_gpt_batch, depth=s.gpt_depth, optimizer="sgd")}
