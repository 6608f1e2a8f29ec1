"""Chapter 11, exercise 2: one Adam step on one block whose moments are 8-bit codes."""
from __future__ import annotations

import random

import torch

from companion.checks.ch11._common import _as_codes, _codes_nearest, _nearest
from companion.checks.core import call, compare, exercise, fresh_seeds, require
from companion.lowbit import dynamic_map
from companion.lowbit.adam8bit import adam_direction


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
                               "companion.checks.ch11.adam8bit_step.adam8bit_block",
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
