"""Simulate a plan's training step on fake tensors (`simulate`): the same code as a real step
(`training.build`, `micro_step`, `optimizer_step`) under `FakeTensorMode`, measured by
`companion.memory.track`; several ranks as rank 0 of a "fake" process group.

No kernel runs: each operator's rule for the shape and dtype of its result does, for the CPU's
dispatch, except RMSNorm when simulating CUDA: there it runs as CUDA's fused kernel saves
(`_fused_rms_norm`: its input and fp32 rstd), not as the CPU's composite, which keeps fp32
copies besides (a Llama block's activations ~1.3x in bf16). What it shows is that the same ledger
of tensors fits; kernels' scratch, the caching allocator's rounding and fragmentation are
`plan.budget`'s lines.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import FakeTensor

from companion.memory import MemoryTracker, track
from companion.plan.space import Candidate, GPTShape
from companion.plan.training import (Setup, _dtype, _quantized_on_host, build, micro_step,
                                     optimizer_step)

__all__ = ["simulate", "sharded_init"]


@contextlib.contextmanager
def _fake_ranks(world_size: int) -> Iterator[None]:
    """A "fake" process group of `world_size` in which this process is rank 0: collectives
    return at once, allocations are the real ones. Nothing when world_size is 1."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("simulating several ranks needs a process of its own: this one "
                           "already belongs to a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_MISSING = object()


@contextlib.contextmanager
def _fake_addresses() -> Iterator[None]:
    """Give fake tensors distinct addresses. A FakeTensor's storage is meta, whose data_ptr is 0
    for every tensor, so code that tells storages apart by address (FSDP's saved-tensor hook,
    a gradient that is already its bucket's view) would take every tensor for the same one;
    here each storage's address is its C++ object's, spread 2^40 apart, plus the view's offset."""
    classes = (torch.UntypedStorage, FakeTensor)
    own = [cls.__dict__.get("data_ptr", _MISSING) for cls in classes]   # not inherited ones
    storage_ptr = torch.UntypedStorage.data_ptr

    def storage_address(storage):
        return storage._cdata << 40 if storage.device.type == "meta" else storage_ptr(storage)

    def tensor_address(t):
        return storage_address(t.untyped_storage()) + t.storage_offset() * t.element_size()

    # Process-wide for the block's duration (the simulation runs in this thread); restored
    # exactly as it was: a class's own attribute put back, an inherited one uncovered again.
    torch.UntypedStorage.data_ptr, FakeTensor.data_ptr = storage_address, tensor_address
    try:
        yield
    finally:
        for cls, before in zip(classes, own):
            if before is _MISSING:
                delattr(cls, "data_ptr")
            else:
                setattr(cls, "data_ptr", before)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA dispatches it: `aten._fused_rms_norm`, one kernel that saves its input and
    the fp32 rstd (N values) for `_fused_rms_norm_backward`, which makes only dx and dw. Forward
    runs the op's decomposition (no_grad inside forward: nothing else is saved, its fp32
    temporaries freed at once); backward the op itself, which has no CPU kernel: fake tensors
    only, where its meta rule makes the two outputs and nothing between."""

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        out, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)   # (.., C), (.., 1)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dx, dw = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight,
                                                         [True, weight is not None])
        return dx, dw, None, None


@contextlib.contextmanager
def _rms_norm_as_on(device_type: str) -> Iterator[None]:
    """nn.RMSNorm runs as `device_type` dispatches it: on "cuda" the fused kernel's saved
    tensors (`_FusedRMSNorm`), elsewhere unchanged. Restored when the block ends."""
    if device_type != "cuda":
        yield
        return
    forward = nn.RMSNorm.forward
    nn.RMSNorm.forward = lambda self, x: _FusedRMSNorm.apply(
        x, self.weight, list(self.normalized_shape), self.eps)
    try:
        yield
    finally:
        nn.RMSNorm.forward = forward


def _trainable(setup: Setup) -> list[torch.Tensor]:
    return [p for p in setup.model.parameters() if p.requires_grad]


@contextlib.contextmanager
def _broadcast_skipped() -> Iterator[None]:
    """`dist.broadcast` does nothing while the block runs. In a fake group it does nothing
    anyway, but its fake operator returns the tensor it was given, which the tracker, not having
    seen that tensor made (`sharded_init`: made before the measurement), counts as new: a 70B
    model's FSDP start counted 260 GiB of weights that were never allocated in it."""
    broadcast = dist.broadcast
    dist.broadcast = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.broadcast = broadcast


