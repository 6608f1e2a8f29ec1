"""Put a plan together from the course's parts, and run its steps: for real, or simulated.

`build` makes the model and optimizer a `Candidate` asks for, with the course's own code for each
lever: `checkpoint_sequential` (hooks design, which restores autocast) over the blocks,
`MasterWeights` for bf16 weights, `CPUOffloadOptimizer`, `ShardedOptimizer` and `FSDP` for ZeRO,
`ddp.DDP`, `lora.apply_lora`, `lowbit.apply_qlora` and `lowbit.Adam8bit`; issue 52's levers:
`checkpointing.selective_checkpoint` on every block, `lowbit.BF16AdamW` (pure bf16, stochastic
rounding; with 8-bit states `Adam8bit(stochastic_round=True)`), `optim.optimizer_in_backward`
(`InBackward`), and paged 8-bit states (`PagedAdam8bit`: Adam8bit a page at a time; on the
CPU nothing to page); issue 59's: `chunked_loss.fused_linear_cross_entropy` and
`checkpointing.checkpoint_offloaded` over the checkpointed segments (`CheckpointedBlocks`).
`train_step` runs one optimizer step over the micro-batches. The same code runs in
`simulation.simulate`, under `FakeTensorMode` (every tensor is shape and dtype only: a 7B model's
step costs no memory and a few seconds), measured by `companion.memory.track`; several ranks are
simulated as rank 0 of a "fake" process group, whose collectives do nothing.

Example:
    >>> setup = build(partial(GPT, 128, 64, 64, 4, 4), Candidate(4, 4, segments=2), lr=1e-3)
    >>> loss = train_step(setup, x, y)          # x, y: (16, 64) token ids

Simplified vs real: the simulation sees every tensor an operator returns, not the scratch space a
kernel allocates and frees inside itself, nor the caching allocator's rounding and fragmentation
on CUDA (the planner adds those as lines of its own: `plan.budget`). No kernel runs there: each
operator's rule for the shape and dtype of its result does, for the CPU's dispatch, whose saved
tensors match CUDA's except where autocast's op lists differ (see `companion.estimate`). It
shows that the same ledger fits, no more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from companion import amp, ddp, lora, lowbit
from companion.checkpointing import InputOffload, checkpoint_offloaded, checkpoint_sequential
from companion.checkpointing.selective import selective_checkpoint
from companion.optim import optimizer_in_backward
from companion.placement import on_host
from companion.activation_offload import OffloadActivations
from companion.chunked_loss import chunked_cross_entropy, fused_linear_cross_entropy
from companion.nvme import NVMeOffloadOptimizer
from companion.offload import CPUOffloadOptimizer
from companion.models import Llama
from companion.plan.parts import PAGE             # values of a page (a multiple of 256)
from companion.plan.space import LLAMA_LORA_TARGETS, LORA_TARGETS, Candidate
from companion.zero import FSDP, ShardedOptimizer

__all__ = ["CheckpointedBlocks", "SelectiveBlocks", "InBackward", "PagedAdam8bit", "Setup",
           "build", "micro_step", "optimizer_step", "train_step"]


class CheckpointedBlocks(nn.Module):
    """A GPT's blocks run by `checkpoint_sequential(blocks, segments, x, use_reentrant=False)`:
    segments - 1 of them keep only their input and recompute in backward, the last runs plainly.
    With `last=True` the last segment is checkpointed too, the same way, as trainers that wrap
    every block do (torchtune's `set_activation_checkpointing`, torchtitan's full AC, HF's
    `gradient_checkpointing_enable`). The hooks design replays autocast in the recompute (the
    reentrant one would not). `offload=True`: the checkpointed segments run under torch's
    non-reentrant checkpoint inside `InputOffload`'s hooks (`checkpoint_offloaded`), each
    segment's input on the host until backward fetches it, one segment ahead."""

    def __init__(self, blocks: nn.Sequential, segments: int, last: bool = False,
                 offload: bool = False):
        super().__init__()
        self.blocks, self.segments, self.last, self.offload = blocks, segments, last, offload

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offload:
            return checkpoint_sequential(list(self.blocks), self.segments, x,
                                         use_reentrant=False, last=self.last)
        size = len(self.blocks) // self.segments       # checkpoint_sequential's segments:
        cuts = [i * size for i in range(self.segments)] + [len(self.blocks)]   # the last
        parts = [self.blocks[a:b] for a, b in zip(cuts, cuts[1:])]            # the rest
        x = checkpoint_offloaded(parts if self.last else parts[:-1], x, offload=InputOffload())
        return x if self.last else parts[-1](x)        # (B, T, C); the last segment plainly


