"""Simulate any model's training step on fake tensors (`simulate_model`): build it from a
factory (`build_model`), pull a plan's levers on it (LoRA, checkpointing of its largest block
container, 8-bit Adam states, autocast), and run one step as every step after the first, measured
by `companion.memory.track`, its FLOPs counted by `FlopCounterMode` in a fake run of their own.
`anymodel.plan_model` scores its candidates with it; `measure_step` runs the plan's step as a
training loop does, for real, to check it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import warnings
from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

from companion import lora, lowbit
from companion.checkpointing import checkpoint_sequential
from companion.memory import MemoryTracker, track
from companion.plan.space import Candidate
from companion.plan.simulation import _fake_addresses

__all__ = ["build_model", "next_token_step", "simulate_model", "simulate_memory", "count_flops",
           "measure_step", "blocks_of", "checkpointed_already"]

_WHAT = ("the planner builds your model on fake tensors (shapes only, nothing allocated): pass a "
         "function of no arguments that returns the model on the CPU in fp32 (sizes bound with "
         "functools.partial); it may not load weights from files, call .cuda() or .to(device)")


def build_model(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """model_fn(), with an error that names the cause when it cannot run on fake tensors.

    Two kinds of factory cannot run under FakeTensorMode. One that converts its model
    (`.to(memory_format=torch.channels_last)`, `.float()`): `nn.Module._apply` swaps each fake
    parameter for its converted copy, and FakeTensorMode's memo holds a weak reference to it,
    which `torch.utils.swap_tensors` refuses ("Couldn't swap Conv2d.weight"; the flag
    `torch.__future__.set_overwrite_module_params_on_conversion(True)` does not avoid it, since
    fake parameters are always swapped). And one whose initialisation reads values
    (`nn.init.trunc_normal_` calls `.item()`: transformers' ViT). Either is built on the meta
    device instead (no dispatch mode: conversions copy in place, and `trunc_normal_` skips meta
    tensors), and its tensors are then made fake with the same shapes, strides and dtypes."""
    if isinstance(model_fn, nn.Module) or not callable(model_fn):
        raise TypeError(f"model_fn is a {type(model_fn).__name__}, not a function that builds the "
                        f"model: {_WHAT}")
    try:
        model = model_fn()
    except TypeError as e:
        raise TypeError(f"model_fn() raised TypeError: {e}. {_WHAT}") from e
    except Exception as e:
        if not (_faking() and ("Couldn't swap" in str(e) or isinstance(
                e, (DataDependentOutputException, DynamicOutputShapeException)))):
            raise RuntimeError(f"model_fn() raised {type(e).__name__} while building the model on "
                               f"fake tensors (FakeTensorMode): {e}. {_WHAT}") from e
        model = _built_on_meta(model_fn, e)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn() returned a {type(model).__name__}, not an nn.Module")
    return model


def _faking() -> bool:
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def _built_on_meta(model_fn: Callable[[], nn.Module], swap: Exception) -> nn.Module:
    """model_fn() on the meta device (no dispatch mode, so conversions copy in place), then each
    parameter and buffer a fake tensor of its shape, strides and dtype; shared ones stay shared."""
    try:
        with _disable_current_modes(), torch.device("meta"):
            model = model_fn()
    except Exception as e:
        raise RuntimeError(f"model_fn() cannot run on fake tensors ({type(swap).__name__}: "
                           f"{swap}), and building it on the meta device instead raised "
                           f"{type(e).__name__}: {e}. {_WHAT}") from e
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                    made[id(t)] = (t, nn.Parameter(fake, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else fake)
                table[key] = made[id(t)][1]
    return model


def next_token_step(seq_len: int, vocab: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """The default step of a language model: `batch` random sequences of `seq_len` token ids in,
    logits (batch, seq_len, vocab) out, cross-entropy against the next token. The model may
    return the logits, a dict or Hugging Face `ModelOutput` holding "logits", or a tuple whose
    first element they are (`return_dict=False`)."""
    def step(model: nn.Module, batch: int) -> torch.Tensor:
        device = next(model.parameters()).device
        x = torch.randint(vocab, (batch, seq_len), device=device)
        logits = _logits(model(x))                             # (batch, seq_len, vocab)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    return step


def _logits(out) -> torch.Tensor:
    """The logits in a model's output: the tensor, out["logits"], out.logits or out[0]."""
    if isinstance(out, Mapping):                               # a dict, or a ModelOutput
        found = out.get("logits")
    elif isinstance(out, (tuple, list)) and out:
        found = out[0]
    else:
        found = getattr(out, "logits", out)
    if not isinstance(found, torch.Tensor) or found.dim() != 3:
        what = (f"{type(out).__name__} with keys {list(out.keys())}" if isinstance(out, Mapping)
                else f"{type(found).__name__}" + (f" of shape {tuple(found.shape)}"
                                                  if isinstance(found, torch.Tensor) else ""))
        raise TypeError(f"the default step reads logits (batch, seq_len, vocab) from the model's "
                        f"output (the tensor, a dict or ModelOutput with 'logits', or a tuple "
                        f"that starts with them), got {what}: pass step(model, batch) -> loss")
    return found


def blocks_of(model: nn.Module) -> nn.Module | None:
    """The container of repeated blocks: the nn.ModuleList or nn.Sequential of at least two
    children that holds the most parameters."""
    found = [(sum(p.numel() for p in m.parameters()), i, m)
             for i, m in enumerate(model.modules())
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2]
    return max(found, key=lambda f: (f[0], -f[1]))[2] if found else None


def _checkpoint(model: nn.Module, container: nn.Module) -> None:
    """Recompute in backward: each block of a ModuleList but the last keeps only its input
    (non-reentrant `torch.utils.checkpoint`; the last block's tensors are used at once by
    backward, as `checkpoint_sequential` runs its last segment); a Sequential runs as round(√n)
    segments (`checkpoint_sequential`). A Hugging Face model's KV cache is turned off first, as
    its own checkpointing does ("`use_cache=True` is incompatible with gradient checkpointing",
    transformers' `merge_with_config_defaults`): recomputing a layer would append its keys to
    the cache again, and on a padded batch the recomputed attention sees twice the keys its mask
    covers and fails. Its own switch (`gradient_checkpointing_enable`) is not used: it
    checkpoints every layer, the last one too."""
    for hf in _hf_models(model):
        hf.config.use_cache = False
    if isinstance(container, nn.Sequential):
        children, segments = list(container), max(2, round(math.sqrt(len(container))))
        container.forward = lambda x: checkpoint_sequential(children, segments, x,
                                                            use_reentrant=False)
        return
    for block in list(container)[:-1]:
        inner = block.forward
        block.forward = (lambda inner: lambda *a, **k: torch.utils.checkpoint.checkpoint(
            inner, *a, use_reentrant=False, **k))(inner)


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The `transformers.PreTrainedModel`s in `model` (none when transformers is not imported:
    a model of its classes imports it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    return [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]


def checkpointed_already(model: nn.Module) -> str | None:
    """How `model` already recomputes its blocks, as built: Hugging Face's
    `gradient_checkpointing_enable()` (a module's `gradient_checkpointing` flag set, what its
    `is_gradient_checkpointing` reads), torch's `checkpoint_wrapper`, or a block's `forward`
    replaced by one that calls `checkpoint` (as this lever does); None if none of them."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return "Hugging Face's gradient_checkpointing_enable()"
    if any(type(m).__name__ == "CheckpointWrapper" for m in model.modules()):
        return "torch's checkpoint_wrapper"
    container = blocks_of(model)
    for block in container if container is not None else ():
        forward = vars(block).get("forward")
        if isinstance(forward, functools.partial):
            forward = forward.func
        code = getattr(forward, "__code__", None)
        if forward is torch.utils.checkpoint.checkpoint or (
                code is not None and "checkpoint" in code.co_names):
            return "its blocks' forward wrapped in torch.utils.checkpoint"
    return None


@dataclasses.dataclass
class _Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    blocks: int                      # blocks the fixed per-block cost is counted for


def _build(model_fn, cand: Candidate, optimizer=None) -> _Setup:
    """The model with the plan's levers pulled, and its optimizer (none when not asked for)."""
    model = build_model(model_fn)
    if cand.lora_rank:                         # first: checkpointing captures the blocks
        with warnings.catch_warnings():        # plan_model warns once, not at every simulation
            warnings.simplefilter("ignore")
            lora.apply_lora(model, cand.lora_rank)
    container = blocks_of(model)
    if cand.segments > 1:
        if container is None:
            raise ValueError("checkpointing needs an nn.ModuleList or nn.Sequential of blocks")
        _checkpoint(model, container)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (None if optimizer is None else
           lowbit.Adam8bit(trainable, lr=1e-3, decoupled_weight_decay=True)
           if cand.state_bits == 8 else optimizer(trainable))
    return _Setup(model, opt, len(container) if container is not None else 1)


def _micro_batch(setup: _Setup, cand: Candidate, step, k: int) -> None:
    """One micro-batch's forward (under autocast when the plan has it) and backward."""
    with torch.autocast("cpu", torch.bfloat16, enabled=cand.precision == "autocast"):
        loss = step(setup.model, cand.micro_batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"step(model, batch) must return the loss (a one-element "
                        f"tensor), got {type(loss).__name__}")
    (loss.float() / k).backward()


def simulate_model(model_fn: Callable[[], nn.Module], cand: Candidate,
                   step: Callable[[nn.Module, int], torch.Tensor], *,
                   optimizer: Callable = torch.optim.AdamW, fake: bool = True
                   ) -> tuple[MemoryTracker, int, int]:
    """(tracker, FLOPs of one micro-batch's forward and backward, blocks) of a step of the plan
    (`simulate_memory`, then `count_flops`)."""
    tracker, blocks = simulate_memory(model_fn, cand, step, optimizer=optimizer, fake=fake)
    return tracker, count_flops(model_fn, cand, step, fake=fake), blocks


def simulate_memory(model_fn: Callable[[], nn.Module], cand: Candidate,
                    step: Callable[[nn.Module, int], torch.Tensor], *,
                    optimizer: Callable = torch.optim.AdamW, fake: bool = True
                    ) -> tuple[MemoryTracker, int]:
    """(tracker, blocks) of a step of the plan, simulated as every step after the first:
    optimizer state made, gradients of the earlier micro-batches there (zeros, when
    accumulating), the last micro-batch, the optimizer step. `fake=False` runs the same step for
    real on the CPU. Nothing but `track` watches the step: under `FlopCounterMode` (its module
    hooks) the tensors of the blocks a checkpointed step recomputes stayed alive (the README's
    `mha_lm`, 8 sequences, every block but the last checkpointed: 26,818,784 B with the counter,
    19,639,008 B without, the user's own loop 19,639,004 B), so FLOPs are counted in a run of
    their own (`count_flops`). The garbage collector is left running, as in a training loop:
    without the counter the checkpointed steps peaked the same with it paused or running, after
    any history tried (the spread by history an earlier version put down to the collector was
    measured with the counter in the step)."""
    k = cand.accumulation
    with (FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()), \
            (_fake_addresses() if fake else contextlib.nullcontext()):
        with track("cpu") as tracker:
            setup = _build(model_fn, cand, optimizer)
            trainable = [p for p in setup.model.parameters() if p.requires_grad]
            for p in trainable:                               # 1. the optimizer's state
                p.grad = torch.zeros_like(p)
            setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)
            for p in trainable if k > 1 else ():              # 2. earlier micro-batches' grads
                p.grad = torch.zeros_like(p)
            _micro_batch(setup, cand, step, k)                # 3. the last micro-batch
            setup.optimizer.step()
            blocks = setup.blocks
            del setup, trainable
    return tracker, blocks


def count_flops(model_fn: Callable[[], nn.Module], cand: Candidate,
                step: Callable[[nn.Module, int], torch.Tensor], *, fake: bool = True) -> int:
    """FLOPs of one micro-batch's forward and backward (a checkpointed block's recomputation
    included), counted by `FlopCounterMode` on fake tensors, in a run that nothing measures.
    `fake=False` counts a real run (a step fake tensors cannot run: `plan.fallback`)."""
    with (FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()), \
            (_fake_addresses() if fake else contextlib.nullcontext()):
        setup = _build(model_fn, cand)
        with FlopCounterMode(display=False) as counter:
            _micro_batch(setup, cand, step, cand.accumulation)
    return counter.get_total_flops()


def measure_step(model_fn: Callable[[], nn.Module], cand: Candidate,
                 step: Callable[[nn.Module, int], torch.Tensor], *,
                 optimizer: Callable = torch.optim.AdamW) -> MemoryTracker:
    """The plan's step as a training loop runs it, for real on this CPU: the model built and its
    levers pulled, one whole step taken (the optimizer's state made), then the next step (its
    `accumulation` micro-batches, the optimizer step, gradients set to None) measured by
    `track(external=(model, optimizer), modules=model)` and nothing else."""
    setup = _build(model_fn, cand, optimizer)

    def whole_step():
        for _ in range(cand.accumulation):
            _micro_batch(setup, cand, step, cand.accumulation)
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)

    whole_step()
    with track("cpu", external=(setup.model, setup.optimizer), modules=setup.model) as tracker:
        whole_step()
    return tracker
