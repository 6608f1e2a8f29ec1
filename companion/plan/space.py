"""What the planner chooses from: the model's shape, one candidate plan, and every candidate.

A plan (`Candidate`) sets one value per lever of the course:
  micro-batch x accumulation (chapter 03), checkpoint segments (04), precision (05: autocast,
  bf16 weights with 16-bit or fp32 gradients), ZeRO stage (07, several ranks), optimizer offload
  and its NVMe tier, activation offload (08), chunked cross-entropy (00), fused attention (04,
  10), LoRA adapters (09), 8-bit Adam states and QLoRA's NF4 base (11); and practitioners'
  levers (issue 52): selective checkpointing (torch's `create_selective_checkpoint_contexts`),
  pure bf16 with stochastic rounding (11), the optimizer step inside backward (03), paged 8-bit
  AdamW states (bitsandbytes' paged optimizers); and issue 59's: the fused linear cross-entropy
  (`chunked_loss.fused_linear_cross_entropy`: the head's gradients made in forward, slice by
  slice) and checkpointed segments' inputs on the host (`checkpointing.InputOffload`). Their
  CLI names have hyphens ("selective-checkpointing"), the internal ones underscores:
  `technique_name` maps one to the other, and `allow` takes both.
`candidates` lists every combination that can run together; `GPTShape.of` reads the sizes the
predictions need off the model, built under FakeTensorMode (no memory allocated).

Simplified vs real planners: two model families (`companion.models.GPT`, and `Llama`, without
the levers `LLAMA_NOT_SEARCHED` names), AdamW only, LoRA on every Linear of each block (the
GPT's four, the Llama's seven) at one rank, checkpointing by `checkpoint_sequential` segments
or one selective policy over every block, and ZeRO, offload, LoRA and 8-bit states not combined
with each other (nor the step in backward with accumulation, ZeRO, offload or LoRA; the fused loss
and offloaded checkpoints are planned on one process).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Iterable

import torch
from torch._subclasses import FakeTensorMode

from companion.models import GPT, Llama

__all__ = ["TECHNIQUES", "EXACT", "LOW_PRECISION", "FEWER_BITS", "PRECISIONS", "LORA_TARGETS",
           "LOSS_CHUNKS", "LLAMA_NOT_SEARCHED", "LLAMA_LORA_TARGETS", "technique_name",
           "GPTShape", "Candidate", "candidates", "capstone_model", "lora_target_names"]

TECHNIQUES = ("accumulation", "checkpointing", "autocast", "mixed", "main_grad", "zero",
              "offload", "activation_offload", "chunked_loss", "fused_attention", "nvme", "lora",
              "adam8bit", "qlora", "selective_checkpointing", "pure_bf16", "optimizer_in_backward",
              "paged_adam8bit", "fused_loss", "offload_checkpoints")
EXACT = ("accumulation", "checkpointing", "zero", "offload", "activation_offload",
         "chunked_loss", "fused_attention", "nvme")     # fp32 training, to rounding
LOW_PRECISION = ("autocast", "mixed", "main_grad")  # bf16 compute: the capstone's losses moved
                                               # by 5e-5 (relative) from fp32's over 6 steps (CPU)
FEWER_BITS = ("adam8bit", "qlora", "pure_bf16", "paged_adam8bit")   # chapter 11: Adam's moments
                                               # in 8 bits (AdamW's decay); LoRA over a base
                                               # frozen in NF4; bf16 weights, gradients and
                                               # moments, no master, stochastic rounding
PRECISIONS = ("fp32", "autocast", "mixed", "main_grad", "bf16")   # "main_grad": bf16 weights,
                                               # fp32 gradients (Megatron's 18 B with Adam);
                                               # "bf16": pure bf16, no master (torchtune's 8 B)
LOSS_CHUNKS = 8                                # slices of the chunked (or fused) cross-entropy
LORA_TARGETS = ("qkv", "proj", "fc", "out")    # the Linear layers of each GPT block
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_NOT_SEARCHED = (                         # for a Llama, and why
    "bf16 autocast but under ZeRO-3 (no formula for what a Llama saves under autocast, whose "
    "casts differ between the CPU and CUDA; FSDP's bf16 compute is the bf16 model's)",)


def capstone_model(S, *, seed: int = 0) -> Callable[..., GPT]:
    """Chapter 09's GPT at the sizes `S` (`companion.device.sizes`): vocab, seq_len, gpt_heads and
    the cap_width, cap_depth fields, with fused attention, as a function of dtype= and device=
    (what the planner takes). The notebook, its check and the recorded run all build it here."""
    return functools.partial(GPT, S.vocab, S.seq_len, S.cap_width, S.cap_depth, S.gpt_heads,
                             fused_attention=True, seed=seed)


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The sizes of a `companion.models.GPT`, or of a `Llama` (`llama`: RMSNorm, grouped-query
    attention with `kv_heads`, SwiGLU of width `intermediate`), that memory and time depend on."""

    vocab: int
    seq_len: int
    width: int
    depth: int
    heads: int
    fused_attention: bool
    n_params: int        # every parameter
    n_params_1d: int     # in 1-D tensors (biases, LayerNorms): ZeRO-3 here keeps those whole
    largest: int         # elements of the largest parameter tensor
    n_params_small: int = 0   # in tensors under 4096 values (Adam8bit keeps their fp32 moments)
    n_tensors: int = 0        # parameter tensors (the NVMe tier keeps three files for each)
    llama: bool = False       # a Llama: RMSNorm, rotary positions, GQA, SwiGLU, always SDPA
    kv_heads: int = 0         # the Llama's key/value heads
    intermediate: int = 0     # the Llama's SwiGLU width
    tied: bool = False        # head and token embedding one tensor (GPT-2, Llama 3.2 1B,
                              # Qwen2.5 0.5B): counted once in n_params
    qkv_bias: bool = False    # biases on q, k and v (Qwen2)
    o_bias: bool = False      # a bias on o (transformers' Llama with attention_bias)
    mlp_bias: bool = False    # biases on gate, up and down (Llama's mlp_bias)

    @classmethod
    def of(cls, model_fn: Callable[..., torch.nn.Module]) -> "GPTShape":
        """Build `model_fn(dtype=torch.float32, device="cpu")` under FakeTensorMode and read it."""
        what = ("pass a function that takes dtype= and device= and returns a companion.models."
                "GPT, e.g. functools.partial(GPT, vocab, seq_len, width, depth, heads)")
        if isinstance(model_fn, torch.nn.Module) or not callable(model_fn):
            raise TypeError(f"model_fn is a {type(model_fn).__name__}, not a function that "
                            f"builds the model: {what}")
        try:
            with FakeTensorMode():
                model = model_fn(dtype=torch.float32, device="cpu")
        except Exception as e:
            raise TypeError(f"model_fn(dtype=torch.float32, device='cpu') raised "
                            f"{type(e).__name__}: {e}. {what[0].upper()}{what[1:]}") from e
        if not isinstance(model, (GPT, Llama)):
            raise TypeError(f"the planner predicts the memory of companion.models.GPT and "
                            f"Llama; model_fn built a {type(model).__name__}. Pass a function "
                            "that takes dtype= and device= and returns a GPT, e.g. "
                            "functools.partial(GPT, vocab, seq_len, width, depth, heads)")
        params = list(model.parameters())
        block = model.blocks[0]
        llama = {"llama": True, "kv_heads": block.kv_heads,
                 "intermediate": block.gate_proj.out_features,
                 "qkv_bias": block.q_proj.bias is not None,
                 "o_bias": block.o_proj.bias is not None,
                 "mlp_bias": block.gate_proj.bias is not None} if isinstance(model, Llama) else {}
        return cls(**llama, vocab=model.tok.num_embeddings, seq_len=model.seq_len,
                   width=model.tok.embedding_dim, depth=len(model.blocks), heads=block.heads,
                   fused_attention=block.fused_attention,
                   tied=model.head.weight is model.tok.weight,
                   n_params=sum(p.numel() for p in params),
                   n_params_1d=sum(p.numel() for p in params if p.dim() == 1),
                   largest=max(p.numel() for p in params),
                   n_params_small=sum(p.numel() for p in params if p.numel() < 4096),
                   n_tensors=len(params))

    def block_matmul_params(self) -> int:
        """Weights of one block's matmuls: GPT 12·C²; Llama q, k, v, o, gate, up and down."""
        C = self.width
        kv = self.kv_heads * (C // self.heads)
        return 2 * C * C + 2 * C * kv + 3 * C * self.intermediate if self.llama else 12 * C * C

    def block_params(self) -> int:
        """Parameters of one block: the matmuls' and GPT's 13·C of biases and LayerNorms, or
        the Llama's two RMSNorms (and q, k and v's biases with qkv_bias, o's with o_bias, gate,
        up and down's with mlp_bias)."""
        if not self.llama:
            return self.block_matmul_params() + 13 * self.width
        bias = (self.heads + 2 * self.kv_heads) * (self.width // self.heads) * self.qkv_bias
        bias += self.width * self.o_bias + (2 * self.intermediate + self.width) * self.mlp_bias
        return self.block_matmul_params() + 2 * self.width + bias

    def lora_params(self, rank: int, targets: tuple[str, ...] = ()) -> int:
        """Trainable parameters of rank-`rank` adapters on every block's adapted Linears:
        r·(in + out) each; the GPT's four r·(C + 3C + C + C + C + 4C + 4C + C) = 16·r·C.
        `targets`: the Linears adapted, by name (`block_linears`); () adapts all of them."""
        return self.depth * rank * sum(i + o for i, o in self.lora_linear_shapes(targets))

    def trainable_tensors(self, lora_rank: int = 0, targets: tuple[str, ...] = ()) -> int:
        """Tensors the optimizer steps: every parameter, or two adapter matrices per adapted
        Linear with LoRA."""
        return (2 * len(self.lora_linear_shapes(targets)) * self.depth if lora_rank
                else self.n_tensors)

    def lora_linear_weights(self, targets: tuple[str, ...] = ()) -> list[int]:
        return [i * o for i, o in self.lora_linear_shapes(targets)]      # per block

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """{name: (in, out) features} of a block's Linears: GPT qkv (C, 3C), proj (C, C),
        fc (C, 4C), out (4C, C); Llama q, k, v, o, gate, up, down. QLoRA's NF4 base is all of
        them, whichever LoRA adapts (as bitsandbytes' 4-bit loading, litgpt and torchtune do)."""
        C, I, kv = self.width, self.intermediate, self.kv_heads * (self.width // self.heads)
        if self.llama:
            return dict(zip(LLAMA_LORA_TARGETS,
                            [(C, C), (C, kv), (C, kv), (C, C), (C, I), (C, I), (I, C)]))
        return dict(zip(LORA_TARGETS, [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]))

    def lora_linear_shapes(self, targets: tuple[str, ...] = ()) -> list[tuple[int, int]]:
        """(in, out) features of each Linear LoRA adapts, per block: those named in `targets`
        (`block_linears`' names), or all of them (())."""
        linears = self.block_linears()
        unknown = [t for t in targets if t not in linears]
        if unknown:
            raise ValueError(f"LoRA target(s) {unknown} are not Linears of this model's blocks: "
                             f"choose from {', '.join(linears)}")
        return [shape for name, shape in linears.items() if not targets or name in targets]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan: a value for every lever. `micro_batch` is per rank."""

    micro_batch: int
    accumulation: int = 1
    segments: int = 1            # checkpoint_sequential over the blocks; 1 = no checkpointing
    precision: str = "fp32"      # "fp32" | "autocast" (bf16 compute) | "mixed" (bf16 + fp32 master)
    zero_stage: int = 0          # 0 = plain data parallelism when world_size > 1
    offload: bool = False        # AdamW state and fp32 master weights on the host
    lora_rank: int = 0           # 0 = train every parameter
    state_bits: int = 32         # 8: Adam's moments as block-wise 8-bit codes (`lowbit.Adam8bit`)
    nf4_base: bool = False       # QLoRA: every block Linear's weight frozen in NF4, the adapted
                                 # ones under their adapters (lora_rank > 0)
    activation_offload: bool = False   # saved activations to the host (saved-tensor hooks)
    chunked_loss: int = 0        # slices of `chunked_cross_entropy` (0: the whole logits at once)
    fused_attention: bool = False  # build the model with fused attention (no (T, T) matrix)
    nvme: bool = False           # offloaded AdamW state in files (ZeRO-Infinity's tier); offload
    selective: bool = False      # every block under the matmul-saving policy (`checkpointing.
                                 # selective`): attention core and element-wise ops recomputed
    in_backward: bool = False    # each parameter's AdamW step in backward (`optim.
                                 # optimizer_in_backward`): one gradient alive at a time
    paged: bool = False          # 8-bit states paged to the host (bitsandbytes' paged AdamW8bit)
    lora_targets: tuple[str, ...] = ()  # the Linears LoRA adapts (GPTShape.block_linears'
                                 # names, e.g. ("q_proj", "v_proj"), PEFT's and litgpt's default
                                 # for a Llama); (): every Linear of a block
    nf4_keeps_inputs: bool = False  # QLoRA as with bitsandbytes < 0.43.2: each 4-bit Linear
                                 # keeps its input until its graph is freed, and the loop's
                                 # variable holds the last forward's output with its graph until
                                 # the next forward returns (litgpt's `logits`)
    checkpoint_last: bool = False  # the last segment checkpointed too: every block wrapped, as
                                 # torchtune, torchtitan's full AC and HF's gradient checkpointing
                                 # do (checkpoint_sequential runs the last segment plainly)
    fused_loss: int = 0          # slices of `fused_linear_cross_entropy` (0: off): the head's
                                 # gradients made in forward, its matmul not run again
    offload_checkpoints: bool = False  # each checkpointed segment's input on the host
                                 # (`checkpointing.InputOffload`), fetched one segment ahead

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation", "segments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Candidate.{name} must be an int of at least 1, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Candidate.precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Candidate.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) \
                or self.lora_rank < 0:
            raise ValueError(f"Candidate.lora_rank must be an int >= 0 (0: no LoRA), got "
                             f"{self.lora_rank!r}")
        if self.state_bits not in (8, 32):
            raise ValueError(f"Candidate.state_bits must be 32 or 8, got {self.state_bits!r}")
        if self.nf4_base and not self.lora_rank:
            raise ValueError("Candidate.nf4_base (QLoRA) freezes the base under adapters: give "
                             "it a lora_rank >= 1")
        if self.state_bits == 8 and (self.offload or self.zero_stage):
            raise ValueError("8-bit states are planned on one device, without offload or ZeRO")
        if self.nvme and not self.offload:
            raise ValueError("Candidate.nvme pages the offloaded optimizer state to disk: it needs "
                             "offload=True")
        if isinstance(self.chunked_loss, bool) or not isinstance(self.chunked_loss, int) \
                or self.chunked_loss < 0:
            raise ValueError(f"Candidate.chunked_loss is a number of slices (0: off), got "
                             f"{self.chunked_loss!r}")
        self._check_new_levers()
        self._check_loss_and_input_levers()

    def _check_new_levers(self) -> None:
        """Selective checkpointing, pure bf16, the step in backward, paged 8-bit states: the
        combinations planned here (issue 52's levers)."""
        if not isinstance(self.lora_targets, tuple) or not all(
                isinstance(t, str) for t in self.lora_targets):
            raise ValueError(f"Candidate.lora_targets is a tuple of Linear names, got "
                             f"{self.lora_targets!r}")
        if self.lora_targets and not self.lora_rank:
            raise ValueError("Candidate.lora_targets names the Linears LoRA adapts: give it a "
                             "lora_rank >= 1")
        for name in ("checkpoint_last", "nf4_keeps_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Candidate.{name} is True or False, got "
                                 f"{getattr(self, name)!r}")
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise ValueError(f"Candidate.lora_targets names a Linear twice: {self.lora_targets}")
        if self.nf4_keeps_inputs and (not self.nf4_base or self.segments > 1
                                      or self.activation_offload):
            raise ValueError("Candidate.nf4_keeps_inputs is QLoRA's (nf4_base=True), planned "
                             "without checkpointing and activation offload")
        if self.checkpoint_last and (self.segments == 1 or self.activation_offload):
            raise ValueError("Candidate.checkpoint_last checkpoints the last of the checkpoint "
                             "segments: it needs segments > 1, and is planned without "
                             "activation offload")
        if self.paged and self.state_bits != 8:
            raise ValueError("Candidate.paged pages 8-bit Adam states: it needs state_bits=8")
        if self.selective and (self.segments > 1 or self.activation_offload or self.lora_rank):
            raise ValueError("Candidate.selective checkpoints every block under its policy: it "
                             "is planned without checkpoint segments (segments=1), activation "
                             "offload and LoRA")
        if self.precision == "bf16" and (self.offload or self.zero_stage or self.lora_rank):
            raise ValueError("pure bf16 (precision='bf16') is planned on one device, without "
                             "offload, ZeRO or LoRA")
        if self.in_backward and self.accumulation > 1:
            raise ValueError("Candidate.in_backward steps each parameter as soon as its gradient "
                             "is made: it cannot accumulate over micro-batches (accumulation=1)")
        if self.in_backward and (self.zero_stage or self.offload or self.lora_rank
                                 or self.precision in ("mixed", "main_grad")):
            raise ValueError("Candidate.in_backward is planned on one device with the weights' "
                             "own optimizer (fp32, autocast or pure bf16): not with ZeRO, "
                             "offload, LoRA or fp32 masters")

    def _check_loss_and_input_levers(self) -> None:
        """The fused loss and offloaded checkpoint inputs (issue 59): the combinations planned."""
        if isinstance(self.fused_loss, bool) or not isinstance(self.fused_loss, int) \
                or self.fused_loss < 0:
            raise ValueError(f"Candidate.fused_loss is a number of slices (0: off), got "
                             f"{self.fused_loss!r}")
        if self.fused_loss and (self.chunked_loss or self.zero_stage or self.in_backward
                                or self.nf4_keeps_inputs):
            raise ValueError("Candidate.fused_loss replaces the chunked loss (chunked_loss=0) "
                             "and is planned on one device, without ZeRO, the step in backward "
                             "and nf4_keeps_inputs")
        if not isinstance(self.offload_checkpoints, bool):
            raise ValueError(f"Candidate.offload_checkpoints is True or False, got "
                             f"{self.offload_checkpoints!r}")
        if self.offload_checkpoints and (self.segments == 1 or self.activation_offload
                                         or self.zero_stage):
            raise ValueError("Candidate.offload_checkpoints moves the checkpointed segments' "
                             "inputs to the host: it needs segments > 1, and is planned on one "
                             "device without activation offload (which moves them already)")

    def recomputed_blocks(self, depth: int) -> int:
        """Blocks whose forward runs again in backward: every checkpointed segment's (the last
        one's too with checkpoint_last; checkpoint_sequential sizes them depth // segments and
        gives the last the rest)."""
        if self.segments == 1:
            return 0
        return depth if self.checkpoint_last else (depth // self.segments) * (self.segments - 1)

    def check_depth(self, depth: int) -> None:
        """Raise ValueError when the plan asks for more checkpoint segments than blocks."""
        if self.segments > depth:
            raise ValueError(f"{self.segments} checkpoint segments for a model of {depth} "
                             f"blocks: segments can be at most the depth")

    def techniques(self) -> list[str]:
        """The levers this plan pulls, in words."""
        out = []
        if self.accumulation > 1:
            out.append(f"{self.accumulation} micro-batches of {self.micro_batch}")
        if self.segments > 1:
            out.append(f"checkpointing ({self.segments} segments"
                       + (", the last too)" if self.checkpoint_last else ")"))
        if self.selective:
            out.append("selective checkpointing")
        if self.precision != "fp32":
            out.append({"autocast": "bf16 autocast", "mixed": "bf16 weights + fp32 master",
                        "main_grad": "bf16 weights + fp32 main_grad and master",
                        "bf16": "pure bf16 (stochastic rounding)"}[self.precision])
        if self.fused_attention:
            out.append("fused attention")
        if self.activation_offload:
            out.append("activation offload")
        if self.offload_checkpoints:
            out.append("checkpoint inputs on the host")
        if self.chunked_loss:
            out.append(f"chunked loss ({self.chunked_loss} slices)")
        if self.fused_loss:
            out.append(f"fused loss ({self.fused_loss} slices)")
        if self.zero_stage:
            out.append(f"ZeRO-{self.zero_stage}")
        if self.offload:
            out.append("optimizer offload to NVMe" if self.nvme else "optimizer offload")
        if self.lora_rank:
            on = f" on {', '.join(self.lora_targets)}" if self.lora_targets else ""
            out.append(f"QLoRA r={self.lora_rank}{on} (NF4 base frozen"
                       + (", inputs kept as bitsandbytes < 0.43.2)" if self.nf4_keeps_inputs
                          else ")") if self.nf4_base
                       else f"LoRA r={self.lora_rank}{on} (base frozen)")
        if self.state_bits == 8:
            out.append("paged 8-bit Adam states" if self.paged else "8-bit Adam states")
        if self.in_backward:
            out.append("optimizer in backward")
        return out

    def describe(self) -> str:
        """The plan in words, e.g. "4 micro-batches of 4, optimizer offload"."""
        return ", ".join(self.techniques()) or "plain (no technique)"


def lora_target_names(targets) -> tuple[str, ...]:
    """LoRA's target names as a tuple, each once, in their order: a list or tuple of strings
    (a lone string or None is refused: say ("qkv",), or () for every Linear)."""
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) \
            or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"lora_targets is a tuple of Linear names, e.g. ('q_proj', 'v_proj'), "
                         f"or () for every Linear; got {targets!r}")
    return tuple(dict.fromkeys(targets))


def technique_name(name: str) -> str:
    """A technique's internal name: "pure-bf16" (the CLI's) is "pure_bf16"."""
    return name.replace("-", "_") if isinstance(name, str) else name


def _check_allow(allow: Iterable[str]) -> frozenset[str]:
    if isinstance(allow, str):
        allow = [allow]
    allow = frozenset(technique_name(a) for a in allow)
    unknown = allow - set(TECHNIQUES)
    if unknown:
        raise ValueError(f"unknown technique(s) {sorted(unknown)} in allow: choose from "
                         f"{', '.join(TECHNIQUES)}")
    return allow


def candidates(shape: GPTShape, batch: int, *, world_size: int = 1,
               allow: Iterable[str] = EXACT, lora_rank: int = 8,
               lora_targets: tuple[str, ...] = ()) -> list[Candidate]:
    """Every plan that trains `batch` sequences per optimizer step (over all ranks) with the
    techniques in `allow`. Several ranks: each takes batch / world_size, with a ZeRO stage (or
    plain data parallelism); the course's offload and LoRA run on one process, so they are
    searched for world_size = 1 only, as are 8-bit states and QLoRA. `lora_targets`: the
    Linears LoRA and QLoRA adapt (`Candidate.lora_targets`; (): all of a block's)."""
    allow = _check_allow(allow)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int (sequences per step), got {batch!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if batch % world_size:
        raise ValueError(f"batch {batch} must split evenly over world_size={world_size} ranks")
    if allow & {"lora", "qlora"} and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int)
                            or not 1 <= lora_rank <= shape.width):
        raise ValueError(f"lora_rank must be an int from 1 to the width {shape.width}, "
                         f"got {lora_rank!r}")
    lora_targets = lora_target_names(lora_targets)
    shape.lora_linear_shapes(lora_targets)             # names a block's Linears, or raises
    per_rank = batch // world_size
    micro = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    if "accumulation" not in allow:
        micro = [per_rank]
    segments = [1] + ([s for s in range(2, shape.depth + 1)] if "checkpointing" in allow else [])
    precisions = [p for p in PRECISIONS if p == "fp32" or p in allow
                  or p == "bf16" and "pure_bf16" in allow]
    several = world_size > 1
    one = not several                  # the course's hooks and loss run on one process here
    stages = ([0, 1, 2, 3] if "zero" in allow else [0]) if several else [0]
    offloads = [False, True] if "offload" in allow and not several else [False]
    adapters = not several and ("lora" in allow or "qlora" in allow)
    ranks = [0, lora_rank] if adapters else [0]
    bits = [32, 8] if allow & {"adam8bit", "paged_adam8bit"} and not several else [32]
    pages = [False, True] if "paged_adam8bit" in allow and not several else [False]
    selective = [False, True] if "selective_checkpointing" in allow else [False]
    in_backward = [False, True] if "optimizer_in_backward" in allow and one else [False]
    bases = [False, True] if "qlora" in allow and not several else [False]
    acts = [False, True] if "activation_offload" in allow and one else [False]
    chunks = [(0, 0)] + [(LOSS_CHUNKS, 0)] * ("chunked_loss" in allow and one) + [
        (0, LOSS_CHUNKS)] * ("fused_loss" in allow and one)   # (chunked, fused) slices
    inputs_out = [False, True] if "offload_checkpoints" in allow and one else [False]
    fused = [False, True] if "fused_attention" in allow and not shape.fused_attention else [False]
    disks = [False, True] if "nvme" in allow and one else [False]
    out = []
    for m, s, p, z, off, r, b, nf4, a, (ch, fl), f, d, pg, sel, ib, io in itertools.product(
            micro, segments, precisions, stages, offloads, ranks, bits, bases, acts, chunks,
            fused, disks, pages, selective, in_backward, inputs_out):
        if pg and b != 8 or b == 8 and not pg and "adam8bit" not in allow:
            continue                           # paging is of 8-bit states
        if sel and (s > 1 or a or r) or ib and (m != per_rank or off or r or p in (
                "mixed", "main_grad")) or p == "bf16" and (off or r):
            continue                           # `Candidate._check_new_levers` says why; the
        if several and p in ("mixed", "main_grad", "bf16"):   # step in backward: no micro-batches
            continue                       # ZeRO here: fp32 shards, bf16 compute via autocast
        if d and not off or max(ch, fl) > m * shape.seq_len:
            continue                       # NVMe is offload's last tier; a slice per token
        if fl and ib or io and (s == 1 or a):
            continue                       # `Candidate._check_loss_and_input_levers` says why
        if p == "main_grad" and (off or r):
            continue                       # its fp32 gradients live beside trained weights
        if (off or b == 8) and r or off and b == 8:
            continue                       # adapters' states are already tiny
        if nf4 and not r or r and not nf4 and "lora" not in allow:
            continue                       # QLoRA is LoRA on an NF4 base
        if shape.llama and p == "autocast" and z != 3:
            continue                       # LLAMA_NOT_SEARCHED says why
        out.append(Candidate(m, per_rank // m, s, p, z, off, r, b, nf4, a, ch, f, d,
                             selective=sel, in_backward=ib, paged=pg,
                             lora_targets=lora_targets if r else (),
                             fused_loss=fl, offload_checkpoints=io))
    return out
