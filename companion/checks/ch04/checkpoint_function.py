"""Chapter 04, exercise 2: a checkpoint function that recomputes its block in backward."""
from __future__ import annotations

import torch

from companion import checkpointing
from companion.checks.ch04._common import _block, _input
from companion.checks.core import (CheckFailed, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)
from companion.memory import format_bytes

__all__ = ["check_checkpoint_function"]


def _gradients(fn_wrapper, block, x, seed, *, autocast: torch.dtype | None = None):
    """(output, parameter and input gradients) of fn_wrapper(block, x); with `autocast` (a dtype),
    forward runs under CPU autocast to that dtype and backward after its block has closed, as a
    training step does."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = fn_wrapper(block, x)
    if not isinstance(y, torch.Tensor) or not y.requires_grad:
        raise CheckFailed(f"expected a tensor that requires grad, got {type(y).__name__}"
                          + (" without grad" if isinstance(y, torch.Tensor) else ""),
                          hint="return the output of Checkpoint.apply(fn, x).")
    weights = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    (y * weights).sum().backward()
    grads = tuple(p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                  for p in block.parameters())
    return y.detach(), grads + (x.grad if x.grad is not None else torch.zeros_like(x),)


@harness
def _checkpoint_forward(answer, seed: int, width: int, p: float) -> tuple[int, int]:
    """(bytes the answer's forward keeps for backward, how many times it ran fn)."""
    block, calls = _block(seed, width, p), []
    counted = lambda t: (calls.append(1), block(t))[1]
    torch.manual_seed(seed)
    kept = checkpointing.activation_bytes(lambda t: call_inplace(answer, counted, t),
                                          _input(seed, width))
    return kept, len(calls)


@harness
def _checkpoint_backward(answer, seed: int, width: int, p: float) -> tuple[tuple, int]:
    """((output, gradients) through the answer, how many times fn ran in forward and backward)."""
    block, calls = _block(seed, width, p), []
    counted = lambda t: (calls.append(1), block(t))[1]
    got = _gradients(lambda m, t: call_inplace(answer, counted, t), block, _input(seed, width),
                     seed)
    return got, len(calls)


@harness
def _autocast_gradients(answer, seed: int, width: int,
                        dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(output, gradients) of a block through the answer (plain autograd when answer is None),
    forward under CPU autocast to `dtype`, backward outside it."""
    run = (lambda m, t: m(t)) if answer is None else (lambda m, t: call_inplace(answer, m, t))
    return _gradients(run, _block(seed, width, 0.0), _input(seed, width), seed, autocast=dtype)


@harness
def _random_after_backward(answer, seed: int, width: int) -> torch.Tensor:
    """torch.rand after a backward through two stacked checkpointed blocks with dropout (the
    answer's, or plain autograd's when answer is None): a checkpoint must leave the caller's
    random stream where plain autograd leaves it."""
    first, second = _block(seed, width, 0.5), _block(seed + 1, width, 0.5)
    run = (lambda fn, t: fn(t)) if answer is None else \
        (lambda fn, t: call_inplace(answer, fn, t))
    torch.manual_seed(seed)
    y = run(second, run(first, _input(seed, width)))
    if isinstance(y, torch.Tensor) and y.requires_grad:
        y.sum().backward()
    return torch.rand(8)


@exercise(points=3, timeout=20.0, reference=("companion.checkpointing.Checkpoint",
                                             "companion.checkpointing.checkpoint",
                                             "torch.utils.checkpoint.checkpoint",
                                             "companion.checkpointing.checkpoint_hooks",
                                             "torch.utils.checkpoint.CheckpointFunction"))
def check_checkpoint_function(answer) -> str:
    """answer(fn, x) -> fn(x), keeping only x for backward and recomputing fn inside backward.
    x requires grad; fn may use dropout; forward may run under autocast."""
    saved_plain = saved_mine = 0
    seeds = fresh_seeds(3)
    for seed, width, p in zip(seeds, [6, 11, 16], [0.0, 0.5, 0.3]):
        block, x = _block(seed, width, p), _input(seed, width)
        plain_saved = checkpointing.activation_bytes(block, x)
        want = _gradients(lambda m, t: m(t), block, x, seed)
        mine_saved, calls = _checkpoint_forward(answer, seed, width, p)
        require(calls == 1, f"fn ran {calls} times in forward; expected once",
                hint="forward runs fn once, under torch.no_grad().")
        require(mine_saved <= x.numel() * x.element_size(),
                f"forward kept {mine_saved} bytes for backward; a checkpoint keeps only its input "
                f"({x.numel() * x.element_size()} bytes; plain autograd keeps {plain_saved})",
                hint="run fn under torch.no_grad() in forward, so autograd saves nothing inside it; "
                     "ctx.save_for_backward(x) is all you keep.")
        saved_plain, saved_mine = saved_plain + plain_saved, saved_mine + mine_saved
        got, calls = _checkpoint_backward(answer, seed, width, p)
        require(calls == 2, f"fn ran {calls} times in forward and backward; expected "
                            "twice (once more to recompute)",
                hint="in backward, run fn again on a detached copy of x with grad enabled, then "
                     "backpropagate through that.")
        try:
            compare(got, want, name="(output, parameter and input gradients)")
        except CheckFailed as failure:
            if p > 0:
                failure.hint = ("with dropout the recomputation must draw the same masks: save "
                                "torch.get_rng_state() in forward and restore it (inside "
                                "torch.random.fork_rng()) before running fn in backward.")
            else:
                failure.hint = ("return x.grad of the recomputed input from backward, one "
                                "value per forward argument (None for fn).")
            raise
    plain_random = _random_after_backward(None, seeds[0], 7)
    plain_autocast = _autocast_gradients(None, seeds[1], 10)
    compare(_random_after_backward(answer, seeds[0], 7), plain_random,
            name="torch.rand(8) after backward through two stacked checkpoints",
            hint="restore the saved random state inside `with torch.random.fork_rng():`, so the "
                 "recomputation does not rewind the random stream of the code around backward.")
    compare(_autocast_gradients(answer, seeds[1], 10), plain_autocast,
            name="(output, parameter and input gradients) under bf16 autocast",
            hint="forward ran inside an autocast block and backward after it closed, so your "
                 "recomputation ran at another precision than forward did: remember forward's "
                 "autocast settings for the tensors' device (here the CPU, not CUDA) and "
                 "recompute under them.")
    # CPU autocast's default dtype is bf16, so a recomputation that assumes bf16 (or names no
    # dtype) matches above; under fp16 it runs at another precision than forward did (the
    # reference matches plain autograd exactly; issue 54, review finding 5).
    compare(_autocast_gradients(answer, seeds[1], 10, torch.float16),
            _autocast_gradients(None, seeds[1], 10, torch.float16),
            name="(output, parameter and input gradients) under float16 autocast",
            hint="your recomputation matches forward under bf16 autocast but not under float16: "
                 "which of forward's autocast settings does it remember, and which does it "
                 "assume?")
    return (f"same gradients as plain autograd (with dropout, and under autocast), random stream "
            f"left as it was; saved for backward "
            f"{format_bytes(saved_plain)} -> {format_bytes(saved_mine)}")