def sharded_init(cand: Candidate, world_size: int, device_type: str) -> bool:
    """Whether a simulated GPU step leaves the whole model's making out of its measurement:
    ZeRO-3 over several ranks, where FSDP2 users make the model on the meta device and each rank
    materializes only its shards (`fully_shard`, then `to_empty` and the weights' init:
    torchtitan's train.py builds `with torch.device("meta")`). The course's `zero.FSDP` takes a
    model made whole and shards it; made whole inside the measurement, a 70B model's 260 GiB of
    fp32 weights would be every such plan's peak, a load no later step repeats. Its shards, and
    each module's flat copy while it is split, are measured."""
    return cand.zero_stage == 3 and world_size > 1 and device_type != "cpu"


def simulate(model_fn: Callable[..., nn.Module], cand: Candidate, *, world_size: int = 1,
             device_type: str = "cpu", shape: GPTShape | None = None) -> MemoryTracker:
    """Simulate the plan's training step on fake tensors, measured with `track`.

    Nothing is allocated (shapes and dtypes only), so the peak of a model far larger than this
    machine is measured in seconds. The step is run as every step after the first: on one rank,
    the optimizer state is made first (a step on zero gradients), the gradients of the earlier
    micro-batches are there (zeros, when accumulating), then the last micro-batch's forward and
    backward, then the optimizer step, whose peak every later step repeats. Several ranks (rank
    0's memory): two real steps, of one micro-batch, then of min(k, 2) (the second micro-batch
    holds what every later one does). QLoRA for a GPU (`device_type="cuda"`): the dense base is
    made and quantized on the host before the measurement, which counts its copy to the device;
    RMSNorm saves what CUDA's fused kernel does (the module doc). ZeRO-3 on several GPUs: the
    model is made before the measurement, its shards after (`sharded_init`). `shape`: `GPTShape.of(model_fn)`,
    when the caller has it (it builds the model once more, seconds for a 7B)."""
    shape, k = shape or GPTShape.of(model_fn), cand.accumulation
    batch = (cand.micro_batch, shape.seq_len)
    with _fake_ranks(world_size), FakeTensorMode(), _fake_addresses(), \
            _rms_norm_as_on(device_type):
        x, y = (torch.randint(shape.vocab, (k * batch[0], batch[1])) for _ in range(2))  # the
        # step's data, like a loader's, and QLoRA's host-side model for a GPU: not counted
        host = (_quantized_on_host(model_fn, cand)
                if cand.nf4_base and device_type != "cpu" else None)
        made = None                                    # FSDP2 makes it on the meta device:
        if sharded_init(cand, world_size, device_type):   # unseen (fused: the lever's model)
            made = model_fn(dtype=_dtype(cand), device="cpu",
                            **({"fused_attention": True} if cand.fused_attention else {}))
        with track("cpu") as tracker:
            with _broadcast_skipped() if made is not None else contextlib.nullcontext():
                setup = build(model_fn, cand, world_size=world_size, host_model=host,
                              paged_to_host=device_type != "cpu", made=made)
            del host, made
            if world_size == 1:
                # 1. The optimizer's state, as after the first step (offload: on the host).
                if not cand.offload:
                    for p in _trainable(setup):
                        p.grad = torch.zeros_like(p)
                        if cand.in_backward:       # stepped in backward: one gradient at a
                            setup.optimizer.step()     # time, freed after its step
                            p.grad = None
                    optimizer_step(setup)
                # 2. Gradients cleared, then what the earlier micro-batches left (accumulation).
                setup.optimizer.zero_grad(set_to_none=True)
                held = [] if cand.nf4_keeps_inputs else None   # bitsandbytes < 0.43.2: the
                if cand.nf4_keeps_inputs:              # micro-batch before, its output held
                    micro_step(setup, x[:batch[0]], y[:batch[0]], scale=1 / k, held=held)
                    if k == 1:                         # (litgpt's `logits`): the last step's,
                        optimizer_step(setup)          # stepped and its gradients cleared
                        setup.optimizer.zero_grad(set_to_none=True)
                elif k > 1 and not cand.offload and cand.precision != "main_grad":  # (main_grad:
                    for p in _trainable(setup):                         # in its fp32 buffers)
                        p.grad = torch.zeros_like(p)
                # 3. The last micro-batch's forward and backward, then the step.
                micro_step(setup, x[-batch[0]:], y[-batch[0]:], scale=1 / k, held=held)
                optimizer_step(setup)
                del held                               # (its output held through the step)
            # Several ranks: two real steps (fake collectives), of 1 then min(k, 2) micro-batches.
            for count in ((1, min(k, 2)) if world_size > 1 else ()):
                setup.optimizer.zero_grad(set_to_none=True)
                for i in range(count):
                    micro_step(setup, x[:batch[0]], y[:batch[0]], scale=1 / k,
                               sync=i == count - 1)
                optimizer_step(setup)
            del setup
    return tracker
