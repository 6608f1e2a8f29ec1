"""Chapter 10, exercise 2: the forward tile loop, exact and never holding every score at once."""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from companion.attention import naive_attention
from companion.checks.ch10._common import _qkv
from companion.checks.core import (CheckFailed, NotDone, call_inplace, compare, exercise,
                                   fresh_seeds, harness, require)

__all__ = ["check_forward_tiles"]


class _Largest(TorchDispatchMode):
    """The largest tensor an operator creates: (elements, dtype name, shape)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, "", [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), str(t.dtype).removeprefix("torch."), list(t.shape))
        return out


@harness
def _forward_run(answer, seed: int, b: int, nq: int, nk: int, d: int, causal: bool, bq: int,
                 bk: int, dtype: str = "float32"):
    """(the answer's result, the largest tensor its operators made: (elements, dtype, shape))."""
    # The answer's own inputs: a copy would count as its tensor.
    q, k, v = (t.to(getattr(torch, dtype)) for t in _qkv(seed, b, nq, nk, d))
    with _Largest() as seen:
        got = call_inplace(answer, q, k, v, causal, bq, bk)
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
    # The first two are lengths where a loop's end is easy to get wrong by one: Nq one past a
    # whole number of query tiles with Nk a whole number of key tiles, then Nk one past.
    cases = [(2, 33, 64, 8, True, 16, 16), (1, 32, 33, 8, False, 16, 16),
             (2, 45, 61, 8, False, 8, 16), (1, 37, 37, 16, True, 16, 8),
             (2, 29, 50, 8, True, 8, 8), (3, 50, 23, 4, True, 16, 16),   # rows that see nothing
             (2, 40, 150, 4, True, 16, 8)]     # Nk >> block_k: (B, block_q, Nk) is 4x a K
    biggest = 0
    for seed, (b, nq, nk, d, causal, bq, bk) in zip(fresh_seeds(len(cases)), cases):
        q, k, v = _qkv(seed, b, nq, nk, d)
        o, lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
        wrong = _forward_wrong(q, k, v, causal)
        got, (largest, dtype, shape) = _forward_run(answer, seed, b, nq, nk, d, causal, bq, bk)
        label = (f"(o, lse) for B={b}, Nq={nq}, Nk={nk}, d={d}, causal={causal}, "
                 f"tiles {bq}x{bk}")
        compare(got, (o.float(), lse.float()), name=label, rtol=1e-4, atol=1e-5,
                known_wrong=wrong,
                hint="after each key tile: m_new = max(m, rowmax(S)), rescale l and the output "
                     "accumulator by exp(m − m_new), add the tile's exp(S − m_new); at the end "
                     "o = acc / l and lse = m + log(l). Queries that see no key: o = 0, lse = "
                     "−inf.")
        whole = lambda n, t: -(-n // t) * t * d                 # a sequence padded to whole tiles
        allowed = b * max(whole(nq, bq), whole(nk, bk), bq * bk)
        require(largest <= allowed,
                f"{label}: an operator made a {dtype} tensor of shape {tuple(shape)} ({largest} "
                f"elements); the inputs and output hold at most {allowed // b} per batch, one "
                f"tile of scores {bq * bk}, all the scores {nq * nk}",
                hint=_too_large_hint(dtype, shape, nq, nk))
        biggest = max(biggest, largest)
    _check_bf16(answer, fresh_seeds(1)[0])
    return (f"exact to the written-out attention (and on bf16 inputs within bf16's rounding, o in "
            f"bf16 and lse in fp32); the largest tensor you made had {biggest} elements, no more "
            "than the inputs or a tile of scores")


def _check_bf16(answer, seed: int) -> None:
    """16-bit inputs, as on a GPU: o in q's dtype, lse in fp32, within bf16's rounding."""
    b, nq, nk, d, causal, bq, bk = 2, 24, 40, 16, True, 16, 16
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(seed, b, nq, nk, d))
    o, lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
    label = (f"(o, lse) for bf16 q, k, v: B={b}, Nq={nq}, Nk={nk}, d={d}, causal={causal}, "
             f"tiles {bq}x{bk}")
    fp32 = ("compute each tile's scores, m, l and the accumulator in fp32 (cast the tiles you "
            "read with .float()), whatever q's dtype; only o is cast back to q's dtype, at the "
            "end.")
    try:
        got, _ = _forward_run(answer, seed, b, nq, nk, d, causal, bq, bk, "bfloat16")
    except NotDone:
        raise
    except CheckFailed as failed:
        raise CheckFailed(f"{label}: {failed.summary}", where=failed.where, hint=fp32) from None
    require(isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got),
            f"{label}: expected a tuple of two tensors (o, lse), got {type(got).__name__}")
    require(got[0].dtype == q.dtype,
            f"{label}: o is {got[0].dtype}; the exercise asks for o in q's dtype, {q.dtype}",
            hint="accumulate in fp32, then cast the output to q's dtype once, at the end.")
    require(got[1].dtype == torch.float32,
            f"{label}: lse is {got[1].dtype}; the exercise asks for lse in fp32",
            hint="backward recomputes P = exp(S − lse) from it, and bf16 keeps 8 significant "
                 "bits: between 16 and 32 its step is 0.125, so P can be off by 6%. Keep m, l and "
                 "lse in fp32.")
    compare(got, (o.to(q.dtype), lse.float()), name=label, rtol=2e-2, atol=2e-2, hint=fp32)


def _too_large_hint(dtype: str, shape: list, nq: int, nk: int) -> str:
    """What the too-large tensor most likely is: a mask, a row block of scores, or all of them."""
    if dtype == "bool":
        return ("that is a mask over more than one tile: a (Nq, Nk) causal mask holds T² "
                "values, the size tiling is there to avoid (the written-out attention keeps it "
                "for backward). Build each tile's mask inside the loop, from that tile's row and "
                "column indices.")
    if nk in shape and nq not in shape:
        return ("that is a block of rows over every key: a softmax over all the keys of a query "
                "tile is not tiling. Loop over key tiles too, and merge them with the online "
                "softmax (m, l and the accumulator).")
    return ("compute the scores one (block_q, block_k) tile at a time inside the loops, never "
            "q @ k.transpose(-2, -1) over every key at once.")
