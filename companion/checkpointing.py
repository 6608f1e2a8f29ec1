"""Gradient checkpointing: keep a few activations, recompute the rest during backward.

Backward needs tensors from forward (a Linear layer needs its input to form the weight gradient, a
ReLU needs to know where its input was positive). Autograd saves them, so a deep network holds one
set of activations per layer until its backward runs. Checkpointing a block keeps only the block's
*inputs*, runs the block without saving anything, and runs it again inside backward to get the
saved tensors back. It trades one extra forward pass (about a third more compute: backward costs
about two forwards) for activation memory. It does not change which parameters are trained: every
gradient is the same as without it.

Example:
    >>> layers = [torch.nn.Linear(64, 64) for _ in range(16)]
    >>> y = checkpoint_sequential(layers, 4, torch.randn(8, 64, requires_grad=True))
    >>> y.sum().backward()                     # same gradients as running the layers plainly

Simplified vs PyTorch (`torch.utils.checkpoint`): this is the "reentrant" design (backward calls
backward again on the recomputed block). It does not restore autocast state, supports only
tensor (or tuple of tensor) outputs, and ignores keyword arguments; PyTorch's default non-reentrant
version packs and unpacks saved tensors through hooks instead and can stop recomputing early.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from companion.memory import track

__all__ = [
    "Checkpoint",
    "checkpoint",
    "checkpoint_sequential",
    "SavedTensor",
    "saved_for_backward",
    "activation_bytes",
    "predicted_activation_units",
    "predicted_activation_bytes",
    "segments_for_budget",
    "sqrt_segments",
    "predicted_time_ratio",
    "SegmentRun",
    "profile_segments",
]


class Checkpoint(torch.autograd.Function):
    """Run `fn` without saving activations; recompute it in backward.

    Memory: only the tensor inputs of `fn` are kept (plus the RNG state, a few KiB), instead of
    everything autograd would save inside `fn`. Cost: `fn` runs twice, once here and once in
    backward.
    """

    @staticmethod
    def forward(ctx, fn: Callable, anchor: torch.Tensor, *args):
        # 1. Remember how to run fn again: the function, its inputs, and the random state.
        ctx.fn = fn
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_devices = sorted({a.device.index for a in args
                                   if isinstance(a, torch.Tensor) and a.is_cuda})
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])   # the only activations kept
        # 2. Run fn with autograd off: nothing inside it is saved for backward.
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        # 1. Rebuild the inputs as fresh leaves, so the recomputed graph starts here.
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        # 2. Run fn again with autograd on, from the same random state (same dropout masks),
        #    without disturbing the random stream of the code around us.
        with torch.random.fork_rng(devices=ctx.cuda_devices):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # 3. Backpropagate through the recomputed graph: parameter .grad fills here,
        #    input gradients are returned to the outer graph.
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return (None, None) + input_grads


def checkpoint(fn: Callable, *args):
    """`fn(*args)`, keeping only `args` for backward and recomputing `fn` there.

    Same gradients as `fn(*args)`, also with dropout inside `fn` (the random state is replayed).

    Example:
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> y = checkpoint(block, torch.randn(4, 8))
        >>> y.sum().backward()                 # block's parameters get their .grad
    """
    # A zero-size leaf that requires grad: autograd then calls our backward even when no input
    # requires grad (the first block of a network), because fn's parameters still need gradients.
    anchor = torch.empty(0, requires_grad=True)
    return Checkpoint.apply(fn, anchor, *args)


def _run(layers: Sequence[Callable]) -> Callable:
    def forward(x):
        for layer in layers:
            x = layer(x)
        return x
    return forward


def checkpoint_sequential(layers: Sequence[Callable], segments: int, x: torch.Tensor) -> torch.Tensor:
    """Run `layers` in order on `x`, split into `segments` pieces, all but the last checkpointed.

    Memory, for n equal layers of activation size A: about (segments - 1) + n/segments activations
    instead of n, smallest near segments = √n (about 2√n·A). Cost: every layer but the last
    segment's runs forward twice.
    `segments=1` is plain execution (nothing checkpointed).

    Example:
        >>> y = checkpoint_sequential(list(model), 4, x)   # model: an nn.Sequential
    """
    layers = list(layers)
    if not 1 <= segments <= max(len(layers), 1):
        raise ValueError(f"segments must be between 1 and the number of layers ({len(layers)}), "
                         f"got {segments}")
    size = len(layers) // segments
    for start in range(0, size * (segments - 1), size):       # checkpointed segments
        x = checkpoint(_run(layers[start:start + size]), x)
    return _run(layers[size * (segments - 1):])(x)            # last segment: plain, saved


# ---------------------------------------------------------------- what autograd saves

@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd saved for backward."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    is_parameter: bool   # a parameter is stored anyway; only the rest is activation memory
    storage: int         # address of its storage: tensors saved twice, or views, share one


def saved_for_backward(fn: Callable, *args) -> list[SavedTensor]:
    """Run `fn(*args)` and list every tensor autograd saves for backward, in the order saved.

    A tensor saved twice (``x * x`` saves x twice) is listed twice; its storage exists once.
    Uses `torch.autograd.graph.saved_tensors_hooks`, which sees each tensor as it is packed.
    """
    params: set[int] = set()
    if isinstance(fn, torch.nn.Module):
        params = {p.untyped_storage().data_ptr() for p in fn.parameters()}
    seen: list[SavedTensor] = []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage().data_ptr()
        seen.append(SavedTensor(tuple(t.shape), t.dtype, t.numel() * t.element_size(),
                                storage in params, storage))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return seen


def activation_bytes(fn: Callable, *args) -> int:
    """Bytes of activation memory `fn(*args)` keeps for backward: saved tensors that are not
    parameters of `fn` (a module), each storage counted once."""
    first: dict[int, int] = {}
    for t in saved_for_backward(fn, *args):
        if not t.is_parameter:
            first.setdefault(t.storage, t.nbytes)
    return sum(first.values())


# ---------------------------------------------------------------- choosing the segment count

def predicted_activation_units(n_layers: int, segments: int) -> int:
    """Layer outputs held at the peak of backward with `checkpoint_sequential(…, segments, …)`.

    The inputs of the checkpointed segments stay alive (segments - 1 of them, the first is the
    network's own input, counted here too), plus one segment's layer outputs while it is
    recomputed or held: the longest segment, which is the last one. With segments = 1 that is
    all n layers.
    """
    size = n_layers // segments
    longest = n_layers - size * (segments - 1)
    return (segments - 1) + longest


def predicted_activation_bytes(n_layers: int, segments: int, layer_bytes: int,
                               checkpoint_bytes: int | None = None) -> int:
    """`predicted_activation_units` in bytes, when a checkpoint (one layer's input, `checkpoint_bytes`)
    is smaller than everything a layer saves (`layer_bytes`), as in a transformer block."""
    checkpoint_bytes = layer_bytes if checkpoint_bytes is None else checkpoint_bytes
    longest = predicted_activation_units(n_layers, segments) - (segments - 1)
    return (segments - 1) * checkpoint_bytes + longest * layer_bytes


def segments_for_budget(n_layers: int, layer_bytes: int, budget_bytes: int) -> int | None:
    """The fewest segments whose predicted activation peak fits `budget_bytes`, or None.

    Fewest, because each extra checkpointed segment means more recompute; None when even the
    best split (near √n segments) does not fit.
    """
    for segments in range(1, n_layers + 1):
        if predicted_activation_units(n_layers, segments) * layer_bytes <= budget_bytes:
            return segments
    return None


def sqrt_segments(n_layers: int) -> int:
    """The segment count near √n that minimises `predicted_activation_units`."""
    return min(range(1, n_layers + 1), key=lambda s: (predicted_activation_units(n_layers, s), s))


def predicted_time_ratio(n_layers: int, segments: int) -> float:
    """Step time with checkpointing over step time without, counting compute only.

    A backward costs about two forwards, so a plain step is 3 forward-units; every layer in a
    checkpointed segment runs forward once more: at most 4/3 when all of them are recomputed.
    """
    recomputed = (n_layers // segments) * (segments - 1)
    return (3 * n_layers + recomputed) / (3 * n_layers)


# ---------------------------------------------------------------- measuring

@dataclasses.dataclass(frozen=True)
class SegmentRun:
    """One segment count, measured: peaks are bytes above what was live before the step."""

    segments: int
    peak_bytes: int          # everything the step allocated: activations, temporaries, gradients
    activation_bytes: int    # the most bytes saved for backward at any one time
    seconds: float           # fastest of the timed steps


def profile_segments(step: Callable[[int], object], counts: Sequence[int], *,
                     device: torch.device | str | None = None, repeats: int = 3) -> list[SegmentRun]:
    """Measure `step(segments)` (one forward and backward) for each segment count.

    Per count: one warm-up run (it also allocates the gradients, so later runs measure activations,
    not gradients), one run under `companion.memory.track`, then `repeats` timed runs without the
    tracker (it slows operators down), of which the fastest is kept: other work on the
    machine only ever adds time.
    """
    device = torch.device(device) if device is not None else None
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    runs = []
    for segments in counts:
        step(segments)                                          # warm-up
        with track(device) as tracker:
            step(segments)
        times = []
        for _ in range(repeats):
            sync()                                              # host-device sync
            start = time.perf_counter()
            step(segments)
            sync()                                              # host-device sync
            times.append(time.perf_counter() - start)
        runs.append(SegmentRun(segments, tracker.peak, _saved_peak(tracker.timeline()),
                               min(times)))
    return runs


def _saved_peak(timeline: dict[str, list]) -> int:
    """The most bytes saved for backward at once. The tracker labels a saved leaf that requires
    grad a parameter; inside a step those are the inputs `Checkpoint.backward` rebuilds as leaves
    (the model's parameters exist before the step and are not counted), so both kinds add up."""
    return max((a + p for a, p in zip(timeline["activations"], timeline["parameters"])), default=0)
