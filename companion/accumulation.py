"""Gradient accumulation, and finding the largest batch that fits.

Activation memory grows with the batch; model states (weights, gradients, optimizer state) do not.
To train with an effective batch of k·b when only b examples fit, run k micro-batches of b, each
loss divided by k, and let backward *sum* their gradients into `.grad`; then take one optimizer
step. Because the loss is a mean, (1/k)·Σ mean(micro-batch) = mean(full batch): the gradient and the
step are those of the full batch, up to float rounding. Peak memory follows b, not k·b. The cost is
time: k smaller forward/backward passes use the device less well than one big one.

It is exact only when each example's loss does not depend on the others and on the number of calls:
BatchNorm (statistics per micro-batch), dropout (masks drawn in a different order) and anything that
counts micro-steps instead of optimizer steps (a learning-rate schedule) break the equality.

With token sequences the loss is a mean over *tokens*, and micro-batches hold different numbers
of real (not padding) tokens: dividing each micro-batch's mean by k then weights the tokens of a
short micro-batch more than those of a long one. `token_normalized_step` sums each micro-batch's
token losses and divides by the tokens of the whole batch, counted before the first backward.

Example:
    >>> loss = accumulation_step(model, F.mse_loss, opt, x, y, accum_steps=4)
    >>> loss = token_normalized_step(gpt, opt, [(x1, y1), (x2, y2)])    # y: -100 on padding

Simplified vs PyTorch: PyTorch has no accumulation helper; with DDP one adds `no_sync()` on all
micro-steps but the last (chapter 06). Here micro-batches are slices of one batch already in
memory; a real loop would load them one by one.
"""
from __future__ import annotations

import gc
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from companion.memory import MemoryTracker, budget_active, budget_bytes, track

__all__ = [
    "accumulation_step",
    "token_normalized_step",
    "accumulated_gradients",
    "gradient_gap",
    "step_memory",
    "find_max_batch_size",
    "choose_micro_batch",
    "fit_accumulation",
]


def accumulation_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                      x: torch.Tensor, y: torch.Tensor, *, accum_steps: int) -> float:
    """One optimizer step on the batch (x, y), computed as `accum_steps` micro-batches.

    Memory: activations of one micro-batch (len(x) / accum_steps examples) at a time.
    Cost: accum_steps forward and backward passes instead of one; the same single step.
    `loss_fn` must average over the batch (the default of PyTorch's losses). Returns the loss on
    the whole batch.
    """
    if not 1 <= accum_steps <= len(x):
        raise ValueError(f"accum_steps must be between 1 and the batch size {len(x)}, "
                         f"got {accum_steps}")
    # 1. Start from empty gradients: backward adds into .grad.
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for xb, yb in zip(x.tensor_split(accum_steps), y.tensor_split(accum_steps)):
        # 2. Scale each micro-batch's mean loss by its share of the batch:
        #    1/k when the micro-batches are equal, so the summed gradients are the full batch's.
        loss = loss_fn(model(xb), yb) * (len(xb) / len(x))
        # 3. Backward sums this micro-batch's gradient into .grad; its activations are freed.
        loss.backward()
        total += loss.item()                                   # host-device sync
    # 4. One step, with the gradient of the whole batch.
    optimizer.step()
    return total


def token_normalized_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                          ignore_index: int = -100) -> float:
    """One optimizer step on token micro-batches [(x, y), ...], the same step as on all of them at
    once: the mean cross-entropy over every real token, whatever their split.

    `model(x)` returns logits (b, T, vocab); y (b, T) holds the targets, `ignore_index` where a
    position is padding. Memory and cost as `accumulation_step`; counting the tokens first is one
    host-device sync per micro-batch. Returns the loss on the whole batch.
    """
    # 1. Count the real tokens of the whole batch before any backward.
    total_tokens = sum(int((y != ignore_index).sum()) for _, y in micro_batches)   # syncs
    if total_tokens == 0:
        raise ValueError("every target is ignore_index: there is no token to learn from")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in micro_batches:
        logits = model(x)                                        # (b, T, vocab)
        # 2. Sum this micro-batch's token losses; divide by the tokens of the whole batch.
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=ignore_index,
                               reduction="sum") / total_tokens
        loss.backward()                                          # adds into .grad
        total += loss.item()                                     # host-device sync
    optimizer.step()                                             # 3. one step
    return total


