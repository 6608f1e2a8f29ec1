"""Chapter 05, exercise 5: the cast to FP8 (e4m3) with a per-tensor scale, overflows counted."""
from __future__ import annotations

import math
import numbers

import torch

from companion.checks.ch05._common import _own_amax
from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require

__all__ = ["check_to_e4m3"]


def _fp8_cases(seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, x, amax): the tensor's own amax, a delayed amax 4x too small (a spike), values that
    land between 448 and the overflow limit and on it (464, the tie round-to-nearest-even takes
    to 448: `>= 464` counts 2 more there), amax 0 and inf, bf16 input, every sign; an amax
    below 1 (a gradient's); a bf16 amax (x.abs().max() of a bf16 tensor: 448 / amax in bf16
    rounds the scale, here by 1 part in 900 at amax 13)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 19, generator=g) * 3.0
    own = x.abs().max()
    near = torch.tensor([455.0, -460.0, 463.9, 464.0, -464.0, 464.1, -470.0, 100.0, 1.0])
    small = x * 1e-3
    wide = (x / own * 12.0).bfloat16()
    wide.view(-1)[seed % wide.numel()] = -13.0                 # amax 13: 448 / 13 is not a bf16
    return [("its own amax", x, own),
            ("an amax from earlier steps, 4x below this tensor's (a spike)", x, own / 4),
            ("an amax of 448 (scale 1) on values from 1 to 470 of both signs", near,
             torch.tensor(448.0)),
            ("an amax of 0 (nothing to scale by)", x, torch.tensor(0.0)),
            ("an amax of inf", x, torch.tensor(math.inf)),
            ("a bf16 tensor and its own amax", x.bfloat16(), x.bfloat16().abs().max().float()),
            ("a gradient-sized tensor (amax below 1) and its own amax", small,
             small.abs().max()),
            ("a bf16 tensor and its own amax, a bf16 tensor too", wide, wide.abs().max())]


def _as_scale(value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckFailed(f"expected the scale as a number (or a one-element tensor), got "
                          f"{type(value).__name__}", hint="return (codes, scale, overflows).")
    return float(value)


@exercise(points=2, reference=("companion.scaling.quantize", "companion.scaling.amax_scale",
                               "companion.scaling.overflow_limit",
                               "companion.scaling.DelayedScaling"))
def check_to_e4m3(answer) -> str:
    """answer(x, amax) -> (codes, scale, overflows): x times the scale that maps amax onto e4m3's
    largest value, cast to float8_e4m3fn, and how many values the cast could not represent."""
    from companion import scaling
    for seed in fresh_seeds(2):
        for what, x, amax in _fp8_cases(seed):
            want_scale = float(scaling.amax_scale(amax, "e4m3"))
            out = call(answer, x, amax)
            require(isinstance(out, tuple) and len(out) == 3,
                    f"expected (codes, scale, overflows), got {type(out).__name__}",
                    hint="return three things: the float8 tensor, the scale, the count.")
            codes, scale, overflows = out
            got_scale = _as_scale(scale)
            if not math.isclose(got_scale, want_scale, rel_tol=1e-6):
                _wrong_scale(got_scale, want_scale, amax, x, what)
            require(isinstance(codes, torch.Tensor) and codes.dtype == torch.float8_e4m3fn
                    and codes.shape == x.shape,
                    f"with {what}: codes should be a float8_e4m3fn tensor of shape "
                    f"{tuple(x.shape)}, got "
                    f"{codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__}",
                    hint="cast x * scale with .to(torch.float8_e4m3fn).")
            # From the answer's own scale: one ulp of the scale apart (448 / amax rounded once or
            # twice) moves products that sit on an e4m3 midpoint, common for bf16 inputs. The
            # product in float64 is as honest as float32's (the statement names no dtype), and
            # rounds some bf16 products to the other side of a midpoint: either is accepted.
            want_codes, want_over = scaling.quantize(x, got_scale, "e4m3")
            require(torch.equal(codes.float(), want_codes.float()) or torch.equal(
                        codes.float(), (x.double() * got_scale).to(torch.float8_e4m3fn).float()),
                    f"with {what}: the codes differ from x * scale cast to e4m3",
                    hint="multiply in float32 or wider (x.float() * scale), then cast once.")
            require(isinstance(overflows, numbers.Integral) or (
                isinstance(overflows, torch.Tensor) and overflows.numel() == 1),
                f"expected the overflow count as an int, got {type(overflows).__name__}")
            got_over = int(overflows)
            if got_over != want_over and got_over != int(((x.double() * got_scale).abs()
                                                           > scaling.overflow_limit("e4m3")).sum()):
                _wrong_overflows(got_over, want_over, x, got_scale, what)
    return ("scales from the amax you are given, overflows counted before the saturating cast, "
            "at the limit round-to-nearest really has")


def _wrong_scale(got: float, want: float, amax, x, what: str) -> None:
    hint = "the scale multiplies x so that amax lands on e4m3's largest value."
    own = float(_own_amax(x))
    if want and math.isclose(got, 1 / want, rel_tol=1e-6):
        hint = "the scale is 448 / amax, a multiplier, not amax / 448."
    elif not (float(amax) > 0 and math.isfinite(float(amax))):
        hint = ("with an amax of 0 or inf there is nothing to scale by: use a scale of 1, as "
                "Transformer Engine does, rather than inf or 0.")
    elif isinstance(amax, torch.Tensor) and amax.dtype in (torch.bfloat16, torch.float16) and \
            got == float(448.0 / amax):
        hint = (f"amax is a {amax.dtype} tensor here: 448 / amax computed in that dtype is "
                f"rounded to its precision ({got:.6g}).")
    elif own and math.isclose(got, 448.0 / own, rel_tol=1e-6):
        hint = ("use the amax you are given, not the tensor's own: delayed scaling's amax comes "
                "from earlier steps, and the whole point is not to look at this tensor first.")
    raise CheckFailed(f"with {what}: scale {got:.6g}, expected {want:.6g}", hint=hint)


def _wrong_overflows(got: int, want: int, x, scale: float, what: str) -> None:
    scaled = (x.float() * scale).abs()
    hint = "count the values of x * scale the cast cannot bring into e4m3's range."
    if got == 0 and want > 0:
        hint = ("count before the cast: torch's float8_e4m3fn cast saturates at 448 (even inf "
                "becomes 448), so after it nothing looks too large.")
    elif got == int((scaled > 448).sum()):
        hint = ("a value a little above 448 still rounds to 448, the nearest e4m3 value: where "
                "does round-to-nearest stop reaching it? (The next step above 448 would be 480.)")
    elif got == int(((x.float() * scale) > 464).sum()):
        hint = "overflow is about magnitude: large negative values overflow too."
    elif got == int((scaled >= 464).sum()):
        hint = ("a value of exactly 464 lies halfway between 448 and the step above it (480, which "
                "e4m3fn does not have): which way does round-to-nearest, ties to even, take it?")
    raise CheckFailed(f"with {what}: {got} overflows counted, expected {want}", hint=hint)
