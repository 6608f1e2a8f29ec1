"""The online softmax: softmax(s) v over keys that arrive in tiles, never all at once.

For one query row and the keys seen so far keep three things: the running maximum m of the scores,
the running sum l = Σ exp(s_j − m), and the output o = Σ exp(s_j − m) v_j / l. A new tile with its
own (m', l', o') merges exactly:

    m* = max(m, m')
    l* = e^(m − m*) l + e^(m' − m*) l'
    o* = (e^(m − m*) l o + e^(m' − m*) l' o') / l*

Subtracting the maximum keeps exp() from overflowing; rescaling by e^(m − m*) corrects the sums
that were taken against an older maximum (Milakov & Gimelshein, 2018, "Online normalizer
calculation for softmax"). At the end, the log-sum-exp of the row is m + log l: the one number
per query that FlashAttention keeps for backward. `tile_states` runs the loop on one row and
returns every intermediate state, for the notebook's plot and widget.
"""
from __future__ import annotations

import torch

__all__ = ["merge", "tile_states"]


def merge(m1, l1, o1, m2, l2, o2):
    """Merge two partial softmax results over disjoint sets of keys (see the module docstring).
    m, l: (..., rows); o: (..., rows, d). A partial over no keys is (−inf, 0, 0)."""
    m = torch.maximum(m1, m2)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)           # both empty: no NaN from −inf − −inf
    a1, a2 = torch.exp(m1 - m_safe), torch.exp(m2 - m_safe)   # rescale each to the new maximum
    l = a1 * l1 + a2 * l2
    o = (a1 * l1)[..., None] * o1 + (a2 * l2)[..., None] * o2
    return m, l, o / l.masked_fill(l == 0, 1.0)[..., None]


def tile_states(scores: torch.Tensor, values: torch.Tensor, block: int) -> list[dict]:
    """The online softmax over one query's `scores` (n,) and `values` (n, d), `block` keys at a
    time: after each tile, {"keys": keys seen, "m", "l", "o", "lse"} as Python floats and lists.
    The last state equals softmax(scores) @ values and logsumexp(scores)."""
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    o = torch.zeros(values.shape[-1])
    states = []
    for start in range(0, scores.numel(), block):
        s, v = scores[start:start + block].float(), values[start:start + block].float()
        m_t = s.max()
        l_t = torch.exp(s - m_t).sum()
        o_t = torch.exp(s - m_t) @ v / l_t
        m, l, o = merge(m, l, o, m_t, l_t, o_t)
        states.append({"keys": start + s.numel(), "m": float(m), "l": float(l),
                       "o": o.tolist(), "lse": float(m + torch.log(l))})
    return states
