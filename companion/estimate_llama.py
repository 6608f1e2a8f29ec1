"""Predict a Llama's memory before running: its parameters and the activations its step saves.

The formulas of `companion.estimate` for `companion.models.Llama` (RMSNorm, rotary positions,
grouped-query attention through SDPA, SwiGLU): `llama_params` counts the weights, and
`llama_activations` the bytes `Llama.loss` saves for backward, operator by operator, checked
to the byte against `companion.memory.track` on the CPU (tests/test_estimate.py). Both are
re-exported by `companion.estimate`.

Example:
    >>> llama_params(128256, 4096, 32, 32, kv_heads=8, intermediate=14336)   # Llama 3 8B
    8030261248
    >>> llama_activations(1, 8192, 4096, 32, 32, 128256, kv_heads=8, intermediate=14336,
    ...                   precision="bf16") / 2**30                          # 55.3 GiB

Simplified vs measurement: as in `companion.estimate`, temporaries that live inside one operator
or one backward step are not counted (the peak of a step adds the largest of those).
"""
from __future__ import annotations

__all__ = ["llama_params", "llama_activations"]

_VALUE_BYTES = {"fp32": 4, "mixed": 2, "bf16": 2, "fp16": 2}   # the model's dtype


def llama_params(vocab: int, width: int, depth: int, heads: int, *, kv_heads: int,
                 intermediate: int, tied: bool = False, qkv_bias: bool = False,
                 o_bias: bool = False, mlp_bias: bool = False) -> int:
    """Parameters of `companion.models.Llama`, with C = width, d = width // heads, I =
    intermediate, V = vocab, L = depth:

        V·C + L·(2·C + C·(heads·d) + 2·C·(kv_heads·d) + (heads·d)·C + 3·C·I) + C + V·C

    (embedding; per block two RMSNorms, q, k and v, o, gate, up and down; the final RMSNorm; the
    head, left out when `tied` to the embedding). `qkv_bias` (Qwen2) adds heads·d + 2·kv_heads·d
    per block, `o_bias` C (o's output) and `mlp_bias` 2·I + C (gate, up, down): transformers'
    LlamaAttention gives q, k, v and o biases with `attention_bias`, LlamaMLP its three with
    `mlp_bias` (transformers/models/llama/modeling_llama.py, 5.25)."""
    C, I, d = width, intermediate, width // heads
    q, kv = heads * d, kv_heads * d
    block = 2 * C + C * q + 2 * C * kv + q * C + 3 * C * I + (q + 2 * kv if qkv_bias else 0)
    block += (C if o_bias else 0) + (2 * I + C if mlp_bias else 0)
    return vocab * C + depth * block + C + (0 if tied else C * vocab)


def llama_activations(batch: int, seq_len: int, width: int, depth: int, heads: int, vocab: int,
                      *, kv_heads: int, intermediate: int, precision: str = "fp32",
                      device_type: str = "cpu") -> int:
    """Bytes `Llama.loss` saves for backward, beyond its input tokens and targets, for a model
    built in `precision`'s dtype ("fp32"; "bf16", "fp16" or "mixed": 16-bit, e = 2 bytes).

    With N = batch·seq_len tokens, C = width, Q = heads·d and K = kv_heads·d (d = C // heads),
    I = intermediate, per block:
      each RMSNorm on the CPU (torch's composite rms_norm, which computes in fp32):
              4·N·C  its input in fp32 (pow and x·rstd save it; in 16 bits an fp32 copy, and the
                     residual stream itself is then saved by nothing),
              4·N    rstd, one fp32 value per token,
              4·N·C  x·rstd in fp32 (the product with the weight saves it),
              e·N·C  its output, cast back to e bytes (q, k and v, or gate and up, save it);
              on CUDA (`_fused_rms_norm`, whose backward saves input and rstd): e·N·C input,
              4·N rstd, e·N·C output;
      attention: e·N·(Q + K) q and k after rotation, e·N·K v (SDPA saves the three; the Linears'
              outputs q and k are freed: rotation saves only the cos and sin buffers), e·N·Q
              SDPA's output (o_proj's input is a view of it) and its fp32 log-sum-exp,
              4·B·heads·T (no (T, T) tensor; k and v stay kv_heads wide with enable_gqa);
      SwiGLU: 4·e·N·I: gate's output (silu's input), silu's output and up's output (the product
              saves both), and the product (down's input).
    Outside the blocks: the final RMSNorm (as above), the log-softmax of the logits (e·N·vocab;
    the logits themselves are freed) and the loss's one-value total weight (e). The embedding
    saves only the token ids.

    Checked to the byte against the tracker on the CPU in fp32 and bf16. `device_type="cuda"`
    changes only the RMSNorm terms, read off torch 2.13's dispatch, not measured here; on CUDA
    SDPA picks its kernel by dtype (the flash kernels take 16 bits only), so fp32 with
    kv_heads < heads may fall back to the math kernel, which keeps (T, T) weights: not counted.
    Simplified vs Hugging Face's Llama: its RMSNorm casts x·rstd to e bytes before the weight
    multiplies it (e·N·C where this model keeps 4·N·C), and it computes cos and sin in each
    forward, 2·T·d values that the blocks' rotations save. The planner's `micro_step` upcasts
    16-bit logits for the loss: its log-softmax is 4·N·vocab bytes, not e·N·vocab."""
    if precision not in _VALUE_BYTES:
        raise ValueError(f"precision must be one of {', '.join(_VALUE_BYTES)} (the dtype the "
                         f"model is built in), got {precision!r}; for autocast, simulate the "
                         "step (companion.plan.simulate)")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    e, N, C, I = _VALUE_BYTES[precision], batch * seq_len, width, intermediate
    d = width // heads
    Q, K = heads * d, kv_heads * d
    if device_type == "cpu":
        norm = 4 * N * C + 4 * N + 4 * N * C + e * N * C       # fp32 input, rstd, x·rstd, output
    else:
        norm = e * N * C + 4 * N + e * N * C                   # input, rstd, output
    attention = (e * N * (Q + K)                               # q, k rotated
                 + e * N * K                                   # v
                 + e * N * Q                                   # SDPA's output, o_proj's input
                 + 4 * batch * heads * seq_len)                # log-sum-exp, fp32
    swiglu = 4 * e * N * I                                     # gate, silu(gate), up, product
    block = 2 * norm + attention + swiglu
    return depth * block + norm + e * N * vocab + e            # final norm, log-softmax, weight
