"""AdamW on bf16 weights with no fp32 master copy, and what keeps its small updates.

bf16 keeps 8 significant bits: a weight w moves only if its update exceeds half of bf16's spacing
at w (2^-8·|w|). Late in training most updates are smaller, and round-to-nearest drops them: the
weights stall (chapter 05 measures it). Two fixes keep the model states at bf16's 8 bytes per
parameter (weights 2, gradients 2, moments 2 + 2):

- `compensation="stochastic"`: round the new weight up or down at random, with the probability
  that makes the rounding unbiased (its expectation is the fp32 value), by adding 16 random low
  bits to its fp32 pattern and cutting them off (Gupta et al., 2015, "Deep Learning with Limited
  Numerical Precision"; used for bf16 training by Zamirai et al., 2020, "Revisiting BFloat16
  Training");
- `compensation="kahan"`: keep what rounding dropped in a bf16 buffer and add it to the next
  update (Kahan summation; Zamirai et al., 2020): 2 more bytes per parameter.

The moments stall the same way. Adam's second moment v decays by 1 - β2 = 0.1% per step, while
bf16's spacing is 2^-8 to 2^-7 of a value: written back to nearest, a v that changes by less
than half a spacing (0.2% to 0.4%) per step comes back unchanged, so after the gradients shrink it stays at their old size and the steps
stay too small. `moments` says how the two moments are written back:

- `"stochastic"` (the default): with `round_stochastic`, so v decays as fp32's does on average;
  2 + 2 bytes. Public optimizers for pure bf16 do this, e.g. lodestone-rock/compass_optimizer
  (experimental/compass_experimental_sr_bf16.py, 2024-09-14: `copy_stochastic_` on both EMAs
  and on the weight);
- `"nearest"`: round to nearest, 2 + 2 bytes, and the stall. What torchao's `_AdamW` does
  (torchao 0.19.0, source of 2026-08-21: bf16 moments written with `copy_`; its
  `bf16_stochastic_round`, since 2024-10-23 (pytorch/ao #1124), rounds only the weights), and
  torchdistx's `AnyPrecisionAdamW` with `momentum_dtype=variance_dtype=torch.bfloat16`, its
  recipe for pure bf16 (source of 2022-09-08; it updates the states in place in bf16);
- `"fp32"`: the moments kept in fp32, 4 + 4 bytes: 4 more per parameter (12 in all, 14 with
  Kahan). `AnyPrecisionAdamW`'s dtypes allow it; its defaults keep the first moment in fp32
  and the second in bf16.

`fp32_products()` computes the matrix products of 16-bit tensors as fp32 products of the same
values, rounded back: what a bf16 GEMM that accumulates in fp32 returns (to the order of the
sums), at fp32's speed on a CPU without bf16 matrix instructions, where PyTorch's own bf16 GEMM
is tens of times slower than fp32's.

Example:
    >>> model = model.to(torch.bfloat16)
    >>> opt = BF16AdamW(model.parameters(), lr=1e-3, compensation="kahan")
    >>> with fp32_products():
    ...     model.loss(x, y).backward()

Simplified vs torch.optim.AdamW: the moments are stored in bf16 (or fp32, `moments="fp32"`) and
the update is computed in fp32 from them; no amsgrad, no maximize.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from companion.lowbit.adam8bit import adam_direction

__all__ = ["BF16AdamW", "round_stochastic", "fp32_products"]

_PRODUCTS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
             torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm}
_SIXTEEN = (torch.bfloat16, torch.float16)


class fp32_products(TorchFunctionMode):
    """Inside `with fp32_products():`, F.linear, matmul, @, mm, bmm and addmm on bf16 or fp16
    tensors run as fp32 products of the same values, and their result is rounded back to the
    inputs' dtype. Each product of two 16-bit values is exact in fp32 and the sums are fp32's, so
    the result is that of a 16-bit GEMM with fp32 accumulation up to the order of its additions.
    Autograd sees the casts: gradients reach the weights in their own dtype. Other ops and fp32
    tensors pass through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if func not in _PRODUCTS or not tensors or tensors[0].dtype not in _SIXTEEN:
            return func(*args, **kwargs)
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors):
            return func(*args, **kwargs)                           # let PyTorch raise its error
        wide = lambda a: a.float() if isinstance(a, torch.Tensor) else a
        out = func(*map(wide, args), **{k: wide(v) for k, v in kwargs.items()})
        return out.to(dtype)

