"""Chapter 11, exercise 6: which codes (map and block size) to keep one tensor's Adam moments
in, within a budget of bytes per value."""
from __future__ import annotations

import random

import torch

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require
from companion.lowbit import dynamic_map, linear_map
from companion.lowbit.adam8bit import direction_error


_STATE_BLOCKS = tuple(2**k for k in range(5, 13))          # 32 ... 4096


def _state_maps() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {"linear": (linear_map(True), linear_map(False)),
            "dynamic": (dynamic_map(True), dynamic_map(False))}


def state_bytes_per_value(blocksize: int) -> float:
    """The reference's count: both moments' one-byte codes and one fp32 absmax per block each."""
    return 2 + 2 * 4 / blocksize


def choose_state_codes(m, v, max_bytes):
    """The reference: the (map, blocksize) whose codes keep Adam's direction closest to fp32's
    among those within `max_bytes` per value, or None."""
    errors = _state_errors(m, v)
    fits = {k: e for k, e in errors.items() if state_bytes_per_value(k[1]) <= max_bytes}
    return min(fits, key=fits.get) if fits else None


def _state_errors(m, v) -> dict[tuple[str, int], float]:
    return {(name, b): direction_error(m, v, b, signed=s, unsigned=u)["error"]
            for name, (s, u) in _state_maps().items() for b in _STATE_BLOCKS}


def _moments(kind: str, g: torch.Generator, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) of 16,384 values: "rows" (v constant along rows of 64 and spanning four decades
    between rows, as an embedding's), "narrow" (v within a factor of 50), "outliers" (narrow, and
    8 values of v 10^4 times larger)."""
    n = 16384
    if kind == "rows":
        v = (10 ** (-11 + 4 * torch.rand(n // 64, 1, generator=g))).expand(-1, 64).reshape(-1)
        v = v * (0.5 + torch.rand(n, generator=g))
    else:
        v = 1e-8 * (1 + 49 * torch.rand(n, generator=g))
        if kind == "outliers":
            v[torch.randperm(n, generator=g)[:8]] *= 1e4
    v = v * scale
    return v.sqrt() * torch.randn(n, generator=g) * 0.3, v


@exercise(points=2, timeout=60.0, reference=("companion.checks.ch11.state_codes.choose_state_codes",
                                             "companion.checks.ch11.state_codes.state_bytes_per_value"))
def check_state_codes(answer) -> str:
    """answer(m, v, max_bytes) -> (map name, blocksize) or None: the codes for one tensor's Adam
    moments that keep its direction closest to fp32's within a budget of bytes per value."""
    rng = random.Random(fresh_seeds(1)[0])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    cases = [("rows", 2.2), ("rows", 2.07), ("narrow", 2.07), ("outliers", 2.3),
             (rng.choice(["rows", "narrow"]), rng.choice([2.02, 2.04])),
             (rng.choice(["rows", "narrow"]), 2.005),          # only blocks of 2048 and 4096 fit
             ("narrow", 1.999)]
    for kind, budget in cases:
        m, v = _moments(kind, g, 10 ** rng.uniform(-2, 2))
        label = f"moments of 16,384 values ({kind}), {budget:g} bytes per value"
        errors = _state_errors(m, v)
        want = choose_state_codes(m, v, budget)
        got = call(answer, m, v, budget)
        if want is None:
            require(got is None, f"{label}: nothing fits this budget; expected None, got {got!r}",
                    hint="every choice keeps some bytes per value: return None when none is "
                         "within the budget.")
            continue
        require(isinstance(got, (tuple, list)) and len(got) == 2 and
                tuple(got) in errors, f"{label}: expected (map, blocksize) with map 'linear' "
                f"or 'dynamic' and blocksize a power of two from 32 to 4096, got {got!r}")
        got = (got[0], int(got[1]))
        require(state_bytes_per_value(got[1]) <= budget,
                f"{label}: {got} does not fit the budget",
                hint="count every byte the two moments keep per value, their scales included.")
        if errors[got] > 1.02 * errors[want]:
            raise CheckFailed(f"{label}: with {got} Adam's direction moves by "
                              f"{errors[got]:.3g} (relative); another choice within the budget "
                              f"moves it by {errors[want]:.3g}",
                              expected=errors[want], got=errors[got],
                              hint="measure each candidate on these moments rather than "
                                   "assuming one map or one block size is always best.")
    return (f"{len(cases)} tensors and budgets: each choice fits and keeps Adam's direction "
            "within 2% of the best choice's error")
