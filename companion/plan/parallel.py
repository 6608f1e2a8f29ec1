"""Tensor, pipeline, context and data parallelism for a Llama: memory per GPU and step time.

Data parallelism and ZeRO divide the model states, never a layer. With G GPUs split as
t·p·c·d == G, tensor parallelism (t, Megatron's column and row split, with sequence parallelism)
divides each layer's weights and activations inside a node; pipeline parallelism (p, 1F1B)
divides the layers; context parallelism (c, ring attention) divides each sequence; data
parallelism (d) divides the batch, and ZeRO-1 divides Adam's states over d·c.

Memory per GPU: the tensors by formula (below), then the lines a CUDA step adds beyond them,
the single-axis planner's own (`overheads`: `allocator.step_overheads`' CUDA context, cuBLAS
workspace, FlashAttention scratch and NCCL buffers, one communicator per group of more than one
rank; `Estimate.fit` adds `budget.fit_predicted`'s one segment of headroom). No step is replayed
through the allocator: fragmentation beyond that segment is not counted. With ZeRO-0 or 1, bf16
weights with an fp32 main gradient, fp32 master weights and Adam (Megatron's 18 bytes a
parameter: 2 + 4 + 4 + 4 + 4); with ZeRO-3, FSDP2 as torchtitan applies it (`_fsdp_lines`), with
its DTensor tensor parallelism's gathered norm outputs (`_gathered_inputs`) and its loss
(`_loss_line`), checked against its measured 70B (`parallel_published.TORCHTITAN_70B`):
- parameters on a stage: L/p layers of (C·Q + 2·C·K + Q·C + 3·C·I)/t + 2·C (the RMSNorm weights
  stay whole on each rank), the embedding V·C/t on the first stage (vocabulary-parallel), the
  head V·C/t and the final norm C on the last;
- activations of one layer for one micro-batch of b sequences of s tokens, N = b·s, bf16, with
  SDPA's flash kernel and the fused RMSNorm (`companion.estimate_llama.llama_activations`'s
  CUDA count, derived for the Llama in place of Korthikanti et al.'s GPT count, arXiv:2205.05198
  Table 2: no dropout, so no masks; GQA, so k and v are K = kv_heads·d wide; SwiGLU's four I-wide
  tensors in place of GELU's two 4h-wide ones):
      2·N·(4C + 2Q + 2K + 4I) + 8·N + 4·b·heads·s, divided by t·c
  (norm inputs and outputs 4C, q and the attention output 2Q, k and v 2K, gate, silu, up and
  their product 4I; each norm's fp32 rstd 4N; the fp32 log-sum-exp). With sequence parallelism
  every term is sharded over t, as Korthikanti's sbh(34/t + 5as/(ht)); context parallelism
  shards the tokens over c. Selective checkpointing here recomputes silu and the product
  (keeps 2·N·2I less, no matmul redone); full keeps each layer's input 2·N·C/(t·c) and
  recomputes one layer at a time in backward;
- 1F1B: the first stage holds min(m, p) micro-batches of its L/p layers; interleaved over v
  chunks, p·(1 + (p - 1)/(p·v)) (Megatron's `interleaved_schedule_memory_penalty`); the last
  stage holds one, plus the loss's fp32 logits over the vocabulary, 4·b·(s/c)·V/t.

Step time: see `step_time`. Example:
    >>> from companion.plan.configs import load_config
    >>> shape = Shape.from_config(load_config("llama-3-70b"))
    >>> best = search(shape, gpus=64, gpus_per_node=8, seq_len=8192, batch=512,
    ...               gpu="H100 SXM")[0]
    >>> best.layout.levers(), best.total_bytes, best.seconds

Tensor parallelism is charged its communication only: a rank's matmuls are 1/t of the layer's
and are priced at the same efficiency as whole ones (no cited figure for the loss of efficiency
of the smaller per-rank matmuls is used).

Simplified vs Megatron-LM: no expert parallelism, no ZeRO-2, no uneven stages (p divides L), every stage priced as the first or the last, communication not
overlapped except data parallel's gradient reduce behind the last micro-batch's backward and the
ring's passes behind attention.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from companion import allocator
from companion.cost import gpus as table
from companion.estimate_llama import llama_params
from companion.tensor_parallel import tp_bytes_per_layer

__all__ = ["Shape", "Layout", "Line", "Estimate", "CHECKPOINTING", "layer_activation_bytes",
           "memory", "overheads", "step_time", "estimate", "layouts", "search", "check_layout"]

CHECKPOINTING = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4)          # sequences per micro-batch tried
INTERLEAVE = (1, 2)                # model chunks per pipeline stage tried


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama's sizes (untied head, no biases): what the formulas read."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "Shape":
        """From a `companion.plan.configs.ModelConfig` of the Llama family."""
        if config.family != "llama" or config.tied or config.qkv_bias or config.mlp_bias:
            raise ValueError(f"{config.name}: the parallel layouts are priced for an untied "
                             "Llama without biases (Llama 2 and 3)")
        return cls(config.depth, config.width, config.heads, config.kv_heads,
                   config.intermediate, config.vocab)

    @property
    def n_params(self) -> int:
        return llama_params(self.vocab, self.width, self.layers, self.heads,
                            kv_heads=self.kv_heads, intermediate=self.intermediate)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.width // self.heads)

    @property
    def layer_matmul_params(self) -> int:
        C, K, I = self.width, self.kv_width, self.intermediate
        return 2 * C * C + 2 * C * K + 3 * C * I           # q and o, k and v, gate, up, down


@dataclasses.dataclass(frozen=True)
class Layout:
    """t·p·c·d GPUs; ZeRO stage over d·c; b sequences a micro-batch, m micro-batches a step."""

    t: int
    p: int
    c: int
    d: int
    zero: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    checkpointing: str = "none"
    v: int = 1                     # interleaved model chunks per pipeline stage

    @property
    def gpus(self) -> int:
        return self.t * self.p * self.c * self.d

    def levers(self) -> list[str]:
        """The levers in words: "tensor parallel 8", "pipeline parallel 4", "ZeRO-1", ..."""
        out = [f"{name} {n}" for name, n in (("tensor parallel", self.t),
                                             ("pipeline parallel", self.p),
                                             ("context parallel", self.c),
                                             ("data parallel", self.d)) if n > 1]
        out += ["sequence parallel"] if self.t > 1 else []
        out += [f"interleaved 1F1B, {self.v} chunks a stage"] if self.v > 1 else []
        out += [f"ZeRO-{self.zero}"] if self.zero else []
        out += [f"{self.micro_batches} micro-batches of {self.micro_batch}"]
        out += [f"{self.checkpointing} checkpointing"] if self.checkpointing != "none" else []
        return out


@dataclasses.dataclass(frozen=True)
class Line:
    """One line of a plan: bytes or seconds, and the formula it comes from."""

    name: str
    value: float
    formula: str


@dataclasses.dataclass
class Estimate:
    """A layout's memory per GPU (its most loaded stage) and step time, line by line."""

    layout: Layout
    memory: list[Line]
    time: list[Line]
    stage: str                     # "first", "last" or "only": the stage whose memory is shown
    overheads: list = dataclasses.field(default_factory=list)   # allocator.Overhead, CUDA's

    @property
    def total_bytes(self) -> int:
        """The tensors' bytes, by formula (no line beyond them)."""
        return int(sum(line.value for line in self.memory))

    @property
    def seconds(self) -> float:
        return sum(line.value for line in self.time)

    def fits(self, limit: int) -> bool:
        """The tensors' formula against a limit on tensors (chapter 13's exercise)."""
        return self.total_bytes <= limit

    def fit(self, budget: int):
        """The tensors and the lines beyond them (`overheads`) against a GPU's `budget` bytes, as
        the single-axis planner judges a predicted plan (`budget.fit_predicted`: one segment of
        headroom, the context and NCCL outside what the allocator may reserve)."""
        from companion.plan import budget as fit_budget
        largest = max(line.value for line in self.memory if line.value)
        return fit_budget.fit_predicted(self.total_bytes, self.total_bytes, int(largest), budget,
                                        list(self.overheads), "cuda")


