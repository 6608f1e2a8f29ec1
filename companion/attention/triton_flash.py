"""FlashAttention-2 as Triton kernels: the algorithm of `companion.attention.flash`, one program
per tile, all tiles in parallel.

Three kernels, forward and backward both in Triton:
  `_forward`   one program per (query tile, head): loops over the key tiles it can see, keeps m, l
               and the output tile in registers, writes O and L = m + log l;
  `_backward_kv` one program per (key tile, key/value head): loops over the query tiles (of every
               query head in its group) that see it and accumulates dK, dV, written once;
  `_backward_q`  one program per (query tile, head): loops over key tiles and accumulates dQ.
Splitting dQ from dK, dV recomputes the scores twice in backward instead of adding into dQ with
atomics (FlashAttention-2 uses atomics; Triton's tutorial recomputes, as here). D = rowsum(dO ∘ O)
is one PyTorch reduction before the backward kernels.

On a CUDA GPU the kernels compile natively: 16-bit tiles go into `tl.dot` as they are, with fp32
accumulation, and P is cast to 16 bits for P·V as FlashAttention-2 does; fp32 tiles ask `tl.dot`
for IEEE fp32 products (Triton's default for fp32 is TF32). Program ids are cast to int64 before
they multiply a head's size, so offsets past 2³¹ elements (B·H·T·d, e.g. 16·32·32k·128) do not
wrap. On CPU tensors they run
only under Triton's interpreter (`TRITON_INTERPRET=1` in the environment before triton is
imported, in that process only). The interpreter emulates bit patterns, not 16-bit arithmetic,
so there every tile is cast to fp32 inside the kernel and the outputs are written in fp32 and
rounded to the input dtype by PyTorch (the interpreter truncates when it casts fp32 to bf16).

Example:
    >>> o = FlashAttentionTriton.apply(q, k, v, True)          # q (B, H, T, d) on a GPU

Simplified vs FlashAttention-2: no atomics, no persistent kernels or warp specialization, tile
sizes from a small table instead of an autotuner; head dimension up to 256.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from companion.attention.flash import _heads_last, check_blocks
from companion.attention.shapes import check_inputs, grouped, visible_keys

__all__ = ["FlashAttentionTriton", "triton_available", "interpreted", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256


def interpreted() -> bool:
    """Do this process's kernels run under Triton's interpreter (TRITON_INTERPRET=1)?"""
    return not hasattr(_forward, "run") or type(_forward).__name__ == "InterpretedFunction"


def triton_available(device: torch.device | str = "cuda") -> bool:
    """Can the Triton kernels run on `device` in this process: natively on CUDA, or on the CPU
    under the interpreter?"""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and not interpreted()
    return device.type == "cpu" and interpreted()


@triton.jit
def _load_tile(ptr, base, idx, dims, n, d, FP32: tl.constexpr):
    """Rows `idx` of the (n, d) matrix at ptr + base, as a (rows, BLOCK_D) tile: 0 past n and d,
    cast to fp32 when FP32."""
    mask = (idx[:, None] < n) & (dims[None, :] < d)
    tile = tl.load(ptr + base + idx[:, None] * d + dims[None, :], mask=mask, other=0.0)
    if FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _store_tile(ptr, base, idx, dims, n, d, row_stride, value):
    mask = (idx[:, None] < n) & (dims[None, :] < d)
    tl.store(ptr + base + idx[:, None] * row_stride + dims[None, :],
             value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scores(q, k, rows, cols, n_k, offset, scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """S = q kᵀ · scale of one tile (fp32), −inf past n_k and where the causal mask hides a key."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    seen = cols[None, :] < n_k
    if CAUSAL:
        seen = seen & (cols[None, :] <= rows[:, None] + offset)
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _probs(q, k, lse, rows, cols, n_k, offset, scale, CAUSAL: tl.constexpr,
           PRECISION: tl.constexpr):
    """P = exp(S − L) of one tile: 0 where masked, and in rows whose query saw no key."""
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)
    return tl.exp(_scores(q, k, rows, cols, n_k, offset, scale, CAUSAL, PRECISION)
                  - lse_safe[:, None])


