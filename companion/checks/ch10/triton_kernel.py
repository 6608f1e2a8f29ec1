"""Checks for chapter 10, attention without the T×T matrix."""
from __future__ import annotations

import contextlib
import math
import pathlib
import random
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from companion.attention import causal_mask, naive_attention
from companion.attention.tiles import SHIPPED, SRAM_PER_SM, tile_sram_bytes
from companion.checks.core import (_LIBRARIES, CheckFailed, NotDone, call, call_inplace, compare,
                                   exercise, fresh_seeds, harness, learner_frames, require,
                                   require_function)

__all__ = ["check_merge", "check_forward_tiles", "check_tile_backward", "check_triton_forward",
           "check_choose_tiles"]

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


# ---------------------------------------------------------------- exercise 2: the forward loop

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


def _qkv(seed: int, b: int, nq: int, nk: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, nq, d, generator=g), torch.randn(b, nk, d, generator=g),
            torch.randn(b, nk, d, generator=g))


@harness
def _forward_run(answer, seed: int, b: int, nq: int, nk: int, d: int, causal: bool, bq: int,
                 bk: int):
    """(the answer's result, the largest tensor its operators made: (elements, dtype, shape),
    the names of the inputs it wrote into)."""
    q, k, v = _qkv(seed, b, nq, nk, d)      # the answer's own: a copy would count as its tensor
    with _Largest() as seen:
        got = call_inplace(answer, q, k, v, causal, bq, bk)
    changed = [name for name, t, t0 in zip("qkv", (q, k, v), _qkv(seed, b, nq, nk, d))
               if not torch.equal(t, t0)]
    return got, seen.largest, changed


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
        got, (largest, dtype, shape), changed = _forward_run(answer, seed, b, nq, nk, d, causal,
                                                             bq, bk)
        label = (f"(o, lse) for B={b}, Nq={nq}, Nk={nk}, d={d}, causal={causal}, "
                 f"tiles {bq}x{bk}")
        require(not changed, f"{label}: your function wrote into its input "
                f"{' and '.join(changed)}",
                hint="attention reads q, k and v and leaves them as they were: the caller (and "
                     "backward) needs them again. Write the output and any scaled copy into "
                     "tensors of your own.")
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
    return (f"exact to the written-out attention; the largest tensor you made had {biggest} "
            "elements, no more than the inputs or a tile of scores")


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
        want, wrong = tile_backward(q, k, v, o, do, lse, scale), _tile_wrong(q, k, v, o, do, lse,
                                                                            scale)
        got = call(answer, q, k, v, o, do, lse, scale)      # on copies: do.zero_() changes none
        compare(got, want,
                name=f"(dq, dk, dv) of query tile {bq} x key tile {j + 1} of {tiles} ({bk} keys)",
                rtol=1e-4, atol=1e-5, known_wrong=wrong,
                hint="recompute P = exp(S − lse); dV = Pᵀ dO; dP = dO Vᵀ; then dS from dP, P and "
                     "D = rowsum(dO ∘ O); dq and dk from dS.")
    return "one tile's backward: summed over every tile, it is autograd's gradient"


# ---------------------------------------------------------------- exercise 4: the kernel in Triton

# (heads, Nq, Nk, d, causal, block_q, block_k), fixed: each is where one likely mistake shows.
_KERNEL_CASES = [
    (2, 37, 53, 24, False, 16, 16),   # keys past Nk in the last tile; d = 24 pads to 32
    (2, 37, 53, 24, True, 16, 16),    # Nq < Nk: bottom-right is not top-left; tiles to skip
    (3, 53, 37, 16, True, 16, 32),    # Nq > Nk: the first 16 queries see no key
    (1, 5, 70, 8, False, 16, 32),     # one query tile, partly filled; three key tiles
    # Offsets n_k − n_q that are not multiples of the tiles, and block_q > block_k: where a
    # query tile is partly empty (rows that see no key beside rows that do), and where a loop
    # that stops early drops keys only the tile's later rows see.
    (1, 50, 23, 16, True, 16, 16),    # offset −27: tile 1 holds rows with and without keys
    (1, 64, 64, 16, True, 32, 16),    # a query tile spans two key tiles of its diagonal
    (1, 36, 37, 16, True, 16, 16),    # offset 1: each tile's last row sees one key further
]


