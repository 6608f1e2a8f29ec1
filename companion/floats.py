"""Floating-point formats bit by bit: fp32, fp16, bf16 and the two fp8 flavours.

A float is stored as three fields: a sign bit, an exponent field and a mantissa (fraction) field.
For a normal number the value is (-1)^sign × 1.mantissa × 2^(exponent - bias); an exponent field of
all zeros holds zero and the subnormals, 0.mantissa × 2^(1 - bias); an exponent field of all ones
holds infinity and NaN. The formats differ only in how many bits each field gets, and that choice
sets their range (exponent bits), their precision (mantissa bits) and their bytes per parameter.

Memory: a parameter costs 4 bytes in fp32, 2 in fp16 or bf16 and 1 in fp8. Storing weights in a
narrower format saves that memory and costs precision (bf16 keeps 8 significant bits, fp16 11) or
range (fp16 overflows above 65504 and flushes values below 2^-24 to zero).

Example:
    >>> encode(1.0, "fp16")
    15360
    >>> fields(0.1, "bf16").binary
    '0 01111011 1001101'
    >>> decode(0x7BFF, "fp16"), FORMATS["fp16"].max
    (65504.0, 65504.0)

Simplified vs PyTorch: plain Python, one number at a time; PyTorch casts whole tensors in C++.
`encode` rounds as PyTorch's casts do, including their details: a Python float (a double) is cast
to the narrow formats through fp32, and fp8 e4m3fn saturates at ±448 rather than becoming NaN.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Iterable

import torch

__all__ = [
    "FloatFormat",
    "FORMATS",
    "Fields",
    "decode",
    "encode",
    "fields",
    "fields_of_bits",
    "ulp",
    "flip_bit",
    "bit_roles",
    "rounding_report",
    "running_totals",
    "running_sum",
    "parameter_bytes",
]


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point layout: 1 sign bit, `exponent_bits`, `mantissa_bits`.

    `finite_only` marks fp8 e4m3fn ("fn": finite, NaN only): it has no infinities, its top
    exponent holds ordinary numbers, only S.1111.111 is NaN, and PyTorch's cast saturates.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype | None = None
    finite_only: bool = False
    bias: int = dataclasses.field(init=False)
    max: float = dataclasses.field(init=False)            # largest finite value
    min_normal: float = dataclasses.field(init=False)     # smallest positive normal, 2^(1-bias)
    min_subnormal: float = dataclasses.field(init=False)  # smallest positive value, 2^(1-bias-m)
    eps: float = dataclasses.field(init=False)            # gap from 1.0 to the next value, 2^-m

    def __post_init__(self):
        e, m = self.exponent_bits, self.mantissa_bits
        bias = 2 ** (e - 1) - 1
        if self.finite_only:   # top exponent is a normal binade, minus its NaN pattern
            largest = (2 - 2.0 ** (1 - m)) * 2.0 ** (2**e - 1 - bias)
        else:                  # top exponent is reserved for inf and NaN
            largest = (2 - 2.0**-m) * 2.0 ** (2**e - 2 - bias)
        for key, value in dict(bias=bias, max=largest, min_normal=2.0 ** (1 - bias),
                               min_subnormal=2.0 ** (1 - bias - m), eps=2.0**-m).items():
            object.__setattr__(self, key, value)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bytes(self) -> int:
        return self.bits // 8

    @property
    def digits(self) -> float:
        """Significant decimal digits: log10 of 2^(mantissa_bits + 1)."""
        return (self.mantissa_bits + 1) * math.log10(2)


FORMATS: dict[str, FloatFormat] = {
    "fp32": FloatFormat("fp32", 8, 23, torch.float32),
    "fp16": FloatFormat("fp16", 5, 10, torch.float16),
    "bf16": FloatFormat("bf16", 8, 7, torch.bfloat16),
    "fp8_e4m3": FloatFormat("fp8_e4m3", 4, 3, torch.float8_e4m3fn, finite_only=True),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, torch.float8_e5m2),
}


def _format(fmt: str | FloatFormat) -> FloatFormat:
    if isinstance(fmt, FloatFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def _pattern(bits: int, f: FloatFormat) -> int:
    try:
        bits = operator.index(bits)
    except TypeError:
        raise TypeError(f"a bit pattern is an int, got {type(bits).__name__}") from None
    if not 0 <= bits < 1 << f.bits:
        raise ValueError(f"{f.name} has {f.bits} bits: a pattern is an int in [0, 2^{f.bits}), "
                         f"got {bits}; write a negative number by setting the sign bit")
    return bits


def decode(bits: int, fmt: str | FloatFormat) -> float:
    """The value a bit pattern (an unsigned int) stands for in `fmt`: normals, subnormals, ±0, ±inf, NaN."""
    f = _format(fmt)
    bits = _pattern(bits, f)
    e, m = f.exponent_bits, f.mantissa_bits
    sign = -1.0 if bits >> (f.bits - 1) else 1.0
    exponent, mantissa = (bits >> m) & (2**e - 1), bits & (2**m - 1)
    if exponent == 2**e - 1 and not f.finite_only:              # 1. inf and NaN
        return sign * math.inf if mantissa == 0 else math.nan
    if f.finite_only and exponent == 2**e - 1 and mantissa == 2**m - 1:
        return math.nan
    if exponent == 0:                                           # 2. zero and subnormals: 0.mantissa
        return sign * math.ldexp(mantissa, 1 - f.bias - m)
    return sign * math.ldexp(2**m + mantissa, exponent - f.bias - m)   # 3. normals: 1.mantissa


def encode(x: float, fmt: str | FloatFormat) -> int:
    """The bit pattern PyTorch stores when it casts `x` to `fmt` (round to nearest, ties to even).

    Values too small for the format become subnormals or zero; values too large become ±inf
    (fp8 e4m3fn, which has no inf, saturates at ±448 as PyTorch's cast does). NaN becomes the
    format's quiet NaN with the sign of `x`.
    """
    f = _format(fmt)
    x = float(x)
    if f.name != "fp32":                  # PyTorch casts a double to narrow formats via fp32
        x = decode(encode(x, "fp32"), "fp32")
    m = f.mantissa_bits
    sign = 1 << (f.bits - 1) if math.copysign(1.0, x) < 0 else 0
    top = (2**f.exponent_bits - 1) << m   # exponent field all ones: inf (or fp8 e4m3's last binade)
    if math.isnan(x):
        return sign | (top | 2**m - 1 if f.finite_only else top | 2 ** (m - 1))
    overflow = top | 2**m - 2 if f.finite_only else top    # saturate to max, or round to inf
    if math.isinf(x):
        return sign | overflow
    if x == 0:
        return sign
    # 1. the power of two of x's binade, clamped to the subnormal range
    power = max(math.frexp(abs(x))[1] - 1, 1 - f.bias)
    # 2. x in units of the spacing 2^(power - m), rounded half to even (exact: scaling by 2^k)
    k = round(math.ldexp(abs(x), m - power))
    # 3. positive patterns count up with the value: (power + bias - 1) binades below, k steps in
    return sign | min(((power + f.bias - 1) << m) + k, overflow)


def ulp(x: float, fmt: str | FloatFormat) -> float:
    """The spacing of `fmt`'s values around |x|: 2^(exponent - mantissa_bits); nan for inf and NaN."""
    f = _format(fmt)
    x = abs(float(x))
    if not math.isfinite(x):
        return math.nan
    if x == 0:
        return f.min_subnormal
    power = max(math.frexp(x)[1] - 1, 1 - f.bias)
    return math.ldexp(1.0, power - f.mantissa_bits)


@dataclasses.dataclass(frozen=True)
class Fields:
    """A pattern split into its fields, with what each one means."""

    format: FloatFormat
    bits: int
    sign: int          # 0 is +, 1 is -
    exponent: int      # the stored (biased) exponent field
    mantissa: int      # the stored mantissa field
    kind: str          # "zero", "subnormal", "normal", "inf" or "nan"
    power: int | None  # the power of two it scales by: exponent - bias (1 - bias for subnormals)
    significand: float | None  # 1.mantissa for normals, 0.mantissa for subnormals, in [0, 2)
    value: float

    @property
    def binary(self) -> str:
        e, m = self.format.exponent_bits, self.format.mantissa_bits
        return f"{self.sign} {self.exponent:0{e}b} {self.mantissa:0{m}b}"

    def __str__(self) -> str:
        head = f"{self.format.name} {self.binary}"
        if self.power is None:
            return f"{head} = {self.value} ({self.kind})"
        sign = "-" if self.sign else "+"
        return f"{head} = {sign}{self.significand!r} × 2^{self.power} = {self.value!r} ({self.kind})"


def fields_of_bits(bits: int, fmt: str | FloatFormat) -> Fields:
    """Split a bit pattern of `fmt` into sign, exponent and mantissa, and say what they mean."""
    f = _format(fmt)
    bits = _pattern(bits, f)
    m = f.mantissa_bits
    sign, exponent, mantissa = bits >> (f.bits - 1), (bits >> m) & (2**f.exponent_bits - 1), bits & (2**m - 1)
    value = decode(bits, f)
    if math.isnan(value) or math.isinf(value):
        return Fields(f, bits, sign, exponent, mantissa, "nan" if math.isnan(value) else "inf",
                      None, None, value)
    if exponent == 0:
        kind = "zero" if mantissa == 0 else "subnormal"
        return Fields(f, bits, sign, exponent, mantissa, kind, 1 - f.bias, mantissa / 2**m, value)
    return Fields(f, bits, sign, exponent, mantissa, "normal", exponent - f.bias,
                  1 + mantissa / 2**m, value)


def fields(x: float, fmt: str | FloatFormat) -> Fields:
    """The fields of `x` once rounded into `fmt` (see `encode`), for display."""
    return fields_of_bits(encode(x, fmt), fmt)


# ---------------------------------------------------------------- the bit explorer's logic

def flip_bit(bits: int, position: int, fmt: str | FloatFormat) -> int:
    """`bits` with bit `position` toggled; position 0 is the last mantissa bit, bits-1 the sign."""
    f = _format(fmt)
    bits = _pattern(bits, f)
    if not 0 <= operator.index(position) < f.bits:
        raise ValueError(f"{f.name} has bit positions 0..{f.bits - 1}, got {position}")
    return bits ^ (1 << position)


def bit_roles(fmt: str | FloatFormat) -> list[str]:
    """The role of each bit, most significant first: "sign", then "exponent"s, then "mantissa"s."""
    f = _format(fmt)
    return ["sign"] + ["exponent"] * f.exponent_bits + ["mantissa"] * f.mantissa_bits


def rounding_report(x: float, formats: Iterable[str] = tuple(FORMATS)) -> list[dict]:
    """What each format stores for `x`: its bits, the stored value, and the error of rounding."""
    x = float(x)
    rows = []
    for name in formats:
        f = fields(x, name)
        error = f.value - x if math.isfinite(x) and math.isfinite(f.value) else math.nan
        if math.isnan(x):
            note = "NaN"
        elif math.isinf(f.value):
            note = "inf" if math.isinf(x) else "overflow to inf"
        elif f.format.finite_only and abs(x) > f.format.max:
            note = f"saturated at ±{f.format.max:g}"
        elif x != 0 and f.value == 0:
            note = "underflow to zero"
        else:
            note = "exact" if error == 0 else f"rounded ({f.kind})"
        rows.append(dict(format=name, bits=f.binary, value=f.value, error=error,
                         relative_error=abs(error) / abs(x) if x and math.isfinite(error) else math.nan,
                         note=note))
    return rows


# ---------------------------------------------------------------- low precision in practice

def running_totals(values: torch.Tensor, dtype: torch.dtype, *,
                   accumulate: torch.dtype | None = None) -> torch.Tensor:
    """Every partial sum of `values` added one at a time, each value cast to `dtype`, into an
    accumulator of `accumulate` (default `dtype`); returned in `dtype`, one per value. Every
    addition rounds to the accumulator's format, which is why a long fp16 sum drifts, and stalls
    once the increment is at most half the accumulator's ulp.
    """
    accumulate = dtype if accumulate is None else accumulate
    flat = values.flatten().to(dtype)
    totals = torch.empty(flat.numel(), dtype=accumulate)
    total = torch.zeros((), dtype=accumulate)
    for i, v in enumerate(flat):
        total = total + v.to(accumulate)    # rounds to `accumulate` after every step
        totals[i] = total
    return totals.to(dtype)


def running_sum(values: torch.Tensor, dtype: torch.dtype, *,
                accumulate: torch.dtype | None = None) -> torch.Tensor:
    """The sum of `values` added one at a time, as a 0-d tensor of `dtype` (see `running_totals`)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=dtype)
    return running_totals(values, dtype, accumulate=accumulate)[-1]


def parameter_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes that `module`'s parameters take when stored in `dtype`: numel × bytes per element."""
    per_element = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in module.parameters()) * per_element