@triton.jit
def _forward(Q, K, V, O, L, n_q, n_k, d, offset, scale, heads, kv_heads, group,
             o_batch, o_head, o_row, CAUSAL: tl.constexpr, FP32: tl.constexpr,
             PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_D: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)      # int64: bh·Nq·d can pass 2³¹
    kvh = (bh // heads) * kv_heads + (bh % heads) // group          # this head's k, v head
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q = _load_tile(Q, bh * n_q * d, rows, dims, n_q, d, FP32)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)               # running max
    l = tl.zeros([BLOCK_Q], tl.float32)                             # running sum
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)                  # unnormalized O tile
    stop = n_k
    if CAUSAL:
        stop = tl.minimum(n_k, tile * BLOCK_Q + BLOCK_Q + offset)   # keys past it are hidden
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        k = _load_tile(K, kvh * n_k * d, cols, dims, n_k, d, FP32)
        v = _load_tile(V, kvh * n_k * d, cols, dims, n_k, d, FP32)
        s = _scores(q, k, rows, cols, n_k, offset, scale, CAUSAL, PRECISION)   # (BQ, BK) fp32
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # rows with no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    # O is laid out (..., Nq, heads, d), as SDPA's output: (B, T, H·d) is then a view
    _store_tile(O, (bh // heads) * o_batch + (bh % heads) * o_head, rows, dims, n_q, d, o_row,
                acc / tl.where(l > 0, l, 1.0)[:, None])
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))   # no key: −inf
    tl.store(L + bh * n_q + rows, lse, mask=rows < n_q)


@triton.jit
def _backward_kv(Q, K, V, DO, L, D, DK, DV, n_q, n_k, d, offset, scale, heads, kv_heads,
                 group, CAUSAL: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    tile, bkv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, BLOCK_D)
    k = _load_tile(K, bkv * n_k * d, cols, dims, n_k, d, FP32)
    v = _load_tile(V, bkv * n_k * d, cols, dims, n_k, d, FP32)
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    first = 0
    if CAUSAL:                                                      # queries that see no key here
        first = tl.maximum(tile * BLOCK_K - offset, 0) // BLOCK_Q * BLOCK_Q
    for g in range(0, group):                                       # every query head of the group
        bh = (bkv // kv_heads) * heads + (bkv % kv_heads) * group + g
        for start in range(first, n_q, BLOCK_Q):
            rows = start + tl.arange(0, BLOCK_Q)
            q = _load_tile(Q, bh * n_q * d, rows, dims, n_q, d, FP32)
            do = _load_tile(DO, bh * n_q * d, rows, dims, n_q, d, FP32)
            lse = tl.load(L + bh * n_q + rows, mask=rows < n_q, other=float("-inf"))
            delta = tl.load(D + bh * n_q + rows, mask=rows < n_q, other=0.0)
            p = _probs(q, k, lse, rows, cols, n_k, offset, scale, CAUSAL, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])                          # P ∘ (dP − D)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scale
    _store_tile(DK, bkv * n_k * d, cols, dims, n_k, d, d, dk)
    _store_tile(DV, bkv * n_k * d, cols, dims, n_k, d, d, dv)