@contextlib.contextmanager
def _counting_dots():
    """[number of tl.dot calls] while the block runs under Triton's interpreter; None when this
    Triton's interpreter has no `InterpreterBuilder.create_dot` to count (then nothing is)."""
    from triton.runtime import interpreter
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None:
        yield None
        return
    count = [0]

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)
    builder.create_dot = counted
    try:
        yield count
    finally:
        builder.create_dot = original


@harness
def _kernel_run(answer, seed: int, heads: int, nq: int, nk: int, d: int, causal: bool, bq: int,
                bk: int):
    """(o, lse, tl.dot calls or -1) of the answer's kernel launched on CPU tensors, interpreted."""
    from triton.runtime.errors import InterpreterError
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from companion.attention.triton_launch import launch_forward
    require_function(answer)
    q, k, v = _qkv(seed, heads, nq, nk, d)
    if not isinstance(answer, (JITFunction, InterpretedFunction)):
        try:
            call(answer, q, k, v)
        except NotDone:
            raise                                     # a stub without its decorator
        except CheckFailed:
            pass
        raise CheckFailed(f"expected a @triton.jit kernel, got {answer!r}",
                          hint="decorate your kernel with @triton.jit and pass the kernel "
                               "itself: check_triton_forward(flash_fwd_kernel).")
    try:
        with _counting_dots() as dots:
            o, lse = launch_forward(answer, q, k, v, causal, bq, bk)
    except InterpreterError as error:
        cause = error.__cause__ or error
        while isinstance(cause, InterpreterError) and cause.__cause__ is not None:
            cause = cause.__cause__                   # one per @triton.jit helper it went through
        if isinstance(cause, NotImplementedError):
            _not_implemented(cause)
        raise CheckFailed(f"your kernel raised {type(cause).__name__}: {cause}",
                          hint="run it on one small case (the launcher cell) and print "
                               "(tl.device_print, or print under the interpreter) the shapes "
                               "of the tiles you combine.",
                          where=learner_frames(cause)) from None
    return o, lse, dots[0] if dots is not None else -1


def _not_implemented(error: NotImplementedError) -> None:
    """NotDone when the kernel's own code raised (the workbook's stub); else a CheckFailed that
    says which part of Triton is missing: a correct kernel can meet one (Triton 3.9 removed block
    pointers, and raises NotImplementedError for tl.make_block_ptr)."""
    frames = traceback.extract_tb(error.__traceback__)
    inner = str(pathlib.Path(frames[-1].filename).resolve()) if frames else ""
    if str(error).startswith("Exercise:") or not inner.startswith(_LIBRARIES):
        raise NotDone(f"not done yet: your kernel raises NotImplementedError ({error})")
    block_pointers = "block pointer" in str(error).lower() or any(
        frame.name in ("make_block_ptr", "advance") for frame in frames)
    raise CheckFailed(
        f"Triton {_triton_version()} does not implement something your kernel calls: "
        f"NotImplementedError: {error}", where=learner_frames(error),
        hint=("block pointers (tl.make_block_ptr, tl.advance) were removed in Triton 3.9: "
              "load tiles with pointer arithmetic and masks (Q + rows[:, None]·stride_qn + "
              "dims[None, :]), or with tl.make_tensor_descriptor(ptr, shape, strides, "
              "block_shape) and its .load([row, col]), which this Triton's interpreter runs."
              if block_pointers else
              "this Triton lacks that operation (or its interpreter does): write the step "
              "with tl.load, tl.store, tl.dot and pointer arithmetic."))


def _triton_version() -> str:
    import triton
    return triton.__version__


