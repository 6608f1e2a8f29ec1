"""Scaling into narrow formats: one scale per tensor (current or delayed) or per block, for FP8.

FP8 keeps 3 significant bits (e4m3, largest 448) or 2 (e5m2, largest 57344), far too little range
for raw activations or gradients: a tensor is multiplied by a scale that brings its largest
magnitude (its *amax*) near the format's largest value, cast, and divided by the scale again
after the matmul (Micikevicius et al., 2022, "FP8 Formats for Deep Learning"; NVIDIA Transformer
Engine's recipes). Which amax:

- current scaling: the tensor's own, which needs a pass over it before the cast;
- delayed scaling: the largest of the last `history` steps' amaxes, known before the step
  (Transformer Engine's default): no extra pass, but a spike beyond the history overflows;
- per block: one scale per tile, so one outlier costs only its tile the precision
  (DeepSeek-V3: 1×128 tiles for activations, 128×128 for weights; the OCP MX formats: 32 values
  sharing a power-of-two scale).

torch's float8 casts do not overflow to inf: e4m3fn saturates at ±448 (even inf becomes 448), e5m2
rounds large values to ±inf. `quantize` therefore counts the values beyond the format's range
*before* the cast. `block_absmax` is the per-block statistic the block-wise 8- and 4-bit
quantizers of the optimizer states share.

`fp8_linears(model, recipe)` trains a model's `nn.Linear`s through simulated FP8 matmuls: e4m3
inputs and weights in forward, e5m2 output gradients in backward, each with its own per-tensor
scale (current or delayed), products accumulated in fp32, the FP8 codes saved for backward.

Example:
    >>> scale = amax_scale(x.abs().max(), "e4m3")
    >>> codes, overflows = quantize(x, scale, "e4m3")      # float8_e4m3fn, 0 overflows
    >>> x_again = dequantize(codes, scale)
"""
from __future__ import annotations

import collections
import contextlib
import math

import torch
from torch import nn

__all__ = ["FP8", "amax_scale", "overflow_limit", "overflows", "quantize", "dequantize",
           "DelayedScaling", "block_absmax", "block_quantize", "mx_scales", "fp8_linears", "FP8Recipe"]

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _dtype(fmt: str | torch.dtype) -> torch.dtype:
    if isinstance(fmt, torch.dtype) and fmt in FP8.values():
        return fmt
    if fmt not in FP8:
        raise ValueError(f"fmt is 'e4m3' (forward: weights, activations) or 'e5m2' (backward: "
                         f"gradients), got {fmt!r}")
    return FP8[fmt]


def amax_scale(amax: torch.Tensor | float, fmt: str = "e4m3", *, margin: int = 0) -> torch.Tensor:
    """The scale that maps `amax` onto the format's largest value, divided by 2^margin (room for
    growth): (max / amax) / 2^margin; 1 where amax is 0 or not finite (nothing to scale by)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    top = torch.finfo(_dtype(fmt)).max
    scale = top / amax / 2.0**margin
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))


_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def overflow_limit(fmt: str = "e4m3") -> float:
    """Where round-to-nearest stops reaching the format's largest value: the largest value plus
    half its ulp (464 for e4m3, 61440 for e5m2). Below it a value rounds to a representable one
    (448.00003 is 448, not an overflow). The limit itself is a tie, which rounds to the even
    mantissa: e4m3's 448 (1.110 x 2^8) is even, so 464 becomes 448; e5m2's 57344 (1.11 x 2^15) is
    odd, so 61440 rounds up, past the range (`overflows` counts it)."""
    dtype = _dtype(fmt)
    top = torch.finfo(dtype).max
    return top + 2.0 ** (math.floor(math.log2(top)) - _MANTISSA[dtype]) / 2


def _top_is_odd(dtype: torch.dtype) -> bool:
    top = torch.finfo(dtype).max
    return int(top / 2.0 ** (math.floor(math.log2(top)) - _MANTISSA[dtype])) % 2 == 1


def overflows(scaled: torch.Tensor, fmt: str = "e4m3") -> int:
    """How many values of `scaled` round-to-nearest-even cannot bring into the format's range
    (NaN counts too): beyond `overflow_limit`, or on it when the tie rounds away from the top."""
    dtype = _dtype(fmt)
    limit = overflow_limit(fmt)
    inside = scaled.abs() < limit if _top_is_odd(dtype) else scaled.abs() <= limit
    return int((~inside).sum())


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3"
             ) -> tuple[torch.Tensor, int]:
    """(x · scale cast to the FP8 format, how many values lay beyond its range before the cast
    (`overflows`), which the cast saturates or turns into inf without saying so)."""
    dtype = _dtype(fmt)
    scaled = x.float() * torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return scaled.to(dtype), overflows(scaled, fmt)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """codes / scale in float32: what the FP8 tensor stands for."""
    return codes.float() / torch.as_tensor(scale, dtype=torch.float32, device=codes.device)


class DelayedScaling:
    """Transformer Engine's delayed scaling for one tensor: the scale of step t comes from the
    largest amax of the previous `history` steps, so it is known before the tensor exists.

        >>> scaling = DelayedScaling(history=16, fmt="e4m3")
        >>> codes, overflows = quantize(x, scaling.scale(), "e4m3")
        >>> scaling.update(x.abs().max())                  # after the step

    Before any update the scale is 1 (TE starts there too)."""

    def __init__(self, history: int = 16, fmt: str = "e4m3", *, margin: int = 0):
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history is how many past amaxes to keep, an int >= 1, "
                             f"got {history!r}")
        _dtype(fmt)
        self.fmt, self.margin = fmt, margin
        self.amaxes: collections.deque = collections.deque(maxlen=history)

    def scale(self) -> torch.Tensor:
        """The scale for the coming step."""
        if not self.amaxes:
            return torch.ones(())
        return amax_scale(max(self.amaxes), self.fmt, margin=self.margin)

    def update(self, amax: torch.Tensor | float) -> None:
        """Record this step's amax (a host-device sync if it is on a GPU)."""
        self.amaxes.append(float(amax))