class SelectiveBlocks(nn.Module):
    """Every block under `selective_checkpoint` (torch's `create_selective_checkpoint_contexts`
    with torchtitan's op-level policy, `alternate_matmuls`): each keeps its input, every second
    matmul's output and fused attention's, and recomputes the rest in its backward."""

    def __init__(self, blocks: nn.Sequential):
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = selective_checkpoint(block, x)                           # (B, T, C)
        return x


class InBackward:
    """The optimizer step inside backward: one optimizer per parameter, stepped by its
    post-accumulate-grad hook (`companion.optim.optimizer_in_backward`), which then frees the
    gradient. `step` steps the parameters that still hold a gradient (none after a backward; the
    simulation's first step, on zero gradients, makes the state); `zero_grad` as torch's."""

    def __init__(self, params: list[torch.Tensor], optimizer_class: type, **kwargs):
        self.optimizers, self.handles = optimizer_in_backward(params, optimizer_class, **kwargs)

    def step(self) -> None:
        for p, optimizer in self.optimizers.items():
            if p.grad is not None:
                optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)




class _HostAdam8bit(lowbit.Adam8bit):
    """`lowbit.Adam8bit` whose 8-bit codes are stored on the host (`placement.on_host`) when
    `host` is set: a GPU's paged states, evicted between steps."""

    def __init__(self, params, *, host: bool = False, **kwargs):
        super().__init__(params, **kwargs)
        self.host = host

    def _store(self, p: torch.Tensor, group: dict, m: torch.Tensor, v: torch.Tensor) -> None:
        super()._store(p, group, m, v)                 # quantized on the device, then the
        if self.host:                                  # codes and scales paged out
            state = self.state[p]
            for key in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes",
                        "exp_avg_sq_absmax"):
                if key in state:
                    with on_host():
                        state[key] = state[key].clone()


class PagedAdam8bit:
    """bitsandbytes' paged AdamW8bit as the course runs it: `lowbit.Adam8bit` (AdamW's decay)
    stepped one page of `PAGE` values at a time, each page a view of its tensor with its own
    codes, so the step's fp32 temporaries are one page's (bitsandbytes' kernel, fused, has none)
    and the states can live on the host between steps (`host=True`: a GPU's plan, simulated).
    The updates are Adam8bit's: pages are whole blocks of 256."""

    def __init__(self, params: list[torch.Tensor], *, host: bool = False, **kwargs):
        self.params = list(params)
        self.pages = {p: [p.detach().view(-1)[i:i + PAGE] for i in range(0, p.numel(), PAGE)]
                      for p in self.params}
        self.inner = _HostAdam8bit([v for views in self.pages.values() for v in views],
                                   host=host, **kwargs)

    def step(self) -> None:
        for p, views in self.pages.items():
            if p.grad is None:
                continue
            flat = p.grad.view(-1)
            for i, view in enumerate(views):                 # the page's gradient: a view
                view.grad = flat[i * PAGE:i * PAGE + view.numel()]
        self.inner.step()
        for views in self.pages.values():
            for view in views:
                view.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


@dataclasses.dataclass
class Setup:
    """What `train_step` needs: the network to call, the optimizer, how to finish a step."""

    candidate: Candidate
    model: nn.Module              # the GPT itself
    net: nn.Module                # what forward calls: the GPT, or its DDP / FSDP wrapper
    optimizer: torch.optim.Optimizer | InBackward   # InBackward: stepped inside backward
    master: amp.MasterWeights | None = None   # bf16 weights: steps go through it
    held: list | None = None      # the loop's variable holding the last forward's output, across
                                  # micro-batches and steps (`Candidate.nf4_keeps_inputs`)


