"""Checks for chapter 02, float formats."""
from __future__ import annotations

import math
import random

import torch

from companion import floats
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require

__all__ = ["check_decode_bf16", "check_max_normal", "check_min_subnormal",
           "check_low_precision_sum", "check_bytes_per_format"]

# Layouts (exponent_bits, mantissa_bits): the course's formats, fp64, and made-up ones.
_LAYOUTS = [(5, 10), (8, 7), (8, 23), (5, 2), (4, 3), (11, 52), (6, 9), (3, 4)]


def _layout_name(e: int, m: int) -> str:
    known = {(f.exponent_bits, f.mantissa_bits): n for n, f in floats.FORMATS.items()}
    return known.get((e, m), "fp64" if (e, m) == (11, 52) else f"a made-up e{e}m{m}")


def _number(value, name: str) -> float:
    """A learner's number as a float, or a CheckFailed that says what came back instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{name}: expected a number, got a {type(value).__name__}: {value!r:.80}",
                          hint="return a Python float (or int).")
    return float(value)


# ---------------------------------------------------------------- decoding bf16 by hand

def _bf16_wrong(bits: int) -> dict[str, float]:
    """What the usual mistakes give for one bf16 pattern."""
    sign = -1.0 if bits >> 15 else 1.0
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if exponent == 0xFF:
        return {}
    if exponent == 0:
        return {"an exponent field of 0 means a subnormal: 0.mantissa × 2^(1 − 127), with no "
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


@exercise(points=1, reference="companion.floats.decode")
def check_decode_bf16(answer) -> str:
    """answer(bits: int) -> float: the value of a 16-bit bf16 pattern, every kind of pattern."""
    # normals first, then subnormals, then the zeros, then the specials: the first failure
    # comes from the simplest pattern that shows the mistake, so its hint fits
    fixed = [0x3F80, 0xC000, 0x3DCD, 0x0080, 0x7F7F, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F80,
             0xFF80, 0x7FC0]
    rng = random.Random(fresh_seeds(1)[0])
    drawn = [rng.randrange(2**16) for _ in range(24)]
    drawn += [rng.randrange(1, 0x80) | sign for sign in (0, 0x8000)]    # two subnormals
    for bits in fixed + drawn:
        got = _number(call(answer, bits), f"decode_bf16({bits:#06x})")
        want = floats.decode(bits, "bf16")
        if want == 0:
            if got != 0:                          # the zero/subnormal branch is wrong, not the sign
                compare(got, want, name=f"decode_bf16({bits:#06x})", atol=0.0,
                        known_wrong=_bf16_wrong(bits),
                        hint="an exponent field of 0 with a mantissa of 0 is zero: 0.0 × 2^(1 − "
                             "127).")
            require(math.copysign(1, got) == math.copysign(1, want),
                    f"decode_bf16({bits:#06x}) should be {want!r}, got {got!r}",
                    hint="the sign bit applies to zero too: 0x8000 is -0.0.")
            continue
        compare(got, want, name=f"decode_bf16({bits:#06x})", atol=0.0,
                known_wrong=_bf16_wrong(bits),
                hint="an exponent field of all ones is inf (mantissa 0) or NaN (anything else).")
    return f"decodes normals, subnormals, ±0, ±inf and NaN: {len(fixed + drawn)} patterns right"


# ---------------------------------------------------------------- range from the layout

def _pow2(k: int) -> float:
    """2^k as a float, inf where a double overflows (fp64's wrong answers go past 2^1023)."""
    return math.inf if k > 1023 else 2.0**k


@exercise(points=1, reference="companion.floats.FloatFormat")
def check_max_normal(answer) -> str:
    """answer(exponent_bits, mantissa_bits) -> float: the largest finite value of an IEEE layout."""
    for e, m in _LAYOUTS:
        if (e, m) == (4, 3):
            continue                    # e4m3fn breaks the IEEE rule; the chapter says how
        f = floats.FloatFormat("layout", e, m)
        emax = 2**e - 2 - f.bias
        got = _number(call(answer, e, m), f"max_normal({e}, {m})")
        name = f"max_normal({e}, {m}) ({_layout_name(e, m)})"
        compare(got, f.max, name=name, atol=0.0, known_wrong={
            "an exponent field of all ones is reserved for inf and NaN: the largest finite "
            "number uses all ones but the last bit.": (2 - 2.0**-m) * _pow2(emax + 1),
            "the largest mantissa is 1.11…1 = 2 − 2^−m: include it.": 2.0**emax,
            "the largest mantissa 1.11…1 is 2 − 2^−m, just below 2.": _pow2(emax + 1),
            "the bias is 2^(e−1) − 1.": (2 - 2.0**-m) * 2.0 ** (emax - 1),
        })
    return "fp16's 65504, bf16's 3.39e38 and fp64's 1.80e308 all follow from the layout"


@exercise(points=1, reference="companion.floats.FloatFormat")
def check_min_subnormal(answer) -> str:
    """answer(exponent_bits, mantissa_bits) -> float: the smallest positive (subnormal) value."""
    for e, m in _LAYOUTS:
        f = floats.FloatFormat("layout", e, m)
        got = _number(call(answer, e, m), f"min_subnormal({e}, {m})")
        compare(got, f.min_subnormal, name=f"min_subnormal({e}, {m}) ({_layout_name(e, m)})",
                atol=0.0, known_wrong={
                    "subnormals use the exponent 1 − bias (like the smallest normals), "
                    "not 0 − bias.": f.min_subnormal / 2,
                    "that is the smallest normal number; subnormals go below it by "
                    "2^mantissa_bits.": f.min_normal,
                    "the smallest subnormal is 0.00…01 × 2^(1 − bias): one unit in the last "
                    "mantissa place, 2^−m.": f.min_normal / 2,
                })
    return "fp16 reaches 2^-24 ≈ 5.96e-08 and bf16 2^-133 ≈ 9.18e-41 thanks to subnormals"


# ---------------------------------------------------------------- summing in low precision

@exercise(points=2, timeout=10.0, reference=("companion.floats.running_sum",
                                             "companion.floats.running_totals"))
def check_low_precision_sum(answer) -> str:
    """answer(values, dtype) -> 0-d tensor of dtype: values added one at a time in dtype."""
    seeds = fresh_seeds(2)
    cases = [(torch.full((1000,), 0.01), torch.float16),
             (torch.rand(357, generator=torch.Generator().manual_seed(seeds[0])), torch.bfloat16),
             (torch.rand(611, generator=torch.Generator().manual_seed(seeds[1])) * 0.1,
              torch.float16)]
    for values, dtype in cases:
        got = call(answer, values.clone(), dtype)
        want = floats.running_sum(values, dtype)
        compare(got, want, name=f"sum of {len(values)} values in {dtype}", rtol=0.0, atol=0.0,
                known_wrong={
                    ".sum() adds in a wider accumulator (fp32) and rounds once at the end; add "
                    "one value at a time in the low-precision dtype.": values.to(dtype).sum(),
                    "cast each value to the dtype first: the sum must round after every "
                    "addition.": values.sum().to(dtype),
                    "keep the accumulator in the low-precision dtype, not fp32.":
                        floats.running_sum(values, dtype, accumulate=torch.float32),
                })
    stalled = floats.running_sum(cases[0][0], torch.float16)
    return f"0.01 added 1000 times in fp16 gives {stalled.item():g}, not 10"


# ---------------------------------------------------------------- bytes per parameter

def _model(seed: int) -> torch.nn.Module:
    g = random.Random(seed)
    widths = [g.randrange(3, 90) for _ in range(g.randrange(2, 5))]
    layers: list[torch.nn.Module] = [torch.nn.Embedding(g.randrange(5, 50), widths[0])]
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b, bias=g.random() < 0.5), torch.nn.BatchNorm1d(b)]
    return torch.nn.Sequential(*layers)