def _loop64(q, k, v, causal, bq, bk, *, rescale_l=True, rescale_acc=True, stop=None,
            strict=False):
    """(o, lse) of the tile loop in fp64, with the running sum or the accumulator left
    unrescaled on request, or the key loop of the query tile starting at row i ending before
    stop(i), or a causal mask that hides the diagonal key itself (strict): what a kernel that
    forgets them, stops early or masks with < returns."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    q, k, v = q.double(), k.double(), v.double()
    o, lse = torch.zeros_like(q), torch.empty(q.shape[:-1], dtype=torch.float64)
    for i in range(0, n_q, bq):
        rows = torch.arange(i, min(i + bq, n_q))
        m = torch.full((q.shape[0], len(rows)), NEG_INF, dtype=torch.float64)
        l, acc = torch.zeros_like(m), torch.zeros(q.shape[0], len(rows), d, dtype=torch.float64)
        for j in range(0, n_k if stop is None else stop(i), bk):
            cols = torch.arange(j, min(j + bk, n_k))
            s = q[:, rows] @ k[:, cols].transpose(-2, -1) / math.sqrt(d)
            if causal:
                hidden = cols[None, :] - (rows[:, None] + n_k - n_q)
                s = s.masked_fill(hidden >= 0 if strict else hidden > 0, NEG_INF)
            m_new = torch.maximum(m, s.amax(-1))
            shift = m_new.masked_fill(m_new == NEG_INF, 0.0)
            p = torch.exp(s - shift[..., None])
            alpha = torch.exp(m - shift)
            l = (alpha if rescale_l else 1.0) * l + p.sum(-1)
            acc = (alpha[..., None] if rescale_acc else 1.0) * acc + p @ v[:, cols]
            m = m_new
        o[:, rows] = acc / l.masked_fill(l == 0, 1.0)[..., None]
        lse[:, rows] = torch.where(l > 0, m + torch.log(l.masked_fill(l == 0, 1.0)), NEG_INF)
    return o.float(), lse.float()


def _kernel_wrong(q, k, v, causal, bq, bk) -> dict:
    """What the likely wrong kernels return, by hint."""
    o, lse = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
    s = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(causal_mask(q.shape[-2], k.shape[-2]), NEG_INF)
    m = s.amax(-1)
    wrong = {
        "after each key tile, rescale the output accumulator by alpha = exp(m − m_new) before "
        "adding the tile's p @ v: it was summed against the old maximum.":
            _loop64(q, k, v, causal, bq, bk, rescale_acc=False),
        "rescale both the running sum l and the accumulator by exp(m − m_new) after each key "
        "tile.": _loop64(q, k, v, causal, bq, bk, rescale_l=False, rescale_acc=False),
        "L is the log-sum-exp of the row, m + log(l): log(l) alone is taken against the running "
        "maximum.": (o.float(), torch.where(lse == NEG_INF, NEG_INF, lse - m).float()),
    }
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        reach = ("the key loop must reach the last key the tile's last query sees, (tile + 1)·"
                 "BLOCK_Q − 1 + (n_k − n_q)")
        # One short first: where both stops drop the same keys, it is the likelier slip.
        wrong[reach + ", so the loop's stop is one past that key, not the key itself."] = _loop64(
            q, k, v, causal, bq, bk, stop=lambda i: max(0, min(n_k, i + bq + n_k - n_q - 1)))
        wrong[reach + ": a stop taken from the tile's first row drops keys its later rows "
              "see."] = _loop64(q, k, v, causal, bq, bk,
                                stop=lambda i: max(0, min(n_k, i + n_k - n_q + 1)))
        wrong[reach + ": the stop is at that key, wherever it falls inside a key tile, not "
              "rounded down to a whole BLOCK_K (the last tile is partly masked, as at n_k)."] = \
            _loop64(q, k, v, causal, bq, bk,
                    stop=lambda i: min(n_k, max(0, i + bq + n_k - n_q) // bk * bk))
        wrong["the diagonal is visible: query i sees keys j <= i + (n_k − n_q), inclusive, so "
              "with n_q = n_k each query sees itself; a strict < hides that key."] = _loop64(
                  q, k, v, causal, bq, bk, strict=True)
    if causal and q.shape[-2] != k.shape[-2]:
        top = naive_attention(q.double(), k.double(), v.double(), True, align="top_left",
                              return_lse=True)
        wrong["align the causal mask bottom-right: query i sees key j when j <= i + (n_k − "
              "n_q), as in Exercise 2; the loop's end moves by the same offset."] = tuple(
                  t.float() for t in top)
    if not causal and k.shape[-2] % bk:
        pad = -k.shape[-2] % bk
        padded = [torch.cat([t.double(), t.new_zeros(t.shape[0], pad, t.shape[-1]).double()], 1)
                  for t in (k, v)]
        zeros = naive_attention(q.double(), *padded, False, return_lse=True)
        wrong["the last key tile runs past n_k: loading it with other=0.0 gives those columns a "
              "score of 0, not −inf; mask the scores of columns >= n_k."] = tuple(
                  t.float() for t in zeros)
    return wrong


@exercise(points=3, timeout=60.0, reference=("companion.attention.triton_flash._forward",
                                             "companion.attention.triton_flash._scores",
                                             "companion.attention.triton_flash._probs",
                                             "companion.attention.FlashAttentionTriton"))
def check_triton_forward(answer) -> str:
    """answer: a @triton.jit kernel with the signature `launch_forward` launches (see
    companion.attention.triton_launch); it writes O and L for one query tile of one head."""
    seeds = fresh_seeds(len(_KERNEL_CASES))
    dots = {}
    for seed, (heads, nq, nk, d, causal, bq, bk) in zip(seeds, _KERNEL_CASES):
        q, k, v = _qkv(seed, heads, nq, nk, d)
        want = naive_attention(q.double(), k.double(), v.double(), causal, return_lse=True)
        o, lse, dots[(heads, nq, nk, d, causal, bq, bk)] = _kernel_run(
            answer, seed, heads, nq, nk, d, causal, bq, bk)
        label = (f"(O, L) of {heads} head(s), Nq={nq}, Nk={nk}, d={d}, causal={causal}, "
                 f"tiles {bq}x{bk}")
        if bool(torch.isnan(o).any() or torch.isnan(lse).any()):
            raise CheckFailed(
                f"{label}: NaN in {'O' if bool(torch.isnan(o).any()) else 'L'}",
                hint="the launcher fills memory past the last key and past d with NaN: load "
                     "with a mask (keys < n_k, dims < d) and set the scores of keys >= n_k to "
                     "−inf; and a row that has seen no key yet has m = −inf, where exp(s − m) "
                     "is NaN: subtract 0 instead. O is written where its own strides say.")
        compare((o, lse), tuple(t.float() for t in want), name=label, rtol=1e-4, atol=1e-5,
                known_wrong=_kernel_wrong(q, k, v, causal, bq, bk),
                hint="for each key tile: S = q kᵀ · scale, masked; m_new = max(m, rowmax(S)); "
                     "alpha = exp(m − m_new); l = alpha·l + rowsum(P); acc = alpha·acc + P v. "
                     "At the end O = acc / l and L = m + log(l); a query that sees no key "
                     "writes O = 0 and L = −inf.")
    full, causal = dots[_KERNEL_CASES[0]], dots[_KERNEL_CASES[1]]
    heads, nq, nk, _, _, bq, bk = _KERNEL_CASES[1]
    tiles = -(-nq // bq) * -(-nk // bk)
    seen = sum(max(0, -(-min(nk, (t + 1) * bq + nk - nq) // bk)) for t in range(-(-nq // bq)))
    if full > 0:
        require(causal * tiles <= full * seen,
                f"causal, Nq={nq}, Nk={nk}, tiles {bq}x{bk}: your kernel computed {causal} "
                f"tl.dot products where the non-causal run computed {full}; only {seen} of its "
                f"{tiles} (query tile, key tile) pairs hold a key a query can see",
                hint="a causal program can stop its loop at the first key tile that lies wholly "
                     "right of its last query's diagonal, (tile + 1)·BLOCK_Q + (n_k − n_q): "
                     "about half the work.")
        skipped = f"; causal tiles skipped: {full - causal} of {full} products"
    else:
        skipped = " (this Triton's interpreter cannot count tl.dot calls: tile skipping unchecked)"
    return ("your kernel writes O and L exactly, on odd lengths, Nq ≠ Nk both ways and d = 24"
            + skipped)


# ---------------------------------------------------------------- exercise 5: tile sizes

_SIZES = (16, 32, 64, 128, 256)


def _pick(sram: int, cost, key=max, *, min_bk: int = 16, min_bq: int = 16):
    fits = [(bq, bk) for bq in _SIZES for bk in _SIZES
            if cost(bq, bk) <= sram and bk >= min_bk and bq >= min_bq]
    return key(fits) if fits else None


def _smem(bq: int, bk: int, d: int, e: int) -> int:
    """Shared memory of a program that keeps S, P and its accumulator in registers."""
    return (bq + 2 * bk) * d * e


def smem_tiles(sram_bytes: int, head_dim: int, dtype_bytes: int, programs_per_sm: int,
               min_block_k: int) -> tuple[int, int] | None:
    """The reference of Exercise 5: the tiles with the fewest passes over K and V, then the
    fewest key-tile steps, of a kernel built as FlashAttention-2 is."""
    return _pick(sram_bytes // programs_per_sm, lambda bq, bk: _smem(bq, bk, head_dim,
                                                                     dtype_bytes),
                 min_bk=min_block_k)


# The card whose shipped tile the defaults must reproduce: FA2's non-causal 128 x 32 on sm86.
_A10 = SRAM_PER_SM["A10"]["bytes"]
_A10_SHIPPED = next(row[3] for row in SHIPPED if row[:3] == ("FA2", "A10", False))

# The likely wrong rules, each as a function of (sram, d, e, programs, min_block_k), with its hint.
_TILE_MISTAKES = {
    "a kernel built as FlashAttention-2 keeps S, P and the output accumulator in registers: "
    "only what it stages in shared memory counts against sram_bytes.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: tile_sram_bytes(bq, bk, d, e),
                                       min_bk=m),
    "a kernel built as FlashAttention-2 keeps S and P in registers too, not only the "
    "accumulator.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: _smem(bq, bk, d, e)
                                       + e * bq * bk, min_bk=m),
    "programs that share an SM share its SRAM: each of them gets only its part.":
        lambda sram, d, e, p, m: _pick(sram, lambda bq, bk: _smem(bq, bk, d, e), min_bk=m),
    "sram_bytes is all the programs of one SM may use, split evenly among them: the 1 KiB per "
    "block that CUDA keeps back on compute capability 8.x is not charged here.":
        lambda sram, d, e, p, m: _pick(sram // p - 1024, lambda bq, bk: _smem(bq, bk, d, e),
                                       min_bk=m),
    "min_block_k is a lower bound on block_k: narrower key tiles are out, whatever they save.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: _smem(bq, bk, d, e)),
    "the lower bound is on block_k only: block_q may be smaller than min_block_k.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: _smem(bq, bk, d, e),
                                       min_bk=m, min_bq=m),
    "a program holds a tile of V beside the tile of K: 2·block_k·d·e bytes.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: (bq + bk) * d * e, min_bk=m),
    "the tiles hold the inputs as they come, dtype_bytes per value.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: _smem(bq, bk, d, 2), min_bk=m),
    "HBM traffic falls with block_q (K and V are read once per query tile); block_k only sets "
    "the number of steps: maximize block_q first.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: _smem(bq, bk, d, e),
                                       key=lambda fits: max(fits, key=lambda t: (t[1], t[0])),
                                       min_bk=m),
    "the largest tile area is not the least traffic: K and V are read once per query tile, "
    "whatever block_k is; maximize block_q first.":
        lambda sram, d, e, p, m: _pick(sram // p, lambda bq, bk: _smem(bq, bk, d, e),
                                       key=lambda fits: max(fits, key=lambda t: (t[0] * t[1],
                                                                                 t[0])),
                                       min_bk=m),
}


def _as_pair(got, label: str):
    if got is None:
        return None
    require(isinstance(got, (tuple, list)) and len(got) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in got),
        f"{label}: expected a pair of ints (block_q, block_k) or None, got {got!r}")
    return tuple(got)


def _tile_cases(rng: random.Random) -> list[tuple]:
    """(sram, d, e, programs, min_block_k, name): the SRAM budgets of the GPUs listed, made-up
    ones, fixed ones where each likely mistake changes the answer, and one too small for any
    tile."""
    budgets = {}
    for name, entry in SRAM_PER_SM.items():
        budgets.setdefault(entry["bytes"], []).append(name)
    cases = [(sram, rng.choice([32, 64, 80, 96, 128, 256]), e, rng.choice([1, 2, 3]),
              rng.choice([16, 32, 64]), " / ".join(names))
             for sram, names in budgets.items() for e in (2, 4)]
    cases += [(rng.randrange(8_000, 300_000), rng.choice([40, 64, 96, 128, 160]),
               rng.choice([2, 4]), rng.choice([1, 2]), rng.choice([16, 32, 64]),
               "a made-up GPU") for _ in range(6)]
    # Fixed: each is where at least one rule of _TILE_MISTAKES (or a budget kept back, or a
    # strict <) gives another answer; the largest-area rule differs from the reference only at
    # the first of them among the listed GPUs at 1 or 2 programs per SM.
    cases += [(233_472, 96, 4, 2, 16, "an H200"), (65_536, 96, 2, 2, 64, "a T4"),
              (98_304, 32, 2, 2, 16, "a V100"), (98_304, 64, 2, 2, 128, "a V100"),
              (233_472, 96, 2, 2, 32, "an H200"), (98_304, 64, 4, 1, 64, "a V100"),
              (233_472, 64, 2, 1, 128, "a B200"), (102_400, 128, 2, 2, 16, "an L4"),
              (65_536, 32, 2, 1, 64, "a T4"), (102_400, 64, 2, 1, 64, "an RTX 4090"),
              (102_400, 128, 2, 1, 128, "an L4"),
              (6_000, 128, 4, 1, 16, "a GPU too small for any tile"),
              # 512 B and 1.5 KiB above FA2-like tiles: 1 KiB kept back per program changes the
              # first (where a strict < does not), 8·block_q bytes of m and l the second.
              (49_664, 128, 2, 1, 16, "a made-up GPU"), (83_456, 128, 2, 1, 16, "a made-up GPU")]
    return cases


@exercise(points=2, reference=("companion.checks.ch10.smem_tiles",
                               "companion.attention.tiles.choose_tiles",
                               "companion.attention.tiles.fitting_tiles"))
def check_choose_tiles(answer) -> str:
    """answer(sram_bytes, head_dim, dtype_bytes, programs_per_sm=..., min_block_k=...) ->
    (block_q, block_k) or None, for a kernel that stages its Q, K and V tiles in shared memory and
    keeps the rest in registers; its default programs_per_sm is the learner's choice for FA2 on an
    sm86 card (min_block_k's default, 16, is given)."""
    cases = _tile_cases(random.Random(fresh_seeds(1)[0]))
    answers = []
    for sram, d, e, p, m, name in cases:
        label = (f"tiles for {name} ({sram:,} B of SRAM per SM), d = {d}, {e}-byte inputs, "
                 f"{p} program(s) per SM, block_k >= {m}")
        answers.append(_as_pair(call(answer, sram, d, e, p, m), label))
    wrong = [i for i, (got, case) in enumerate(zip(answers, cases))
             if got != smem_tiles(*case[:5])]
    if wrong:
        # One rule that gives every answer the learner gave names the mistake.
        hints = [hint for hint, rule in _TILE_MISTAKES.items()
                 if all(rule(*case[:5]) == got for got, case in zip(answers, cases))]
        sram, d, e, p, m, name = cases[wrong[0]]
        want = smem_tiles(sram, d, e, p, m)
        raise CheckFailed(
            f"tiles for {name} ({sram:,} B of SRAM per SM), d = {d}, {e}-byte inputs, {p} "
            f"program(s) per SM, block_k >= {m}: expected {want}, got {answers[wrong[0]]} "
            f"({len(wrong)} of {len(cases)} settings wrong)",
            expected=want, got=answers[wrong[0]],
            hint=hints[0] if hints else "list the power-of-two pairs from 16 to 256 whose "
            "shared memory fits in the program's share of the SM and whose block_k is wide "
            "enough (None if none is), then pick by the forward pass's HBM traffic, then by its "
            "number of steps.")
    label = (f"tiles for the A10 ({_A10:,} B per SM, sm86), d = 128, 16-bit inputs, with your "
             "default programs_per_sm (and min_block_k's, 16)")
    try:
        got = _as_pair(call(answer, _A10, 128, 2), label)
    except NotDone:
        raise
    except CheckFailed as failed:
        raise CheckFailed(f"{label}: {failed.summary}", where=failed.where,
                          hint="give programs_per_sm a default value (your choice for "
                               "FlashAttention-2 on this card) and keep min_block_k's default, "
                               "16, in the def line.") from None
    require(got == _A10_SHIPPED,
            f"{label}: your function picks {got}, where FlashAttention-2 ships "
            f"{_A10_SHIPPED[0]} x {_A10_SHIPPED[1]} on this card (non-causal, the table above)",
            hint="the search is right; the default programs_per_sm is not FA2's choice for this "
                 "card (and min_block_k's default is 16). Why would one program per SM leave its "
                 "loads of K and V exposed, and what does each program give up for a neighbour?")
    budgets = len({case[0] for case in cases})
    return (f"your tiles fit every setting tried ({len(cases)} settings over {budgets} distinct "
            f"SRAM budgets, 1 to 3 programs per SM), and your default reproduces FA2's "
            f"{_A10_SHIPPED[0]} x {_A10_SHIPPED[1]} on an A10; FA2's launch code says why: "
            f"\"128 x 32 (48 KB smem) is the fastest for non-causal since we get 2 CTAs per SM\"")
