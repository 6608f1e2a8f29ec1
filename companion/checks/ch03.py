"""Checks for chapter 03, batch size and gradient accumulation."""
from __future__ import annotations

import copy
import math
import random

import torch
import torch.nn.functional as F

from companion import accumulation
from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)

__all__ = ["check_accumulation_step", "check_choose_micro_batch", "check_batch_size_search"]


def _setup(seed: int, n: int, d: int = 6):
    """A small classifier, SGD with momentum, and a fresh batch of n examples."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    x, y = torch.randn(n, d, generator=g), torch.randint(3, (n,), generator=g)
    return model, x, y


def _step_params(model, x, y, k, *, variant="reference", stale=None):
    """Parameters after one step: the reference, or a known-wrong variant of it."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if variant == "reference":
        accumulation.accumulation_step(model, F.cross_entropy, opt, x, y, accum_steps=k)
    else:
        for p, g in zip(model.parameters(), stale):
            p.grad = g.clone() if variant == "no_zero_grad" else None
        for xb, yb in zip(x.tensor_split(k), y.tensor_split(k)):
            scale = 1.0 if variant == "no_one_over_k" else 1.0 / k
            (F.cross_entropy(model(xb), yb) * scale).backward()
        opt.step()
    return tuple(p.detach().clone() for p in model.parameters())


def _reject_known_wrong(got, known_wrong: dict[str, tuple]) -> None:
    """CheckFailed with the hint of the first known-wrong result that `got` equals."""
    for hint, wrong in known_wrong.items():
        try:
            same = len(got) == len(wrong) and all(
                torch.allclose(torch.as_tensor(g, dtype=torch.float64),
                               torch.as_tensor(w, dtype=torch.float64), rtol=1e-4, atol=1e-6)
                for g, w in zip(got, wrong))
        except (TypeError, RuntimeError, ValueError):
            same = False
        if same:
            raise CheckFailed("this is a known mistake", expected=None, got=None, hint=hint)


def _stale(model, seed: int) -> list[torch.Tensor]:
    """Gradients left in .grad by an earlier step."""
    g = torch.Generator().manual_seed(seed + 2)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


@harness
def _accumulation_run(answer, seed: int, k: int, b: int) -> tuple:
    """Run the answer on the seed's model (stale gradients in .grad, SGD with momentum); return
    (its parameters after, how many optimizer steps ran, the batch sizes the model saw)."""
    model, x, y = _setup(seed, k * b)
    for p, g in zip(model.parameters(), _stale(model, seed)):
        p.grad = g
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen, steps = [], []
    model.register_forward_pre_hook(lambda module, inputs: seen.append(len(inputs[0])))
    opt.register_step_post_hook(lambda *args: steps.append(1))
    call(answer, model, F.cross_entropy, opt, x.clone(), y.clone(), k)
    return tuple(p.detach() for p in model.parameters()), len(steps), seen


@exercise(points=2, timeout=30.0, reference="companion.accumulation.accumulation_step")
def check_accumulation_step(answer) -> str:
    """answer(model, loss_fn, optimizer, x, y, accum_steps): one optimizer step on (x, y) made of
    accum_steps equal micro-batches (len(x) is a multiple of accum_steps)."""
    for seed, (k, b) in zip(fresh_seeds(3), [(4, 6), (3, 7), (5, 1)]):
        model, x, y = _setup(seed, k * b)
        stale = _stale(model, seed)
        got, steps, seen = _accumulation_run(answer, seed, k, b)
        require(steps == 1, f"optimizer.step() ran {steps} times; expected once",
                hint="accumulate the gradients of all micro-batches, then step once, after the loop.")
        require(max(seen, default=len(x)) <= b and len(seen) == k,
                f"the model saw batches of sizes {seen}; expected {k} micro-batches of {b}",
                hint="split x and y into accum_steps pieces (x.chunk(k)) and run the model on each: "
                     "that is what keeps the activations small.")
        expected = _step_params(model, x, y, k)
        if not all(torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(got, expected)):
            _reject_known_wrong(got, {
                "the step is k times too large: divide each micro-batch's loss by accum_steps "
                "(1/k). backward sums the gradients, it does not average them.":
                    _step_params(model, x, y, k, variant="no_one_over_k", stale=stale),
                "start with optimizer.zero_grad(): backward adds to whatever .grad holds, here "
                "gradients left over from an earlier step.":
                    _step_params(model, x, y, k, variant="no_zero_grad", stale=stale),
            })
        compare(got, expected, name="parameters after the step",
                hint="start with optimizer.zero_grad(), divide each micro-batch's loss by "
                     "accum_steps, call backward on each, step once.")
    return ("k micro-batches of b make the same step as one batch of k·b; activations are held for "
            "b examples at a time")


