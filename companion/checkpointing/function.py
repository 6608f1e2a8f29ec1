"""The first design: a `torch.autograd.Function` whose backward runs the block again ("reentrant").

Forward runs the block under `no_grad` and saves only its inputs; backward rebuilds the inputs as
fresh leaves, runs the block again with autograd on, and calls `torch.autograd.backward` on that
recomputed graph, from *inside* the outer backward (which is what "reentrant" means).

As in PyTorch, the reentrant design refuses `torch.autograd.grad` and `backward(inputs=...)`
(the inner backward would write `.grad`, and `create_graph=True` would get no graph): the error
comes before anything is recomputed, so no `.grad` is touched.

Simplified vs PyTorch (`torch.utils.checkpoint(use_reentrant=True)`): tensor (or tuple of
tensor) outputs only, positional arguments only; no `preserve_rng_state=False`
(the random state is always replayed), no `determinism_check` or `debug`; no warning when no input
requires grad (an internal anchor makes the block's parameters get their gradients anyway).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from companion.checkpointing.hooks import _autocast, autocast_settings, checkpoint_hooks

__all__ = ["Checkpoint", "checkpoint", "checkpoint_sequential"]


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
        ctx.autocast = autocast_settings()
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])   # the only activations kept
        # 2. Run fn with autograd off: nothing inside it is saved for backward.
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        # 0. The inner backward below writes .grad (torch.autograd.backward), which
        #    torch.autograd.grad and backward(inputs=...) promise not to do: refuse them first.
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or "
                "passing an `inputs` parameter to .backward(). To resolve this error, you can "
                "either set use_reentrant=False, or call .backward() without passing the "
                "`inputs` argument.")
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
            with torch.enable_grad(), _autocast(ctx.autocast):      # forward's precision
                outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # 3. Backpropagate through the recomputed graph: parameter .grad fills here,
        #    input gradients are returned to the outer graph.
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return (None, None) + input_grads


def checkpoint(fn: Callable, *args, use_reentrant: bool = True, policy: Callable | None = None,
               **kwargs):
    """`fn(*args, **kwargs)`, keeping only the inputs for backward and recomputing `fn` there.

    Same gradients as `fn(*args)`, also with dropout inside `fn` (the random state is replayed).
    `use_reentrant=True` (the default here) is the `Checkpoint` Function above; False is the
    saved-tensor-hooks design (`checkpoint_hooks`), which also serves `torch.autograd.grad`,
    keyword arguments, non-tensor outputs and a selective `policy`.

    Example:
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> y = checkpoint(block, torch.randn(4, 8))
        >>> y.sum().backward()                 # block's parameters get their .grad
    """
    _refuse_torch_options(kwargs)
    if not use_reentrant:
        return checkpoint_hooks(fn, *args, policy=policy, **kwargs)
    if kwargs or policy is not None:
        raise ValueError("the reentrant checkpoint takes positional tensors only: pass "
                         "use_reentrant=False for keyword arguments or a selective policy")
    # A zero-size leaf that requires grad: autograd then calls our backward even when no input
    # requires grad (the first block of a network), because fn's parameters still need gradients.
    anchor = torch.empty(0, requires_grad=True)
    return Checkpoint.apply(fn, anchor, *args)


def _refuse_torch_options(kwargs: dict) -> None:
    """torch.utils.checkpoint's own options, which would otherwise reach `fn` as its arguments:
    `preserve_rng_state=True` is what this checkpoint always does; the others are not built."""
    if kwargs.get("preserve_rng_state", True) is True:
        kwargs.pop("preserve_rng_state", None)
    else:
        raise ValueError("preserve_rng_state=False is not supported: this checkpoint always "
                         "replays the random state (same dropout masks); use "
                         "torch.utils.checkpoint for it")
    for name in ("context_fn", "determinism_check", "debug"):
        if name in kwargs:
            raise ValueError(f"{name}= is an option of torch.utils.checkpoint that this "
                             "checkpoint does not have: for selective recomputation pass "
                             "policy=... with use_reentrant=False, or use torch.utils.checkpoint")


def _run(layers: Sequence[Callable]) -> Callable:
    def forward(x):
        for layer in layers:
            x = layer(x)
        return x
    return forward


def checkpoint_sequential(layers: Sequence[Callable], segments: int, x: torch.Tensor, *,
                          use_reentrant: bool = True, last: bool = False) -> torch.Tensor:
    """Run `layers` in order on `x`, split into `segments` pieces, all but the last checkpointed
    (`last=True`: the last one too, as wrapping every layer in a checkpoint does).

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
        x = checkpoint(_run(layers[start:start + size]), x, use_reentrant=use_reentrant)
    rest = _run(layers[size * (segments - 1):])               # the last segment: plain, its
    return checkpoint(rest, x, use_reentrant=use_reentrant) if last else rest(x)   # tensors saved
