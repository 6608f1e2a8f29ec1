"""Adam with 8-bit states (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization").

Adam's two moments take 8 bytes per parameter in fp32, more than the fp32 weights and gradients
together. Here each moment lives between steps as block-wise 8-bit codes (`blockwise`): the first
moment (signed) with the signed dynamic map, the second (never negative) with the unsigned one,
each with one fp32 absmax per block. A step dequantizes a tensor's moments to fp32, takes Adam's
update there, and quantizes them again.

Memory: 2 bytes of state per parameter + 8 bytes per block of 256 (2.03 instead of 8). Cost: a
dequantize and a quantize per step (the paper fuses them into the update kernel). Tensors under
`min_8bit_size` (4096) values keep fp32 moments, as bitsandbytes does: biases and norms are few
bytes, and their moments are the least forgiving.

Example:
    >>> opt = Adam8bit(model.parameters(), lr=1e-3)          # a drop-in for torch.optim.Adam
    >>> model.loss(x, y).backward(); opt.step(); opt.zero_grad()

On bf16 weights (the 6-byte layout: weights 2, gradients 2, moments 1 + 1 and the absmax values)
the update meets the stall of pure bf16 (`bf16`): added to the weight and rounded to nearest,
an update under half of bf16's spacing is lost. `stochastic_round=True` computes the new weight
in fp32 and rounds it to bf16 with `round_stochastic`, unbiased, as torchao's 8-bit optimizers
do with `bf16_stochastic_round=True` (torchao 0.19.0; the flag since 2024-10-23, pytorch/ao
#1124). It adds no bytes. Weights in fp32 take their update exactly and ignore the flag (as
torchao's does); fp16 weights with it raise, since `round_stochastic` makes bf16.

Simplified vs bitsandbytes: the update is torch.optim.Adam's (weight decay added to the gradient,
as Adam's L2 does; `decoupled_weight_decay=True` decays the weight itself first, as AdamW and
bitsandbytes' `AdamW8bit` do); no paged states, no percentile clipping, no stable-embedding
layer.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from companion.lowbit.blockwise import (check_blocksize, dequantize_blockwise, dynamic_map,
                                        quantize_blockwise)

__all__ = ["Adam8bit", "adam_direction", "direction_error"]


def adam_direction(m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, t: int,
                   betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Fold `grad` into Adam's fp32 moments m and v (in place) at step t and return the update's
    direction, m̂ / (√v̂ + ε) with both bias corrections; the step is -lr times it. Shared by the
    optimizers of this package, whose moments live in other formats between steps."""
    beta1, beta2 = betas
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = v.sqrt().div_((1 - beta2**t) ** 0.5).add_(eps)      # √v̂ + ε
    return torch.div(m, 1 - beta1**t).div_(denom)                 # m̂ / (√v̂ + ε)


def direction_error(m: torch.Tensor, v: torch.Tensor, blocksize: int, *, signed: torch.Tensor,
                    unsigned: torch.Tensor, eps: float = 1e-8) -> dict[str, float]:
    """How far Adam's direction m / (√v + ε) moves when m and v are stored as block-wise codes of
    the maps `signed` and `unsigned`: {"error": ‖d_q − d‖ / ‖d‖, "v_zero": the fraction of
    nonzero v stored as 0 (its update is then m / ε)}."""
    mq = dequantize_blockwise(*quantize_blockwise(m, signed, blocksize), signed, blocksize)
    vq = dequantize_blockwise(*quantize_blockwise(v, unsigned, blocksize), unsigned, blocksize)
    d, dq = m / (v.sqrt() + eps), mq / (vq.sqrt() + eps)
    return {"error": float((dq - d).norm() / d.norm()),
            "v_zero": float(((vq == 0) & (v > 0)).float().mean())}


class Adam8bit(torch.optim.Optimizer):
    """torch.optim.Adam whose moments are stored as block-wise 8-bit codes between steps;
    `stochastic_round=True` rounds bf16 weights stochastically (see the module docstring)."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, blocksize: int = 256, min_8bit_size: int = 4096,
                 decoupled_weight_decay: bool = False, *, stochastic_round: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"need lr, eps, weight_decay >= 0 and 0 <= betas < 1; got lr={lr}, "
                             f"betas={betas}, eps={eps}, weight_decay={weight_decay}")
        check_blocksize(blocksize)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "blocksize": blocksize,
                                  "min_8bit_size": min_8bit_size,
                                  "decoupled_weight_decay": bool(decoupled_weight_decay),
                                  "stochastic_round": bool(stochastic_round)})
        for group in self.param_groups:
            if group["stochastic_round"] and any(p.dtype == torch.float16
                                                 for p in group["params"]):
                raise TypeError("stochastic_round=True rounds bf16 weights; fp16 ones would be "
                                "rounded to nearest: model.to(torch.bfloat16) first, or leave "
                                "stochastic_round off")
        self._maps = {"signed": dynamic_map(True), "unsigned": dynamic_map(False)}

    def _moments(self, p: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 moments of p (zeros on the first step)."""
        state = self.state[p]
        if "exp_avg" in state:                                    # small tensor: fp32
            return state["exp_avg"], state["exp_avg_sq"]
        if "exp_avg_codes" not in state:
            return torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p,
                                                                             dtype=torch.float32)
        size = group["blocksize"]
        m = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"],
                                 self._maps["signed"], size)
        v = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"],
                                 self._maps["unsigned"], size)
        return m, v

    def _store(self, p: torch.Tensor, group: dict, m: torch.Tensor, v: torch.Tensor) -> None:
        state = self.state[p]
        if p.numel() < group["min_8bit_size"]:
            state["exp_avg"], state["exp_avg_sq"] = m, v
            return
        size = group["blocksize"]
        state["exp_avg_codes"], state["exp_avg_absmax"] = quantize_blockwise(
            m, self._maps["signed"], size)                             # 1 byte each + absmax
        state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = quantize_blockwise(
            v, self._maps["unsigned"], size)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                t = state["step"]
                grad = p.grad.float()
                rounding = group.get("stochastic_round") and p.dtype == torch.bfloat16
                w = p.float() if rounding else p       # the weight the update lands on
                if group["weight_decay"] and group.get("decoupled_weight_decay"):
                    w.mul_(1 - group["lr"] * group["weight_decay"])      # AdamW's decay
                elif group["weight_decay"]:
                    grad = grad.add(w.float(), alpha=group["weight_decay"])
                m, v = self._moments(p, group)                       # 1. codes -> fp32
                direction = adam_direction(m, v, grad, t, group["betas"], group["eps"])
                w.add_(direction.to(w.dtype), alpha=-group["lr"])    # 2. Adam's update
                if rounding:
                    from companion.lowbit.bf16 import round_stochastic   # (bf16 imports us)
                    p.copy_(round_stochastic(w))                     #    fp32 -> bf16, unbiased
                self._store(p, group, m, v)                          # 3. fp32 -> codes
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, which casts every state tensor of a float parameter to its dtype: the codes
        are turned back into uint8 (exactly: they are whole numbers from 0 to 255)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg_codes", "exp_avg_sq_codes"):
                if key in state:
                    state[key] = state[key].to(torch.uint8)
            for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
                if key in state:
                    state[key] = state[key].float()

    def state_bytes(self) -> int:
        """Bytes of optimizer state: the codes, the absmax values and the fp32 moments kept."""
        return sum(t.numel() * t.element_size() for s in self.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))
