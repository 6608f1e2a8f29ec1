"""Chapter 11, exercise 3: stochastic rounding of fp32 to bf16, unbiased and fresh on each call."""
from __future__ import annotations

import math
import random

import torch

from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below (toward zero) and above x's magnitude, as fp32."""
    low = (x.view(torch.int32) & -65536).view(torch.float32)     # truncated: toward zero
    high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    return low, high


@exercise(points=2, timeout=20.0, reference=("companion.lowbit.round_stochastic",
                                             "companion.lowbit.bf16.round_stochastic"))
def check_stochastic_rounding(answer) -> str:
    """answer(x fp32) -> bf16: each value rounded to one of its two bf16 neighbours at random,
    with E[result] = x."""
    rng = random.Random(fresh_seeds(1)[0])
    # values a fraction of the way between two bf16 neighbours, of both signs and many scales
    base = torch.tensor([1.0, -3.0, 2.0 ** -20, 700.0, -0.0123, 1.5e30])
    base = base.to(torch.bfloat16).float()
    fractions = torch.tensor([rng.uniform(0.05, 0.2), rng.uniform(0.4, 0.6), 0.75,
                              rng.uniform(0.85, 0.97), 0.3, 0.5])
    gap = _neighbours(base.abs())[1] - base.abs()
    values = base + torch.sign(base) * fractions * gap
    draws = 20000
    x = values.repeat_interleave(draws)
    got = call(answer, x.clone())
    require(isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and
            got.shape == x.shape, f"expected a bf16 tensor of shape {tuple(x.shape)}, got "
            f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}")
    got = got.float().view(len(values), draws)
    low, high = _neighbours(values.abs())
    sign = torch.sign(values)[:, None]
    near = ((got == sign * low[:, None]) | (got == sign * high[:, None])).all(1)
    if not near.all():
        raise CheckFailed(f"value {float(values[~near][0]):.8g}: some results are not one of its "
                          "two bf16 neighbours", hint="round to the bf16 value just below or "
                          "just above the magnitude, nothing further away.")
    for i, v in enumerate(values.tolist()):
        p = fractions[i].item()
        up = float((got[i].abs() == high[i]).float().mean())
        sigma = math.sqrt(p * (1 - p) / draws)
        if abs(up - p) > 5 * sigma:
            always = up in (0.0, 1.0)
            raise CheckFailed(
                f"value {v:.8g} lies {p:.3f} of the way from its lower bf16 neighbour to the "
                f"upper one; it should round up with probability {p:.3f}, yours rounded up "
                f"{up:.4f} of {draws} times (5σ = {5 * sigma:.4f})",
                expected=p, got=up,
                hint="rounding to nearest (or always the same way) is biased: the result must "
                     "be random, up with probability equal to the distance from the lower "
                     "neighbour in units of the spacing." if always else
                     "the rate of rounding up is off for this fraction of the spacing: check that "
                     "your random draw covers the whole spacing evenly, with no value of it more "
                     "likely than another, and that the magnitude rounds, not the signed value.")
    _ends_of_the_spacing(answer)
    _fine_fraction(answer)
    _fresh_each_call(answer, rng)
    exact = torch.tensor([1.0, -2.5, 0.0, 2.0 ** -100], dtype=torch.bfloat16).float()
    again = call(answer, exact.clone())
    compare(again.float() if isinstance(again, torch.Tensor) else again, exact,
            name="values bf16 holds exactly", rtol=0, atol=0,
            hint="a value already in bf16 has nothing to round: it must come back unchanged.")
    return (f"unbiased on {len(values)} values of both signs from 1e-6 to 1e30, each rounded "
            f"{draws} times: within 5σ of its expectation; a value 1/{_FINE} of a spacing above "
            f"1.0 rounded up at its rate over {_FINE_DRAWS:,} draws; each of {_POSITIONS} "
            f"positions rounded afresh on each of {_CALLS} calls")


_ENDS = 1 << 18


def _ends_of_the_spacing(answer) -> None:
    """Fixed and cheap: values at both ends of a spacing, _ENDS copies each. A value bf16
    holds exactly is its own lower neighbour: nothing may come back below it (noise that can be
    negative). A value one fp32 step under its upper neighbour (65,535/65,536 of the spacing)
    rounds down once in 65,536: a correct answer never does in all 8 x _ENDS draws with probability
    e^-32 (about 1e-14), noise that never draws the lowest step always rounds it up. Noise of
    -1 to 65,535 moves one exact value in 65,537 down: 32 expected, none with probability e^-32."""
    exact = torch.tensor([1.0, -3.0, 2.0 ** -20, 700.0, -0.0123, 1.5e30, 0.0, -7.5])
    exact = exact.to(torch.bfloat16).float()
    below = (exact.view(torch.int32) | 0xFFFF).view(torch.float32)      # magnitude's low bits set
    values = torch.cat([exact, below])
    x = values.repeat_interleave(_ENDS)
    got = call(answer, x.clone())
    require(isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and
            got.shape == x.shape, f"expected a bf16 tensor of shape {tuple(x.shape)}, got "
            f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}")
    got = got.float().view(len(values), _ENDS)
    low, high = _neighbours(values.abs())
    sign = torch.where(values.view(torch.int32) < 0, -1.0, 1.0)[:, None]
    near = ((got == sign * low[:, None]) | (got == sign * high[:, None])).all(1)
    if not near[:len(exact)].all():
        v = float(exact[~near[:len(exact)]][0])
        raise CheckFailed(f"value {v:.8g}, which bf16 holds exactly: some of {_ENDS:,} results are "
                          "neither it nor the bf16 value above its magnitude",
                          hint="a value bf16 holds exactly is its own lower neighbour: nothing "
                               "rounds below it, so the random draw must never move a value down.")
    if not near.all():
        raise CheckFailed(f"value {float(values[~near][0]):.10g}: some results are not one of its "
                          "two bf16 neighbours", hint="round to the bf16 value just below or just "
                          "above the magnitude, nothing further away.")
    down = int((got[len(exact):].abs() == low[len(exact):, None]).sum())
    if down == 0:
        raise CheckFailed(
            f"{len(below)} values each one fp32 step under their upper bf16 neighbour "
            f"(65,535/65,536 of the spacing above the lower one), {_ENDS:,} copies each: all "
            f"{len(below) * _ENDS:,} rounded up; about one in 65,536 should round down "
            f"({len(below) * _ENDS // 65536} expected)", expected=len(below) * _ENDS / 65536,
            got=0, hint="a value just under its upper neighbour must still round down now and "
                        "then: the random draw must cover the whole spacing evenly, its lowest "
                        "step included.")


