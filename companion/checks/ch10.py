"""Checks for chapter 10, attention without the T×T matrix."""
from __future__ import annotations

import math
import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from companion.attention import naive_attention
from companion.attention.tiles import SRAM_PER_SM, choose_tiles, tile_sram_bytes
from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)

__all__ = ["check_merge", "check_forward_tiles", "check_tile_backward", "check_choose_tiles"]

NEG_INF = float("-inf")


# ---------------------------------------------------------------- exercise 1: merging partials

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
            got = call(answer, *first, *second)
            label = (f"merge of keys [0, {cut}) and [{cut}, {n}) (scores up to ±{spread:g})")
            if cut in (0, n):
                _no_nan(got, label)
            compare(got, want, name=label, rtol=1e-4, atol=1e-5,
                    known_wrong=_merge_wrong(*first, *second) if 0 < cut < n else {},
                    hint="m is the larger maximum; each part's l and o are rescaled by exp(m_i − "
                         "m) into the new maximum's terms before they are combined.")
    empty = _partial(torch.zeros(2, 0), torch.zeros(0, 3))
    got = call(answer, *empty, *empty)
    _no_nan(got, "merge of two parts over no keys")
    compare(got, empty, name="merge of two parts over no keys",
            hint="two empty parts merge into an empty part (−inf, 0, 0), without NaN.")
    return "two partial softmaxes merge exactly: keys can arrive in any number of tiles"


# ---------------------------------------------------------------- exercise 2: the forward loop

class _Largest(TorchDispatchMode):
    """The largest number of elements of any tensor an operator creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _qkv(seed: int, b: int, nq: int, nk: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, nq, d, generator=g), torch.randn(b, nk, d, generator=g),
            torch.randn(b, nk, d, generator=g))


@harness
def _forward_run(answer, seed: int, b: int, nq: int, nk: int, d: int, causal: bool, bq: int,
                 bk: int):
    """(the answer's result, the largest tensor its operators made, in elements)."""
    q, k, v = _qkv(seed, b, nq, nk, d)
    with _Largest() as seen:
        got = call(answer, q, k, v, causal, bq, bk)
    return got, seen.largest


def _forward_wrong(q, k, v, causal) -> dict:
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
    wrong = {}
    if causal and q.shape[-2] != k.shape[-2]:
        top = naive_attention(q.double(), k.double(), v.double(), True, align="top_left",
                              return_lse=True)
        wrong["align the causal mask bottom-right: query i sees keys j <= i + (n_keys − "
              "n_queries), so the last query sees every key."] = tuple(t.float() for t in top)
    unscaled = naive_attention(q.double(), k.double(), v.double(), causal, scale=1.0,
                               return_lse=True)
    wrong["multiply the scores by scale = 1/√d before the softmax."] = tuple(
        t.float() for t in unscaled)
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    if not causal:
        wrong["the log-sum-exp is m + log(l): log(l) alone is the log of a sum taken against "
              "the running maximum."] = (o.float(), torch.log(torch.exp(
                  s - s.amax(-1, keepdim=True)).sum(-1)).float())
    return wrong


@exercise(points=3, timeout=30.0, reference=("companion.attention.flash.flash_forward",
                                             "companion.attention.flash_forward",
                                             "companion.attention.FlashAttentionTorch",
                                             "companion.attention.naive.naive_attention",
                                             "companion.attention.naive_attention",
                                             "torch.nn.functional.scaled_dot_product_attention",
                                             "companion.attention.online.tile_states"))
def check_forward_tiles(answer) -> str:
    """answer(q, k, v, is_causal, block_q, block_k) -> (o, lse): attention over tiles, for q
    (B, Nq, d) and k, v (B, Nk, d), never holding all the scores at once."""
    seeds = fresh_seeds(4)
    cases = [(2, 45, 61, 8, False, 8, 16), (1, 37, 37, 16, True, 16, 8),
             (2, 29, 50, 8, True, 8, 8), (3, 50, 23, 4, True, 16, 16)]  # last: rows see nothing
    biggest = 0
    for seed, (b, nq, nk, d, causal, bq, bk) in zip(seeds, cases):
        q, k, v = _qkv(seed, b, nq, nk, d)
        got, largest = _forward_run(answer, seed, b, nq, nk, d, causal, bq, bk)
        o, lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
        label = (f"(o, lse) for B={b}, Nq={nq}, Nk={nk}, d={d}, causal={causal}, "
                 f"tiles {bq}x{bk}")
        compare(got, (o.float(), lse.float()), name=label, rtol=1e-4, atol=1e-5,
                known_wrong=_forward_wrong(q, k, v, causal),
                hint="after each key tile: m_new = max(m, rowmax(S)), rescale l and the output "
                     "accumulator by exp(m − m_new), add the tile's exp(S − m_new); at the end "
                     "o = acc / l and lse = m + log(l). Queries that see no key: o = 0, lse = "
                     "−inf.")
        require(largest < b * nq * nk // 2,
                f"{label}: an operator made a tensor of {largest} elements; all the scores are "
                f"{b * nq * nk}, one tile is {b * bq * bk}",
                hint="compute the scores one (block_q, block_k) tile at a time inside the loops, "
                     "never q @ k.transpose(-2, -1) over every key at once.")
        biggest = max(biggest, largest)
    return (f"exact to the written-out attention; the largest tensor you made had {biggest} "
            "elements, a tile's worth, not the whole score matrix")


# ---------------------------------------------------------------- exercise 3: one tile's backward

def tile_backward(q, k, v, o, do, lse, scale):
    """The reference: one (query tile, key tile) pair's share of dq, dk, dv, fp32."""
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])    # (B, Bq, Bk)
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    D = (do * o).sum(-1)                                               # (B, Bq) over all keys
    ds = p * (dp - D[..., None])
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _tile_wrong(q, k, v, o, do, lse, scale) -> dict:
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])
    dp = do @ v.transpose(-2, -1)
    dv = p.transpose(-2, -1) @ do
    pack = lambda ds: (ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv)
    local = (p * dp).sum(-1, keepdim=True)
    right = p * (dp - (do * o).sum(-1, keepdim=True))
    s = q @ k.transpose(-2, -1) * scale
    p_tile = s.softmax(-1)
    ds_tile = p_tile * (do @ v.transpose(-2, -1) - (p_tile * dp).sum(-1, keepdim=True))
    return {
        "softmax's backward subtracts, from each dP, the P-weighted sum over the row: dS = P ∘ "
        "(dP − D), with D = rowsum(dO ∘ O).": pack(p * dp),
        "D must be a sum over all of the row's keys, and this tile holds only some of them: "
        "rowsum(P ∘ dP) over the tile is not D; use rowsum(dO ∘ O), which equals the sum over "
        "every key.": pack(p * (dp - local)),
        "dS is P ∘ (dP − D): without the factor P, keys the query hardly attends to get "
        "gradient too.": pack(dp - (do * o).sum(-1, keepdim=True)),
        "S = q kᵀ · scale, so dq = dS k · scale and dk = dSᵀ q · scale: both carry the scale.":
            (right @ k, right.transpose(-2, -1) @ q, dv),
        "P = exp(S − lse) with the log-sum-exp of the whole row, saved by forward; a softmax over "
        "this tile alone normalizes over the wrong keys.": (ds_tile @ k * scale,
                                                           ds_tile.transpose(-2, -1) @ q * scale,
                                                           p_tile.transpose(-2, -1) @ do),
    }


