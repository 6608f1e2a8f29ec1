"""Predict memory before running: model states per parameter, activations of the course's models.

Training memory has two parts. *Model states* (weights, gradients, optimizer state) scale with the
parameter count and not with the batch. *Activations* (tensors the forward pass saves for backward)
scale with batch × sequence length and not with the optimizer. `model_states` gives the first,
`mlp_activations` and `gpt_activations` the second for `companion.models.MLP` and `GPT`
(`transformer_activations`: the same in Korthikanti et al.'s general per-layer form), and
`training_memory` gives them by kind, which is what the chapter 00 calculator draws, and
`training_peak` what of them is alive at once at the step's peak. These formulas are for the
course's models; for any other `nn.Module` the step is simulated on fake tensors instead
(`companion.plan.anymodel.simulate_model`, `python -m companion plan --model module:factory`).
`llama_params` and `llama_activations` (from `companion.estimate_llama`) count the course's
`companion.models.Llama`. `offload_placement` (from `companion.estimate_offload`) splits model
states between device, host and disk under offload, in DeepSpeed's estimator conventions or the
course's measured layout.

Example:
    >>> model_states(1_000_000, optimizer="adam", precision="mixed").total   # 16 bytes/param
    16000000
    >>> gpt_activations(batch=8, seq_len=64, width=128, depth=4, heads=4, vocab=256)

Simplified vs measurement: the formulas count what PyTorch saves for backward in eager mode on these
models; temporaries that live only inside one operator or one backward step are not included (the
peak of a step adds the largest of those to states + activations).
"""
from __future__ import annotations

import math

import dataclasses
import numbers
import operator

from companion.estimate_llama import llama_activations, llama_params
from companion.estimate_offload import (OFFLOAD_LADDER, Placement, choose_offload,
                                        offload_placement, rung_placement)

__all__ = ["ModelStates", "model_states", "bytes_per_element", "mlp_params", "gpt_params",
           "mlp_activations", "gpt_activations", "transformer_layer_activations",
           "transformer_activations", "gpt_shape", "training_memory", "training_peak", "OPTIMIZERS",
           "PRECISIONS", "Placement", "offload_placement", "OFFLOAD_LADDER", "choose_offload",
           "rung_placement",
           "nf4_bytes", "llama_params", "llama_activations"]

OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
PRECISIONS = ("fp32", "mixed", "bf16", "fp16", "autocast")
_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}   # tensors of state per parameter


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes of model states on one device: parameters, gradients, optimizer state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_states(n_params: int | float, *, optimizer: str = "adam", precision: str = "fp32",
                 fp32_grads: bool = False, fp32_grad_buffer: bool = False, zero_stage: int = 0,
                 world_size: int = 1, state_bits: int = 32,
                 compensation: str = "none") -> ModelStates:
    """Bytes per device for the weights, gradients and optimizer state of `n_params` parameters.

    Per parameter, following the ZeRO paper (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
    Toward Training Trillion Parameter Models", section 3.1):
      - "fp32":  4 (weights) + 4 (grads) + 4 per state tensor (Adam: m and v, 8)  -> Adam 16.
      - "mixed": 2 (16-bit weights) + 2 (16-bit grads) + K, where K holds the fp32 master weights
        (4) and fp32 states: K = 12 for Adam, 8 for SGD with momentum, 4 for plain SGD -> Adam 16.
        Mixed precision does not shrink model states; it shrinks activations.
      - "bf16"/"fp16": pure 16-bit training, states in 16-bit too: 2 + 2 + 2 per state -> Adam 8.
      - "autocast": torch.amp, fp32 weights, gradients and states as in "fp32" -> Adam 16. The
        16-bit weight copies autocast makes in forward are saved for backward: activations.
    `fp32_grads=True` keeps gradients in fp32 (4 bytes) instead of 16-bit: mixed Adam becomes 18
    bytes, Megatron-LM's bf16 default (its fp32 `main_grad`, the bf16 `.grad` freed) and the
    figure in Hugging Face's "Model training anatomy" (6 bytes of weights counting the fp32 copy,
    4 of fp32 gradients, 8 of Adam state). `fp32_grad_buffer=True` keeps the 16-bit gradients
    *and* an fp32 buffer they are accumulated into (2 + 4 bytes, filed under grads): mixed Adam
    becomes 20 bytes, DeepSpeed's `BF16_Optimizer` and the Ultra-Scale Playbook's figure
    (2 + 2 + 4 + 8 + 4). "mixed" alone, 16, is the ZeRO paper's count (written for fp16).
    `amp.MasterWeights(grads="16-bit" | "main_grad" | "both")` builds the three.
    `n_params` may be a float that holds a whole number (7.5e9); 7.5e9 + 0.5 is an error.

    `state_bits=8` stores each optimizer state tensor as block-wise 8-bit codes (Dettmers et al.,
    2022; `companion.lowbit.Adam8bit`): 1 byte per value plus a 4-byte absmax per block of 256,
    so fp32 Adam holds about 10 bytes (4 + 4 + 2.03), pure bf16 about 6. `compensation="kahan"`
    (pure 16-bit precisions only) adds a 16-bit compensation buffer, 2 bytes, under optimizer:
    pure bf16 Adam becomes 10 (`companion.lowbit.BF16AdamW`). A frozen base in NF4 is
    `nf4_bytes`.

    ZeRO (same paper, section 5) shards over `world_size` data-parallel ranks: stage 1 the
    optimizer state (which includes mixed precision's master weights), stage 2 also the gradients,
    stage 3 also the weights. A shard is ceil(n_params / world_size) parameters.
    """
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("precision", precision, PRECISIONS)
    n_params = _whole_count(n_params)
    if fp32_grad_buffer and (fp32_grads or precision in ("fp32", "autocast")):
        raise ValueError("fp32_grad_buffer adds an fp32 copy of 16-bit gradients: use it with "
                         "precision 'mixed', 'bf16' or 'fp16' and without fp32_grads")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if state_bits not in (32, 8):
        raise ValueError(f"state_bits is 32 (states in the weights' format) or 8 (block-wise "
                         f"8-bit codes), got {state_bits!r}")
    if compensation not in ("none", "kahan") or (compensation == "kahan"
                                                 and precision not in ("bf16", "fp16")):
        raise ValueError(f"compensation is 'none', or 'kahan' with precision 'bf16' or 'fp16' "
                         f"(a 16-bit buffer beside 16-bit weights), got {compensation!r} with "
                         f"{precision!r}")
    weight = 4 if precision in ("fp32", "autocast") else 2
    grad = 4 if (precision in ("fp32", "autocast") or fp32_grads) else 2 + 4 * fp32_grad_buffer
    per_state = {32: 4 if precision == "mixed" else weight, 8: 1 + 4 / 256}[state_bits]
    state = _STATES[optimizer] * per_state + 4 * (precision == "mixed") \
        + 2 * (compensation == "kahan")                              # fp32 master, Kahan buffer
    shard = -(-n_params // world_size)                               # ceil
    count = [shard if zero_stage >= s else n_params for s in (3, 2, 1)]   # params, grads, optimizer
    return ModelStates(params=weight * count[0], grads=grad * count[1],
                       optimizer=math.ceil(state * count[2]))


def nf4_bytes(n_params: int | float, *, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes of a frozen weight of `n_params` values in NF4 (QLoRA; `companion.lowbit.nf4`):
    half a byte per value, plus a 4-byte absmax per block, or with double quantization a 1-byte
    absmax code per block and 4 bytes per 256 of them, plus their 4-byte mean. About 0.56 bytes
    per value (4.5 bits), 0.52 with double quantization (4.127 bits)."""
    n = _whole_count(n_params)
    blocks = -(-n // blocksize)
    scales = blocks + 4 * -(-blocks // 256) + 4 if double_quant else 4 * blocks
    return -(-n // 2) + scales


def bytes_per_element(precision: str) -> int:
    """Bytes of one activation value: 4 in fp32, 2 in 16-bit (and, as a lower bound, under
    "autocast", which keeps some tensors in fp32: see `gpt_activations`)."""
    _check_choice("precision", precision, PRECISIONS)
    return 4 if precision == "fp32" else 2


def mlp_params(d_in: int, width: int, depth: int, d_out: int) -> int:
    """Parameters of `companion.models.MLP`."""
    return d_in * width + width + (depth - 1) * (width * width + width) + width * d_out + d_out


def gpt_params(vocab: int, seq_len: int, width: int, depth: int, *, tied: bool = False) -> int:
    """Parameters of `companion.models.GPT`: embeddings, 12C² + 13C per block, final norm, head
    (C·vocab + vocab; nothing with `tied`, GPT-2's head, which is the token embedding)."""
    C = width
    head = 0 if tied else C * vocab + vocab
    return (vocab + seq_len) * C + depth * (12 * C * C + 13 * C) + 2 * C + head


def mlp_activations(batch: int, width: int, depth: int, d_out: int, *,
                    precision: str = "fp32", d_in: int | None = None) -> int:
    """Bytes `MLP.loss` saves for backward, beyond its input batch and labels (the course's
    `companion.models.MLP` only).

    Each hidden layer keeps its ReLU output (B·width values; the next Linear saves the same
    tensor), the loss keeps the log-softmax of the logits (B·d_out) and a one-value total weight.
    "autocast" (an fp32 model under 16-bit autocast; needs `d_in`): the ReLU outputs in 16 bits,
    plus the 16-bit copies the Linears save: of the input batch (B·d_in) for the first layer's
    weight gradient, and of every weight matrix but the first (whose input needs no gradient);
    the loss is on autocast's fp32 list, so the log-softmax stays fp32."""
    if precision == "autocast":
        if d_in is None:
            raise ValueError("precision='autocast' also counts the 16-bit copy of the input: "
                             "pass d_in")
        weights = (depth - 1) * width * width + width * d_out
        return 2 * batch * d_in + 2 * weights + depth * batch * width * 2 + 4 * batch * d_out + 4
    e = bytes_per_element(precision)
    return depth * batch * width * e + batch * d_out * e + e


def gpt_activations(batch: int, seq_len: int, width: int, depth: int, heads: int, vocab: int, *,
                    precision: str = "fp32", device_type: str = "cpu",
                    attention: str = "written") -> int:
    """Bytes `GPT.loss` saves for backward, beyond its input tokens and targets. For the course's
    `companion.models.GPT` only (other models: `companion.plan.anymodel.simulate_model`).

    Per block, with N = batch·seq_len tokens and C = width (values of e bytes):
      16·N·C: block input and ln1 output (2), q, k, v copies for the batched matmuls (3), the
              attention output into proj (1), the residual into ln2 and its output (2),
              the fc output into GELU (4) and GELU's output into the second Linear (4);
      B·heads·T² softmax weights (the term that grows with the square of the sequence);
      T² bytes of causal mask, and 2 LayerNorms × (mean, rstd) × N values (in the activations'
      dtype on CPU; CUDA's kernels keep these in fp32, 8·N more bytes per LayerNorm in 16-bit).
    Outside the blocks: the final LayerNorm's input and output (2·N·C) and statistics, the
    log-softmax of the logits (N·vocab), the position indices (8·T bytes) and a one-value weight.
    "autocast": see `_gpt_autocast_activations`; `device_type` matters only there.

    `attention="fused"` (SDPA's kernels, `companion.attention`'s FlashAttention: `GPT(attention=
    "sdpa" | "flash" | "flash_triton")`): no softmax weights and no mask, but one fp32
    log-sum-exp per query and head (4·B·heads·T bytes). The linear terms stay 4·N·C around
    attention: the kernel keeps q, k, v as the one qkv output and its own output, which is the
    projection's input (a view), where the written-out products keep contiguous copies of q, k, v
    and the projection its input."""
    _check_choice("attention", attention, ("written", "fused"))
    if precision == "autocast":
        acts = _gpt_autocast_activations(batch, seq_len, width, depth, heads, vocab, device_type)
        softmax = (2 if device_type == "cpu" else 6) * batch * heads * seq_len ** 2
    else:
        e = bytes_per_element(precision)
        N, T = batch * seq_len, seq_len
        block = 16 * N * width * e + batch * heads * T * T * e + T * T + 2 * 2 * N * e
        acts = depth * block + 2 * N * width * e + 2 * N * e + N * vocab * e + 8 * T + e
        softmax = batch * heads * T * T * e
    if attention == "fused":
        acts -= depth * (softmax + seq_len ** 2 - 4 * batch * heads * seq_len)
    return acts


def _gpt_autocast_activations(batch: int, seq_len: int, width: int, depth: int, heads: int,
                              vocab: int, device_type: str) -> int:
    """Bytes `GPT.loss` of an fp32 model saves under 16-bit autocast (bf16 or fp16: 2 bytes).

    What runs in which dtype (read off with `companion.amp.autocast_dtypes`): the matmuls in 16
    bits (autocast's lower-precision list), the cross-entropy in fp32 (its fp32 list); other ops
    in their inputs' dtype. The residual stream stays fp32 (fp32 embeddings + 16-bit branch
    outputs promote to fp32), so LayerNorm inputs and statistics stay fp32. Per block:
      36·N·C: 2 LayerNorm inputs in fp32 (8) and, in 16 bits, the copies of their outputs that
              the Linears save (4), q, k, v (6), the attention output (2), the fc output and
              GELU's output (16);
      24·C² : 16-bit copies of the four weight matrices (12·C² values), made in forward and
              freed in backward, like activations;
      16·N  : LayerNorm means and rstds in fp32; T² bytes of mask;
      softmax weights: 2·B·heads·T² on CPU, where softmax runs in its input's dtype; on CUDA
              softmax is on the fp32 list, so 4·B·heads·T² in fp32 plus the 16-bit copy the
              product with v saves, 6·B·heads·T² (PyTorch's "Autocast Op Reference").
    Outside the blocks: the final LayerNorm (6·N·C + 8·N), the head's weight copy (2·C·vocab), the
    fp32 log-softmax (4·N·vocab), position indices (8·T) and a one-value weight (4)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    N, T, C = batch * seq_len, seq_len, width
    softmax = (2 if device_type == "cpu" else 6) * batch * heads * T * T
    block = 36 * N * C + 24 * C * C + 16 * N + softmax + T * T
    return depth * block + 6 * N * C + 8 * N + 2 * C * vocab + 4 * N * vocab + 8 * T + 4


def transformer_layer_activations(batch: int, seq_len: int, width: int, heads: int, *,
                                  dropout: bool = True, precision: str = "bf16") -> int:
    """Bytes one transformer layer saves for backward, as counted by Korthikanti et al., 2022
    ("Reducing Activation Recomputation in Large Transformer Models", section 4.1), with
    s = seq_len, b = batch, h = width, a = heads, e bytes per value (2 for 16-bit activations, the
    paper's case; `precision="fp32"`: 4) and 1 byte per dropout-mask entry. In 16 bits:

      attention  11·sbh + 5·as²b: the input of the QKV Linear (2sbh), Q and K for QKᵀ (4sbh),
                 softmax's output (2as²b), its dropout mask (as²b) and dropout's output with V for
                 the product (2as²b + 2sbh), the input of the output Linear (2sbh), and the mask of
                 the dropout after it (sbh);
      MLP        19·sbh: the first Linear's input (2sbh), GELU's input (8sbh), the second Linear's
                 input (8sbh), the dropout mask (sbh);
      LayerNorms 4·sbh: the input of each (2sbh).
    Total sbh·(34 + 5·as/h). Without dropout (the course's GPT) the three masks go, and the product
    with V saves softmax's output itself: sbh·(32 + 2·as/h). In general
    sbh·(16e + 2m) + as²b·(e·(1 + m) + m), with m = 1 with dropout, 0 without.

    Simplified vs measurement: LayerNorm's mean and rstd (one value per token each, two per
    LayerNorm) and the causal mask are left out, as in the paper; `companion.models.GPT` in bf16 saves 8·sb + s² bytes more
    per layer (`gpt_activations(..., precision="bf16")` counts them).
    """
    s, b, h, a = seq_len, batch, width, heads
    e, m = _value_bytes(precision), int(bool(dropout))
    return s * b * h * (16 * e + 2 * m) + a * s * s * b * (e * (1 + m) + m)


def transformer_activations(batch: int, seq_len: int, width: int, depth: int, heads: int,
                            vocab: int, *, dropout: bool = True, precision: str = "bf16") -> int:
    """Bytes a GPT saves for backward: `depth` layers of `transformer_layer_activations`, plus
    the embedding dropout's mask (sbh bytes, with dropout), the final LayerNorm's input and the
    head's input (e·sbh each: 2sbh in 16 bits), and the log-softmax of the logits in fp32 (4·sbV:
    the loss runs in fp32, as autocast and Megatron-LM run it). `precision`: "bf16" (or "fp16":
    16-bit activations, the paper's case) or "fp32".

    The last term grows with the vocabulary, not the depth: it dominates small models with large
    vocabularies (GPT-2 small: 4V = 201,028 bytes per token against 34h + 5as = 87,552 per layer),
    and chunked cross-entropy (`companion.chunked_loss`) removes most of it.

    Example (GPT-2 XL's shape, batch 8 of 1024 tokens):
        >>> transformer_activations(8, 1024, 1600, 48, 25, 50257) / 1e9      # 73.4 GB
    """
    s, b, h, e = seq_len, batch, width, _value_bytes(precision)
    layers = depth * transformer_layer_activations(batch, seq_len, width, heads, dropout=dropout,
                                                   precision=precision)
    return layers + s * b * h * bool(dropout) + 2 * e * s * b * h + 4 * s * b * vocab


def _value_bytes(precision: str) -> int:
    _check_choice("precision", precision, ("bf16", "fp16", "fp32"))
    return 4 if precision == "fp32" else 2


def gpt_shape(n_params: int, *, vocab: int = 50257, seq_len: int = 1024) -> dict[str, int]:
    """A GPT-2-like shape with about `n_params` parameters: width = 64·depth, 64-wide heads.
    (GPT-2 small has depth 12, width 768; this rule gives its width exactly.)"""
    best = min(range(1, 200), key=lambda L: abs(gpt_params(vocab, seq_len, 64 * L, L) - n_params))
    return {"width": 64 * best, "depth": best, "heads": best, "vocab": vocab}


def training_memory(n_params: int, *, batch: int, seq_len: int, precision: str = "fp32",
                    optimizer: str = "adam", zero_stage: int = 0, world_size: int = 1,
                    fp32_grads: bool = False, shape=None, device_type: str = "cpu",
                    dropout: bool = False) -> dict[str, int]:
    """Predicted bytes per device by kind for training a GPT of `n_params` parameters.

    Model states come from `model_states`; activations from `gpt_activations` (the course's GPT,
    no dropout) with the per-device batch, or with `dropout=True` from `transformer_activations`
    (Korthikanti et al.'s GPT with dropout; 16-bit activations unless precision is "fp32").
    `shape` is required: a dict of width, depth, heads and vocab (`gpt_shape(n)` makes a
    GPT-2-like one), or a `companion.models.GPT` to read them from. For any other model the
    formulas do not apply: simulate its step (`companion.plan.anymodel.simulate_model`, or
    `python -m companion plan --model module:factory`).
    `device_type` ("cpu" or "cuda") matters only for precision="autocast" (CUDA's fp32 softmax).

    These are the sizes of each kind, not what is alive at once: `training_peak` says that."""
    shape = _read_shape(shape)
    states = model_states(n_params, optimizer=optimizer, precision=precision,
                          fp32_grads=fp32_grads, zero_stage=zero_stage, world_size=world_size)
    if dropout:
        acts = transformer_activations(batch, seq_len, shape["width"], shape["depth"],
                                       shape["heads"], shape["vocab"], dropout=True,
                                       precision="fp32" if precision == "fp32" else "bf16")
    else:
        acts = gpt_activations(batch, seq_len, shape["width"], shape["depth"], shape["heads"],
                               shape["vocab"], precision=precision, device_type=device_type)
    return {"parameters": states.params, "gradients": states.grads,
            "optimizer_state": states.optimizer, "activations": acts}


def training_peak(n_params: int, *, batch: int, seq_len: int, accumulation: int = 1,
                  **options) -> dict[str, int | str]:
    """What is alive at a training step's peak, by kind, with the phase it falls in.

    Weights (P) and optimizer state (O) live through the whole step. With gradients set to None
    between steps (`zero_grad()`'s default), backward begins with every activation (A) saved and
    no gradient; as it runs, each layer's saved tensors are freed while its gradients (G) appear,
    so the live bytes move from P + O + A towards P + O + G and the peak is the larger end:
    "backward" (its start) when A >= G, else "optimizer" (the step, with every gradient). With
    `accumulation` > 1 the gradients of earlier micro-batches are alive while the last one's
    activations are: P + O + G + A, in backward. In backward's first operator the loss's gradient
    is alive too: two fp32 (tokens, vocab) tensors through the log-softmax, 8·N·V bytes
    ("temporaries"). Summing every kind, as `training_memory`'s parts would, puts gradients
    in that are not yet alive. Temporaries of the optimizer and of attention's softmax backward
    are left out. Checked against the simulated step of the course GPT in fp32 with AdamW
    (tests/test_estimate.py); other precisions follow the same phases, unchecked.
    `options` are `training_memory`'s; `batch` is the micro-batch."""
    parts = training_memory(n_params, batch=batch, seq_len=seq_len, **options)
    G, A = parts["gradients"], parts["activations"]
    loss_grad = 8 * batch * seq_len * _read_shape(options.get("shape"))["vocab"]
    if accumulation > 1:
        alive, phase = {**parts, "temporaries": loss_grad}, "backward"
    elif A + loss_grad >= G:
        alive, phase = {**parts, "gradients": 0, "temporaries": loss_grad}, "backward"
    else:
        alive, phase = {**parts, "activations": 0, "temporaries": 0}, "optimizer"
    return {**alive, "peak": sum(alive.values()), "phase": phase}


def _read_shape(shape) -> dict[str, int]:
    """width, depth, heads and vocab from a dict, or from a `companion.models.GPT`."""
    if shape is None:
        raise ValueError("shape is required: a dict of width, depth, heads and vocab (for a "
                         "GPT-2-like model, estimate.gpt_shape(n_params, seq_len=...)), or the "
                         "companion.models.GPT itself. For other models, simulate the step: "
                         "companion.plan.anymodel.simulate_model")
    if isinstance(shape, dict):
        missing = {"width", "depth", "heads", "vocab"} - set(shape)
        if missing:
            raise ValueError(f"shape needs width, depth, heads and vocab; missing "
                             f"{', '.join(sorted(missing))}")
        return shape
    blocks = getattr(shape, "blocks", None)
    tok = getattr(shape, "tok", None)
    if blocks is None or tok is None:
        raise TypeError(f"shape is a dict or a companion.models.GPT, got {type(shape).__name__}: "
                        "for other models, simulate the step (companion.plan.anymodel."
                        "simulate_model)")
    return {"width": tok.embedding_dim, "depth": len(blocks), "heads": blocks[0].heads,
            "vocab": tok.num_embeddings}


def _whole_count(n: int | float) -> int:
    """A parameter count as an int: integers (NumPy's too), and floats that hold a whole number
    (7.5e9)."""
    if isinstance(n, numbers.Integral) and not isinstance(n, bool):
        n = operator.index(n)                                # np.int64(7) -> 7
    elif isinstance(n, float):
        if not n.is_integer():
            raise ValueError(f"n_params must be a whole number of parameters, got {n!r}: "
                             "round it, e.g. model_states(round(n))")
        n = int(n)
    else:
        raise ValueError(f"n_params must be a number of parameters (an int, or a float such as "
                         f"7.5e9), got {type(n).__name__} {n!r:.40}")
    if n < 0:
        raise ValueError(f"n_params must be non-negative, got {n!r}")
    return n


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