def accumulated_gradients(model: torch.nn.Module, loss_fn: Callable, x: torch.Tensor,
                          y: torch.Tensor, *, accum_steps: int) -> list[torch.Tensor]:
    """The gradients that `accumulation_step` would step with (accum_steps=1: the full batch's)."""
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.tensor_split(accum_steps), y.tensor_split(accum_steps)):
        (loss_fn(model(xb), yb) * (len(xb) / len(x))).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def gradient_gap(make_model: Callable[[], torch.nn.Module], loss_fn: Callable, x: torch.Tensor,
                 y: torch.Tensor, *, accum_steps: int, seed: int = 0) -> float:
    """Largest |difference| between the accumulated and the full-batch gradient, same start.

    Both runs build the model with `make_model()` and start from `torch.manual_seed(seed)`, so any
    gap left comes from the method: float rounding (about 1e-7 relative in fp32), or a layer whose
    output depends on the batch it sees (BatchNorm) or on the order of random draws (dropout).
    """
    grads = []
    for k in (1, accum_steps):
        torch.manual_seed(seed)
        model = make_model().train()
        grads.append(accumulated_gradients(model, loss_fn, x, y, accum_steps=k))
    return max(float((a - b).abs().max()) for a, b in zip(*grads))


def step_memory(make_model: Callable[[], torch.nn.Module], loss_fn: Callable, x: torch.Tensor,
                y: torch.Tensor, *, accum_steps: int = 1,
                device: torch.device | str | None = None,
                foreach: bool | None = None) -> MemoryTracker:
    """Measure training from nothing: build the model, then two Adam steps on (x, y).

    Everything the run allocates is counted (weights, gradients, Adam's two moments, activations,
    temporaries); the data (x, y) exists before and is not. The second step is the steady state:
    its peak is model states plus one micro-batch's activations. Read `.peak` and `.breakdown()`.
    `foreach`: Adam's implementation (None: torch's default, foreach on CUDA, which holds 4 bytes
    per parameter of temporaries in the step; the per-tensor loop on the CPU, two of the largest).
    """
    with track(device) as tracker:
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), foreach=foreach)
        for _ in range(2):
            accumulation_step(model, loss_fn, optimizer, x, y, accum_steps=accum_steps)
    return tracker


# ---------------------------------------------------------------- the largest batch that fits

def _free(device: torch.device) -> None:
    gc.collect()                                               # drop cycles that hold tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()                               # return cached blocks to the driver


def _fits(step: Callable[[int], object], batch: int, device: torch.device) -> bool:
    before = budget_bytes()
    try:
        step(batch)
        return True
    except torch.OutOfMemoryError:
        pass                                                   # the error and its frames die here
    # What the failed step allocated may sit in reference cycles: collect them, and on CUDA
    # return the cache. On the CPU only when the budget still counts bytes the try made (a full
    # collection costs ~0.3 s in a large process, and a step that raised alone left nothing).
    if device.type == "cuda" or budget_bytes() > before:
        _free(device)
    return False


