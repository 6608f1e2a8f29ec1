"""Optimizers from scratch: Adam's update and its state, and the step fused into backward.

Adam (Kingma & Ba, 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1) keeps, per
parameter, a running mean of the gradient (m, PyTorch's "exp_avg") and of its square
(v, "exp_avg_sq"), and a step count t:

    m ← β1·m + (1 − β1)·g              v ← β2·v + (1 − β2)·g²
    θ ← θ − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

Memory: m and v have the parameter's shape and dtype, so in fp32 Adam's state is 8 bytes per
parameter (plus one 4-byte step counter per tensor). With the 4-byte weight and 4-byte gradient,
that is the 16 bytes per parameter every chapter counts. The update itself needs one temporary
the size of the parameter (the denominator).

`optimizer_in_backward` runs the step of each parameter inside backward, as soon as its gradient
is complete, and frees that gradient at once: the full set of gradients never exists.

Example:
    >>> opt = Adam(model.parameters(), lr=1e-3)      # swaps with torch.optim.Adam
    >>> model(x).sum().backward(); opt.step()
    >>> hooks = optimizer_in_backward(model.parameters(), torch.optim.Adam, lr=1e-3)
    >>> model(x).sum().backward()                    # the steps ran inside backward

Simplified vs PyTorch: no weight decay, amsgrad, maximize, capturable or complex numbers (a
group that turns one on, e.g. from torch's state_dict, makes `step` raise);
`adam_step` is `torch.optim.Adam`'s single-tensor path (its foreach and fused paths give the same
numbers with fewer kernel launches, and foreach a temporary for the whole model at once).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["adam_step", "Adam", "optimizer_in_backward"]


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], *, lr: float = 1e-3,
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
    """One Adam update of `param`, in place. `state` is {} before the first step; the step fills
    it with "step" (a 0-d fp32 tensor), "exp_avg" (m) and "exp_avg_sq" (v), as torch.optim.Adam
    keeps them, and updates them in place afterwards.

    Memory: the first call allocates m and v, 2 × param's bytes; each call one temporary of
    param's size (the denominator)."""
    beta1, beta2 = betas
    if not state:                                            # 1. state, on the first step
        state["step"] = torch.tensor(0.0)                        # 4 bytes
        state["exp_avg"] = torch.zeros_like(param)               # m: param's bytes
        state["exp_avg_sq"] = torch.zeros_like(param)            # v: param's bytes
    m, v = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    t = state["step"].item()                                 # host-device sync (on CUDA)
    m.lerp_(grad, 1 - beta1)                                 # 2. m ← β1·m + (1 − β1)·g
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)      # 3. v ← β2·v + (1 − β2)·g²
    step_size = lr / (1 - beta1**t)                          # 4. bias corrections
    denom = v.sqrt().div_((1 - beta2**t) ** 0.5).add_(eps)   #    the one temporary
    param.addcdiv_(m, denom, value=-step_size)               # 5. θ ← θ − step_size·m / denom


# torch.optim.Adam's options that this Adam does not have, at the values that turn them off: its
# groups carry them, so that torch.optim.Adam can load its state_dict (and step it).
_OFF = {"weight_decay": 0.0, "amsgrad": False, "maximize": False, "capturable": False,
        "differentiable": False, "decoupled_weight_decay": False}


class Adam(torch.optim.Optimizer):
    """`torch.optim.Adam` without its options, built on `adam_step`; same state, same numbers.
    Its state_dict loads into torch.optim.Adam and back; a group that turns one of torch's other
    options on (weight_decay=0.1, from a torch state_dict) makes `step` raise, not ignore it."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"need lr >= 0, eps >= 0 and 0 <= betas < 1; got lr={lr}, "
                             f"betas={betas}, eps={eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, **_OFF,
                                  "foreach": None, "fused": None})

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            used = {k: group[k] for k in _OFF if group.get(k, _OFF[k]) != _OFF[k]}
            if used:
                raise ValueError(f"companion.optim.Adam has none of {sorted(used)} (this group "
                                 f"sets {used}): use torch.optim.Adam for them")
            for p in group["params"]:
                if p.grad is not None:
                    adam_step(p, p.grad, self.state[p], lr=group["lr"], betas=group["betas"],
                              eps=group["eps"])
        return loss


def optimizer_in_backward(params: Iterable[torch.nn.Parameter], optimizer_class: type, **kwargs
                          ) -> tuple[dict[torch.nn.Parameter, torch.optim.Optimizer], list]:
    """Give each parameter its own optimizer that steps inside backward, as soon as the
    parameter's gradient is accumulated, and then frees that gradient.

    Memory: the gradients (4 bytes per fp32 parameter) never all exist at once: each is freed as
    soon as its step has run, so only those of the layers backward is working on are alive.
    Cost: no step sees all gradients, so no clipping by the total norm and no accumulation over
    micro-batches. Returns ({parameter: its optimizer}, hook handles: `.remove()` each to undo).

    Simplified vs PyTorch: PyTorch's recipe ("How to save memory by fusing the optimizer step into
    the backward pass") is these hooks; torch.distributed.optim has a private
    `_apply_optimizer_in_backward` that does the same for FSDP and DDP.
    """
    optimizers = {p: optimizer_class([p], **kwargs) for p in params}

    def step_now(param: torch.Tensor) -> None:               # runs inside backward
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)        # the gradient is freed here

    handles = [p.register_post_accumulate_grad_hook(step_now) for p in optimizers]
    return optimizers, handles