def _optimizer(cand: Candidate, model: nn.Module, world_size: int, lr: float,
               paged_to_host: bool = False):
    """(net, optimizer, master) for the plan's optimizer lever."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw = {"lr": lr}
    if world_size > 1 and cand.zero_stage == 3:
        dtype = torch.bfloat16 if cand.precision == "autocast" else None
        net = FSDP(model, compute_dtype=dtype)                    # gathers in bf16 itself
        return net, torch.optim.AdamW(net.parameters(), fused=True, **adamw), None
    if world_size > 1 and cand.zero_stage in (1, 2):
        return model, ShardedOptimizer(trainable, torch.optim.AdamW, stage=cand.zero_stage,
                                       fused=True, **adamw), None
    net = ddp.DDP(model, gradient_as_bucket_view=True) if world_size > 1 else model
    if cand.nvme and not _fake(trainable):     # masters and states in files; a simulation
        return net, NVMeOffloadOptimizer([{"params": [p]} for p in trainable],  # keeps them
                                         torch.optim.AdamW, directory=tempfile.gettempdir(),
                                         **adamw), None       # on the host; paged a tensor at a time
    if cand.offload:                       # keeps its own fp32 masters, on the host
        return net, CPUOffloadOptimizer(trainable, torch.optim.AdamW, **adamw), None
    master = (amp.MasterWeights(trainable, grads="main_grad" if cand.precision == "main_grad"
                                else "16-bit") if cand.precision in ("mixed", "main_grad")
              else None)
    params = master.master_params if master is not None else trainable
    pure = cand.precision == "bf16"            # bf16 weights, no master: stochastic rounding
    if cand.state_bits == 8:                   # AdamW's update and decay, moments in 8 bits
        kind, options = lowbit.Adam8bit, {"weight_decay": 0.01, "decoupled_weight_decay": True,
                                          "stochastic_round": pure}
        if cand.paged:                         # a page at a time; a GPU's pages on the host
            kind, options = PagedAdam8bit, {**options, "host": paged_to_host}
    elif pure:                                 # moments in bf16 too (2 + 2 + 4 = 8 B)
        kind, options = lowbit.BF16AdamW, {"compensation": "stochastic"}
    else:
        kind, options = torch.optim.AdamW, {"fused": True}
    if cand.in_backward:
        return net, InBackward(params, kind, **options, **adamw), master
    return net, kind(params, **options, **adamw), master


def _dtype(cand: Candidate) -> torch.dtype:
    return torch.bfloat16 if cand.precision in ("mixed", "main_grad", "bf16") else torch.float32


def _quantized_on_host(model_fn: Callable[..., nn.Module], cand: Candidate) -> nn.Module:
    """QLoRA's model as a quantizing loader leaves it: made on the host, each adapted Linear
    weight replaced by its NF4 codes (one layer at a time), ready to move to the device."""
    model = model_fn(dtype=_dtype(cand), device="cpu")
    return lowbit.apply_qlora(model, cand.lora_rank, targets=_lora_targets(model, cand),
                              quantize=_lora_targets(model))


def _lora_targets(model: nn.Module, cand: Candidate | None = None) -> tuple[str, ...]:
    """The Linear layers LoRA adapts: those `cand.lora_targets` names, or all of a block's (a
    Llama's q, k, v, o, gate, up and down; a GPT's qkv, proj, fc and out)."""
    if cand is not None and cand.lora_targets:
        return cand.lora_targets
    return LLAMA_LORA_TARGETS if isinstance(model, Llama) else LORA_TARGETS


def _copy_in(model: nn.Module) -> None:
    """Replace every tensor of `model` by a copy, in place (Module._apply would swap fake
    tensors, which their weak references forbid): what moving it to a GPU allocates there."""
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = p.data.clone()
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.clone()
            if isinstance(module, lowbit.QLoRALinear):
                module.base = module.base.apply(torch.clone)


def build(model_fn: Callable[..., nn.Module], cand: Candidate, *, world_size: int = 1,
          device: torch.device | str = "cpu", lr: float = 1e-3,
          host_model: nn.Module | None = None, paged_to_host: bool = False,
          made: nn.Module | None = None) -> Setup:
    """The model `model_fn(dtype=..., device=...)` and its optimizer, as `cand` says.

    Memory is the plan's: bf16 weights are made in bf16 (never an fp32 copy first), adapters are
    added before the optimizer exists, so frozen weights get no gradient and no state. QLoRA's
    dense base never reaches a GPU: it is made and quantized on the host, then moved (on the
    CPU, host and device are one memory: the dense model is its build's peak). `host_model`:
    that host-side model, already made (`simulate` copies it in, as the move to a GPU would).
    `paged_to_host`: paged 8-bit states live on the host (`simulate` for a GPU). `made`: the
    model already made, taken as it is (`simulate` makes a ZeRO-3 model before it measures)."""
    device = torch.device(device)
    if made is not None:
        model = made
    elif host_model is not None:                       # the copy a move to the GPU makes
        model = host_model
        _copy_in(model)
    elif cand.nf4_base:                                # base frozen, in NF4: only codes move
        model = _quantized_on_host(model_fn, cand)
        if device.type != "cpu":
            model = model.to(device)
    elif cand.fused_attention:                         # the same model, attention fused
        model = model_fn(dtype=_dtype(cand), device=device, fused_attention=True)
    else:
        model = model_fn(dtype=_dtype(cand), device=device)
    cand.check_depth(len(model.blocks))
    if cand.nf4_keeps_inputs:                          # bitsandbytes < 0.43.2's MatMul4Bit
        for module in model.modules():
            if isinstance(module, lowbit.QLoRALinear):
                module.keeps_input = True
    if cand.lora_rank and not cand.nf4_base:
        lora.apply_lora(model, cand.lora_rank, targets=_lora_targets(model, cand))   # base frozen
    if cand.segments > 1:
        model.blocks = CheckpointedBlocks(model.blocks, cand.segments, cand.checkpoint_last,
                                          cand.offload_checkpoints)
    if cand.selective:
        model.blocks = SelectiveBlocks(model.blocks)
    net, optimizer, master = _optimizer(cand, model, world_size, lr, paged_to_host)
    return Setup(cand, model, net, optimizer, master)


def micro_step(setup: Setup, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0,
               sync: bool = True, held: list | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch, its mean loss times `scale` (1/k of k
    micro-batches), gradients added into .grad; `sync=False` skips DDP's all-reduce (no_sync).
    `held`: a list the loop keeps, as a variable of its own: once this forward has returned
    it is emptied (the last micro-batch's output let go) and given this one's output (the logits,
    or the hidden states with a chunked loss), its graph attached: litgpt's `logits =
    model(...)`, which keeps what a graph holds outside backward's reach (bitsandbytes < 0.43.2's
    kept inputs) until the next forward returns."""
    net, cand = setup.net, setup.candidate
    use_autocast = cand.precision == "autocast" and not isinstance(net, FSDP)
    skip = isinstance(net, ddp.DDP) and not sync
    with net.no_sync() if skip else contextlib.nullcontext(), (         # through backward
            OffloadActivations(min_bytes=0) if cand.activation_offload
            else contextlib.nullcontext()):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=use_autocast):
            if cand.chunked_loss or cand.fused_loss:   # no (b·T, vocab) logits kept: slices
                with _head_off(setup.model) as head:
                    hidden = net(x)                                      # (b, T, C)
                _hold(held, hidden)
                loss = _sliced_loss(cand, hidden.flatten(0, 1), head, y.flatten()) * scale
                del hidden
            else:
                logits = net(x)                                          # (b, T, vocab)
                _hold(held, logits)
        if not (cand.chunked_loss or cand.fused_loss):
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) * scale
            del logits                     # freed now, not after backward (unless held)
        loss.backward()
    return loss.detach()


