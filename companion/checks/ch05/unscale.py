"""Chapter 05, exercise 4: unscaling gradients in place and finding infs and NaNs."""
from __future__ import annotations

import math

import torch

from companion import amp
from companion.checks.core import (CheckFailed, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)

__all__ = ["check_unscale_grads"]


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 2, 3), (1,)]
    out = [torch.randn(s, generator=g) * 2.0**12 for s in shapes]
    out[1] = out[1].bfloat16()                               # mixed dtypes, as in a real model
    return out


def _flag(value) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise CheckFailed(f"expected found_inf as a bool (or a one-element tensor), got "
                          f"{type(value).__name__}", hint="return whether any gradient held an "
                                                          "inf or NaN, e.g. `return found_inf`.")
    return bool(value)


@harness
def _unscale_run(answer, seed: int, inv_scale: float, where, value, device: str = "cpu"
                 ) -> tuple:
    """The answer's flag, and the gradients the optimizer would then read from p.grad (on the
    CPU), the gradients and inv_scale on `device`."""
    grads = _grads(seed)
    if isinstance(value, tuple):                   # two entries, at two different positions
        flat = grads[where].view(-1)
        flat[0], flat[flat.numel() - 1] = value
    elif where is not None:
        grads[where].view(-1)[seed % grads[where].numel()] = value
    params = [torch.nn.Parameter(torch.zeros_like(g, device=device)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.to(device)
    found = call_inplace(answer, [p.grad for p in params], torch.tensor(inv_scale, device=device))
    if isinstance(found, torch.Tensor):
        found = found.cpu()
    return found, [p.grad.cpu() for p in params]


@exercise(points=2, reference=("companion.amp.unscale_grads_",
                               "companion.amp.GradScaler",
                               "torch._amp_foreach_non_finite_check_and_unscale_"))
def check_unscale_grads(answer) -> str:
    """answer(grads, inv_scale) -> found_inf: multiply every gradient by inv_scale (a 0-d tensor)
    in place and say whether any of them held an inf or NaN."""
    poisons = [(None, None), (3, math.inf), (2, -math.inf), (1, math.nan), (0, math.nan)]
    seeds = fresh_seeds(2)
    for seed in seeds:
        for inv_scale in (2.0**-12, 2.0**-7):
            for where, value in poisons:
                found, grads = _unscale_run(answer, seed, inv_scale, where, value)
                _judge_flag(_flag(found), where, value)
                if where is not None:
                    _require_all_unscaled(grads, seed, inv_scale, where, value)
                if where is None:
                    originals = _grads(seed)
                    expected = [g.clone() for g in originals]
                    amp.unscale_grads_(expected, torch.tensor(inv_scale))
                    compare(tuple(grads), tuple(expected), name="p.grad after unscaling",
                            known_wrong={
                                "unscale in place (g.mul_(inv_scale)): the optimizer reads the "
                                "same tensors in p.grad; new tensors would not reach it.":
                                    tuple(originals),
                                "multiply by inv_scale = 1/scale: backward made the gradients "
                                "scale times too large.": tuple(g / inv_scale for g in originals),
                            })
        for where in (0, 1):                     # fp32 and bf16: finite, but x2 overflows
            big = torch.finfo(_grads(seed)[where].dtype).max / 1.5
            found, _ = _unscale_run(answer, seed, 2.0, where, big)
            require(not _flag(found), f"found_inf is True for a finite gradient ({big:.3g} in "
                    f"gradient {where}) unscaled with inv_scale = 2 (a scale below 1)",
                    hint="look before you multiply: check each gradient for inf and NaN first, "
                         "then multiply, as PyTorch's kernel does (with inv_scale > 1 the product "
                         "of a finite gradient can itself be inf).")
        big = torch.finfo(torch.float32).max / 1.5                  # finite; two of them sum to inf
        found, _ = _unscale_run(answer, seed, 2.0**-8, 0, (big, big))
        require(not _flag(found), f"found_inf is True, but every gradient is finite (two entries of "
                f"{big:.3g} in gradient 0, whose sum overflows to inf)",
                hint="a sum of finite gradients can overflow: test the elements "
                     "(torch.isfinite(g).all()), not their sum.")
        found, _ = _unscale_run(answer, seed, 2.0**-8, 2, (math.inf, -math.inf))
        require(_flag(found), "found_inf is False, but gradient 2 holds an inf and a -inf",
                hint="inf + (-inf) is NaN, not inf: a test on a sum misses it (and a finite sum "
                     "can overflow); test the elements: (~torch.isfinite(g)).any().")
    on_gpu = ""
    if torch.cuda.is_available():               # where training runs: tensors on the GPU
        found, grads = _unscale_run(answer, seeds[0], 2.0**-7, 3, math.inf, "cuda")
        _judge_flag(_flag(found), 3, math.inf)
        _require_all_unscaled(grads, seeds[0], 2.0**-7, 3, math.inf)
        on_gpu = "; on the GPU too"
    return ("every gradient unscaled in place, the ones after an inf too; inf, -inf and NaN found "
            "element by element in any tensor, finite sums that overflow not flagged" + on_gpu)


def _require_all_unscaled(grads, seed: int, inv_scale: float, where, value) -> None:
    """After an inf or NaN, every gradient is still unscaled, as PyTorch's kernel does."""
    expected = _grads(seed)
    expected[where].view(-1)[seed % expected[where].numel()] = value
    amp.unscale_grads_(expected, torch.tensor(inv_scale))
    for i, (got, want) in enumerate(zip(grads, expected)):
        same = isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(
            got.float().nan_to_num(), want.float().nan_to_num())
        require(same, f"gradient {i} is not unscaled after gradient {where} held a non-finite value",
                hint="unscale every gradient even after finding an inf or NaN, as PyTorch's kernel "
                     "does: whoever reads them next (a clip, a log of the norm) expects them "
                     "unscaled. Do not return early.")


def _judge_flag(found: bool, where, value) -> None:
    if where is None:
        require(not found, "found_inf is True but every gradient is finite",
                hint="flag only inf and NaN: (~torch.isfinite(g)).any().")
        return
    kind = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    require(found, f"found_inf is False, but gradient {where} holds a {kind}",
            hint="NaN counts too: torch.isfinite is False for inf, -inf and NaN (isinf misses "
                 "NaN)." if kind == "NaN" else
                 "look at every gradient tensor, not only the first, and at every element.")
