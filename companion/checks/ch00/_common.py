"""Chapter 00's checks: what several of them share (a byte count read from an answer)."""
from __future__ import annotations

import math
import numbers
import operator

import torch

from companion.checks.core import CheckFailed


def _number(got, name: str) -> int:
    """The learner's answer as a whole number of bytes: any integer (NumPy's too), or a float that
    holds a whole number; otherwise a CheckFailed that says what was wrong."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise CheckFailed(f"{name}: expected a number of bytes (an int), got "
                          f"{type(got).__name__} {got!r:.60}",
                          got=got, hint="return the count itself, e.g. `return total`.")
    if isinstance(got, numbers.Integral):
        return operator.index(got)                           # np.int64(96) -> 96
    if math.isnan(got):
        raise CheckFailed(f"{name} is NaN", got=got, hint="count bytes with integers.")
    if math.isfinite(got) and abs(got - round(got)) <= 16 * math.ulp(got):
        return int(round(got))                               # / left a rounding error behind
    if not math.isfinite(got) or not float(got).is_integer():
        raise CheckFailed(f"{name}: expected a whole number of bytes, got {got!r}", got=got,
                          hint="a byte count is a whole number: divide with // (integer "
                               "division), not /, or round the result.")
    return int(got)