@exercise(points=3, reference=("companion.checks.ch10.tile_backward",
                               "companion.attention.flash.flash_backward",
                               "companion.attention.flash_backward"))
def check_tile_backward(answer) -> str:
    """answer(q, k, v, o, do, lse, scale) -> (dq, dk, dv): the share of one tile of queries and
    one tile of keys in the gradients; o, do and lse are the queries' full rows."""
    for seed in fresh_seeds(3):
        rng = random.Random(seed)
        b, bq, bk, tiles, d = rng.randrange(1, 3), rng.randrange(3, 9), rng.randrange(3, 9), \
            rng.randrange(2, 5), rng.choice([4, 8, 12])
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(b, bq, d, generator=g)
        keys, values = torch.randn(b, bk * tiles, d, generator=g), torch.randn(b, bk * tiles, d,
                                                                              generator=g)
        do = torch.randn(b, bq, d, generator=g)
        scale = 1 / math.sqrt(d)
        o, lse = naive_attention(q, keys, values, return_lse=True)
        j = rng.randrange(tiles)                              # one key tile of several
        k, v = keys[:, j * bk:(j + 1) * bk], values[:, j * bk:(j + 1) * bk]
        got = call(answer, q, k, v, o, do, lse, scale)
        compare(got, tile_backward(q, k, v, o, do, lse, scale),
                name=f"(dq, dk, dv) of query tile {bq} x key tile {j + 1} of {tiles} ({bk} keys)",
                rtol=1e-4, atol=1e-5, known_wrong=_tile_wrong(q, k, v, o, do, lse, scale),
                hint="recompute P = exp(S − lse); dV = Pᵀ dO; dP = dO Vᵀ; then dS from dP, P and "
                     "D = rowsum(dO ∘ O); dq and dk from dS.")
    return "one tile's backward: summed over every tile, it is autograd's gradient"


