"""Chapter 03, exercise 1: one optimizer step accumulated over k micro-batches."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from companion import accumulation
from companion.checks.ch03._common import (_interleaved, _reject_known_wrong, _released, _stale,
                                           _watched)
from companion.checks.core import call_inplace, compare, exercise, fresh_seeds, harness, require

__all__ = ["check_accumulation_step"]


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
            if variant == "zero_grad_each":
                opt.zero_grad()
            scale = 1.0 if variant == "no_one_over_k" else 1.0 / k
            (F.cross_entropy(model(xb), yb) * scale).backward()
        opt.step()
    return tuple(p.detach().clone() for p in model.parameters())


@harness
def _accumulation_run(answer, seed: int, k: int, b: int) -> tuple:
    """Run the answer on the seed's model (stale gradients in .grad, SGD with momentum); return
    (its parameters after, how many optimizer steps ran, the batch sizes the model saw)."""
    model, x, y = _setup(seed, k * b)
    opt, seen, steps, order, held = _watched(model, seed, lr=0.1)
    call_inplace(answer, model, F.cross_entropy, opt, x.clone(), y.clone(), k)
    return tuple(p.detach() for p in model.parameters()), len(steps), seen, order, held


@exercise(points=2, timeout=30.0, reference=("companion.accumulation.accumulation_step",
                                             "companion.accumulation.accumulated_gradients",
                                             "companion.ddp.accumulation_step",
                                             "companion.accumulation.token_normalized_step"))
def check_accumulation_step(answer) -> str:
    """answer(model, loss_fn, optimizer, x, y, accum_steps): one optimizer step on (x, y) made of
    accum_steps equal micro-batches (len(x) is a multiple of accum_steps)."""
    for seed, (k, b) in zip(fresh_seeds(3), [(4, 6), (3, 7), (5, 1)]):
        model, x, y = _setup(seed, k * b)
        stale = _stale(model, seed)
        expected = _step_params(model, x, y, k)
        got, steps, seen, order, held = _accumulation_run(answer, seed, k, b)
        require(steps == 1, f"optimizer.step() ran {steps} times; expected once",
                hint="accumulate the gradients of all micro-batches, then step once, after the loop.")
        require(max(seen, default=len(x)) <= b and len(seen) == k,
                f"the model saw batches of sizes {seen}; expected {k} micro-batches of {b}",
                hint="split x and y into accum_steps pieces (x.chunk(k)) and run the model on each: "
                     "that is what keeps the activations small.")
        _interleaved(order, k)
        _released(held)
        if not all(torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(got, expected)):
            _reject_known_wrong(got, {
                "the step is k times too large: divide each micro-batch's loss by accum_steps "
                "(1/k). backward sums the gradients, it does not average them.":
                    _step_params(model, x, y, k, variant="no_one_over_k", stale=stale),
                "start with optimizer.zero_grad(): backward adds to whatever .grad holds, here "
                "gradients left over from an earlier step.":
                    _step_params(model, x, y, k, variant="no_zero_grad", stale=stale),
                "zero the gradients once, before the loop: inside it, each micro-batch erases the "
                "gradients of the ones before, and only the last micro-batch is learned from.":
                    _step_params(model, x, y, k, variant="zero_grad_each", stale=stale),
            })
        compare(got, expected, name="parameters after the step",
                hint="backward adds each micro-batch's gradient to what .grad already holds: "
                     "what must .grad hold before the first one, and which loss per micro-batch "
                     "makes the sum the gradient of the whole batch's mean loss?")
    return ("k micro-batches of b make the same step as one batch of k·b; activations are held for "
            "b examples at a time")
