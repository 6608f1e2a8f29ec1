"""Chapter 03, exercise 1: one optimizer step accumulated over k micro-batches."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from companion import accumulation
from companion.checks.core import (CheckFailed, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)

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


def _watched(model, seed: int, lr: float) -> tuple:
    """Stale gradients in the model's .grad, SGD with momentum, and what the answer will be seen
    doing: (optimizer, batch sizes the model's forwards get, one entry per optimizer step, the
    order of forward and backward passes, how many earlier micro-batches' hidden activations are
    still held as each forward starts)."""
    for p, g in zip(model.parameters(), _stale(model, seed)):
        p.grad = g
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    seen, steps, order, held, hidden = [], [], [], [], []

    def forward(module, inputs):
        seen.append(len(inputs[0]))
        order.append("forward")
        held.append(sum(not ref.expired() for ref in hidden))

    def hidden_output(module, inputs, output):
        # the hidden layer's output: saved for backward, and seen by no answer
        try:
            hidden.append(StorageWeakRef(output.untyped_storage()))
        except (NotImplementedError, RuntimeError):
            pass        # a torch.func transform's wrapper: no storage to watch

    model.register_forward_pre_hook(forward)
    model[1].register_forward_hook(hidden_output)
    # a gradient reaching the first weight: one per backward pass, however many forwards it spans
    next(model.parameters()).register_hook(lambda grad: order.append("backward"))
    opt.register_step_post_hook(lambda *args: steps.append(1))
    return opt, seen, steps, order, held


def _interleaved(order: list[str], k: int) -> None:
    """Each micro-batch's backward must run before the next micro-batch's forward: otherwise
    every micro-batch's graph, and its saved activations, lives until the one backward. An
    answer whose gradients reach the weight through no backward pass (torch.func.grad over a
    functional call) cannot be watched this way and is judged by its step alone."""
    forwards, backwards = order.count("forward"), order.count("backward")
    if backwards == 0:
        return      # gradients without autograd's backward (torch.func.grad): nothing to watch
    require(order == ["forward", "backward"] * k,
            f"forward and backward passes ran in the order {_runs(order)}; expected {k} times "
            f"forward then backward",
            hint=("call backward on each micro-batch's loss inside the loop: adding the losses up "
                  "and calling backward once keeps the graphs, and the activations, of every "
                  "micro-batch alive until then, as much memory as the whole batch.")
            if forwards == k and backwards < k else
            "each micro-batch's backward belongs before the next micro-batch's forward.")


def _released(held: list[int]) -> None:
    """Each micro-batch's activations must be freed by its backward, before the next forward."""
    late = next((i for i, n in enumerate(held) if n), None)
    if late is not None:
        raise CheckFailed(f"when micro-batch {late + 1}'s forward began, the activations of "
                          f"{held[late]} earlier micro-batch{'es' * (held[late] > 1)} were still "
                          "held: forward and backward ran in turn, but a graph outlived its "
                          "backward", hint="backward frees a graph's saved activations unless told "
                          "to keep them (retain_graph=True) while something still refers to the "
                          "graph (a loss kept to print later): keep the loss's value with .item(), "
                          "and no graph past its backward.")


def _runs(order: list[str]) -> str:
    """["forward", "forward", "backward"] -> "forward x2, backward"."""
    out: list[str] = []
    for name in order:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in out) or "none"


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
                hint="start with optimizer.zero_grad(), divide each micro-batch's loss by "
                     "accum_steps, call backward on each, step once.")
    return ("k micro-batches of b make the same step as one batch of k·b; activations are held for "
            "b examples at a time")