@triton.jit
def _backward_q(Q, K, V, DO, L, D, DQ, n_q, n_k, d, offset, scale, heads, kv_heads, group,
                CAUSAL: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    kvh = (bh // heads) * kv_heads + (bh % heads) // group
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q = _load_tile(Q, bh * n_q * d, rows, dims, n_q, d, FP32)
    do = _load_tile(DO, bh * n_q * d, rows, dims, n_q, d, FP32)
    lse = tl.load(L + bh * n_q + rows, mask=rows < n_q, other=float("-inf"))
    delta = tl.load(D + bh * n_q + rows, mask=rows < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    stop = n_k
    if CAUSAL:
        stop = tl.minimum(n_k, tile * BLOCK_Q + BLOCK_Q + offset)
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        k = _load_tile(K, kvh * n_k * d, cols, dims, n_k, d, FP32)
        v = _load_tile(V, kvh * n_k * d, cols, dims, n_k, d, FP32)
        p = _probs(q, k, lse, rows, cols, n_k, offset, scale, CAUSAL, PRECISION)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])  # P∘(dP−D)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * scale
    _store_tile(DQ, bh * n_q * d, rows, dims, n_q, d, d, dq)


def _precision(fp32: bool) -> str:
    """tl.dot's input precision: "ieee" for fp32 tiles, since Triton's default for fp32 inputs
    on NVIDIA GPUs is TF32 (10-bit mantissa: errors near 1e-3; triton 3.9's tl.dot docstring,
    "Default: tf32"); 16-bit tiles ignore it."""
    return "ieee" if fp32 else "tf32"


def _default_blocks(d: int) -> tuple[int, int]:
    """Tile sizes by head dimension: 64 x 64 up to d = 64, smaller tiles for wider heads, so
    that q, k, v tiles and the fp32 accumulator stay within a GPU's registers and shared memory
    (`companion.attention.tiles` works out what fits)."""
    return (64, 64) if d <= 64 else (64, 32) if d <= 128 else (32, 32)


def _layout(q, k, v):
    """(q, k, v) as contiguous (Z·H, N, d) and (Z·Hkv, N, d), with (H, Hkv, group)."""
    q5, k5, _ = grouped(q, k, v)
    kv_heads, group = q5.shape[-4], q5.shape[-3]
    heads = kv_heads * group
    flat = lambda t, n: t.reshape(-1, n, t.shape[-1]).contiguous()
    return (flat(q, q.shape[-2]), flat(k, k.shape[-2]), flat(v, v.shape[-2]),
            heads, kv_heads, group)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton: `FlashAttentionTriton.apply(q, k, v, is_causal, scale=None,
    block_q=None, block_k=None)`, the contract of `FlashAttentionTorch` (shapes, bottom-right
    causal mask, grouped-query heads, saved tensors q, k, v, O and the (..., Nq) log-sum-exp).
    fp16, bf16 and fp32; head dimension up to 256; CUDA tensors, or CPU tensors under
    `TRITON_INTERPRET=1`."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, block_q=None, block_k=None):
        scale = check_inputs(q, k, v, is_causal, scale)
        d = q.shape[-1]
        if q.dtype == torch.float64:
            raise TypeError("the Triton kernels take fp16, bf16 or fp32; for fp64 use "
                            "FlashAttentionTorch")
        if d > MAX_HEAD_DIM:
            raise ValueError(f"head dimension {d} is above the kernels' {MAX_HEAD_DIM}: use "
                             "FlashAttentionTorch, or split the heads")
        _runs_on(q.device)
        defaults = _default_blocks(d)
        block_q, block_k = check_blocks(block_q or defaults[0], block_k or defaults[1])
        if block_q < 16 or block_k < 16 or block_q & (block_q - 1) or block_k & (block_k - 1):
            raise ValueError(f"Triton tiles are powers of two of at least 16 (tl.dot's smallest "
                             f"tile), got block_q={block_q}, block_k={block_k}")
        q3, k3, v3, heads, kv_heads, group = _layout(q, k, v)
        n_q, n_k = q3.shape[1], k3.shape[1]
        fp32 = interpreted() or q.dtype == torch.float32
        out = _heads_last(q, torch.float32 if interpreted() else q.dtype)
        o_strides = (n_q * heads * d, d, heads * d) if q.ndim >= 4 else (n_q * d, 0, d)
        lse = torch.empty(q3.shape[:2], device=q.device, dtype=torch.float32)
        grid = (triton.cdiv(n_q, block_q), q3.shape[0])
        _forward[grid](q3, k3, v3, out, lse, n_q, n_k, d, visible_keys(n_q, n_k), scale, heads,
                       kv_heads, group, *o_strides, CAUSAL=is_causal, FP32=fp32,
                       PRECISION=_precision(fp32), BLOCK_Q=block_q, BLOCK_K=block_k,
                       BLOCK_D=max(16, triton.next_power_of_2(d)))
        out = out.to(q.dtype)                                 # keeps the (..., Nq, H, d) layout
        lse = lse.reshape(q.shape[:-1])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (is_causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, scale, block_q, block_k = ctx.options
        q3, k3, v3, heads, kv_heads, group = _layout(q, k, v)
        do3 = grad_out.reshape(q3.shape).contiguous()
        n_q, n_k, d = q3.shape[1], k3.shape[1], q3.shape[2]
        delta = (do3.float() * out.reshape(q3.shape).float()).sum(-1)   # D = rowsum(dO ∘ O)
        lse3 = lse.reshape(q3.shape[:2]).contiguous()
        store = torch.float32 if interpreted() else q.dtype
        dq = torch.empty(q3.shape, device=q.device, dtype=store)
        dk = torch.empty(k3.shape, device=q.device, dtype=store)
        dv = torch.empty(v3.shape, device=q.device, dtype=store)
        fp32 = interpreted() or q.dtype == torch.float32
        common = dict(CAUSAL=is_causal, FP32=fp32, PRECISION=_precision(fp32), BLOCK_Q=block_q,
                      BLOCK_K=block_k, BLOCK_D=max(16, triton.next_power_of_2(d)))
        args = (n_q, n_k, d, visible_keys(n_q, n_k), scale, heads, kv_heads, group)
        _backward_kv[(triton.cdiv(n_k, block_k), k3.shape[0])](
            q3, k3, v3, do3, lse3, delta, dk, dv, *args, **common)
        _backward_q[(triton.cdiv(n_q, block_q), q3.shape[0])](
            q3, k3, v3, do3, lse3, delta, dq, *args, **common)
        return (dq.to(q.dtype).reshape(q.shape), dk.to(k.dtype).reshape(k.shape),
                dv.to(v.dtype).reshape(v.shape), None, None, None, None)


def _runs_on(device: torch.device) -> None:
    if device.type == "cuda" and interpreted():
        raise RuntimeError("TRITON_INTERPRET=1 is set in this process: the kernels would be "
                           "interpreted, not compiled; unset it to run them on the GPU")
    if device.type == "cpu" and not interpreted():
        raise RuntimeError("Triton kernels run on a CUDA GPU. On a CPU they run only under "
                           "Triton's interpreter: set TRITON_INTERPRET=1 in the environment of "
                           "a fresh process before triton is imported (or use "
                           "FlashAttentionTorch)")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the Triton kernels run on CUDA tensors, not {device.type}")