_MODES = ("none", "stochastic", "kahan")
_MOMENTS = ("stochastic", "nearest", "fp32")


def round_stochastic(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 `x` rounded to bf16 up or down at random, unbiased: E[result] = x (up to bf16's range).

    bf16 is fp32's top 16 bits: adding a uniform random 16-bit number to the low half and cutting
    it off rounds up exactly when the random number exceeds the distance to the next value."""
    if x.dtype != torch.float32:
        raise TypeError(f"round fp32 values, got {x.dtype}")
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    rounded = (bits + noise) & -65536                      # clear the low 16 bits
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


class BF16AdamW(torch.optim.Optimizer):
    """AdamW for bf16 parameters, no fp32 master; `compensation` "none", "stochastic" or
    "kahan" says how the weights take their update, `moments` "stochastic", "nearest" or "fp32"
    how the moments are stored (see the module docstring). Other arguments as
    torch.optim.AdamW's."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, compensation: str = "none",
                 moments: str = "stochastic"):
        if compensation not in _MODES:
            raise ValueError(f"compensation is one of {_MODES}, got {compensation!r}")
        if moments not in _MOMENTS:
            raise ValueError(f"moments is one of {_MOMENTS} (how Adam's moments are written "
                             f"back), got {moments!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "compensation": compensation,
                                  "moments": moments})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW trains bf16 parameters, got {p.dtype}: "
                                    "model.to(torch.bfloat16) first, or use torch.optim.AdamW")

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    dtype = torch.float32 if group["moments"] == "fp32" else torch.bfloat16
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)       # 2 bytes (fp32: 4)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)    # 2 bytes (fp32: 4)
                    if group["compensation"] == "kahan":
                        state["compensation"] = torch.zeros_like(p)           # bf16: 2 bytes
                state["step"] += 1
                m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()  # 1. fp32 update
                direction = adam_direction(m, v, p.grad.float(), state["step"], group["betas"],
                                           group["eps"])
                self._store(state, m, v, group["moments"])                    # 2. moments back
                w = p.float()
                delta = -group["lr"] * (direction + group["weight_decay"] * w)
                self._apply(p, w, delta, group["compensation"], state)        # 3. into bf16
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, which casts every state tensor to its parameter's dtype (bf16): fp32
        moments (`moments="fp32"`) are taken back from `state_dict` as they were saved; a state
        saved before `moments` existed keeps this optimizer's."""
        chosen = [group["moments"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, moments in zip(self.param_groups, chosen):
            group.setdefault("moments", moments)
        params = [p for group in self.param_groups for p in group["params"]]
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, saved):
            for key in ("exp_avg", "exp_avg_sq"):
                value = state_dict["state"].get(i, {}).get(key)
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    self.state[p][key] = value.to(p.device, copy=True)

    @staticmethod
    def _store(state: dict, m: torch.Tensor, v: torch.Tensor, moments: str) -> None:
        if moments == "fp32":
            state["exp_avg"], state["exp_avg_sq"] = m, v     # fp32 already (also after a load)
        elif moments == "stochastic":
            state["exp_avg"].copy_(round_stochastic(m))      # unbiased: v decays on average
            state["exp_avg_sq"].copy_(round_stochastic(v))
        else:
            state["exp_avg"].copy_(m)                        # round to nearest: v can stall
            state["exp_avg_sq"].copy_(v)

    @staticmethod
    def _apply(p: torch.Tensor, w: torch.Tensor, delta: torch.Tensor, mode: str,
               state: dict) -> None:
        if mode == "kahan":
            wanted = delta + state["compensation"].float()   # this update and what was dropped
            p.copy_(w + wanted)                              # round to nearest
            state["compensation"].copy_(wanted - (p.float() - w))    # what rounding dropped
        elif mode == "stochastic":
            p.copy_(round_stochastic(w + delta))
        else:
            p.copy_(w + delta)                               # round to nearest: small ones lost
