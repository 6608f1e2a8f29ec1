"""Automatic mixed precision: loss scaling, fp32 master weights, and what autocast runs in 16 bits.

Mixed precision runs the matrix multiplies in a 16-bit format (bf16 or fp16) and keeps what needs
range or precision in fp32. It halves most *activations* (the tensors saved for backward), not
the *model states*: with Adam both layouts below hold 16 bytes per parameter.
- torch.amp (autocast): fp32 parameters (4) + fp32 gradients (4) + Adam (8). Autocast casts each
  weight to 16 bits in forward; those copies are saved for backward and freed there.
- 16-bit model + fp32 master copy (Megatron-LM, DeepSpeed): 16-bit parameters (2) + 16-bit
  gradients (2) + fp32 master weights and Adam (12). `MasterWeights` builds it.
fp16's smallest subnormal is 6e-8, so small gradients flush to zero in backward. `GradScaler`
multiplies the loss by a large scale before backward and divides the gradients by it before the
step, skipping steps whose gradients overflowed; bf16 has fp32's range and needs no scaling.

Example:
    >>> scaler = GradScaler("cpu")
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     loss = model.loss(x, y)
    >>> scaler.scale(loss).backward()
    >>> scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    >>> scaler.step(opt); scaler.update(); opt.zero_grad()

Simplified vs PyTorch (`torch.amp.GradScaler`): the scale update runs on the host after the one
wait for the inf flag that `step` makes anyway (PyTorch's `_amp_update_scale_` runs on the
device); no sparse gradients, no fused optimizers (`_step_supports_amp_scaling`), no pickling.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["GradScaler", "update_scale", "unscale_grads_", "MasterWeights", "OpDtype",
           "autocast_dtypes"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def update_scale(scale: float, growth_tracker: int, found_inf: bool, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """The dynamic loss-scale rule: (new scale, new count of clean steps in a row).

    An inf/NaN gradient means the scale was too large: back off and start counting again (the
    step itself is skipped by `GradScaler.step`). After `growth_interval` clean steps in a row,
    grow, unless the grown scale would overflow float32 (the scale is stored in float32).

    Example:
        >>> update_scale(65536.0, 1999, False)          # (131072.0, 0): grown
        >>> update_scale(65536.0, 1234, True)           # (32768.0, 0): backed off
    """
    if found_inf:
        return _float32(scale * backoff_factor), 0                    # 1. back off, reset
    clean = growth_tracker + 1
    if clean < growth_interval:
        return scale, clean                                           # 2. keep counting
    grown = _float32(scale * growth_factor)
    return (grown if math.isfinite(grown) else scale), 0             # 3. grow, reset


def _float32(x: float) -> float:
    """x rounded to float32, where the scale lives (inf if it does not fit)."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def unscale_grads_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every gradient by `inv_scale` in place; return a 0-d float tensor on
    `inv_scale`'s device, 1.0 if any gradient held an inf or NaN (checked before unscaling).

    Memory: in place, plus one value per tensor. No host-device sync: the flag stays a tensor.
    """
    found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    groups: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    with torch.no_grad():
        for (device, _), group in groups.items():
            # 1. A tensor holds inf or NaN exactly when its min or max is not finite (NaN
            #    propagates through both): 2 values per tensor, no mask of its size.
            ends = [v for g in group if g.numel() for v in torch.aminmax(g)]
            if ends:
                found_inf += (~torch.stack(ends).isfinite()).any().to(found_inf.device)
            # 2. Unscale in place, (1/s)·g, as PyTorch's kernel does: exact for powers of two.
            torch._foreach_mul_(group, inv_scale.to(device))
    return found_inf


class GradScaler:
    """Dynamic loss scaling, a drop-in for `torch.amp.GradScaler`.

    Memory: one float32 scale; gradients are unscaled in place. Cost: one multiply per gradient
    element and one host-device sync per step (to decide whether to skip it).

        scaler = GradScaler("cuda")
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model.loss(x, y)
            scaler.scale(loss).backward()       # gradients are `scale` times too large
            scaler.unscale_(opt)                # optional: true gradients, e.g. for clipping
            scaler.step(opt)                    # skipped if any gradient is inf/NaN
            scaler.update()                     # back off after an overflow, grow after
                                                # `growth_interval` clean steps

    Loss scaling and skipping the update on overflow: Micikevicius et al., 2018, "Mixed Precision
    Training", section 3.2. The dynamic policy is PyTorch's: start high (2^16); an overflow halves
    the scale and skips the step; `growth_interval` clean steps in a row double it. The scale
    therefore sits near the largest value that does not overflow, which lifts small gradients
    clear of fp16's floor.
    """

    def __init__(self, device: str = "cpu", *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1 (the scale grows), got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks), "
                             f"got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        if enabled and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            warnings.warn("GradScaler is enabled, but CUDA is not available. Disabling.")
            enabled = False
        self._enabled = enabled
        self._init_scale, self._growth_tracker = float(init_scale), 0
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval
        self._scale: torch.Tensor | None = None          # float32, made on the loss's device
        self._states: dict[int, dict[str, Any]] = {}     # per optimizer: stage, inf flag

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs):
        """`outputs` (a tensor, or lists/tuples of them) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._scale = torch.full((), self._init_scale, dtype=torch.float32,
                                         device=outputs.device)
            return outputs * self._scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError(f"outputs must be a Tensor or a list/tuple of Tensors, got "
                         f"{type(outputs).__name__}")

    def _state(self, optimizer) -> dict[str, Any]:
        return self._states.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})

    def _require_scale(self, name: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(f"{name}() was called before scale(): call "
                               "scaler.scale(loss).backward() earlier in the iteration.")
        return self._scale

    def unscale_(self, optimizer) -> None:
        """Divide `optimizer`'s gradients by the scale in place, once per step (before clipping)."""
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        state = self._state(optimizer)
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update(). Call it once per step, after backward.")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(): unscale before stepping.")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        for g in grads:
            if g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients: keep fp32 parameters "
                                 "(autocast), or step an fp32 copy (MasterWeights).")
            if g.is_sparse:
                raise ValueError("sparse gradients are not supported; use torch.amp.GradScaler.")
        inv_scale = scale.double().reciprocal().float()          # 1/s, rounded as PyTorch does
        state["found_inf"] = unscale_grads_(grads, inv_scale) if grads else None
        state["stage"] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """`optimizer.step()` on unscaled gradients, or nothing if any of them is inf/NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._require_scale("step")
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        if state["found_inf"] is None:
            raise RuntimeError("No inf checks were recorded for this optimizer: none of its "
                               "parameters has a gradient. Backpropagate the scaled loss first.")
        state["found"] = bool(state["found_inf"].item())             # host-device sync
        state["stage"] = _STEPPED
        return None if state["found"] else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Set the scale for the next step: `new_scale` if given, else by `update_scale`."""
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor) and new_scale.numel() == 1 \
                    and not new_scale.requires_grad:
                scale.copy_(new_scale.reshape(()))
            elif isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
                scale.fill_(float(new_scale))
            else:
                raise ValueError("new_scale should be a float or a 1-element tensor with "
                                 "requires_grad=False.")
        else:
            flags = [s.get("found", s["found_inf"]) for s in self._states.values()
                     if s["found_inf"] is not None]
            if not flags:
                raise RuntimeError("No inf checks were recorded prior to update(): call "
                                   "step(optimizer) (or unscale_) after backward.")
            found = any(bool(f) for f in flags)                     # host-device sync if unstepped
            value, self._growth_tracker = update_scale(
                scale.item(), self._growth_tracker, found, growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor, growth_interval=self._growth_interval)
            scale.fill_(value)
        self._states = {}

    def get_scale(self) -> float:
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def state_dict(self) -> dict[str, Any]:
        """The same keys as torch.amp.GradScaler's, so either can load the other's."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


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
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.model_params = [p for p in params if p.requires_grad]
        for p in self.model_params:
            if p.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"MasterWeights keeps a 16-bit model, got a {p.dtype} parameter: "
                                 "convert the model first, e.g. model.to(torch.bfloat16).")
        self.master_params = [p.detach().float().requires_grad_() for p in self.model_params]

    def grads_to_master(self) -> None:
        """fp32 copies of the 16-bit gradients on the master weights; the 16-bit ones are freed."""
        for p, m in zip(self.model_params, self.master_params):
            m.grad = None if p.grad is None else p.grad.float()     # 2 B -> 4 B per element
            p.grad = None

    def master_to_model(self) -> None:
        """Round the fp32 master weights into the 16-bit model (in place)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                p.copy_(m)

    def step(self, optimizer, scaler: GradScaler | None = None) -> None:
        """Gradients up to fp32, one optimizer step on the master weights, weights back down."""
        self.grads_to_master()                                       # 1. cast gradients up
        if scaler is None:
            optimizer.step()                                         # 2. step in fp32
        else:
            scaler.step(optimizer)                                   # 2'. unscaled, maybe skipped
        self.master_to_model()                                       # 3. copy back, rounded
        for m in self.master_params:
            m.grad = None                                            # 4. fp32 gradients freed