def find_max_batch_size(step: Callable[[int], object], *, start: int = 1,
                        device: torch.device | str | None = None, limit: int = 2**16) -> int:
    """The largest batch size b for which `step(b)` runs without `torch.OutOfMemoryError`.

    Doubles b from `start` until a step runs out of memory (or b reaches `limit`), then bisects
    between the last batch that ran and the first that did not: about 2·log2(b) trial steps.
    After a try that runs out of memory, memory is freed (garbage collection; on CUDA the
    allocator's cache too) before the next.
    Works on CUDA and under `companion.memory.memory_budget` on CPU. Assumes that if b fits,
    every smaller batch fits. On a CPU outside a budget nothing runs out of memory until the
    machine's RAM does (the search would try batches up to `limit` for real): it warns then, and
    warns again when it stops at `limit` without a single failure (the answer is then `limit`, a
    bound, not the largest batch).

    Example:
        >>> with memory_budget("64 MiB"):
        ...     b = find_max_batch_size(lambda b: train_step(model, b), device="cpu")
    """
    device = torch.device(device if device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not budget_active():
        warnings.warn("find_max_batch_size on the CPU outside memory_budget: no step runs out of "
                      "memory before the machine's RAM does, so batches up to limit="
                      f"{limit} may really be tried. Wrap the call in "
                      "companion.memory.memory_budget('512 MiB') (your device's size), unless step "
                      "raises torch.OutOfMemoryError itself.", stacklevel=2)
    if not _fits(step, start, device):
        raise torch.OutOfMemoryError(f"even a batch of start={start} does not fit; "
                                     "lower start, or shrink the model or its states")
    good, bad = start, None                                    # good runs; bad is out of memory
    while bad is None and good < limit:                        # 1. double until out of memory
        trial = min(2 * good, limit)
        good, bad = (trial, None) if _fits(step, trial, device) else (good, trial)
    while bad is not None and bad - good > 1:                  # 2. bisect between good and bad
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _fits(step, middle, device) else (good, middle)
    if bad is None:
        warnings.warn(f"find_max_batch_size stopped at limit={limit} without running out of "
                      "memory: the largest batch may be larger (raise limit), or nothing is "
                      "capping memory (on the CPU: memory_budget)", stacklevel=2)
    return good


def choose_micro_batch(target: int, max_batch: int) -> tuple[int, int]:
    """(b, k) with b·k == target and b the largest that fits (b <= max_batch): fewest micro-steps.

    b divides the target, so every micro-batch has the same size and scaling each loss by 1/k is
    exact. (Weighting each micro-batch by its share, as `accumulation_step` does, is exact for
    uneven ones too: `fit_accumulation` splits that way, and never falls to b = 1 for a prime
    target.) `max_batch` must be the largest *micro*-batch that fits, measured with accumulation
    (`fit_accumulation`): a batch that fits alone is larger.
    """
    if target < 1 or max_batch < 1:
        raise ValueError(f"target and max_batch must be positive, got {target} and {max_batch}")
    b = max(d for d in range(1, min(target, max_batch) + 1) if target % d == 0)
    return b, target // b


def fit_accumulation(step: Callable[[int, int], object], target: int, *, start: int = 1,
                     steps: int = 2, device: torch.device | str | None = None) -> tuple[int, int]:
    """(b, k): the fewest micro-batches k, of at most b examples, in which an effective batch of
    `target` examples trains without `torch.OutOfMemoryError`.

    `step(batch, accum_steps)` takes one optimizer step on the first `batch` examples as
    `accum_steps` micro-batches (`accumulation_step`). Every trial runs `steps` (at least two)
    optimizer steps of the configuration it vouches for: the first step creates the optimizer's
    state, which every later step carries through forward and backward, and from the second
    micro-batch on the earlier micro-batches' gradients are alive while the next one's activations
    are. So the largest micro-batch is smaller than the largest batch that fits alone
    (`find_max_batch_size` of one plain step).

    Example:
        >>> with memory_budget("64 MiB"):
        ...     b, k = fit_accumulation(lambda n, k: accumulation_step(
        ...         model, F.cross_entropy, opt, X[:n], Y[:n], accum_steps=k), target=1024)
    """
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first optimizer step creates the "
                         f"optimizer's state, the second carries it), got {steps}")
    if target < 2:
        raise ValueError(f"target must be at least 2 examples, got {target}")
    device = torch.device(device if device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not budget_active():
        warnings.warn("fit_accumulation on the CPU outside memory_budget: nothing runs out of "
                      "memory before the machine's RAM does. Wrap the call in "
                      "companion.memory.memory_budget(...), unless step raises "
                      "torch.OutOfMemoryError itself.", stacklevel=2)

    def trial(batch: int, accum_steps: int) -> None:
        for _ in range(steps):
            step(batch, accum_steps)

    if _fits(lambda n: trial(n, 1), target, device):           # 1. the whole batch at once
        return target, 1
    # 2. The largest micro-batch b, two micro-batches of b per step: with k >= 2 the peak holds
    #    one set of gradients and one micro-batch's activations, whatever k is.
    with warnings.catch_warnings():                            # said above; limit is k = 2
        warnings.simplefilter("ignore")
        largest = find_max_batch_size(lambda b: trial(2 * b, 2), start=min(start, target // 2),
                                      device=device, limit=target // 2)
    # 3. The fewest micro-batches of at most `largest`; run it, and split finer if it fails.
    for k in range(-(-target // largest), target + 1):
        if _fits(lambda n: trial(n, k), target, device):
            return -(-target // k), k
    raise torch.OutOfMemoryError(f"no split of {target} examples into micro-batches fits")
