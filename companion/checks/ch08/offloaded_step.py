"""Chapter 08, exercise 1: the optimizer step on the host, with gradients down and weights up."""
from __future__ import annotations

import random

import torch

from companion.checks.ch08._common import _EXACT
from companion.checks.core import call_inplace, compare, exercise, fresh_seeds, harness, require
from companion.models import MLP
from companion.offload import Link, to_host

__all__ = ["check_offloaded_step"]


def _mlp_case(seed: int):
    d_in, width = random.Random(seed).choice([(7, 13), (11, 9), (5, 17)])
    model = MLP(d_in, width, 2, 3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(6, d_in, generator=g), torch.randint(3, (6,), generator=g))
               for _ in range(3)]
    return model, batches


class _DeferredLink(Link):
    """A link whose copies land only at synchronize(), as a non_blocking copy into pinned memory
    does on a GPU: until then the destination holds NaN (bytes not yet arrived)."""

    def __init__(self):
        super().__init__("cpu")
        self.pending, self.copies, self.syncs = [], [], 0

    def copy(self, dst, src):
        self._check(dst, src)
        self.pending.append((dst, src.detach().clone()))
        self.copies.append((dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()))
        with torch.no_grad():
            dst.fill_(float("nan"))
        return dst

    def synchronize(self):
        with torch.no_grad():
            for dst, value in self.pending:
                dst.copy_(value)
        self.pending.clear()
        self.syncs += 1


@harness
def _observe_step(answer, seed: int) -> list[dict]:
    model, batches = _mlp_case(seed)
    params = list(model.parameters())
    masters = [to_host(p.detach(), dtype=torch.float32) for p in params]
    host_grads = [to_host(torch.zeros_like(p)) for p in params]
    buffers = {g.untyped_storage().data_ptr() for g in host_grads}
    optimizer = torch.optim.AdamW(masters, lr=0.05, weight_decay=0.1, fused=True)
    link, at_step = _DeferredLink(), {}

    def before_step(opt, args, kwargs):
        at_step.update(
            steps=at_step.get("steps", 0) + 1,
            freed=all(p.grad is None for p in params),
            landed=not any(d.untyped_storage().data_ptr() in buffers for d, _ in link.pending))

    optimizer.register_step_pre_hook(before_step)
    seen = []
    for x, y in batches:
        model.loss(x, y).backward()
        grads = {p.grad.untyped_storage().data_ptr() for p in params}
        storages = [p.untyped_storage().data_ptr() for p in params]
        at_step.clear()
        link.copies.clear()
        call_inplace(answer, params, masters, host_grads, optimizer, link)     # steps them
        link.synchronize()                 # the next forward runs after every queued copy
        seen.append({"weights": [p.detach().clone() for p in params],
                     "masters": [m.detach().clone() for m in masters],
                     "grads_on_host": all(m.grad is None or m.grad.data_ptr() == g.data_ptr()
                                          for m, g in zip(masters, host_grads)),
                     "stepped": all(len(optimizer.state[m]) > 0 for m in masters),
                     "host_grads": [g.clone() for g in host_grads],
                     "freed_before_step": at_step.get("freed"),
                     "landed_before_step": at_step.get("landed"),
                     "steps": at_step.get("steps", 0),
                     "down_by_link": sum(src in grads for _, src in link.copies),
                     "in_place": storages == [p.untyped_storage().data_ptr() for p in params]})
    return seen


def _plain_steps(seed: int) -> list[dict]:
    model, batches = _mlp_case(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    out = [{"weights": [p.detach().clone() for p in model.parameters()]}]
    for x, y in batches:
        model.loss(x, y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        out.append({"weights": [p.detach().clone() for p in model.parameters()], "grads": grads})
    return out


@exercise(points=2, timeout=20.0, reference="companion.offload.CPUOffloadOptimizer")
def check_offloaded_step(answer) -> str:
    """answer(params, masters, host_grads, optimizer, link): after backward, move each p.grad to
    its host buffer over `link` (asynchronous copies, landed at link.synchronize()), keep only
    the weights on the device, step `optimizer` over the host masters with those gradients, and
    put the updated weights back into the parameters in place."""
    for seed in fresh_seeds(2):
        plain = _plain_steps(seed)
        seen = _observe_step(answer, seed)
        for step, (got, before, want) in enumerate(zip(seen, plain, plain[1:]), 1):
            require(got["steps"] == 1, f"step {step} called optimizer.step() {got['steps']} "
                    "times", hint="step the optimizer you are given once per call: it updates "
                    "the host masters.")
            require(got["down_by_link"] == len(want["grads"]),
                    f"step {step} sent {got['down_by_link']} of {len(want['grads'])} gradients "
                    "through link.copy", hint="every gradient crosses the link: "
                    "link.copy(buffer, p.grad). A tensor's own copy_ hides what a GPU does: the "
                    "copy is asynchronous, and the host must wait for it.")
            require(got["landed_before_step"], f"at step {step} the optimizer read host "
                    "gradient buffers whose copies had not landed",
                    hint="a queued copy has not arrived when link.copy returns: the host must "
                         "wait for the link before anything reads the buffers.")
            require(got["freed_before_step"], f"at step {step} a device gradient was still "
                    "alive while the host stepped", hint="the point of moving gradients is the "
                    "device memory they free: once a gradient is on its way, the device copy is "
                    "not needed (the link keeps the stream's order), and the host step is the "
                    "longest part of the step.")
            require(got["in_place"], f"after step {step} a parameter has new storage",
                    hint="write the updated weights into the parameters' own storage (the "
                         "model holds those tensors); do not rebind p.data to the host master.")
            compare(got["host_grads"], want["grads"], name=f"host gradients after step {step}",
                    **_EXACT, hint="each parameter's gradient goes into its own host buffer, "
                                   "and that buffer is what its master's .grad must be.")
            require(got["grads_on_host"], f"after step {step} a master's .grad is not its host "
                    "buffer", hint="the optimizer runs on the host over the masters: their "
                    "gradients are the host buffers, not the device gradients.")
            require(got["stepped"], f"after step {step} the optimizer holds no state for the "
                    "masters", hint="step the optimizer you are given (it updates the host "
                    "masters), not one of your own over the device parameters.")
            compare(got["weights"], want["weights"], name=f"weights after step {step}", **_EXACT,
                    known_wrong={
                        "the device weights are still the ones from before this step: the "
                        "updated masters must go up, after the host step (before it, the weights "
                        "lag one step).": before["weights"],
                        "the device weights never changed: the updated masters must go back "
                        "up.": plain[0]["weights"]})
            compare(got["masters"], want["weights"], name=f"host masters after step {step}",
                    **_EXACT, hint="optimizer.step() updates the masters; do not overwrite them "
                                   "(the copy up goes masters -> parameters).")
    return ("the same weights as AdamW on the device (bit for bit on the CPU), with only the "
            "weights there, and no buffer read before its copy landed")