@exercise(points=1, reference="companion.accumulation.choose_micro_batch")
def check_choose_micro_batch(answer) -> str:
    """answer(target, max_batch) -> (b, k): b·k == target, b <= max_batch, b as large as possible."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [(96, 40), (7, 3), (64, 64), (30, 100), (1, 1)]
    cases += [(rng.randrange(2, 400), rng.randrange(1, 50)) for _ in range(5)]
    for target, max_batch in cases:
        got = call(answer, target, max_batch)
        b, k = accumulation.choose_micro_batch(target, max_batch)
        uneven = (min(max_batch, target), math.ceil(target / min(max_batch, target)))
        if uneven != (b, k):
            _reject_known_wrong(got, {
                "b must divide the target: with b = max_batch the micro-batches are unequal and "
                "b·k != target. Take the largest divisor of target that fits.": uneven})
        compare(got, (b, k), name=f"(b, k) for target {target}, max_batch {max_batch}",
                hint="b must divide the target exactly (b·k == target), fit (b <= max_batch), "
                     "and be the largest such b: fewer micro-steps run faster.")
    return "the largest micro-batch that divides the effective batch and fits"


def _search_problem(seed: int):
    rng = random.Random(seed)
    limit = rng.randrange(37, 5000)
    return limit, rng.randrange(1, 9)


@harness
def _search_run(answer, limit: int, start: int) -> tuple:
    """Run the answer with a step(b) that fails above `limit`; return (its answer, the sizes tried)."""
    tried: list[int] = []

    def step(b):
        require(isinstance(b, int) and not isinstance(b, bool) and b >= 1,
                f"step was called with batch size {b!r}", hint="batch sizes are ints >= 1.")
        tried.append(b)
        if b > limit:
            raise torch.OutOfMemoryError(f"Tried to allocate memory for a batch of {b}")

    try:
        return call(answer, step, start), tried
    except CheckFailed as failure:
        if "OutOfMemoryError" in failure.summary:
            failure.hint = ("wrap each try in `try: step(b) except torch.OutOfMemoryError:` "
                            "and treat the error as 'does not fit'.")
        raise


@exercise(points=2, timeout=10.0, reference="companion.accumulation.find_max_batch_size")
def check_batch_size_search(answer) -> str:
    """answer(step, start) -> int: the largest b for which step(b) runs without
    torch.OutOfMemoryError, assuming every smaller batch fits when b does, and start fits."""
    for seed in fresh_seeds(4):
        limit, start = _search_problem(seed)
        got, tried = _search_run(answer, limit, start)
        powers = [b for b in tried if b <= limit]
        compare(got, limit, name=f"largest batch (start={start})",
                hint="double until a step fails, then bisect between the last that ran and the "
                     "first that failed.",
                known_wrong={"after the first failure, search between the last size that ran and "
                             "the first that did not: the answer is rarely a power of two.":
                             max(powers, default=start)})
        budget = math.log2(2 * limit / start) + math.log2(2 * limit) + 2
        require(len(tried) <= budget,
                f"{len(tried)} trial steps to find {limit}; doubling then bisecting needs at most "
                f"{int(budget)}", hint="each trial is a full training step: grow by doubling, then "
                                       "halve the interval, instead of trying every size.")
    return "finds the largest batch in about 2·log2(b) trial steps"
