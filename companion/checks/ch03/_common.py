"""Chapter 03's checks: helpers several exercises share."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from companion.checks.core import CheckFailed, require


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