# ---------------------------------------------------------------- exercise 4: tile sizes

_SHOWN = ("A100", "H100")         # the notebook works these two; the check tries the others


_SIZES = (16, 32, 64, 128, 256)


def _pick(sram: int, cost, key=max):
    fits = [(bq, bk) for bq in _SIZES for bk in _SIZES if cost(bq, bk) <= sram]
    return key(fits) if fits else None


# The likely wrong rules, each as a function of (sram, d, e), with its hint.
_TILE_MISTAKES = {
    "the scores are fp32 whatever the inputs: the S tile takes block_q·block_k·4 bytes.":
        lambda sram, d, e: _pick(sram, lambda bq, bk: (bq + 2 * bk) * d * e + e * bq * bk
                                 + 4 * bq * d + 8 * bq),
    "the output accumulator stays on chip too, in fp32: block_q·d·4 bytes.":
        lambda sram, d, e: _pick(sram, lambda bq, bk: (bq + 2 * bk) * d * e + 4 * bq * bk
                                 + 8 * bq),
    "a program holds a tile of V beside the tile of K: 2·block_k·d·e bytes.":
        lambda sram, d, e: _pick(sram, lambda bq, bk: (bq + bk) * d * e + 4 * bq * bk
                                 + 4 * bq * d + 8 * bq),
    "HBM traffic falls with block_q (K and V are read once per query tile); block_k only sets "
    "the number of steps: maximize block_q first.":
        lambda sram, d, e: _pick(sram, lambda bq, bk: tile_sram_bytes(bq, bk, d, e),
                                 key=lambda fits: max(fits, key=lambda p: (p[1], p[0]))),
    "the smallest tiles fit, but read K and V the most times: the goal is the least traffic.":
        lambda sram, d, e: _pick(sram, lambda bq, bk: tile_sram_bytes(bq, bk, d, e), key=min),
}


def _as_pair(got, label: str):
    if got is None:
        return None
    require(isinstance(got, (tuple, list)) and len(got) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in got),
        f"{label}: expected a pair of ints (block_q, block_k) or None, got {got!r}")
    return tuple(got)


@exercise(points=2, reference=("companion.attention.tiles.choose_tiles",
                               "companion.attention.tiles.fitting_tiles",
                               "companion.attention.tiles.tile_sram_bytes"))
def check_choose_tiles(answer) -> str:
    """answer(sram_bytes, head_dim, dtype_bytes) -> (block_q, block_k) or None."""
    rng = random.Random(fresh_seeds(1)[0])
    gpus = [name for name in SRAM_PER_SM if name not in _SHOWN]
    cases = [(SRAM_PER_SM[name]["bytes"], rng.choice([32, 64, 80, 96, 128, 256]), e, name)
             for name in gpus for e in (2, 4)]
    cases += [(rng.randrange(8_000, 300_000), rng.choice([40, 64, 96, 128, 160]),
               rng.choice([2, 4]), "a made-up GPU") for _ in range(6)]
    cases += [(6_000, 128, 4, "a GPU too small for any tile")]
    answers = []
    for sram, d, e, name in cases:
        label = f"tiles for {name} ({sram:,} B of SRAM per SM), d = {d}, {e}-byte inputs"
        answers.append(_as_pair(call(answer, sram, d, e), label))
    wrong = [i for i, (got, case) in enumerate(zip(answers, cases))
             if got != choose_tiles(*case[:3])]
    if wrong:
        # One rule that gives every answer the learner gave names the mistake.
        hints = [hint for hint, rule in _TILE_MISTAKES.items()
                 if all(rule(*case[:3]) == got for got, case in zip(answers, cases))]
        sram, d, e, name = cases[wrong[0]]
        want = choose_tiles(sram, d, e)
        raise CheckFailed(
            f"tiles for {name} ({sram:,} B of SRAM per SM), d = {d}, {e}-byte inputs: expected "
            f"{want}, got {answers[wrong[0]]} ({len(wrong)} of {len(cases)} budgets wrong)",
            expected=want, got=answers[wrong[0]],
            hint=hints[0] if hints else "list the power-of-two pairs from 16 to 256 that fit "
            "(None if none does), then pick by the forward pass's HBM traffic, then by its "
            "number of steps.")
    return ("your tiles fit every GPU tried, with the fewest passes over K and V "
            f"({len(cases)} budgets, {len(gpus)} GPUs not named in the exercise)")