@dataclasses.dataclass(frozen=True)
class OpDtype:
    """One operator call: its name, the dtypes of its floating-point inputs and its output."""

    op: str
    inputs: tuple[torch.dtype, ...]
    output: torch.dtype


class _Dtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[OpDtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.is_floating_point()]
        name = func.overloadpacket.__name__
        aliases = name.endswith("view") or all(r.alias_info is not None
                                               for r in func._schema.returns)
        if outs and not aliases:                                     # skip views: no compute
            ins = tuple(t.dtype for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor) and t.is_floating_point())
            self.calls.append(OpDtype(name, ins, outs[0].dtype))
        return out


def autocast_dtypes(model: Callable, *inputs, device_type: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> list[OpDtype]:
    """Run `model(*inputs)` once under `torch.autocast(device_type, dtype)` and list, per operator
    call in order, the dtypes it computed in. Casts autocast inserts show up as `_to_copy`.

    A dispatch mode sees the operators after autocast has cast their inputs, so the list is what
    ran, not what the lists in the documentation say should run. Views are left out.

        >>> ops = autocast_dtypes(gpt.loss, x, y)
        >>> {o.op: o.output for o in ops}["addmm"]     # torch.bfloat16
    """
    with torch.autocast(device_type, dtype=dtype), _Dtypes() as mode:
        model(*inputs)
    return mode.calls
