"""Dynamic loss scaling: the scale's update rule, unscaling with inf/NaN detection, `GradScaler`.

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

Simplified vs PyTorch (`torch.amp.GradScaler`): the scale update runs on the host, from a host
copy of the scale, after the one wait for the inf flag that `step` makes anyway (PyTorch's
`_amp_update_scale_` runs on the device); `step` waits for that flag (`.item()`) with every
optimizer, where PyTorch hands a fused one (`fused=True`, which sets `_step_supports_amp_scaling`)
the scale and the flag on the device and waits for nothing (the same numbers: tested); no sparse
gradients; the device defaults to "cpu" (PyTorch's to "cuda") and the options
after it are keyword-only (PyTorch's may be passed by position); misuse that PyTorch meets with an
AssertionError or AttributeError raises a ValueError or RuntimeError that says what to do.
"""
from __future__ import annotations

import collections
import math
import struct
import warnings
from typing import Any

import torch

__all__ = ["GradScaler", "update_scale", "unscale_grads_", "replay_scale"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def update_scale(scale: float, growth_tracker: int, found_inf: bool, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """The dynamic loss-scale rule: (new scale, new count of clean steps in a row).

    An inf/NaN gradient means the scale was too large: back off and start counting again (the
    step itself is skipped by `GradScaler.step`). When the count of clean steps in a row reaches
    `growth_interval`, grow and start counting again, unless the grown scale would overflow
    float32 (the scale is stored in float32). As in PyTorch's kernel, "reaches" is `==`: a count
    already past the interval (after `set_growth_interval`) never grows the scale again.

    Example:
        >>> update_scale(65536.0, 1999, False)          # (131072.0, 0): grown
        >>> update_scale(65536.0, 1234, True)           # (32768.0, 0): backed off
    """
    if found_inf:
        return _float32(scale * backoff_factor), 0                    # 1. back off, reset
    clean = growth_tracker + 1
    if clean != growth_interval:
        return scale, clean                                           # 2. keep counting
    grown = _float32(scale * growth_factor)
    return (grown if math.isfinite(grown) else scale), 0             # 3. grow, reset


def replay_scale(amaxes, init_scale: float = 2.0**16, growth_interval: int = 2000, *,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 dtype: torch.dtype = torch.float16) -> list[tuple[float, bool]]:
    """The dynamic loss scale over a recorded trace: (scale the step ran with, stepped) per step.

    `amaxes[i]` is step i's largest |gradient| before scaling (fp32; inf or NaN where the step's
    gradients held one). Backward computes the scaled gradient in `dtype`, so a step overflows when
    scale * amax, rounded to `dtype`, is not finite: in fp16 that begins at 65520, where rounding
    to nearest stops reaching 65504, not at 65504 itself. Overflowing steps are skipped and back
    off; `growth_interval` clean steps in a row grow the scale (`update_scale`).

    Example:
        >>> replay_scale([1.0, 0.1, 0.1], growth_interval=1)
        [(65536.0, False), (32768.0, True), (65536.0, True)]
    """
    scale, tracker, steps = _float32(init_scale), 0, []
    for amax in amaxes:
        scaled = torch.tensor(float(amax), dtype=torch.float32) * torch.tensor(scale)
        found_inf = not bool(torch.isfinite(scaled.to(dtype)))
        steps.append((scale, not found_inf))
        scale, tracker = update_scale(scale, tracker, found_inf, growth_factor=growth_factor,
                                      backoff_factor=backoff_factor,
                                      growth_interval=growth_interval)
    return steps


def _float32(x: float) -> float:
    """x rounded to float32, where the scale lives (inf if it does not fit); on the host."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:                                     # rounds to inf in float32
        return math.copysign(math.inf, x)


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
            if ends:                  # a flag, not a count: 1.0 however many groups have one
                found_inf.logical_or_((~torch.stack(ends).isfinite()).any().to(found_inf.device))
            # 2. Unscale in place, (1/s)·g, as PyTorch's kernel does: exact for powers of two.
            torch._foreach_mul_(group, inv_scale.to(device))
    return found_inf


def _check_factors(growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1 (the scale grows), got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks), "
                         f"got {backoff_factor}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
            or growth_interval < 1:
        raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")


class GradScaler:
    """Dynamic loss scaling, a drop-in for `torch.amp.GradScaler`.

    Memory: one float32 scale; gradients are unscaled in place. Cost: one multiply per gradient
    element and one host-device sync per step (to decide whether to skip it; PyTorch's scaler
    avoids it for fused optimizers, see the module docstring).

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

    Arguments (unlike PyTorch's, the device defaults to "cpu", and the rest are keyword-only):
        device: where the loss and gradients live ("cpu", "cuda"); disabled, with a warning, for
            "cuda" when no GPU is available.
        init_scale: the first scale (float32).
        growth_factor: the scale's multiplier after `growth_interval` clean steps (> 1).
        backoff_factor: the scale's multiplier after a step with inf/NaN gradients (in (0, 1)).
        growth_interval: clean steps in a row before the scale grows.
        enabled: False makes `scale`, `unscale_` and `update` do nothing and `step` a plain
            `optimizer.step()`: one training loop with an off switch, no branch.
    """

    def __init__(self, device: str = "cpu", *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        _check_factors(growth_factor, backoff_factor, growth_interval)
        self._device = torch.device(device).type
        if enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn("GradScaler is enabled, but CUDA is not available. Disabling.")
            enabled = False
        self._enabled = enabled
        self._init_scale, self._growth_tracker = float(init_scale), 0
        self._scale_value = _float32(init_scale)         # host copy of the scale: no sync to read
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval
        self._scale: torch.Tensor | None = None          # float32, made on the loss's device
        self._states: dict[int, dict[str, Any]] = {}     # per optimizer: stage, inf flag

    def is_enabled(self) -> bool:
        """False when built with enabled=False (or for CUDA without a GPU): then it does nothing."""
        return self._enabled

    def scale(self, outputs):
        """`outputs` (a tensor, or lists/tuples of them) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._scale = torch.full((), self._scale_value, dtype=torch.float32,
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

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
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

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
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
        """Set the scale for the next step: `new_scale` if given (a float, or a 0-d tensor on the
        scaler's device type), else by `update_scale`."""
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            self._scale_value = self._given_scale(new_scale)
        else:
            flags = [s.get("found", s["found_inf"]) for s in self._states.values()
                     if s["found_inf"] is not None]
            if not flags:
                raise RuntimeError("No inf checks were recorded prior to update(): call "
                                   "step(optimizer) (or unscale_) after backward.")
            found = any(bool(f) for f in flags)                     # host-device sync if unstepped
            self._scale_value, self._growth_tracker = update_scale(
                self._scale_value, self._growth_tracker, found, growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor, growth_interval=self._growth_interval)
        scale.fill_(self._scale_value)                               # from the host: no sync
        self._states = {}

    def _given_scale(self, new_scale: float | torch.Tensor) -> float:
        """`update(new_scale)`'s value rounded to float32; PyTorch's rules for what it accepts."""
        if isinstance(new_scale, float) and math.isfinite(_float32(new_scale)) == math.isfinite(
                new_scale):
            return _float32(new_scale)
        if isinstance(new_scale, torch.Tensor) and new_scale.dim() == 0 \
                and new_scale.device.type == self._device and not new_scale.requires_grad:
            return _float32(float(new_scale))                        # host-device sync
        got = (f"a tensor of shape {tuple(new_scale.shape)} on {new_scale.device}"
               if isinstance(new_scale, torch.Tensor) else repr(new_scale)[:40])
        raise ValueError(f"new_scale should be a float within float32's range or a 0-d tensor on "
                         f"{self._device} with requires_grad=False, got {got}: e.g. "
                         "update(new_scale=1024.0).")

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled), read from the host copy."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale_value

    # The policy's settings, read and changed as on torch.amp.GradScaler (the setters also check
    # the values as __init__ does; PyTorch's take anything).
    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_factors(new_factor, self._backoff_factor, self._growth_interval)
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factors(self._growth_factor, new_factor, self._growth_interval)
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_factors(self._growth_factor, self._backoff_factor, new_interval)
        self._growth_interval = new_interval

    def state_dict(self) -> dict[str, Any]:
        """The same keys as torch.amp.GradScaler's, so either can load the other's."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()` of this class or of torch.amp.GradScaler: the same scale,
        factors and count of clean steps, so the run continues on the same trajectory."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._init_scale = float(state_dict["scale"])
        self._scale_value = _float32(self._init_scale)
        if self._scale is not None:
            self._scale.fill_(self._scale_value)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
