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

    Why fp32 master weights: an update smaller than half a 16-bit ulp of the weight (bf16 has 8
    significant bits) would round away; added to an fp32 copy, it accumulates. Where the
    gradients live is `grads`, and it sets the bytes per parameter under Adam (16-bit weights 2,
    fp32 master 4, Adam's state 8, plus the gradients):

    - "16-bit" (the ZeRO paper's count): the 16-bit `.grad` (2), accumulated in 16 bits over
      micro-batches; `step` makes fp32 copies (4 more while it runs, each 16-bit gradient freed
      as it is copied): 16 bytes.
    - "main_grad" (Megatron-LM's default for bf16): each backward's 16-bit gradient is added into
      an fp32 `p.main_grad` as soon as it is accumulated, and freed: 4, so 18 bytes.
    - "both" (DeepSpeed's `BF16_Optimizer`): the fp32 buffer, and the 16-bit `.grad` is kept
      until the step: 2 + 4, so 20 bytes. DeepSpeed clears the 16-bit `.grad` before each
      backward, so there it holds the last micro-batch's gradient; here autograd keeps summing
      micro-batches into it in 16 bits, which is what chapter 05 compares the fp32 buffer with.
    With a buffer, a parameter that gets no gradient in a step steps with a zero gradient (the
    buffer's), as in Megatron-LM, where "16-bit" leaves it out of the step.

        >>> model = MLP(32, 64, 2, 10, dtype=torch.bfloat16)
        >>> master = MasterWeights(model.parameters())
        >>> opt = torch.optim.Adam(master.master_params, lr=1e-3)
        >>> model.loss(x, y).backward(); master.step(opt)        # fp32 step, copied back

    Arguments:
        params: the 16-bit model's parameters (those with requires_grad=False are left alone).
        grads: "16-bit", "main_grad" or "both" (above).
    """

    GRADS = ("16-bit", "main_grad", "both")

    def __init__(self, params: Iterable[torch.nn.Parameter], *, grads: str = "16-bit"):
        if grads not in self.GRADS:
            raise ValueError(f"grads is one of {self.GRADS}, got {grads!r}")
        self.grads = grads
        self.model_params = [p for p in params if p.requires_grad]
        for p in self.model_params:
            if p.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"MasterWeights keeps a 16-bit model, got a {p.dtype} parameter: "
                                 "convert the model first, e.g. model.to(torch.bfloat16).")
        self.master_params = [p.detach().float().requires_grad_() for p in self.model_params]
        if grads != "16-bit":
            for p in self.model_params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                if grads == "main_grad":
                    p.register_post_accumulate_grad_hook(_into_main_grad)
                else:
                    p.register_hook(_adder(p))

    def grads_to_master(self) -> None:
        """The fp32 gradients onto the master weights; the 16-bit ones are freed. With
        grads="16-bit" they are fp32 copies of the 16-bit gradients (a parameter without one
        keeps its master gradient, already copied); otherwise the fp32 buffers themselves."""
        for p, m in zip(self.model_params, self.master_params):
            if self.grads != "16-bit":
                m.grad = p.main_grad                                 # no copy: the buffer
                p.grad = None
            elif p.grad is not None:
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
        for p, m in zip(self.model_params, self.master_params):
            m.grad = None                                            # 4. fp32 gradients freed
            if self.grads != "16-bit":
                p.main_grad.zero_()                                  #    (or the buffer zeroed)


def _into_main_grad(p: torch.nn.Parameter) -> None:
    """Megatron-LM's post-accumulate hook: the 16-bit gradient into the fp32 buffer, then freed."""
    p.main_grad.add_(p.grad)
    p.grad = None


def _adder(p: torch.nn.Parameter):
    """DeepSpeed's bf16 layout: each backward's 16-bit gradient added into the fp32 buffer, the
    16-bit `.grad` kept as well."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        p.main_grad.add_(grad)
        return grad
    return hook