def _sliced_loss(cand: Candidate, hidden: torch.Tensor, head: nn.Linear,
                 targets: torch.Tensor) -> torch.Tensor:
    """The chunked loss (each slice's logits recomputed in backward) or the fused one (the
    head's gradients made in forward, slice by slice), over (N, C) hidden states."""
    if cand.chunked_loss:
        return chunked_cross_entropy(hidden, head.weight, targets, bias=head.bias,
                                     chunks=cand.chunked_loss)
    return fused_linear_cross_entropy(hidden, head.weight, targets, bias=head.bias,
                                      chunk_size=-(-len(hidden) // cand.fused_loss))


def _hold(held: list | None, output: torch.Tensor) -> None:
    if held is not None:
        held.clear()
        held.append(output)


@contextlib.contextmanager
def _head_off(model: nn.Module) -> Iterator[nn.Linear]:
    """The model's forward without its head (it returns the final norm's output); yields the
    head, whose weight the chunked loss multiplies slice by slice."""
    head = model.head
    model.head = nn.Identity()
    try:
        yield head
    finally:
        model.head = head


def _fake(tensors: list[torch.Tensor]) -> bool:
    return any(isinstance(t, FakeTensor) for t in tensors)


def optimizer_step(setup: Setup) -> None:
    """Finish the gradients' communication, then step (through the fp32 masters for bf16)."""
    if hasattr(setup.net, "finish_gradient_synchronization"):
        setup.net.finish_gradient_synchronization()
    if setup.master is not None:
        setup.master.step(setup.optimizer)             # fp32 step, rounded back into bf16
    else:
        setup.optimizer.step()


def train_step(setup: Setup, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer step on this rank's batch (x, y), as `accumulation` micro-batches of
    `micro_batch`; returns the batch's mean loss, a 0-d tensor (reading it with float() is a
    host-device sync, left to the caller). Gradients are cleared first (set to None), so
    the previous step's do not live through this step's forward."""
    k = setup.candidate.accumulation
    if len(x) != setup.candidate.micro_batch * k:
        raise ValueError(f"this plan takes {setup.candidate.micro_batch * k} sequences per rank "
                         f"and step ({k} x {setup.candidate.micro_batch}), got {len(x)}")
    # 1. No gradients from the last step: they are not alive through this step's forward.
    setup.optimizer.zero_grad(set_to_none=True)
    # 2. k micro-batches of (micro_batch, T): forward, backward of loss / k; gradients add up.
    #    DDP all-reduces (a collective) only after the last one.
    #    bitsandbytes < 0.43.2 (`Candidate.nf4_keeps_inputs`): the loop holds each micro-batch's
    #    output (its graph) until the next forward returns, through the step and into the next
    #    step's first forward, as litgpt's `logits` variable does (`Setup.held`).
    total = torch.zeros((), device=x.device)
    if setup.candidate.nf4_keeps_inputs and setup.held is None:
        setup.held = []
    for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
        total += micro_step(setup, xb, yb, scale=1 / k, sync=i == k - 1, held=setup.held)
    # 3. One optimizer step for the whole batch.
    optimizer_step(setup)
    return total
