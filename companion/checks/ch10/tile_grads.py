"""Chapter 10, exercise 3: one (query tile, key tile) pair's share of dq, dk and dv."""
from __future__ import annotations

import math
import random

import torch

from companion.attention import naive_attention
from companion.checks.core import call, compare, exercise, fresh_seeds

__all__ = ["check_tile_backward", "tile_backward"]


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


@exercise(points=3, reference=("companion.checks.ch10.tile_grads.tile_backward",
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
        want, wrong = tile_backward(q, k, v, o, do, lse, scale), _tile_wrong(q, k, v, o, do, lse,
                                                                            scale)
        got = call(answer, q, k, v, o, do, lse, scale)      # on copies: do.zero_() changes none
        compare(got, want,
                name=f"(dq, dk, dv) of query tile {bq} x key tile {j + 1} of {tiles} ({bk} keys)",
                rtol=1e-4, atol=1e-5, known_wrong=wrong,
                hint="recompute P = exp(S − lse); dV = Pᵀ dO; dP = dO Vᵀ; then dS from dP, P and "
                     "D = rowsum(dO ∘ O); dq and dk from dS.")
    return "one tile's backward: summed over every tile, it is autograd's gradient"
