"""Simulate any model's training step on fake tensors (`simulate_model`): build it from a
factory (`build_model`), pull a plan's levers on it (LoRA, checkpointing of its largest block
container, a Hugging Face model's by its own switch; 8-bit Adam states, autocast), and run one
step as every step after the first, measured by `companion.memory.track`, its FLOPs counted by
`FlopCounterMode` in a fake run of their own. `anymodel.plan_model` scores its candidates with
it; `measure_step` runs the plan's step as a training loop does, for real, to check it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor)
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
    """Recompute in backward, as the model's user turns it on. A Hugging Face model that holds
    these blocks and supports it: by its own switch (`hf_switch`), every layer under
    non-reentrant `torch.utils.checkpoint`, the last one too (a user reading "checkpointing"
    calls `gradient_checkpointing_enable()`, and their step peaked 12-20% below the lever's
    earlier every-layer-but-the-last on Llama, Qwen2, Gemma and Phi-3, 8 x 96 tokens); the KV
    cache is off first, as the switch turns it off in forward ("`use_cache=True` is incompatible
    with gradient checkpointing", transformers' `merge_with_config_defaults`; set here, the
    warning is not printed): recomputing a layer would append its keys to the cache again. Any
    other model: each block of a ModuleList but the last keeps only its input (non-reentrant
    `torch.utils.checkpoint`; the last block's tensors are used at once by backward, as
    `checkpoint_sequential` runs its last segment); a Sequential runs as round(sqrt(n)) segments
    (`checkpoint_sequential`)."""
    for m in _hf_models(model):
        m.config.use_cache = False
    hf = hf_switch(model, container)
    if hf is not None:
        with warnings.catch_warnings():      # 5.x: gradient_checkpointing_enable is deprecated
            warnings.simplefilter("ignore")
            enable = getattr(hf, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    if isinstance(container, nn.Sequential):
        children, segments = list(container), max(2, round(math.sqrt(len(container))))
        container.forward = lambda x: checkpoint_sequential(children, segments, x,
                                                            use_reentrant=False)
        return
    for block in list(container)[:-1]:
        inner = block.forward
        block.forward = (lambda inner: lambda *a, **k: torch.utils.checkpoint.checkpoint(
            inner, *a, use_reentrant=False, **k))(inner)


def hf_switch(model: nn.Module, container: nn.Module | None) -> nn.Module | None:
    """The outermost Hugging Face `PreTrainedModel` that holds `container` and
    `supports_gradient_checkpointing`: the checkpointing lever turns its own switch, what its
    user turns on (`gradient_checkpointing_enable()`, which transformers 5.25 keeps as a
    deprecated alias of `activation_checkpointing_enable()`). None for any other model."""
    if container is None:
        return None
    for m in _hf_models(model):              # model.modules() order: outermost first
        if getattr(m, "supports_gradient_checkpointing", False) and any(
                c is container for c in m.modules()):
            return m
    return None


def hf_layers(model: nn.Module) -> int:
    """The layers Hugging Face's switch checkpoints in `model`: its
    `GradientCheckpointingLayer`s (transformers' `_set_gradient_checkpointing`), 0 if none."""
    layer = getattr(sys.modules.get("transformers.modeling_layers"),
                    "GradientCheckpointingLayer", None)
    return 0 if layer is None else sum(isinstance(m, layer) for m in model.modules())


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The `transformers.PreTrainedModel`s in `model` (none when transformers is not imported:
    a model of its classes imports it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    return [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]


def checkpointed_already(model: nn.Module, step: Callable | None = None) -> str | None:
    """How `model` already recomputes its blocks, as built: Hugging Face's
    `gradient_checkpointing_enable()` (a module's `gradient_checkpointing` flag set, what its
    `is_gradient_checkpointing` reads), torch's `checkpoint_wrapper`, or a block's `forward`
    replaced by one that calls `checkpoint` (as this lever does); else, when `step` is given,
    whether its forward runs `torch.utils.checkpoint` (`_runs_checkpoint`: a model whose own
    forward calls it). None if none of them. With `step`, call it under the FakeTensorMode the
    model was built in."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return "Hugging Face's gradient_checkpointing_enable() in model_fn"
    if any(type(m).__name__ == "CheckpointWrapper" for m in model.modules()):
        return "torch's checkpoint_wrapper in model_fn"
    container = blocks_of(model)
    for block in container if container is not None else ():
        forward = vars(block).get("forward")
        if isinstance(forward, functools.partial):
            forward = forward.func
        code = getattr(forward, "__code__", None)
        if forward is torch.utils.checkpoint.checkpoint or (
                code is not None and "checkpoint" in code.co_names):
            return "its blocks' forward wrapped in torch.utils.checkpoint in model_fn"
    if step is not None and _runs_checkpoint(model, step):
        return "its forward calls torch.utils.checkpoint"
    return None


def _runs_checkpoint(model: nn.Module, step: Callable) -> bool | None:
    """Whether one forward of `step(model, 1)` runs `torch.utils.checkpoint`, however the model
    calls it (`from torch.utils.checkpoint import checkpoint` binds the function at import, so
    the module's attribute is not what it calls): the non-reentrant one enters a
    `_checkpoint_hook` (its saved-tensor hooks, torch's `_checkpoint_without_reentrant_generator`;
    `checkpoint_sequential`, `checkpoint_wrapper` and the composable `checkpoint` go through it),
    the reentrant one runs `CheckpointFunction.forward`; both are looked up on their classes at
    each call, and are watched there for this one forward. A step that raises before any
    checkpoint ran gives None (not known): the simulation runs it again and reports why."""
    ran = []
    hook = torch.utils.checkpoint._checkpoint_hook
    function = torch.utils.checkpoint.CheckpointFunction
    init, forward = hook.__init__, function.__dict__["forward"]

    def watched_init(self, *args, **kwargs):
        ran.append("non-reentrant")
        init(self, *args, **kwargs)

    def watched_forward(*args, **kwargs):
        ran.append("reentrant")
        return forward.__func__(*args, **kwargs)

    hook.__init__, function.forward = watched_init, staticmethod(watched_forward)
    try:
        with _fake_addresses(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(model, 1)
    except Exception:
        if not ran:
            return None                  # not known: the step stopped before any checkpoint
    finally:
        hook.__init__, function.forward = init, forward
    return bool(ran)


@contextlib.contextmanager
def _positions_as_made(model: nn.Module) -> Iterator[None]:
    """On fake tensors, a Hugging Face model's step as it runs on real ones when it is given no
    position ids. With no attention mask, transformers reads the position ids to tell whether
    the batch packs several sequences (`masking_utils.find_packed_sequence_indices`); it cannot
    read a fake tensor's values (`is_tracing` counts a FakeTensor as tracing), so it keeps the
    packed-sequence mask, builds a (B, 1, T, T) mask instead of SDPA's `is_causal`, and repeats
    grouped keys and values (`repeat_kv`) instead of `enable_gqa`: a checkpointed step then
    peaked 5.7% above the real one (Qwen2, 5 layers, 8 x 96 tokens, every layer checkpointed:
    14,185,156 B simulated, 13,423,300 B real; the plain step alike to the byte). The position
    ids the model makes itself (`arange`) never pack, and for them the real run finds none:
    here so does the simulation. Two value-read branches stay the fake run's, since their values
    are the step's: ids the step passes (`position_ids=`) are taken as packed, and an attention
    mask as padded, though the real run drops an all-ones mask (`_ignore_causal_mask_sdpa`'s
    `fast_all`): a Llama of those sizes with `attention_mask=torch.ones_like(ids)` simulated 9.96%
    above its real plain step, 5.5% above its checkpointed one (38,185,672 B against
    34,726,540 B, 14,541,580 B against 13,779,724 B)."""
    masking = sys.modules.get("transformers.masking_utils")
    found = getattr(masking, "find_packed_sequence_indices", None)
    outer = _hf_models(model)
    outer = [m for m in outer if not any(o is not m and any(c is m for c in o.modules())
                                        for o in outer)]
    if found is None or not outer:
        yield
        return
    given: list[bool] = []

    def note(module, args, kwargs):
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        given.append(bound.get("position_ids") is not None)

    def as_made(position_ids):
        if isinstance(position_ids, FakeTensor) and not any(given):
            return None                      # what the real run finds for arange positions
        return found(position_ids)

    hooks = [m.register_forward_pre_hook(note, with_kwargs=True) for m in outer]
    masking.find_packed_sequence_indices = as_made
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found
        for h in hooks:
            h.remove()


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
            lora.apply_lora(model, cand.lora_rank, cand.lora_targets or None)
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
            with _positions_as_made(setup.model) if fake else contextlib.nullcontext():
                _micro_batch(setup, cand, step, k)            # 3. the last micro-batch
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
        with FlopCounterMode(display=False) as counter, \
                (_positions_as_made(setup.model) if fake else contextlib.nullcontext()):
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
