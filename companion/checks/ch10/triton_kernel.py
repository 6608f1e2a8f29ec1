"""Chapter 10, exercise 4: the forward kernel in Triton, run under Triton's interpreter on CPU
tensors, with its tl.dot calls counted."""
from __future__ import annotations

import contextlib
import math
import pathlib
import traceback

import torch

from companion.attention import causal_mask, naive_attention
from companion.checks.ch10._common import NEG_INF, _qkv
from companion.checks.core import (_LIBRARIES, CheckFailed, NotDone, call, compare, exercise,
                                   fresh_seeds, harness, learner_frames, require,
                                   require_function)

__all__ = ["check_triton_forward"]


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
