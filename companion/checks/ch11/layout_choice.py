"""Checks for chapter 11, fewer bits: block-wise codes, an 8-bit Adam step, stochastic rounding,
NF4, which layout fits, and which codes to keep a tensor's moments in."""
from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Iterator

import torch
from torch import nn

from companion import models
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require
from companion.lowbit import NF4, dynamic_map, linear_map
from companion.lowbit.adam8bit import adam_direction, direction_error

__all__ = ["check_blockwise", "check_adam8bit_block", "check_stochastic_rounding",
           "check_nf4_block", "check_pick_layout", "check_state_codes"]


# ---------------------------------------------------------------- shared: codes against levels

def _nearest(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest to each value of x (the reference's rule)."""
    return (x.reshape(-1, 1) - levels.reshape(1, -1)).abs().argmin(1).reshape(x.shape)


def _as_codes(got, n: int, label: str) -> torch.Tensor:
    require(isinstance(got, torch.Tensor), f"{label}: expected a tensor of codes, got "
            f"{type(got).__name__}")
    require(got.dtype == torch.uint8, f"{label}: codes are uint8 (one byte each), got {got.dtype}",
            hint="store each index with .to(torch.uint8): an int64 index takes 8 bytes, not 1.")
    require(got.numel() == n, f"{label}: expected {n} codes, got {got.numel()}")
    return got.reshape(-1).long()


def _codes_nearest(codes: torch.Tensor, scaled: torch.Tensor, levels: torch.Tensor,
                   label: str, hint: str, known: dict | None = None) -> None:
    """Every code is a nearest level of its scaled value (ties either way)."""
    err = (levels[codes] - scaled.reshape(-1)).abs()
    best = (levels[_nearest(scaled.reshape(-1), levels)] - scaled.reshape(-1)).abs()
    bad = (err > best + 1e-6).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        hints = [h for h, wrong in (known or {}).items()
                 if torch.equal(codes, wrong.reshape(-1).long())]
        value = scaled.reshape(-1)[i]
        nearest = levels[_nearest(value.reshape(1), levels)][0]
        raise CheckFailed(f"{label}: {len(bad)} of {codes.numel()} codes are not the nearest "
                          f"level; value {i} divided by its block's absmax is {float(value):.6g}, "
                          f"the nearest level {float(nearest):.6g}, yours "
                          f"{float(levels[codes[i]]):.6g}", expected=float(nearest),
                          got=float(levels[codes[i]]), hint=hints[0] if hints else hint)


# ---------------------------------------------------------------- exercise 1: block-wise codes

def _blocks_absmax(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize).abs().amax(1)


@exercise(points=2, reference=("companion.lowbit.quantize_blockwise",
                               "companion.lowbit.blockwise.quantize_blockwise",
                               "companion.scaling.block_absmax"))
def check_blockwise(answer) -> str:
    """answer(x, code, blocksize) -> (codes uint8 in x's shape, absmax fp32 per block)."""
    rng = random.Random(fresh_seeds(1)[0])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    lopsided = torch.sort(torch.rand(37, generator=g) ** 3 * 2 - 1).values   # not symmetric
    lopsided = torch.cat([lopsided, torch.tensor([0.0, 1.0])]).sort().values
    cases = [(dynamic_map(True), (rng.randrange(300, 900),), 64, "the signed dynamic map"),
             (dynamic_map(False), (7, rng.randrange(30, 90)), 32, "the unsigned dynamic map"),
             (lopsided, (rng.randrange(100, 400),), 16, "a map of 39 uneven levels"),
             (dynamic_map(True), (3, rng.randrange(20, 60)), 32, "the signed map, x in bf16")]
    for code, shape, blocksize, name in cases:
        x = torch.randn(shape, generator=g) * torch.logspace(-4, 0, shape[-1])
        if code.min() >= 0:
            x = x.abs()
        x.view(-1)[:blocksize] = 0.0                                # a block of zeros
        if "bf16" in name:                                          # absmax is fp32 all the same
            x = x.to(torch.bfloat16)
        label = f"x of shape {tuple(shape)}, blocks of {blocksize}, {name}"
        want = _blocks_absmax(x, blocksize)
        scale = torch.where(want > 0, want, torch.ones_like(want)).repeat_interleave(blocksize)
        scaled = x.reshape(-1) / scale[:x.numel()]
        wrong = {"divide each value by its own block's absmax, not by the whole tensor's: "
                 "a block is `blocksize` consecutive values of the flattened tensor.":
                 _nearest(x.reshape(-1) / x.abs().max(), code),
                 "pick the nearest level, not the first level above the value (rounding "
                 "down or up biases every code).":
                 torch.bucketize(scaled, code).clamp(max=len(code) - 1)}
        got = call(answer, x, code, blocksize)
        require(isinstance(got, (tuple, list)) and len(got) == 2,
                f"{label}: expected (codes, absmax), got {type(got).__name__}")
        codes, absmax = got
        require(getattr(codes, "shape", None) == x.shape, f"{label}: codes have x's shape "
                f"{tuple(x.shape)}, got {tuple(getattr(codes, 'shape', ()))}",
                hint="one code per value of x, reshaped back to x's shape.")
        codes = _as_codes(codes, x.numel(), label)
        compare(absmax, want, name=f"{label}: absmax", rtol=1e-6, atol=0.0,
                hint="one absmax per block of `blocksize` consecutive values (the last block "
                     "may be short), the largest |value| in it, in float32 whatever x's dtype.")
        _codes_nearest(codes, scaled, code, label,
                       "each code is the index of the level nearest to value / absmax; a "
                       "block whose absmax is 0 is all zeros (do not divide by 0).", wrong)
    return ("codes and absmax match the nearest-level rule on two dynamic maps and an uneven "
            "one, with short last blocks, an all-zero block and a bf16 x")


# ---------------------------------------------------------------- exercise 2: one Adam8bit step

def adam8bit_block(p, grad, m_codes, m_absmax, v_codes, v_absmax, t, lr, betas, eps):
    """The reference: one Adam step on one block whose moments are 8-bit codes; returns (new p,
    m codes, m absmax, v codes, v absmax)."""
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    m = signed[m_codes.long()] * m_absmax                        # 1. codes -> fp32
    v = unsigned[v_codes.long()] * v_absmax
    direction = adam_direction(m, v, grad.float(), t, betas, eps)   # 2. Adam in fp32
    return (p - lr * direction, *_encode(m, signed), *_encode(v, unsigned))   # 3. fp32 -> codes


def _adam_wrong(p, grad, mc, ma, vc, va, t, lr, betas, eps) -> dict:
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    m = signed[mc.long()] * ma
    v = unsigned[vc.long()] * va
    b1, b2 = betas
    m1, v1 = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad**2
    return {
        "Adam divides by both bias corrections, 1 − β1^t and 1 − β2^t (on √v̂): without them "
        "the first steps are far too small.": p - lr * m1 / (v1.sqrt() + eps),
        "the step uses the new moments, after this gradient is folded in: m ← β1·m + (1−β1)·g "
        "first.": p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps),
        "the second moment is never negative: decode it with the unsigned map (twice the "
        "levels per decade), the first with the signed one.":
            p - lr * adam_direction(signed[mc.long()] * ma, signed[vc.long()].abs() * va,
                                    grad, t, betas, eps),
    }


@exercise(points=3, reference=("companion.lowbit.Adam8bit",
                               "companion.lowbit.adam8bit.Adam8bit",
                               "companion.lowbit.adam8bit.adam_direction",
                               "companion.checks.ch11.adam8bit_block",
                               "companion.optim.adam_step",
                               "companion.optim.Adam",
                               "companion.lowbit.blockwise.quantize_blockwise",
                               "companion.lowbit.blockwise.dequantize_blockwise"))
def check_adam8bit_block(answer) -> str:
    """answer(p, grad, m_codes, m_absmax, v_codes, v_absmax, t, lr, betas, eps) -> (p, m_codes,
    m_absmax, v_codes, v_absmax): one Adam step on one block of 8-bit moments."""
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    for seed in [None] + fresh_seeds(4):
        rng = random.Random(0 if seed is None else seed)
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        n, t = rng.randrange(40, 256), rng.choice([1, 2, 7, 150])
        lr, betas = rng.choice([1e-3, 3e-4, 1e-2]), rng.choice([(0.9, 0.999), (0.8, 0.95)])
        p, grad = torch.randn(n, generator=g), 1e-3 * torch.randn(n, generator=g)
        grad[rng.randrange(n)] *= 50                                   # an outlier
        m0, v0 = 1e-3 * torch.randn(n, generator=g), 1e-6 * torch.rand(n, generator=g) ** 4
        if seed is None:               # first, fixed: a block no gradient reached yet (a row of an
            t, grad = 1, torch.zeros(n)                  # embedding no token used): both absmax 0
        if t == 1:                                                     # Adam starts at zero
            m0, v0 = torch.zeros(n), torch.zeros(n)
        (mc, ma), (vc, va) = _encode(m0, signed), _encode(v0, unsigned)
        args = (p, grad, mc, ma, vc, va, t, lr, betas, 1e-8)
        want, wrong = adam8bit_block(*args), _adam_wrong(*args)
        exact = {what: _exact_moment(args, what) for what in ("m", "v")}
        label = (f"a block of {n} values at step {t}, lr {lr:g}, betas {betas}"
                 + (", its gradient all zero" if seed is None else ""))
        got = call(answer, *args)
        require(isinstance(got, (tuple, list)) and len(got) == 5,
                f"{label}: expected (p, m_codes, m_absmax, v_codes, v_absmax), got "
                f"{type(got).__name__}{'' if not isinstance(got, (tuple, list)) else f' of {len(got)}'}")
        compare(got[0], want[0], name=f"{label}: the new weights", rtol=1e-5, atol=1e-7,
                known_wrong=wrong,
                hint="decode m and v (level × absmax), fold the gradient in, step by "
                     "−lr·m̂/(√v̂ + ε), then encode both again.")
        for i, (what, levels) in enumerate((("m", signed), ("v", unsigned))):
            compare(got[2 + 2 * i], want[2 + 2 * i], name=f"{label}: {what}'s new absmax",
                    rtol=1e-5, atol=1e-30,
                    hint="quantize the updated moment against its own new absmax: the old one "
                         "clips values that grew.")
            scale = want[2 + 2 * i].clamp_min(1e-30)
            _codes_nearest(_as_codes(got[1 + 2 * i], n, f"{label}: {what}'s codes"),
                           exact[what] / scale, levels, f"{label}: {what}'s codes",
                           f"encode {what} with the {'signed' if what == 'm' else 'unsigned'} "
                           "dynamic map: the nearest level of value / new absmax; a moment "
                           "whose absmax is 0 is all zeros (do not divide by 0).")
    return ("one 8-bit Adam step: decoded, updated in fp32, encoded again with fresh absmax "
            "values, on 4 blocks at steps from 1 to 150 and one whose gradient is all zero")


def _encode(x: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, absmax of shape (1,)) of one block."""
    absmax = x.abs().max().reshape(1)
    scaled = x / (absmax if absmax > 0 else torch.ones_like(absmax))
    return _nearest(scaled, levels).to(torch.uint8), absmax


def _exact_moment(args, what: str) -> torch.Tensor:
    """The reference's fp32 moment after the step, before it is encoded."""
    p, grad, mc, ma, vc, va, t, lr, betas, eps = args
    m = dynamic_map(True)[mc.long()] * ma
    v = dynamic_map(False)[vc.long()] * va
    adam_direction(m, v, grad.float(), t, betas, eps)
    return m if what == "m" else v


# ---------------------------------------------------------------- exercise 3: stochastic rounding

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


# ---------------------------------------------------------------- exercise 4: NF4 of one block

def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed.long() >> 4, packed.long() & 15], 1).reshape(-1)[:n]


