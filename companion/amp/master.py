"""A 16-bit model whose optimizer steps an fp32 master copy (the Megatron-LM/DeepSpeed layout):
memory and an example in `MasterWeights`'s docstring.

Simplified vs Megatron-LM's `Float16OptimizerWithFloat16Params` and DeepSpeed's FP16 optimizers:
one list of parameters, no flat buffers, no gradient clipping or loss scaling of its own (pass a
`GradScaler` to `step`; to clip, call `grads_to_master` and `scaler.unscale_` first, see `step`).
"""
from __future__ import annotations

from typing import Iterable

import torch

from companion.amp.scaler import GradScaler

__all__ = ["MasterWeights"]


class MasterWeights:
    """A 16-bit model whose optimizer steps an fp32 master copy (Megatron-LM/DeepSpeed layout).

    Memory per parameter: 16-bit weights (2) and gradients (2) on the model, fp32 master weights
    (4) for the optimizer, plus its state (Adam: 8): 16 bytes, as with fp32 training. During
    `step` the fp32 gradient copies add 4 (each 16-bit gradient is freed as it is copied).
    Why fp32 master weights: an update smaller than half a 16-bit ulp of the weight (bf16 has 8
    significant bits) would round away; added to an fp32 copy, it accumulates.

        >>> model = MLP(32, 64, 2, 10, dtype=torch.bfloat16)
        >>> master = MasterWeights(model.parameters())
        >>> opt = torch.optim.Adam(master.master_params, lr=1e-3)
        >>> model.loss(x, y).backward(); master.step(opt)        # fp32 step, copied back

    Arguments:
        params: the 16-bit model's parameters (those with requires_grad=False are left alone).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.model_params = [p for p in params if p.requires_grad]
        for p in self.model_params:
            if p.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"MasterWeights keeps a 16-bit model, got a {p.dtype} parameter: "
                                 "convert the model first, e.g. model.to(torch.bfloat16).")
        self.master_params = [p.detach().float().requires_grad_() for p in self.model_params]

    def grads_to_master(self) -> None:
        """fp32 copies of the 16-bit gradients on the master weights; the 16-bit ones are freed.
        A parameter without a 16-bit gradient keeps its master gradient (already copied)."""
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is not None:
                m.grad = p.grad.float()                              # 2 B -> 4 B per element
                p.grad = None

    def master_to_model(self) -> None:
        """Round the fp32 master weights into the 16-bit model (in place)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                p.copy_(m)

    def step(self, optimizer: torch.optim.Optimizer, scaler: GradScaler | None = None) -> None:
        """Gradients up to fp32, one optimizer step on the master weights, weights back down.

        To clip, bring the gradients up and unscale them first; `step` then copies nothing more:

            master.grads_to_master(); scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(master.master_params, 1.0)
            master.step(opt, scaler); scaler.update()
        """
        self.grads_to_master()                                       # 1. cast gradients up
        if scaler is None:
            optimizer.step()                                         # 2. step in fp32
        else:
            scaler.step(optimizer)                                   # 2'. unscaled, maybe skipped
        self.master_to_model()                                       # 3. copy back, rounded
        for m in self.master_params:
            m.grad = None                                            # 4. fp32 gradients freed
