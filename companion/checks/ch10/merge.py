"""Chapter 10, exercise 1: two partial softmaxes (m, l, o) merged into their union's."""
from __future__ import annotations

import random

import torch

from companion.checks.ch10._common import NEG_INF
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds

__all__ = ["check_merge"]


def _partial(s: torch.Tensor, v: torch.Tensor):
    """(m, l, o) of scores s (rows, n) over values v (n, d); (−inf, 0, 0) when n == 0."""
    if s.shape[-1] == 0:
        return (torch.full(s.shape[:-1], NEG_INF), torch.zeros(s.shape[:-1]),
                torch.zeros(*s.shape[:-1], v.shape[-1]))
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    return m, p.sum(-1), p @ v / p.sum(-1, keepdim=True)


def _merge_wrong(m1, l1, o1, m2, l2, o2) -> dict:
    """What the likely wrong merges answer, by hint."""
    plain_l = l1 + l2
    unscaled = (l1[..., None] * o1 + l2[..., None] * o2) / plain_l[..., None]
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    l = a1 * l1 + a2 * l2
    by_exp = (a1[..., None] * o1 + a2[..., None] * o2) / (a1 + a2)[..., None]
    return {
        "each part's sum was taken against its own maximum: rescale l1 by exp(m1 − m) and l2 by "
        "exp(m2 − m) before adding them, and the outputs by the same factors.": (m, plain_l,
                                                                                  unscaled),
        "weigh each part's output by its rescaled sum, exp(m_i − m)·l_i, not by exp(m_i − m) "
        "alone: a part over more keys counts for more.": (m, l, by_exp),
    }


def _no_nan(got, label: str) -> None:
    if isinstance(got, (tuple, list)) and any(isinstance(t, torch.Tensor) and t.is_floating_point()
                                              and bool(torch.isnan(t).any()) for t in got):
        raise CheckFailed(f"{label}: NaN where a part is over no keys",
                          hint="a part over no keys is (m = −inf, l = 0, o = 0): exp(−inf − m) is "
                               "0, but −inf − (−inf) is NaN; never subtract a maximum that is "
                               "−inf, and never divide by l = 0.")


@exercise(points=2, reference=("companion.attention.online.merge", "companion.attention.merge"))
def check_merge(answer) -> str:
    """answer(m1, l1, o1, m2, l2, o2) -> (m, l, o): the softmax partials of two disjoint sets of
    keys merged into the partial of their union."""
    # Scores of spread 1 (both parts count), 30 and 400 (exp() of 400 overflows fp32; one part
    # then outweighs the other, so a wrong weighting can hide there but not at spread 1).
    for seed, spread in zip(fresh_seeds(3), (1.0, 30.0, 400.0)):
        g = torch.Generator().manual_seed(seed)
        rows, n, d = random.Random(seed).randrange(2, 7), random.Random(seed).randrange(6, 40), 5
        s = spread * torch.randn(rows, n, generator=g)
        v = torch.randn(n, d, generator=g)
        for cut in (random.Random(seed).randrange(1, n), 0, n):      # 0 or n: one part is empty
            first, second = _partial(s[:, :cut], v[:cut]), _partial(s[:, cut:], v[cut:])
            want = _partial(s, v)
            wrong = _merge_wrong(*first, *second) if 0 < cut < n else {}
            got = call(answer, *first, *second)
            label = (f"merge of keys [0, {cut}) and [{cut}, {n}) (scores up to ±{spread:g})")
            if cut in (0, n):
                _no_nan(got, label)
            compare(got, want, name=label, rtol=1e-4, atol=1e-5, known_wrong=wrong,
                    hint="m is the larger maximum; each part's l and o are rescaled by exp(m_i − "
                         "m) into the new maximum's terms before they are combined.")
    empty = _partial(torch.zeros(2, 0), torch.zeros(0, 3))
    want = _partial(torch.zeros(2, 0), torch.zeros(0, 3))
    got = call(answer, *empty, *empty)
    _no_nan(got, "merge of two parts over no keys")
    compare(got, want, name="merge of two parts over no keys",
            hint="two empty parts merge into an empty part (−inf, 0, 0), without NaN.")
    return "two partial softmaxes merge exactly: keys can arrive in any number of tiles"