@exercise(points=2, reference=("companion.lowbit.quantize_nf4",
                               "companion.lowbit.nf4.quantize_nf4",
                               "companion.lowbit.quantize_blockwise"))
def check_nf4_block(answer) -> str:
    """answer(w) -> (packed uint8 of ceil(n / 2) bytes, high nibble first; absmax fp32): one block
    of weights in NF4."""
    rng = random.Random(fresh_seeds(1)[0])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    for n in (64, rng.randrange(3, 63, 2), rng.randrange(66, 200, 2)):
        w = torch.randn(n, generator=g) * rng.uniform(0.01, 2.0)
        if n == 64:                                   # the largest magnitude is negative
            w[rng.randrange(n)] = -1.5 * w.abs().max()
        label = f"a block of {n} weights"
        want_absmax = w.abs().max()
        got = call(answer, w)
        require(isinstance(got, (tuple, list)) and len(got) == 2,
                f"{label}: expected (packed, absmax), got {type(got).__name__}")
        packed, absmax = got
        compare(torch.as_tensor(absmax).float().reshape(()), want_absmax, name=f"{label}: absmax",
                rtol=1e-6, atol=0, hint="the block's scale is its largest |weight|.")
        packed = _as_codes(packed, (n + 1) // 2, f"{label}: packed codes")
        codes = _unpack(packed.to(torch.uint8), n)
        scaled = w / want_absmax
        right = _nearest(scaled, NF4).reshape(-1)
        pairs = torch.cat([right, right.new_zeros(n % 2)]).view(-1, 2)
        _codes_nearest(codes, scaled, NF4, label,
                       "each weight / absmax goes to the nearest of the 16 NF4 levels; two codes "
                       "per byte (an odd block pads a zero code).",
                       {"the first code of each pair goes in the high four bits: byte = "
                        "(first << 4) | second.": pairs.flip(1).reshape(-1)[:n]})
        if n % 2:
            pad = int(packed[-1]) & 15
            require(pad == 0, f"{label}: the last byte's low four bits pad the odd block; they "
                    f"hold code {pad}, the exercise asks for code 0",
                    hint="an odd block has no partner for its last code: pad with the code 0 "
                         "(the exercise's choice), whatever level that stands for.")
    return "NF4 codes of blocks of odd, even and full length: nearest levels, packed two per byte"


# ---------------------------------------------------------------- exercise 5: which layout fits

CHOICES = ("bf16+master", "fp32+adam8bit", "bf16+kahan", "bf16", "bf16+adam8bit", "qlora")


def _nf4_bytes(n: int) -> int:
    """One weight of n values in NF4 with double quantization (blocks of 64): the codes, one 8-bit
    code per block's absmax, one fp32 scale per 256 of those, and their fp32 mean."""
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4


def layout_bytes(layout: str, model: nn.Module, rank: int) -> int:
    """The reference's count of `model`'s states with Adam in `layout`, as `layouts.predict`
    counts them: 8-bit moments only for tensors of 4096 values or more (fp32 below, as
    bitsandbytes), each with a 4-byte absmax per block of 256; QLoRA's Linear weights in NF4, every
    other weight frozen in fp32, rank-`rank` adapters on each Linear at 16 bytes each."""
    sizes = [p.numel() for p in model.parameters()]
    n = sum(sizes)
    if layout == "qlora":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dense = sum(m.weight.numel() for m in linears)
        adapters = sum(rank * (m.in_features + m.out_features) for m in linears)
        return (sum(_nf4_bytes(m.weight.numel()) for m in linears) + 4 * (n - dense)
                + 16 * adapters)
    moments8 = sum(2 * (k + 4 * -(-k // 256)) if k >= 4096 else 8 * k for k in sizes)
    return {"bf16+master": 16 * n, "fp32+adam8bit": 8 * n + moments8, "bf16+kahan": 10 * n,
            "bf16": 8 * n, "bf16+adam8bit": 4 * n + moments8}[layout]


def pick_layout(model, rank, gpu_bytes, other_bytes):
    """The reference: the first of CHOICES whose states and `other_bytes` fit, else None."""
    for layout in CHOICES:
        if layout_bytes(layout, model, rank) + other_bytes <= gpu_bytes:
            return layout
    return None


@functools.lru_cache(maxsize=None)
def _needs(model: nn.Module, rank: int) -> dict[str, int]:
    """layout_bytes of every layout, once per model of the check's own (built once, never changed:
    the answer gets copies) and rank."""
    return {c: layout_bytes(c, model, rank) for c in CHOICES}


def _want(model: nn.Module, rank: int, gpu: int, other: int) -> str | None:
    """pick_layout on the counts of _needs."""
    return next((c for c, need in _needs(model, rank).items() if need + other <= gpu), None)


@functools.lru_cache(maxsize=None)
def _gpt(vocab: int, seq_len: int, width: int, depth: int) -> nn.Module:
    """A GPT on the meta device, built once per shape (the answer gets copies: `call`)."""
    with torch.random.fork_rng(devices=[]):            # GPT seeds the global generator
        return models.GPT(vocab, seq_len, width, depth, max(1, width // 128), device="meta")


@functools.lru_cache(maxsize=None)
def _narrow_mlp(depth: int) -> nn.Module:
    """Many Linear layers of 60 x 60: every tensor under 4096 values."""
    with torch.random.fork_rng(devices=[]):
        return models.MLP(512, 60, depth, 10, device="meta")


@functools.lru_cache(maxsize=None)
def _probe() -> nn.Module:
    """A 0.34B model of few tensors (cheap to copy), sizes chosen so that every part of every
    layout's count moves it by more than _PAD: big tensors (a block's absmax, the NF4 scales), a
    non-Linear weight (frozen fp32 in QLoRA), tensors of exactly 4095 and 4096 values (fp32 and
    8-bit moments), small ones (fp32 moments, 8 bytes a value)."""
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(50000, 4096), nn.LayerNorm(4096),
                             nn.Linear(4096, 16384), nn.Linear(16384, 4096), nn.Linear(63, 65),
                             nn.Linear(4096, 1000))


_PAD = 64      # bytes: more than whole bytes and per-weight bits differ by on _probe (20 for QLoRA)


def _bits_count(layout: str, model: nn.Module, rank: int) -> float:
    """layout_bytes counted in bits per value (no block rounded up, no NF4 mean): the honest
    variant the exercise's reference writes."""
    sizes = [p.numel() for p in model.parameters()]
    n = sum(sizes)
    if layout == "qlora":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dense = sum(m.weight.numel() for m in linears)
        adapters = sum(rank * (m.in_features + m.out_features) for m in linears)
        return dense * (4 + 8 / 64 + 32 / (64 * 256)) / 8 + 4 * (n - dense) + 16 * adapters
    moments8 = sum(2 * k * (1 + 4 / 256) if k >= 4096 else 8 * k for k in sizes)
    return {"bf16+master": 16 * n, "fp32+adam8bit": 8 * n + moments8, "bf16+kahan": 10 * n,
            "bf16": 8 * n, "bf16+adam8bit": 4 * n + moments8}[layout]


def _boundary_cases() -> list[tuple]:
    """First and cheap: for each layout, _probe on a budget _PAD bytes under the least and over the
    most of its two honest counts. A count off by a byte a value, a block's absmax, an NF4 scale's
    bits, a frozen weight's bytes or the 4096 line gives another answer on one of the two. Last, a
    budget of exactly one layout's bytes: states that fill the GPU to the byte fit."""
    model, rank, other = _probe(), 8, 2**30
    cases = []
    for c in CHOICES:
        counts = (_needs(model, rank)[c], _bits_count(c, model, rank))
        lo, hi = math.floor(min(counts)), math.ceil(max(counts))
        cases += [(model, rank, other + lo - _PAD, other, f"{_PAD} bytes under {c}'s bytes"),
                  (model, rank, other + hi + _PAD, other, f"{_PAD} bytes over {c}'s bytes")]
    exact = _needs(model, rank)["bf16"]                     # 8 bytes a value: every count agrees
    return cases + [(model, rank, other + exact, other, "exactly bf16's bytes: it fits")]


def _fixed_cases() -> list[tuple]:
    """(model, rank, gpu_bytes, other_bytes, what it decides), each a few budgets placed where a
    count that leaves out one part of a layout's bytes gives another answer."""
    return _boundary_cases() + _model_cases()


def _model_cases() -> list[tuple]:
    """The fixed cases on GPT-shaped models (the review's: QLoRA's need, tensors of 4096)."""
    cases = []
    gpt, rank = _gpt(32000, 2048, 4096, 32), 16                       # 6.7B
    need = _needs(gpt, rank)["qlora"]
    linears = [m for m in gpt.modules() if isinstance(m, nn.Linear)]
    dense = sum(m.weight.numel() for m in linears)
    n = sum(p.numel() for p in gpt.parameters())
    parts = [sum(_nf4_bytes(m.weight.numel()) for m in linears) - dense / 2,      # the scales
             16 * rank * sum(m.in_features + m.out_features for m in linears),   # the adapters
             dense * (4.5 - 4.127) / 8,                                 # double quantization
             2 * (n - dense)]                                           # fp32, not bf16
    margin = int(0.01 * min(parts))
    other = 20 * 2**30 - need
    cases += [(gpt, rank, need + other - margin, other, "a budget just under one layout's bytes"),
              (gpt, rank, need + other + margin, other, "a budget just over one layout's bytes")]
    small = _gpt(50257, 1024, 1024, 24)                                 # small tensors: 9·C a block
    bf16, kahan = (_needs(small, 8)[c] for c in ("bf16+adam8bit", "bf16+kahan"))
    flat = sum(p.numel() for p in small.parameters())
    other = 12 * 2**30
    cases += [(small, 8, other + (kahan + 10.0315 * flat) // 2, other, "a budget between two layouts' bytes"),
              (small, 8, other + (bf16 + 6.0315 * flat) // 2 - 4, other, "a budget between two counts of one layout")]
    mlp = _narrow_mlp(30)                                               # 0.14M values, all small
    other = 12 * 2**30 - 13 * sum(p.numel() for p in mlp.parameters())
    cases.append((mlp, 4, 12 * 2**30, other, "a model of 30 narrow layers"))
    tiny = _gpt(50257, 1024, 768, 12)                                   # everything fits
    cases.append((tiny, 8, 141 * 2**30, 2**30, "a large GPU"))
    # width 4096: LayerNorms and some biases hold exactly 4096 values, 8-bit from 4096 on
    at = sum(p.numel() for p in gpt.parameters() if p.numel() == 4096)
    six = _needs(gpt, rank)["bf16+adam8bit"]
    cases.append((gpt, rank, 14 * 2**30 + six + 3 * at, 14 * 2**30,
                  "tensors of exactly 4096 values"))
    return cases


def _random_cases(rng: random.Random, count: int) -> Iterator[tuple]:
    """GPT-shaped models from 0.4B to 65B parameters on GPUs of 12 to 141 GiB, each kept 0.2% or more from a
    boundary between two answers."""
    shapes = [(50257, 1024, 1024, 24), (32000, 2048, 2048, 24), (32000, 4096, 4096, 32),
              (128256, 8192, 5120, 40), (32000, 4096, 8192, 80)]
    made = 0
    while made < count:
        vocab, seq_len, width, depth = rng.choice(shapes)
        model = _gpt(vocab, seq_len, width, depth)
        rank = rng.choice([4, 8, 16, 64])
        gpu = rng.choice([12, 16, 24, 40, 48, 80, 141]) * 2**30
        other = int(gpu * rng.uniform(0.02, 0.3))
        sizes = [need + other for need in _needs(model, rank).values()]
        if all(abs(s - gpu) > 0.002 * gpu for s in sizes):
            made += 1
            yield model, rank, gpu, other, "a random model and GPU"


def _layout_hint(got, want) -> str:
    if {got, want} <= {"qlora", None}:
        return ("QLoRA's bytes for this model are off: count every part of its frozen base and "
                "of its trained adapters, Linear layer by Linear layer.")
    if "fp32+adam8bit" in (got, want) or "bf16+adam8bit" in (got, want):
        return ("8-bit Adam's bytes for this model are off: the course GPT's row measured above "
                "is not 10.03 bytes per parameter, and the text says why; count tensor by "
                "tensor.")
    return _ORDER_HINT


_ORDER_HINT = ("count each layout's bytes for this model, add the other bytes, and take the first "
               "choice in the order of the exercise that fits; None when none does.")


@exercise(points=2, timeout=30.0,
          reference=("companion.checks.ch11.pick_layout", "companion.checks.ch11.layout_bytes",
                     "companion.checks.ch11._nf4_bytes", "companion.lowbit.layouts.predict",
                     "companion.lowbit.layouts.measure", "companion.estimate.model_states",
                     "companion.estimate.nf4_bytes"))
def check_pick_layout(answer) -> str:
    """answer(model, rank, gpu_bytes, other_bytes) -> one of CHOICES or None."""
    rng = random.Random(fresh_seeds(1)[0])
    # built as they are reached: a wrong count stops at the first cheap _probe case it fails
    cases = itertools.chain(_boundary_cases(), _model_cases(), _random_cases(rng, 6),
                            [(_gpt(32000, 4096, 8192, 80), 16, 16 * 2**30, 2**30, "nothing fits")])
    count = 0
    for model, rank, gpu, other, what in cases:
        count += 1
        want = _want(model, rank, gpu, other)
        got = call(answer, model, rank, gpu, other)
        if got != want:
            n = sum(p.numel() for p in model.parameters())
            fitting = [c for c, need in _needs(model, rank).items() if need + other <= gpu]
            skipped = got in fitting and fitting.index(got) > 1      # past the next that fits
            shown = ", ".join(f"{c} {_needs(model, rank)[c] / 2**30:.3f}"
                              for c in CHOICES if c in (got, want))
            raise CheckFailed(f"a {type(model).__name__} of {n / 1e9:.3f}B parameters, adapters of "
                              f"rank {rank}, on {gpu / 2**30:.3f} GiB with {other / 2**30:.3f} GiB "
                              f"of other memory ({what}): expected {want!r}, got {got!r} (GiB of "
                              f"model states: {shown or 'none fits'})",
                              expected=want, got=got, hint=_ORDER_HINT if skipped else
                              _layout_hint(got, want))
    return (f"the right layout for {count} models and GPUs, from 0.01B to 65B parameters, "
            "some budgets within 0.1% of a layout's bytes")


# ---------------------------------------------------------------- exercise 6: codes for one tensor

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


@exercise(points=2, timeout=60.0, reference=("companion.checks.ch11.choose_state_codes",
                                             "companion.checks.ch11.state_bytes_per_value"))
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