def block_absmax(x: torch.Tensor, block: int | tuple[int, int]) -> torch.Tensor:
    """The largest magnitude of each block of `x`: `block` an int (consecutive values of the
    flattened tensor; the last block may be short) -> (ceil(numel / block),), or (rows, cols)
    tiles of a 2-D tensor (edge tiles may be short) -> (ceil(R / rows), ceil(C / cols))."""
    if isinstance(block, int):
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        flat = x.detach().reshape(-1).float().abs()
        pad = (-flat.numel()) % block
        if pad:                                          # F.pad copies even when it adds nothing
            flat = torch.nn.functional.pad(flat, (0, pad))
        return flat.view(-1, block).amax(dim=1)
    rows, cols = block
    if x.dim() != 2:
        raise ValueError(f"(rows, cols) tiles need a 2-D tensor, got shape {tuple(x.shape)}")
    R, C = x.shape
    pr, pc = (-R) % rows, (-C) % cols
    t = torch.nn.functional.pad(x.detach().float().abs(), (0, pc, 0, pr))   # (R', C')
    return t.view((R + pr) // rows, rows, (C + pc) // cols, cols).amax(dim=(1, 3))


def block_quantize(x: torch.Tensor, block: tuple[int, int], fmt: str = "e4m3"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor in FP8 with one scale per (rows, cols) tile (DeepSeek-V3's 1×128 for
    activations, 128×128 for weights): (codes of x's shape, scales per tile). Dequantize with
    `codes.float()` divided by each tile's scale (the scales repeated over their tiles)."""
    rows, cols = block
    scales = amax_scale(block_absmax(x, block), fmt)                      # (tiles_r, tiles_c)
    full = scales.repeat_interleave(rows, 0)[:x.shape[0]]                  # (R, tiles_c)
    full = full.repeat_interleave(cols, 1)[:, :x.shape[1]]                  # (R, C)
    codes, _ = quantize(x, full, fmt)
    return codes, scales


def mx_scales(x: torch.Tensor, block: int = 32, fmt: str = "e4m3") -> torch.Tensor:
    """The OCP Microscaling (MX) shared scale of each block of `block` values: a power of two
    (stored as E8M0), 2^(floor(log2(amax)) - emax), emax the largest exponent of the element
    format (8 for e4m3, 15 for e5m2), as the OCP MX specification v1.0 (section 6.3) computes it.
    Returns the scales as float32 powers of two, one per block: a block's values are divided by
    its scale before the cast (the opposite convention to `amax_scale`, a multiplier)."""
    emax = {"e4m3": 8, "e5m2": 15}[fmt] if fmt in ("e4m3", "e5m2") else None
    if emax is None:
        raise ValueError(f"fmt is 'e4m3' or 'e5m2', got {fmt!r}")
    amax = block_absmax(x, block)
    exponent = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))
    return torch.exp2(exponent - emax)


# ---------------------------------------------------------------- FP8 training, simulated

class FP8Recipe:
    """Per-tensor scales for the FP8 matmuls of `fp8_linears`, and what they overflowed.

    recipe "current" scales each tensor from its own amax; "delayed" from the largest of the
    last `history` amaxes of the same tensor (layer and role), Transformer Engine's default.
    `overflows[role]` counts values beyond the format's range, `values[role]` all values cast;
    the roles are "input" and "weight" (e4m3) and "grad" (e5m2). Overflowing values saturate to
    the format's largest value in both formats (torch's e4m3fn cast does so itself, its e5m2
    cast would give inf), so an overflow costs precision, not a NaN; `saturate=False` keeps
    torch's e5m2 inf."""

    FORMATS = {"input": "e4m3", "weight": "e4m3", "grad": "e5m2"}

    def __init__(self, recipe: str = "current", history: int = 16, *, saturate: bool = True):
        if recipe not in ("current", "delayed"):
            raise ValueError(f"recipe is 'current' or 'delayed', got {recipe!r}")
        self.recipe, self.history, self.saturate = recipe, history, saturate
        self._delayed: dict[tuple[str, str], DelayedScaling] = {}
        self.overflows = collections.Counter()
        self.values = collections.Counter()

    def cast(self, layer: str, role: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 codes of x, their scale), counting the overflows."""
        fmt = self.FORMATS[role]
        amax = x.detach().abs().max().float()
        if self.recipe == "current":
            scale = amax_scale(amax, fmt)
        else:
            delayed = self._delayed.setdefault((layer, role), DelayedScaling(self.history, fmt))
            scale = delayed.scale().to(x.device)
            delayed.update(amax)
        codes, overflows = quantize(x, scale, fmt)
        if overflows and fmt == "e5m2" and self.saturate:     # torch's e5m2 cast gives inf
            top = torch.finfo(FP8[fmt]).max
            codes = (x.float() * scale).clamp(-top, top).to(FP8[fmt])
        self.overflows[role] += overflows
        self.values[role] += x.numel()
        return codes, scale


class _FP8Matmul(torch.autograd.Function):
    """x @ weight.T + bias through FP8: the codes are what is saved for backward (1 byte each)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: FP8Recipe, layer: str):
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = recipe.cast(layer, "input", x2)
        wq, sw = recipe.cast(layer, "weight", weight)
        out = dequantize(xq, sx) @ dequantize(wq, sw).T           # fp32 accumulation
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.recipe, ctx.layer, ctx.shape, ctx.has_bias = recipe, layer, x.shape, bias is not None
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xq, sx, wq, sw = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gq, sg = ctx.recipe.cast(ctx.layer, "grad", g2)
        g = dequantize(gq, sg)
        grad_x = (g @ dequantize(wq, sw)).reshape(ctx.shape)
        grad_w = g.T @ dequantize(xq, sx)
        grad_b = g2.float().sum(0) if ctx.has_bias else None        # from the unquantized grad
        return grad_x, grad_w, grad_b, None, None


@contextlib.contextmanager
def fp8_linears(model: nn.Module, recipe: str = "current", *, history: int = 16,
                saturate: bool = True):
    """Inside the block every `nn.Linear` of `model` multiplies through simulated FP8 (see the
    module's docstring); yields the `FP8Recipe` with its overflow counts.

        >>> with fp8_linears(model, "delayed") as fp8:
        ...     model.loss(x, y).backward()
        >>> fp8.overflows                                   # Counter({'input': 0, ...})

    Simplified: the matmul runs in fp32 on the dequantized codes (an FP8 tensor core multiplies
    the codes and accumulates in higher precision: the same products up to summation order); the
    scale is per tensor; no FP8 weight cache across micro-batches."""
    state = FP8Recipe(recipe, history, saturate=saturate)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no nn.Linear to run in FP8")
    for name, m in linears:
        if "forward" in vars(m):
            raise RuntimeError(f"{name or 'the model'} already has its forward replaced "
                               f"(nested fp8_linears?)")
        m.forward = (lambda x, m=m, name=name:
                     _FP8Matmul.apply(x, m.weight, m.bias, state, name))
    try:
        yield state
    finally:
        for _, m in linears:
            vars(m).pop("forward", None)
