"""Checks for chapter 02, float formats."""
from __future__ import annotations

import math
import numbers
import random

import torch

from companion import floats
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require

__all__ = ["check_decode_bf16", "check_max_finite", "check_largest_exact_integer",
           "check_low_precision_sum", "check_rounding_threshold"]

# Layouts (exponent_bits, mantissa_bits): the course's formats, fp64, and made-up ones.
_LAYOUTS = [(5, 10), (8, 7), (8, 23), (5, 2), (4, 3), (11, 52), (6, 9), (3, 4)]


def _layout_name(e: int, m: int) -> str:
    known = {(f.exponent_bits, f.mantissa_bits): n for n, f in floats.FORMATS.items()}
    return known.get((e, m), "fp64" if (e, m) == (11, 52) else f"a made-up e{e}m{m}")


def _number(value, name: str) -> float:
    """A learner's number as a float, or a CheckFailed that says what came back instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):     # NumPy's numbers too
        raise CheckFailed(f"{name}: expected a number, got a {type(value).__name__}: {value!r:.80}",
                          hint="return a Python float (or int).")
    return float(value)


# ---------------------------------------------------------------- decoding bf16 by hand

def _bf16_wrong(bits: int) -> dict[str, float]:
    """What the usual mistakes give for one bf16 pattern."""
    sign = -1.0 if bits >> 15 else 1.0
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if exponent == 0xFF:
        return {"the sign bit applies to infinity too: 0xff80 is -inf.": math.inf} if (
            mantissa == 0 and sign < 0) else {}
    if exponent == 0:
        return {"subnormals are not zero: an exponent field of 0 with a non-zero mantissa is "
                "0.mantissa × 2^(1 − 127), down to 2^−133 ≈ 9.2e-41 (flushing them to zero is a "
                "speed setting of some hardware, not the format).": sign * 0.0,
                "an exponent field of 0 means a subnormal: 0.mantissa × 2^(1 − 127), with no "
                "implicit leading 1.": sign * (1 + mantissa / 128) * 2.0**-127,
                "subnormals scale by 2^(1 − bias), the same power as the smallest normals, "
                "not 2^(0 − bias).": sign * mantissa / 128 * 2.0**-127}
    return {"normal numbers have an implicit leading 1: 1.mantissa, i.e. 1 + mantissa / 2^7.":
            sign * mantissa / 128 * 2.0 ** (exponent - 127),
            "bf16's bias is 127 (2^(8−1) − 1), like fp32's.": sign * (1 + mantissa / 128) * 2.0 ** (
                exponent - 128),
            "the top bit is the sign: set means negative.": abs(floats.decode(bits, "bf16")),
            "the mantissa field is the 7 lowest bits, divided by 2^7.": sign * (
                1 + mantissa / 2**23) * 2.0 ** (exponent - 127)}


def _bf16_hint(bits: int) -> str:
    """The hint for a pattern no known mistake explains: the rule for its kind of pattern."""
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if exponent == 0xFF:
        return "an exponent field of all ones is inf (mantissa 0) or NaN (anything else)."
    if exponent == 0 and mantissa == 0:
        return "an exponent field of 0 with a mantissa of 0 is zero: 0.0 × 2^(1 − 127)."
    if exponent == 0:
        return ("an exponent field of 0 is a subnormal: print the three fields of this pattern "
                "and your value. Does a subnormal have an implicit leading 1, and which power of "
                "two scales it?")
    return ("a normal pattern (exponent field 1 to 254): print the three fields of this pattern "
            "and your value. Which part of your formula (sign, leading bit, mantissa scale, "
            "bias) turns these fields into another number?")


@exercise(points=1, reference="companion.floats.decode")
def check_decode_bf16(answer) -> str:
    """answer(bits: int) -> float: the value of a 16-bit bf16 pattern, every kind of pattern."""
    # normals first, then subnormals, then the zeros, then the specials: the first failure
    # comes from the simplest pattern that shows the mistake, so its hint fits
    # NaNs of every kind: quiet, signalling (quiet bit 0), negative
    fixed = [0x3F80, 0xC000, 0x3DCD, 0x0080, 0x7F7F, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F80,
             0xFF80, 0x7FC0, 0x7F81, 0x7FBF, 0xFF81, 0xFFC0]
    rng = random.Random(fresh_seeds(1)[0])
    drawn = [rng.randrange(2**16) for _ in range(24)]
    drawn += [rng.randrange(1, 0x80) | sign for sign in (0, 0x8000)]    # two subnormals
    for bits in fixed + drawn:
        want = floats.decode(bits, "bf16")
        got = _number(call(answer, bits), f"decode_bf16({bits:#06x})")
        require(math.isnan(got) == math.isnan(want), f"decode_bf16({bits:#06x}) should be "
                f"{want!r}, got {got!r}", hint=_bf16_hint(bits))
        if want == 0:
            if got != 0:                          # the zero/subnormal branch is wrong, not the sign
                compare(got, want, name=f"decode_bf16({bits:#06x})", atol=0.0,
                        known_wrong=_bf16_wrong(bits), hint=_bf16_hint(bits))
            require(math.copysign(1, got) == math.copysign(1, want),
                    f"decode_bf16({bits:#06x}) should be {want!r}, got {got!r}",
                    hint="the sign bit applies to zero too: 0x8000 is -0.0.")
            continue
        compare(got, want, name=f"decode_bf16({bits:#06x})", atol=0.0,
                known_wrong=_bf16_wrong(bits), hint=_bf16_hint(bits))
    return f"decodes normals, subnormals, ±0, ±inf and NaN: {len(fixed + drawn)} patterns right"


# ---------------------------------------------------------------- range and integers from the layout

def _pow2(k: int) -> float:
    """2^k as a float, inf where a double overflows (fp64's wrong answers go past 2^1023)."""
    return math.inf if k > 1023 else 2.0**k


# (exponent_bits, mantissa_bits, finite_only): IEEE layouts, and ones whose top exponent holds
# numbers (e4m3fn, and made-up "fn" versions of others)
_MAX_CASES = [(5, 10, False), (8, 7, False), (8, 23, False), (11, 52, False), (5, 2, False),
              (4, 3, True), (4, 3, False), (3, 2, False), (2, 1, False), (5, 2, True),
              (3, 4, True), (6, 9, True), (8, 7, True)]


def _convention(finite_only: bool) -> str:
    return "top exponent holds numbers, S.1…1.1…1 is NaN" if finite_only else "IEEE: top exponent is inf/NaN"


@exercise(points=1, reference=("companion.floats.FloatFormat", "companion.floats.decode"))
def check_max_finite(answer) -> str:
    """answer(exponent_bits, mantissa_bits, finite_only) -> float: the largest finite value."""
    cases = list(_MAX_CASES)
    random.Random(fresh_seeds(1)[0]).shuffle(cases)
    for e, m, fn in sorted(cases, key=lambda c: c[2]):           # IEEE ones first
        f = floats.FloatFormat("layout", e, m, finite_only=fn)
        top = 2**e - 1 - f.bias                                    # the all-ones exponent field
        name = f"max_finite({e}, {m}, finite_only={fn}) ({_layout_name(e, m)}, {_convention(fn)})"
        wrong = {"the largest mantissa 1.11…1 is 2 − 2^−m, just below 2: include it.":
                 _pow2(top - 1) if not fn else 2.0**top}
        if fn:
            wrong["with finite_only the top exponent field holds ordinary numbers: only its "
                  "all-ones mantissa is NaN. Which patterns of that field are left for numbers, "
                  "and which is the largest?"] = (2 - 2.0**-m) * 2.0 ** (top - 1)
            wrong["S.1…1.1…1 is the NaN pattern here, not a number: which pattern is the largest "
                  "one below it?"] = (2 - 2.0**-m) * 2.0**top
        else:
            wrong["an exponent field of all ones is reserved for inf and NaN: the largest finite "
                  "number uses all ones but the last bit."] = (2 - 2.0**-m) * _pow2(top)
            wrong["the bias is 2^(e−1) − 1."] = (2 - 2.0**-m) * _pow2(top - 2)
        got = _number(call(answer, e, m, fn), f"max_finite({e}, {m}, {fn})")
        compare(got, f.max, name=name, atol=0.0, rtol=0.0, known_wrong=wrong)
    ieee, fn = (floats.FloatFormat("e4m3", 4, 3, finite_only=c).max for c in (False, True))
    return (f"e4m3 tops out at {fn:g} when its top exponent holds numbers (torch.finfo of "
            f"float8_e4m3fn: {torch.finfo(torch.float8_e4m3fn).max:g}) and at {ieee:g} under the "
            "IEEE rules: the convention decides")


# (exponent_bits, mantissa_bits) under the IEEE convention, where the range can run out first
_INTEGER_LAYOUTS = [(5, 10), (8, 7), (8, 23), (11, 52), (5, 2), (4, 3), (2, 1), (3, 2), (3, 4),
                    (2, 3), (6, 9)]


def _exact_integers(e: int, m: int) -> int:
    """The largest N with every integer 0..N exact in the IEEE layout (e, m)."""
    return int(min(2.0 ** (m + 1), math.floor(floats.FloatFormat("layout", e, m).max)))


@exercise(points=1, reference=("companion.floats.FloatFormat", "companion.floats.encode",
                               "companion.floats.decode", "companion.floats.ulp",
                               "companion.checks.ch02._exact_integers"))
def check_largest_exact_integer(answer) -> str:
    """answer(exponent_bits, mantissa_bits) -> int: the largest N such that every integer 0..N is
    exactly representable in that IEEE layout."""
    layouts = list(_INTEGER_LAYOUTS)
    random.Random(fresh_seeds(1)[0]).shuffle(layouts)
    for e, m in layouts:
        want = _exact_integers(e, m)
        top = floats.FloatFormat("layout", e, m).max
        got = _number(call(answer, e, m), f"largest_exact_integer({e}, {m})")
        compare(got, float(want), atol=0.0, rtol=0.0,
                name=f"largest_exact_integer({e}, {m}) ({_layout_name(e, m)})", known_wrong={
                    "the significand has m + 1 bits (the implicit leading 1 counts): integers "
                    "stay exact up to 2^(m+1), not 2^m.": min(2.0**m, math.floor(top)),
                    "2^(m+1) itself is exact (1.0 × 2^(m+1)); the first integer lost is "
                    "2^(m+1) + 1.": min(2.0 ** (m + 1) - 1, math.floor(top)),
                    "a narrow exponent can run out before the precision does: no integer above "
                    "the largest finite number is representable.": 2.0 ** (m + 1),
                    "above 2^(m+1) the gap between neighbours is 2: not every integer up to the "
                    "largest finite number is exact.": float(math.floor(min(top, 2.0**1000))),
                })
    return (f"fp16 counts exactly to {_exact_integers(5, 10)}, bf16 to {_exact_integers(8, 7)}, "
            f"fp32 to {_exact_integers(8, 23):,}; IEEE e2m1 runs out of range at "
            f"{_exact_integers(2, 1)}")


# ---------------------------------------------------------------- summing in low precision

def _added_unrounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every addition rounded to dtype, but each value added as given (fp32)."""
    total = torch.zeros((), dtype=dtype)
    for v in values:
        total = (total.float() + v).to(dtype)
    return total


@exercise(points=2, timeout=10.0, reference=("companion.floats.running_sum",
                                             "companion.floats.running_totals"))
def check_low_precision_sum(answer) -> str:
    """answer(values, dtype) -> 0-d tensor of dtype: values added one at a time in dtype."""
    seeds = fresh_seeds(2)
    # a double rounding case: 1 + 2^-11 + 2^-22 (exact in fp32) rounds up to fp16's next number,
    # but 2^-11 + 2^-22 stored in fp16 is 2^-11 (a tie, to even), and 1 + 2^-11 rounds to 1
    cases = [(torch.full((1000,), 0.01), torch.float16),
             (torch.tensor([1.0, 2.0**-11 + 2.0**-22]), torch.float16),
             (torch.rand(357, generator=torch.Generator().manual_seed(seeds[0])), torch.bfloat16),
             (torch.rand(611, generator=torch.Generator().manual_seed(seeds[1])) * 0.1,
              torch.float16)]
    for values, dtype in cases:
        want = floats.running_sum(values, dtype)
        wrong = {
            "this sum was kept in a wider accumulator (as .sum(), cumsum and Python floats "
            "keep it) and rounded once at the end: the exercise rounds to the low-precision "
            "dtype after every addition.": values.to(dtype).sum(),
            "round each value to the dtype before adding it, as a tensor of that dtype would "
            "hold it: added as given, a value can round the sum twice differently.":
                _added_unrounded(values, dtype),
            "cast each value to the dtype first: the sum must round after every addition.":
                values.sum().to(dtype),
            "keep the accumulator in the low-precision dtype, not fp32.":
                floats.running_sum(values, dtype, accumulate=torch.float32),
        }
        got = call(answer, values, dtype)
        compare(got, want, name=f"sum of {len(values)} values in {dtype}", rtol=0.0, atol=0.0,
                known_wrong=wrong)
    stalled = floats.running_sum(cases[0][0], torch.float16)
    return f"0.01 added 1000 times in fp16 gives {stalled.item():g}, not 10"


# ---------------------------------------------------------------- where an update vanishes

def _threshold(w: float, e: int, m: int) -> float:
    """Half the gap from w (> 0, in the layout) to the next number of the layout above it."""
    bias = 2 ** (e - 1) - 1
    power = max(math.frexp(w)[1] - 1, 1 - bias)          # subnormals share 2^(1 - bias)
    return math.ldexp(1.0, power - m - 1)


def _threshold_cases(seed: int, e: int, m: int) -> list[float]:
    """Positive numbers of the layout: 1, powers of two, the smallest normal and subnormals, and
    random normals (every one exact in float64 for these layouts)."""
    rng, bias = random.Random(seed), 2 ** (e - 1) - 1
    # An odd multiple of the smallest subnormal (never a power of two, where using w itself and
    # forgetting the subnormals give the same wrong number, and a hint could name either).
    cases = [1.0, 2.0 ** min(3, bias), 2.0 ** (1 - bias), 2.0 ** (1 - bias - m) * rng.randrange(
        3, 2**m, 2)]
    for _ in range(5):
        power = rng.randrange(1 - bias, min(bias, 60))
        cases.append(math.ldexp(1 + rng.randrange(2**m) / 2**m, power))
    return cases


def _threshold_wrong(w: float, e: int, m: int) -> dict[str, float]:
    bias, right = 2 ** (e - 1) - 1, _threshold(w, e, m)
    power = math.frexp(w)[1] - 1
    wrong = {
        "half the gap: an update rounds to the nearer of w and the next number, so it survives "
        "only past half the gap.": 2 * right,
        "the gap grows with the number: scale 2^-m by w's power of two, 2^floor(log2 w).":
            2.0 ** (-m - 1),
        "the gap is the same for every number between two powers of two: use 2^floor(log2 w), "
        "not w itself.": w * 2.0 ** (-m - 1),
    }
    if power < 1 - bias:
        wrong["below the smallest normal number the gap stops shrinking: every subnormal is a "
              "multiple of the smallest one, 2^(1 - bias - m)."] = math.ldexp(1.0, power - m - 1)
    if w == 2.0 ** power:
        wrong["the next number *above* w: at a power of two the gap above is twice the gap "
              "below."] = right / 2
    return wrong


@exercise(points=2, reference=("companion.floats.ulp",
                               "companion.floats.FloatFormat",
                               "companion.checks.ch02._threshold"))
def check_rounding_threshold(answer) -> str:
    """answer(w, exponent_bits, mantissa_bits) -> float: half the gap from w (> 0, a number of the
    layout) to the next number of the layout above it: updates smaller than that vanish."""
    layouts = [(e, m) for e, m in _LAYOUTS if e < 11]   # fp64's half gaps underflow float64
    for seed, (e, m) in zip(fresh_seeds(len(layouts)), layouts):
        for w in _threshold_cases(seed, e, m):
            want, wrong = _threshold(w, e, m), _threshold_wrong(w, e, m)
            got = _number(call(answer, w, e, m), f"rounding_threshold({w!r}, {e}, {m})")
            compare(got, want, atol=0.0, rtol=0.0,
                    name=f"threshold above w = {w!r} in {_layout_name(e, m)} (e={e}, m={m})",
                    known_wrong=wrong)
    bf16, fp16 = _threshold(1.0, 8, 7), _threshold(1.0, 5, 10)
    return (f"an update to a weight of 1.0 vanishes below {bf16:g} in bf16 and {fp16:g} in "
            "fp16: a learning rate of 1e-4 times a gradient of 1 is lost in both")