def layer_activation_bytes(shape: Shape, micro_batch: int, seq_len: int, *, t: int = 1,
                           c: int = 1, checkpointing: str = "none") -> int:
    """Bytes one layer keeps for backward for one micro-batch, per GPU (the formula above)."""
    b, s, C, K, I = micro_batch, seq_len, shape.width, shape.kv_width, shape.intermediate
    N = b * s
    kept = {"none": 4 * I, "selective": 2 * I, "full": 0}[checkpointing]
    if checkpointing == "full":
        return 2 * N * C // (t * c)                           # the layer's input only
    return (2 * N * (4 * C + 2 * C + 2 * K + kept) + 8 * N + 4 * b * shape.heads * s) // (t * c)


def _stage_params(shape: Shape, layout: Layout) -> dict[str, int]:
    layer = shape.layer_matmul_params // layout.t + 2 * shape.width
    body = shape.layers // layout.p * layer
    vocab = shape.vocab * shape.width // layout.t
    if layout.p == 1:                                         # one stage holds both ends
        return {"only": body + 2 * vocab + shape.width}
    return {"first": body + vocab, "last": body + vocab + shape.width}


def _fsdp_lines(shape: Shape, layout: Layout, params: int) -> list[Line]:
    """ZeRO-3 as torchtitan's FSDP2 (parallelize_llama.py at 9dec370: one `fully_shard` a layer
    and one for the root, MixedPrecisionPolicy param_dtype bf16, reduce_dtype fp32): fp32
    parameters, gradients and Adam's m and v sharded over d·c; bf16 layers all-gathered for
    compute (the running one and the one prefetched; with pipelining the stage's whole, kept
    between forward and backward, reshard_after_forward=False); one layer's gradient in fp32
    before its reduce-scatter."""
    n, t = layout.d * layout.c, layout.t
    layer = shape.layer_matmul_params // t + 2 * shape.width
    ends = params - shape.layers // layout.p * layer            # embedding, head, final norm
    if layout.p > 1:
        gathered, why = 2 * params, "the stage's, kept from forward to backward (pipelined)"
    else:
        gathered, why = 2 * (2 * layer + ends), "two layers (running, prefetched) and the ends"
    return [Line("weights (fp32 shards)", 4 * params // n, f"4 B x parameters / {n} (d·c)"),
            Line("gradients (fp32 shards)", 4 * params // n, f"4 B x parameters / {n}"),
            Line("optimizer (Adam m and v, fp32 shards)", 8 * params // n,
                 f"8 B x parameters / {n}"),
            Line("FSDP all-gathered bf16 parameters", gathered, f"2 B x {why}"),
            Line("FSDP fp32 gradient before reduce-scatter", 4 * layer,
                 "4 B x one layer's parameters on the rank (reduce_dtype fp32)")]


def _gathered_inputs(shape: Shape, layout: Layout, seq_len: int, held: float) -> Line:
    """torchtitan's tensor parallel plan (DTensor's ColwiseParallel after a SequenceParallel
    norm, parallelize_llama.py at 9dec370) all-gathers each norm's output and the column-parallel
    matmuls save it whole for their weight gradient, where Megatron's sequence parallelism keeps
    the shard and gathers again in backward: 2 x 2·b·(s/c)·C·(1 - 1/t) more a layer alive (the
    one recomputed with full checkpointing)."""
    t, layers = layout.t, (1 if layout.checkpointing == "full" else shape.layers // layout.p)
    n = layout.micro_batch * (seq_len // layout.c) * shape.width
    return Line("norm outputs gathered for tensor parallel (DTensor)",
                int(held * layers * 4 * n * (t - 1) // t),
                f"{held:g} micro-batches x {layers} layers x 2 x 2 B x b·(s/c)·C·(1 - 1/t)")


def _loss_line(shape: Shape, layout: Layout, seq_len: int) -> Line:
    """The loss's peak on the last stage, vocabulary sharded over t (loss parallel). Megatron's
    fused vocab-parallel cross-entropy: fp32 logits, 4 B a logit. torchtitan (ZeRO-3 here):
    `cross_entropy(pred.float())` on the bf16 logits, DTensor's `_log_softmax` making the
    shifted fp32 logits and their exp beside the fp32 copy: (2 + 4 + 4 + 4) B a logit."""
    n = layout.micro_batch * (seq_len // layout.c) * shape.vocab // layout.t
    if layout.zero == 3:
        return Line("loss (bf16 logits, fp32 copy, shifted, exp)", 14 * n,
                    "14 B x b·(s/c)·V/t (torchtitan's loss under loss parallel)")
    return Line("loss's fp32 logits", 4 * n, "4 B x b·(s/c)·V/t")


def memory(shape: Shape, layout: Layout, seq_len: int) -> tuple[str, list[Line]]:
    """(the heavier stage, its memory lines in bytes per GPU: the tensors, by formula)."""
    t, p, c, d, b = layout.t, layout.p, layout.c, layout.d, layout.micro_batch
    per_layer = layer_activation_bytes(shape, b, seq_len, t=t, c=c,
                                       checkpointing=layout.checkpointing)
    working = (layer_activation_bytes(shape, b, seq_len, t=t, c=c)
               if layout.checkpointing == "full" else 0)
    if layout.v > 1:
        first = p * (1 + (p - 1) / (p * layout.v))
        flight = {"first": first, "last": first}           # v > 1 needs p > 1
    else:
        flight = {"first": min(layout.micro_batches, p), "last": 1, "only": 1}
    shard = d * c if layout.zero else 1
    lines = {}
    for stage, params in _stage_params(shape, layout).items():
        held = flight[stage]
        if layout.zero == 3:
            out = _fsdp_lines(shape, layout, params)
        else:
            out = [Line("weights (bf16)", 2 * params, "2 B x parameters on the stage"),
                   Line("gradients (fp32 main_grad)", 4 * params, "4 B x parameters"),
                   Line("optimizer (fp32 master, Adam m and v)", 12 * params // shard,
                        f"12 B x parameters / {shard} (ZeRO-{layout.zero} over d·c)")]
        out.append(Line("activations", int(held * shape.layers // p * per_layer),
                        f"{held:g} micro-batches x {shape.layers // p} layers x "
                        f"{per_layer:,} B ({'no' if layout.checkpointing == 'none' else layout.checkpointing} checkpointing)"))
        if working:
            out.append(Line("one layer recomputed", working, "a layer's activations, once"))
        if layout.zero == 3 and t > 1:
            out.append(_gathered_inputs(shape, layout, seq_len, held if not working else 1))
        if stage != "last":
            out.append(Line("token ids (int64)", int(held * 8 * b * seq_len // c),
                            "8 B x tokens in flight"))
        if stage != "first":
            out.append(_loss_line(shape, layout, seq_len))
        lines[stage] = out
    stage = max(lines, key=lambda k: sum(line.value for line in lines[k]))
    return stage, lines[stage]


def _links(gpu, t: int, c: int, d: int, p: int,
           gpus_per_node: int) -> dict[str, tuple[str, float]]:
    """(link, bytes/s one way) for each group; ranks are laid out t, then c, then d, then p
    (a group leaves the node when its span, stride times size, exceeds it; the pipeline's
    slowest boundary paces it). Inside a node a ring runs at `ring_link`'s NVLink (or PCIe);
    across nodes each GPU has its own share of the server's network cards (`server_network` / SERVER_GPUS: one 400 Gb/s
    card per H100 on a DGX), as every GPU of the node sends at once."""
    inside = table.ring_link(gpu, min(gpus_per_node, table.SERVER_GPUS))
    card = (gpu.server_network or gpu.pcie_bandwidth * table.SERVER_GPUS) / table.SERVER_GPUS
    across = ("network", min(inside[1], card))
    return {"tensor": inside, "context": inside if t * c <= gpus_per_node else across,
            "data": inside if t * c * d <= gpus_per_node else across,
            "pipeline": inside if t * c * d * p <= gpus_per_node else across}


def step_time(shape: Shape, layout: Layout, seq_len: int, *, gpu="H100 SXM",
              gpus_per_node: int = 8) -> list[Line]:
    """Seconds of one optimizer step, by part.
    - compute: 6·N_matmul·tokens + 12·L·C·s·tokens (attention's two products, the planner's and
      torchtitan's count) over G GPUs, at the bf16 peak times `cost.gpus.efficiency` (the MFU
      of Llama 3's 4D-parallel run); full checkpointing adds a forward (8 in place of 6);
    - tensor parallel: `tp_bytes_per_layer` (sequence parallel) per layer and micro-batch, on
      NVLink, not overlapped; full checkpointing sends the forward's again;
    - pipeline: each micro-batch's activation b·(s/c)·C/t (bf16) forward and its gradient back,
      v times per stage; the bubble (p - 1)/(v·m) of the compute and tensor-parallel time;
    - context parallel: the ring passes k and v c - 1 times forward, k, v and their gradients
      backward, per layer; what attention's compute does not hide is exposed;
    - data parallel: the fp32 gradients all-reduced over d·c (ZeRO-1: reduce-scattered, then
      the bf16 weights all-gathered), behind one micro-batch's backward; ZeRO-3 (FSDP): the
      bf16 weights all-gathered for each micro-batch's forward and backward (once a step when
      pipelined: the stage stays gathered) and the fp32 gradients reduce-scattered, layer by
      layer behind the whole step's compute."""
    g = table.gpu(gpu) if isinstance(gpu, str) else gpu
    t, p, c, d, m, b = layout.t, layout.p, layout.c, layout.d, layout.micro_batches, \
        layout.micro_batch
    tokens = layout.d * m * b * seq_len
    full = layout.checkpointing == "full"
    matmul = shape.layers * shape.layer_matmul_params + shape.vocab * shape.width
    attention = 12 * shape.layers * shape.width * seq_len * tokens
    flops = (8 if full else 6) * matmul * tokens + attention * (4 if full else 3) // 3
    rate = g.flops("bf16") * table.efficiency(g, "bf16")[0]
    compute = flops / layout.gpus / rate
    links = _links(g, t, c, d, p, gpus_per_node)
    layers = shape.layers // p * m                            # layer passes per GPU per step
    tp = tp_bytes_per_layer(b, seq_len // c, shape.width, t, sequence_parallel=True,
                            dtype=torch.bfloat16)
    tp_s = layers * (tp["forward"] * (2 if full else 1) + tp["backward"]) / links["tensor"][1]
    send = 2 * b * (seq_len // c) * shape.width // t
    pp_s = 2 * layout.v * m * send / links["pipeline"][1] if p > 1 else 0.0
    bubble = (p - 1) / (layout.v * m) * (compute + tp_s)
    kv = 2 * 2 * b * (seq_len // c) * shape.kv_width // t
    ring = layers * 3 * (c - 1) * kv / links["context"][1]
    cp_s = max(0.0, ring - attention / layout.gpus / rate)
    n, params = d * c, max(_stage_params(shape, layout).values())
    gathers = 1 if p > 1 else m                 # pipelined FSDP keeps the stage gathered
    per_param = {0: 2 * 4, 1: 4 + 2, 3: gathers * (2 + 2) + 4}[layout.zero]
    moved = (n - 1) / n * params * per_param
    hidden = compute if layout.zero == 3 else 2 / 3 * compute / m
    dp_s = max(0.0, moved / links["data"][1] - hidden) if n > 1 else 0.0
    return [Line("compute", compute, f"{flops:.3g} FLOPs / {layout.gpus} GPUs at {rate:.3g}/s"),
            Line("tensor parallel", tp_s, f"{links['tensor'][0]}, not overlapped"),
            Line("pipeline sends", pp_s, f"{links['pipeline'][0]}"),
            Line("pipeline bubble", bubble, f"(p-1)/(v·m) = {(p - 1) / (layout.v * m):.3g}"),
            Line("context parallel (exposed)", cp_s, f"{links['context'][0]}, behind attention"),
            Line("data parallel (exposed)", dp_s, f"{links['data'][0]}, " +
                 ("layer by layer behind the step" if layout.zero == 3 else "behind one backward"))]


def overheads(shape: Shape, layout: Layout, seq_len: int, *, gpu="H100 SXM") -> list:
    """The lines a CUDA step holds beyond its tensors, the single-axis planner's
    (`allocator.step_overheads`): the CUDA context, cuBLAS's workspace, FlashAttention's backward
    scratch for a rank's b·(s/c) tokens and heads/t heads, and NCCL's buffers, one communicator
    for each group (tensor, context, data, pipeline) of more than one rank."""
    g = table.gpu(gpu) if isinstance(gpu, str) else gpu
    t = layout.t
    attention = (layout.micro_batch, seq_len // layout.c, shape.heads // t,
                 shape.width // shape.heads, shape.kv_heads // t, 2)
    found = allocator.step_overheads(g, attention=attention)
    groups = sum(n > 1 for n in (t, layout.c, layout.d, layout.p))
    if groups:
        found.append(allocator.nccl_buffers(layout.gpus, communicators=groups))
    return found


def estimate(shape: Shape, layout: Layout, seq_len: int, *, gpu="H100 SXM",
             gpus_per_node: int = 8) -> Estimate:
    """A layout's memory per GPU and step time (`check_layout` first: errors name the rule)."""
    check_layout(shape, layout, seq_len, gpus=layout.gpus, gpus_per_node=gpus_per_node)
    stage, lines = memory(shape, layout, seq_len)
    return Estimate(layout, lines, step_time(shape, layout, seq_len, gpu=gpu,
                                             gpus_per_node=gpus_per_node), stage,
                    overheads(shape, layout, seq_len, gpu=gpu))


def check_layout(shape: Shape, layout: Layout, seq_len: int, *, gpus: int,
                 gpus_per_node: int) -> None:
    """A ValueError naming the first rule the layout breaks."""
    t, p, c, d = layout.t, layout.p, layout.c, layout.d
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
               for n in (t, p, c, d, layout.micro_batch, layout.micro_batches, layout.v)):
        raise ValueError(f"layout {layout}: t, p, c, d, the micro-batch, the micro-batches and "
                         "v are whole numbers, at least 1")
    rules = [(t * p * c * d == gpus, f"t·p·c·d = {t * p * c * d}, not the {gpus} GPUs"),
             (shape.heads % t == 0 and shape.kv_heads % t == 0,
              f"t={t} must divide the {shape.heads} heads and {shape.kv_heads} key/value heads"),
             (t <= gpus_per_node and gpus_per_node % t == 0,
              f"t={t} must stay inside a node of {gpus_per_node} GPUs (NVLink)"),
             (shape.layers % (p * layout.v) == 0,
              f"p·v={p * layout.v} must divide the {shape.layers} layers"),
             (seq_len % (2 * c) == 0 or c == 1,
              f"c={c} must divide the sequence into 2c chunks (ring attention's causal halves)"),
             (layout.zero in (0, 1, 3), "ZeRO stage 0, 1 (the optimizer states over d·c) or 3 "
              "(FSDP: every state over d·c)"),
             (layout.checkpointing in CHECKPOINTING, f"checkpointing: one of {CHECKPOINTING}"),
             (layout.v == 1 or (p > 1 and layout.micro_batches % p == 0),
              "interleaving needs p > 1 and micro-batches a multiple of p")]
    for good, why in rules:
        if not good:
            raise ValueError(f"layout {layout}: {why}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(shape: Shape, *, gpus: int, gpus_per_node: int, seq_len: int, batch: int):
    """Every valid layout for `batch` sequences a step on `gpus` GPUs (a generator). ZeRO-3 with
    p > 1 is left out: against torchtitan's measured 405B runs (FSDP, TP 8, PP 8) the formulas
    fall 30-37% short (`parallel_published.torchtitan_error`), too far to choose by them."""
    for t, p, c in itertools.product(_divisors(gpus), repeat=3):
        if gpus % (t * p * c) or batch % (gpus // (t * p * c)):
            continue
        d = gpus // (t * p * c)
        for b, v, zero, ckpt in itertools.product(MICRO_BATCHES, INTERLEAVE, (0, 1, 3),
                                                  CHECKPOINTING):
            if (batch // d) % b or (zero and d * c == 1) or (zero == 3 and p > 1):
                continue                # ZeRO-3 beside pipelining: priced, not searched
            layout = Layout(t, p, c, d, zero, b, batch // d // b, ckpt, v)
            try:
                check_layout(shape, layout, seq_len, gpus=gpus, gpus_per_node=gpus_per_node)
            except ValueError:
                continue
            yield layout


def search(shape: Shape, *, gpus: int, gpus_per_node: int, seq_len: int, batch: int,
           gpu="H100 SXM", limit: int | None = None) -> list[Estimate]:
    """The layouts that fit `limit` bytes a GPU (default the card's usable bytes) with the lines
    beyond their tensors (`Estimate.fit`), fastest first; [] when none fits."""
    g = table.gpu(gpu) if isinstance(gpu, str) else gpu
    limit = g.usable_bytes if limit is None else limit
    found = [estimate(shape, layout, seq_len, gpu=g, gpus_per_node=gpus_per_node)
             for layout in layouts(shape, gpus=gpus, gpus_per_node=gpus_per_node,
                                   seq_len=seq_len, batch=batch)]
    return sorted((e for e in found if e.fit(limit).fits),
                  key=lambda e: (e.seconds, e.total_bytes))