@exercise(points=1, reference="companion.floats.parameter_bytes")
def check_bytes_per_format(answer) -> str:
    """answer(model, dtype) -> int: bytes the model's parameters take when stored in dtype."""
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn]
    for seed, dtype in zip(fresh_seeds(4), dtypes):
        model = _model(seed)
        n = sum(p.numel() for p in model.parameters())
        size = torch.empty((), dtype=dtype).element_size()
        with_buffers = sum(t.numel() for t in model.state_dict().values()) * size
        got = call(answer, model, dtype)
        compare(got, floats.parameter_bytes(model, dtype), name=f"bytes in {dtype}", known_wrong={
            "that is the number of parameters: multiply by the bytes per element.": n,
            "that is bits: divide by 8 (or use torch.empty((), dtype=dtype).element_size()).":
                n * size * 8,
            "the bytes per parameter depend on the dtype you were given.": n * 4,
            "count parameters only (model.parameters()); BatchNorm's running statistics are "
            "buffers.": with_buffers,
        })
        whole = isinstance(got, int) or (isinstance(got, torch.Tensor) and not got.is_floating_point())
        require(whole,
                f"bytes are a whole number; got {got!r:.60}", hint="return an int.")
    model = torch.nn.Linear(1024, 1024)
    mib = [floats.parameter_bytes(model, d) / 2**20 for d in (torch.float32, torch.bfloat16)]
    return f"a 1024×1024 Linear: {mib[0]:.1f} MiB in fp32 -> {mib[1]:.1f} MiB in bf16"
