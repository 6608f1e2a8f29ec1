"""The layouts of model states that training runs use, measured and predicted per parameter.

A layout says in which format each of a step's states lives: the weights, their gradients, the
optimizer's moments and, where the weights are 16-bit, an fp32 master copy. With Adam:

| layout                  | weights | gradients | master | moments | bytes | who runs it                   |
|-------------------------|---------|-----------|--------|---------|-------|-------------------------------|
| fp32                    | 4       | 4         | -      | 4 + 4   | 16    | plain PyTorch                 |
| bf16 + master           | 2       | 2         | 4      | 4 + 4   | 16    | ZeRO paper, `amp.MasterWeights`|
| bf16 + master, main_grad| 2       | 4 (fp32)  | 4      | 4 + 4   | 18    | Megatron-LM (`main_grad`)     |
| bf16 + master, both grads| 2      | 2 + 4     | 4      | 4 + 4   | 20    | DeepSpeed `BF16_Optimizer`    |
| pure bf16               | 2       | 2         | -      | 2 + 2   | 8     | `BF16AdamW`                   |
| pure bf16 + Kahan       | 2       | 2         | -      | 2+2 + 2 | 10    | `BF16AdamW(kahan)`            |
| fp32 + 8-bit Adam       | 4       | 4         | -      | 1+1 + ε | ~10   | bitsandbytes, `Adam8bit`      |
| bf16 + 8-bit Adam       | 2       | 2         | -      | 1+1 + ε | ~6    | `Adam8bit`, stochastic round  |
| QLoRA                   | ~0.5    | adapters  | -      | adapters| ~0.5+ | bitsandbytes + PEFT, `lowbit` |

(ε: one fp32 absmax per block of 256 values, 0.016 B per moment.) The pure bf16 rows write the
moments back with stochastic rounding (`BF16AdamW`'s default `moments`), and bf16 + 8-bit Adam
rounds its weights stochastically (`stochastic_round=True`): without it, updates under half of
bf16's spacing are lost, as in plain pure bf16. Where the bf16 rows come from:
16 B is the ZeRO paper's count (Rajbhandari et al., 2020, section 3.1), what Megatron-LM keeps for
bf16 only with `--grad-reduce-in-bf16`. By default Megatron-LM's bf16 training accumulates and
all-reduces gradients in fp32 (megatron/training/arguments.py sets
`accumulate_allreduce_grads_in_fp32`): each parameter's post-accumulate hook adds its bf16 `.grad`
into an fp32 `main_grad` buffer and frees it (`_make_backward_post_hook` in
megatron/core/distributed/distributed_data_parallel.py), 18 B. DeepSpeed's `BF16_Optimizer`
(deepspeed/runtime/bf16_optimizer.py) adds each bf16 `.grad` into fp32 gradients after backward
and by default keeps the bf16 ones too (`clear_lp_grads=False`), 20 B, the Ultra-Scale Playbook's
figure. `measure` builds a model in a
layout, trains it two steps and counts the bytes of every distinct storage it holds;
`predict` counts the same from `companion.estimate`.

Example:
    >>> make = lambda: GPT(128, 64, 64, 2, 4)
    >>> got = measure(make, "bf16+adam8bit", x, y)
    >>> got.per_param, predict(make(), "bf16+adam8bit").per_param
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from companion import estimate
from companion.amp.master import MasterWeights
from companion.lowbit.adam8bit import Adam8bit
from companion.lowbit.bf16 import BF16AdamW
from companion.lowbit.qlora import QLoRALinear, apply_qlora

__all__ = ["LAYOUTS", "LayoutBytes", "measure", "predict"]

LAYOUTS = ("fp32", "bf16+master", "bf16+master+main_grad", "bf16+master+fp32_grad_buffer",
           "bf16", "bf16+kahan",
           "fp32+adam8bit", "bf16+adam8bit", "qlora")


@dataclasses.dataclass(frozen=True)
class LayoutBytes:
    """Bytes of a model's states in one layout, by kind; master weights count as optimizer state
    (as in `estimate.model_states`), Megatron's fp32 main_grad as gradients."""

    parameters: int
    gradients: int
    optimizer_state: int
    n_params: int                  # parameters of the dense model, the denominator

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def per_param(self) -> float:
        return self.total / self.n_params

    def kinds(self) -> dict[str, int]:
        """{kind: bytes}, the shape `companion.widgets.memory_bars` draws."""
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer_state": self.optimizer_state}