_FINE, _FINE_DRAWS = 1024, 200_000


def _fine_fraction(answer) -> None:
    """The failure stochastic rounding exists to prevent: an update far under one spacing. A value
    1/_FINE of a spacing above 1.0, rounded _FINE_DRAWS times, must round up at rate 1/_FINE within
    5σ. A correct answer fails with probability 9.5e-7 (the exact binomial tail beyond 5σ); noise of
    8 random bits (every fraction under 1/256 lost) lies about 14σ off, a threshold drawn in bf16
    (0 comes up 0.2% of the time) 26σ or more."""
    p = 1 / _FINE
    x = torch.full((_FINE_DRAWS,), 1.0 + p * 2.0 ** -7)           # bf16's spacing at 1.0: 2^-7
    got = call(answer, x.clone())
    require(isinstance(got, torch.Tensor) and got.shape == x.shape,
            f"expected a tensor of shape {tuple(x.shape)}, got "
            f"{tuple(getattr(got, 'shape', ())) or type(got).__name__}")
    got = got.float()
    require(bool(((got == 1.0) | (got == 1.0 + 2.0 ** -7)).all()),
            f"value {1 + p * 2.0 ** -7:.10g}: some results are not one of its two bf16 neighbours",
            hint="round to the bf16 value just below or just above, nothing further away.")
    up = float((got > 1.0).float().mean())
    sigma = math.sqrt(p * (1 - p) / _FINE_DRAWS)
    if abs(up - p) > 5 * sigma:
        raise CheckFailed(
            f"value {1 + p * 2.0 ** -7:.10g} lies 1/{_FINE} of a spacing above 1.0; it should round "
            f"up with probability {p:.6f}, yours rounded up {up:.6f} of {_FINE_DRAWS:,} times "
            f"(5σ = {5 * sigma:.6f})", expected=p, got=up,
            hint="many small updates add up only if each rounds up at exactly its rate: the "
                 "random draw must cover the spacing evenly, finely enough for a value a "
                 "thousandth of a spacing above its lower neighbour.")


_CALLS, _POSITIONS, _FALSE_ALARM = 200, 32, 1e-6


def _fresh_each_call(answer, rng: random.Random) -> None:
    """Calls the answer _CALLS times on one small tensor and tests, position by position, how often
    it rounded up against the probability it should. An answer whose noise repeats from call to call
    (a fixed seed, noise computed from the position) rounds each weight the same way every step,
    the bias stochastic rounding exists to remove. Hoeffding: P(|rate - p| >= d) <= 2 exp(-2 n d²);
    d is chosen so that a correct answer fails with probability under _FALSE_ALARM in all (a bound
    per position of _FALSE_ALARM / _POSITIONS); every fraction lies in [0.35, 0.65], so an answer
    that rounds a position the same way on every call is off by 0.35 or more > d (0.22)."""
    d = math.sqrt(math.log(2 * _POSITIONS / _FALSE_ALARM) / (2 * _CALLS))
    scales = torch.tensor([1.0, -3.0, 2.0 ** -20, 700.0, -0.0123, 1.5e30, -7.5, 0.25])
    base = scales.repeat(_POSITIONS // len(scales)).to(torch.bfloat16).float()
    fractions = torch.tensor([rng.uniform(0.35, 0.65) for _ in range(_POSITIONS)])
    gap = _neighbours(base.abs())[1] - base.abs()
    x = base + torch.sign(base) * fractions * gap
    high = _neighbours(x.abs())[1]
    ups = torch.zeros(_POSITIONS)
    for _ in range(_CALLS):
        got = call(answer, x.clone())
        require(isinstance(got, torch.Tensor) and got.shape == x.shape,
                f"expected a tensor of shape {tuple(x.shape)}, got "
                f"{tuple(getattr(got, 'shape', ())) or type(got).__name__}")
        ups += (got.float().abs() == high).float()
    rate = ups / _CALLS
    off = (rate - fractions).abs()
    i = int(off.argmax())
    if off[i] >= d:
        same = rate[i] in (0.0, 1.0)
        raise CheckFailed(
            f"{_CALLS} calls on one tensor of {_POSITIONS} values: value {float(x[i]):.8g} at "
            f"position {i} lies {float(fractions[i]):.3f} of the way to its upper bf16 neighbour "
            f"and rounded up on {int(ups[i])} of {_CALLS} calls (a correct answer lies within "
            f"{d:.3f} of {float(fractions[i]):.3f} except with probability under {_FALSE_ALARM:g})",
            expected=float(fractions[i]), got=float(rate[i]),
            hint="a position rounded the same way on every call: each call must draw new "
                 "randomness, not repeat the last call's or compute it from the position, or "
                 "every step rounds a weight the same way." if same else
                 "across calls the rate of rounding up is off: each call's randomness must be "
                 "independent of the last call's.")