def _check(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout is one of {LAYOUTS}, got {layout!r}")


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}.values())


def _setup(model: nn.Module, layout: str, rank: int, lr: float):
    """(model, the step function, the tensors of optimizer state besides the optimizer's own)."""
    if layout.startswith("bf16"):
        model = model.to(torch.bfloat16)
    if layout == "qlora":
        model = apply_qlora(model, rank)
    params = [p for p in model.parameters() if p.requires_grad]
    if layout.startswith("bf16+master"):
        grads = {"bf16+master": "16-bit", "bf16+master+main_grad": "main_grad",
                 "bf16+master+fp32_grad_buffer": "both"}[layout]
        master = MasterWeights(params, grads=grads)
        opt = torch.optim.Adam(master.master_params, lr=lr)
        return model, lambda: master.step(opt), opt, master.master_params
    if layout in ("bf16", "bf16+kahan"):
        opt = BF16AdamW(params, lr=lr, weight_decay=0.0,
                        compensation="kahan" if layout == "bf16+kahan" else "none")
    elif layout.endswith("adam8bit"):
        opt = Adam8bit(params, lr=lr, stochastic_round=layout == "bf16+adam8bit")
    else:
        opt = torch.optim.Adam(params, lr=lr)
    return model, opt.step, opt, []


def measure(make_model: Callable[[], nn.Module], layout: str, x: torch.Tensor, y: torch.Tensor,
            *, rank: int = 8, lr: float = 1e-3) -> LayoutBytes:
    """The bytes `make_model()` holds in `layout` at the start of its second optimizer step (every
    state made, the gradients of that step alive). The model needs `.loss(x, y)`."""
    _check(layout)
    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    model, step, opt, master = _setup(model, layout, rank, lr)
    for i in range(2):
        model.loss(x, y).backward()
        if i == 0:
            step()
            opt.zero_grad(set_to_none=True)
    params = list(model.parameters())
    bases = [m.base for m in model.modules() if isinstance(m, QLoRALinear)]
    weights = _bytes(params + list(model.buffers())) + sum(b.nbytes() for b in bases)
    grads = _bytes([p.grad for p in params] + [getattr(p, "main_grad", None) for p in params])
    state = [t for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return LayoutBytes(weights, grads, _bytes(state + master), n_params)


def predict(model: nn.Module, layout: str, *, rank: int = 8) -> LayoutBytes:
    """The bytes of `measure(lambda: model, layout, ...)` counted by `companion.estimate`: every
    tensor under Adam8bit's 4096 values keeps fp32 moments; QLoRA quantizes every nn.Linear's
    weight (`estimate.nf4_bytes`), keeps the rest frozen and trains the adapters in fp32."""
    _check(layout)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if layout == "qlora":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dense = sum(m.weight.numel() for m in linears)
        adapters = sum(rank * (m.in_features + m.out_features) for m in linears)
        train = estimate.model_states(adapters, optimizer="adam")
        return LayoutBytes(4 * (n - dense) + sum(estimate.nf4_bytes(m.weight.numel())
                                                 for m in linears) + train.params,
                           train.grads, train.optimizer, n)
    precision = {"fp32": "fp32", "bf16+master": "mixed", "bf16+master+main_grad": "mixed",
                 "bf16+master+fp32_grad_buffer": "mixed", "bf16": "bf16", "bf16+kahan": "bf16", "fp32+adam8bit": "fp32",
                 "bf16+adam8bit": "bf16"}[layout]
    kw = dict(optimizer="adam", precision=precision,
              fp32_grads=layout.endswith("main_grad"),
              fp32_grad_buffer=layout.endswith("fp32_grad_buffer"),
              compensation="kahan" if layout.endswith("kahan") else "none")
    if layout.endswith("adam8bit"):
        small = sum(p.numel() for p in params if p.numel() < 4096)
        big = [p.numel() for p in params if p.numel() >= 4096]
        full = estimate.model_states(n, **kw)
        exact = 2 * sum(-(-k // 256) * 4 + k for k in big) + 8 * small  # codes, absmax, fp32
        return LayoutBytes(full.params, full.grads, exact, n)
    states = estimate.model_states(n, **kw)
    return LayoutBytes(states.params, states.grads, states.optimizer, n)
